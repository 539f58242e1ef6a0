"""Checkpoints quantized in the compressed-tensors format (Neural Magic / vLLM's llm-compressor), weight-only int.

What loads: ``config.json`` has ``quantization_config.quant_method == "compressed-tensors"``, every
config group quantizes only weights (``input_activations`` / ``output_activations`` null), with
``type: int``, ``symmetric: true``, ``num_bits`` 4 or 8 and ``strategy`` ``channel`` or ``group``
(W8A16 / W4A16), stored as ``pack-quantized`` or ``int-quantized``. Anything else is a ValueError
naming what is unsupported. A quantized linear ``P`` has in the safetensors files:

* ``P.weight_packed`` int32 [out_features, ceil(in_features * num_bits / 32)] (pack-quantized):
  value j of a row sits at bits ``(j * num_bits) % 32`` of word ``(j * num_bits) // 32``, stored
  unsigned (value + 2^(num_bits - 1)); or ``P.weight`` int8 [out_features, in_features] (int-quantized);
* ``P.weight_scale`` [out_features, 1] (channel) or [out_features, in_features / group_size] (group);
* ``P.weight_shape`` int64 [2] = (out_features, in_features) (pack-quantized).

Loading: each quantized linear is dequantized to the model dtype (``q * scale``, per group) and
goes through its parameter's ``weight_loader`` like a float tensor, so TP sharding and the fused
q/k/v and gate/up layers need nothing new; its scale is sharded the same way and kept beside the
parameter (``CHECKPOINT_SCALE``). ``quantization.quantize_model(model, "compressed-tensors")``
then rebuilds the int8 weights (via torchao) from those scales: ``round(q * s / s) == q``, so
the int8 values are the checkpoint's, bit for bit. int4 values are held one per int8 byte (no
packed int4 CPU matmul in torch for float32 activations).

Format reference: the compressed-tensors package (``compressed_tensors.compressors.pack_quantized``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from pdserve.engine.layers.mxfp4 import QUANT_METHOD as MXFP4_METHOD

QUANT_METHOD = "compressed-tensors"
CHECKPOINT_SCALE = "checkpoint_weight_scale"  # attribute a quantized linear holds until quantize_model
_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")
_FORMATS = ("pack-quantized", "int-quantized")


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """The one weight scheme of a supported checkpoint: ``num_bits`` (4, 8), ``strategy`` (channel,
    group), ``group_size`` (group only), ``format``; ``ignore``: module names (or ``re:`` patterns)
    left unquantized."""

    num_bits: int
    strategy: str
    group_size: int | None
    format: str
    ignore: tuple[str, ...]

    @classmethod
    def from_model_dir(cls, model_dir: str) -> "CompressedTensorsConfig | None":
        """The checkpoint's scheme; None when it is not a compressed-tensors checkpoint (a float one,
        or gpt-oss's MXFP4 experts, which ``pdserve.engine.layers.mxfp4`` loads). Raises ValueError for
        another quantization method or a scheme this loader does not run."""
        try:
            with open(os.path.join(model_dir, "config.json")) as f:
                qc = json.load(f).get("quantization_config")
        except (OSError, ValueError):
            return None
        if not qc:
            return None
        method = qc.get("quant_method")
        if method == MXFP4_METHOD:
            return None
        if method != QUANT_METHOD:
            raise ValueError(f"{model_dir}: quantization_config.quant_method={method!r} is not supported; pdserve "
                             "loads compressed-tensors checkpoints (W8A16 / W4A16) and gpt-oss's MXFP4 experts, or "
                             "quantizes float ones with --quantization int8")
        groups = list((qc.get("config_groups") or {}).values())
        schemes = {json.dumps(g.get("weights"), sort_keys=True) for g in groups}
        if len(schemes) != 1:
            raise ValueError(f"{model_dir}: compressed-tensors checkpoints with {len(schemes)} weight schemes are "
                             "not supported (one scheme for every quantized linear)")
        group, w = groups[0], groups[0].get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        problems = []
        if group.get("input_activations") or group.get("output_activations"):
            problems.append("activation quantization (only weight-only W4A16 / W8A16 loads)")
        if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
            problems.append(f"weights {w.get('type')}{w.get('num_bits')} (int4 or int8 only)")
        if not w.get("symmetric", False):
            problems.append("asymmetric weights (zero points)")
        if w.get("strategy") not in ("channel", "group"):
            problems.append(f"strategy {w.get('strategy')!r} (channel or group only)")
        if w.get("actorder") not in (None, "static"):
            problems.append(f"actorder {w.get('actorder')!r}")
        if fmt not in _FORMATS:
            problems.append(f"format {fmt!r} ({' or '.join(_FORMATS)} only)")
        if problems:
            raise ValueError(f"{model_dir}: unsupported compressed-tensors scheme: {'; '.join(problems)}")
        return cls(int(w["num_bits"]), w["strategy"], w.get("group_size"), fmt, tuple(qc.get("ignore") or ()))

    def is_quantized_tensor(self, hf_name: str, tensor: torch.Tensor) -> bool:
        """Whether ``hf_name`` is part of a quantized linear: its ``weight_packed`` / ``weight_scale`` /
        ``weight_shape`` / ``weight_zero_point``, or an int8 ``weight`` (int-quantized); a float
        ``weight`` belongs to a layer the checkpoint left unquantized (``ignore``)."""
        suffix = hf_name.rpartition(".")[2]
        return suffix in _SUFFIXES or (suffix == "weight" and tensor.dtype == torch.int8)

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """One linear's checkpoint tensors -> (weight [out, in] in ``dtype``, scale [out, num_groups]
        float32). Raises ValueError when a tensor is missing or has the wrong shape or dtype."""
        scale = parts.get("weight_scale")
        if scale is None:
            raise ValueError("no weight_scale")
        if "weight_zero_point" in parts and parts["weight_zero_point"].any():
            raise ValueError("non-zero weight_zero_point in a symmetric scheme")
        if self.format == "pack-quantized":
            if "weight_packed" not in parts or "weight_shape" not in parts:
                raise ValueError("pack-quantized weights need weight_packed and weight_shape")
            out_features, in_features = (int(v) for v in parts["weight_shape"].tolist())
            q = unpack_int32(parts["weight_packed"], self.num_bits, in_features)
        else:
            q = parts.get("weight")
            if q is None or q.dtype != torch.int8:
                raise ValueError("int-quantized weights need an int8 weight")
            out_features, in_features = q.shape
        num_groups = 1 if self.strategy == "channel" else in_features // self.group_size
        scale = scale.float().reshape(out_features, -1)
        if scale.shape[1] != num_groups or q.shape != (out_features, in_features):
            raise ValueError(f"weight {tuple(q.shape)} and scale {tuple(scale.shape)} do not match the {self.strategy} "
                             f"scheme (group_size {self.group_size})")
        w = (q.float().reshape(out_features, num_groups, -1) * scale[:, :, None]).reshape(out_features, in_features)
        return w.to(dtype), scale


def unpack_int32(packed: torch.Tensor, num_bits: int, num_values: int) -> torch.Tensor:
    """packed int32 [rows, words] (``num_bits`` in 1, 2, 4, 8: 32 / num_bits values per word, value j
    at bits ``(j * num_bits) % 32`` of word ``(j * num_bits) // 32``, stored + 2^(num_bits - 1)) ->
    int8 [rows, num_values] signed values."""
    if packed.dtype != torch.int32 or 32 % num_bits:
        raise ValueError(f"cannot unpack {packed.dtype} words of {num_bits}-bit values")
    per_word = 32 // num_bits
    shifts = torch.arange(per_word, dtype=torch.int32) * num_bits  # (per_word,)
    mask = (1 << num_bits) - 1
    values = (packed.unsqueeze(-1) >> shifts) & mask  # (rows, words, per_word), 0 .. 2^bits - 1
    values = values.reshape(packed.shape[0], -1)[:, :num_values]
    if values.shape[1] != num_values:
        raise ValueError(f"{packed.shape[1]} words hold fewer than {num_values} values")
    return (values - (1 << (num_bits - 1))).to(torch.int8)
