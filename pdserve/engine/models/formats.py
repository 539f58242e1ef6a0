"""Checkpoint formats other than plain float tensors, each a reader the loader dispatches to.

``load_model`` reads every tensor of a checkpoint once. A tensor that no reader claims is a float
tensor and is loaded as it is; one that a reader claims is held by it until it has every part of one
weight, then handed back dequantized (``Decoded``) and loaded like a float tensor:

- ``Mxfp4Reader``: gpt-oss's MoE experts in MXFP4 (``*_blocks`` and ``*_scales`` pairs,
  ``pdserve.engine.layers.mxfp4``), dequantized to the model's dtype as each pair completes;
- ``CompressedTensorsReader``: compressed-tensors' W8A16 / W4A16 linears (``weight_packed``,
  ``weight_scale``, ...; ``pdserve.engine.layers.compressed_tensors``), dequantized at the end, each
  with its scale, which ``--quantization compressed-tensors`` keeps for the int8 path.

``readers_for`` picks the readers a checkpoint's ``quantization_config`` names, and refuses the
methods pdserve cannot load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pdserve.engine.layers import mxfp4
from pdserve.engine.layers.compressed_tensors import CompressedTensorsConfig


@dataclass
class Decoded:
    """A weight read back to floats: its checkpoint name, the tensor, the file it came from, and the
    quantization scale [out_features, num_groups] a compressed-tensors linear keeps (else None)."""

    hf_name: str
    tensor: torch.Tensor
    source: str
    scale: torch.Tensor | None = None


class FormatReader:
    """One checkpoint format: which tensors are its parts, and the float weights they make."""

    def claims(self, hf_name: str, tensor: torch.Tensor) -> bool:
        """Whether ``hf_name`` is a part of this format (the loader then gives it to ``take``)."""
        raise NotImplementedError

    def take(self, hf_name: str, tensor: torch.Tensor, source: str) -> list[Decoded]:
        """Hold a part; return the weights it completes now (none until every part of one is read)."""
        raise NotImplementedError

    def finish(self) -> list[Decoded]:
        """The weights that complete only once every file is read."""
        return []

    def leftovers(self) -> list[str]:
        """Parts that never found their other parts (the loader reports them as unexpected)."""
        return []

    def summary(self, model: nn.Module) -> str | None:
        """One log line on what was read, or None."""
        return None


class Mxfp4Reader(FormatReader):
    """gpt-oss's MXFP4 experts: each ``<prefix>_blocks`` / ``<prefix>_scales`` pair becomes ``<prefix>``,
    dequantized to ``dtype`` (no MXFP4 matmul on CPU: they run as float experts)."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self._parts: dict[str, dict[str, torch.Tensor]] = {}  # prefix -> its _blocks / _scales read so far
        self.num_tensors = self.packed_bytes = self.float_bytes = 0

    def claims(self, hf_name: str, tensor: torch.Tensor) -> bool:
        return mxfp4.split_name(hf_name) is not None

    def take(self, hf_name: str, tensor: torch.Tensor, source: str) -> list[Decoded]:
        prefix, suffix = mxfp4.split_name(hf_name)
        self._parts.setdefault(prefix, {})[suffix] = tensor
        if len(self._parts[prefix]) < len(mxfp4.SUFFIXES):
            return []
        parts = self._parts.pop(prefix)  # both halves read: dequantize
        try:
            weight = mxfp4.dequantize_experts(parts["_blocks"], parts["_scales"], self.dtype)
        except ValueError as e:
            raise ValueError(f"cannot load the MXFP4 tensor {prefix} from {source}: {e}") from e
        self.num_tensors += 1
        self.packed_bytes += sum(t.numel() * t.element_size() for t in parts.values())
        self.float_bytes += weight.numel() * weight.element_size()
        return [Decoded(prefix, weight, source)]

    def leftovers(self) -> list[str]:
        return [f"{prefix}{suffix}" for prefix, parts in self._parts.items() for suffix in mxfp4.SUFFIXES
                if suffix in parts]

    def summary(self, model: nn.Module) -> str | None:
        if not self.num_tensors:
            return None
        held = sum(p.numel() * p.element_size() for m in model.modules() if hasattr(m, "expected_shards")
                   for n, p in m.named_parameters(recurse=False) if n.endswith("_weight"))
        return (f"MoE experts dequantized from MXFP4 to {str(self.dtype).removeprefix('torch.')} at load "
                f"({self.num_tensors} tensors: {self.packed_bytes / 2**20:.1f} MiB packed -> "
                f"{self.float_bytes / 2**20:.1f} MiB; this rank holds {held / 2**20:.1f} MiB of expert weights): "
                "no MXFP4 matmul on CPU, they run as float experts")


class CompressedTensorsReader(FormatReader):
    """compressed-tensors' quantized linears: a linear's parts (``<prefix>.weight_packed``, ...) become
    ``<prefix>.weight`` in ``dtype``, with the scale it was quantized with."""

    def __init__(self, config: CompressedTensorsConfig, dtype: torch.dtype, model_dir: str):
        self.config, self.dtype, self.model_dir = config, dtype, model_dir
        self._parts: dict[str, dict[str, torch.Tensor]] = {}  # linear's HF name -> its tensors

    def claims(self, hf_name: str, tensor: torch.Tensor) -> bool:
        return self.config.is_quantized_tensor(hf_name, tensor)

    def take(self, hf_name: str, tensor: torch.Tensor, source: str) -> list[Decoded]:
        prefix, _, suffix = hf_name.rpartition(".")
        self._parts.setdefault(prefix, {})[suffix] = tensor
        return []

    def finish(self) -> list[Decoded]:
        out = []
        for prefix, parts in self._parts.items():
            try:
                weight, scale = self.config.dequantize(parts, self.dtype)
            except ValueError as e:
                raise ValueError(f"cannot load the compressed-tensors linear {prefix} from {self.model_dir}: {e}"
                                 ) from e
            out.append(Decoded(f"{prefix}.weight", weight, self.model_dir, scale))
        self._parts.clear()
        return out


def readers_for(model_dir: str, config, dtype: torch.dtype) -> list[FormatReader]:
    """The readers ``model_dir``'s checkpoint needs, from its config's ``quantization_config``.

    Raises ValueError for a ``quant_method`` other than compressed-tensors and mxfp4, and for mxfp4 on a
    model other than gpt-oss (its only MXFP4 weights pdserve reads are gpt-oss's experts)."""
    qc = getattr(config, "quantization_config", None) or {}
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    method = getattr(method, "value", method)
    if method is not None and method not in ("compressed-tensors", mxfp4.QUANT_METHOD):
        raise ValueError(f"{model_dir}: quantization_config.quant_method={method!r} is not supported (pdserve loads "
                         "float checkpoints, compressed-tensors W8A16/W4A16 and gpt-oss's MXFP4 experts); "
                         "dequantize the checkpoint first")
    readers: list[FormatReader] = []
    if method == mxfp4.QUANT_METHOD:
        model_type = getattr(config, "model_type", None)
        if model_type != "gpt_oss":
            raise ValueError(f"{model_dir}: quantization_config.quant_method='mxfp4' is supported for gpt-oss's MoE "
                             f"experts only, not for model_type {model_type!r}")
        readers.append(Mxfp4Reader(dtype))
    compressed = CompressedTensorsConfig.from_model_dir(model_dir)
    if compressed is not None:
        readers.append(CompressedTensorsReader(compressed, dtype, model_dir))
    return readers
