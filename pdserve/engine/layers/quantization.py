"""Weight-only quantization of the decoder's linear layers, applied at load time (``--quantization``).

``int8``: every ``ColumnParallelLinear`` / ``RowParallelLinear`` weight [out_features, in_features]
is quantized by torchao (``Int8Tensor.from_hp`` per row, what ``Int8WeightOnlyConfig`` does,
torchao 0.18): int8 values [out_features, in_features] and one float32 scale per output row,
symmetric (no zero point), ``w ~= q * scale``. The layer then keeps them as its own plain
tensors, ``weight`` (int8) and ``weight_scale`` (float32 [out_features, num_groups]), and its
forward calls ``layers.quantized_linear``: our native kernel (``pdserve.engine.layers.int8_linear``)
widens the int8 values in registers, so decode reads a byte per weight. Activations stay in the
model dtype; the TP all-reduce, LoRA and the batch-invariant mode are unchanged. This is the
per-channel absmax ("vector-wise") weight quantization of Dettmers et al., "LLM.int8()"
(NeurIPS 2022), without its activation outliers' int8 matmul: weight-only, as in vLLM's and
torchao's W8A16.

``compressed-tensors``: a checkpoint already quantized in that format (``pdserve.engine.
compressed_tensors``; W8A16 / W4A16, per channel or per group): the loader dequantizes it and keeps
each layer's scales; ``quantize_model`` rebuilds the int8 values from them (scale
[out_features, num_groups]), holding the checkpoint's int values exactly.

Quantized after loading, so each TP rank quantizes its own shard: a ColumnParallelLinear's
rows (and their scales) are whole rows of the checkpoint, identical at any TP size; a
RowParallelLinear's rows are cut along in_features, so each rank's scale is the absmax of its
own slice (TP 2 gives slightly different, no worse, numbers than TP 1).

Left in the model dtype: the embedding (a lookup of a few rows per step, not bandwidth-bound)
and the LM head (its error lands directly on the logits, which greedy argmax and logprobs
read; vLLM also leaves ``lm_head`` unquantized by default). With tied embeddings they are one
tensor anyway. Norms and biases stay as they are.

Speed on this repository's CPUs: torch has no fast float32 x int8 CPU matmul
(``aten._weight_int8pack_mm`` with float32 activations measured 14x slower than float32
``F.linear`` at batch 1, and torchao's weight-only path converts the whole weight to float32 on
every call), hence the kernel. It serves calls of up to ``int8_linear.KERNEL_MAX_ROWS`` rows
(decode); longer ones (prefill) dequantize the weight and run a float32 GEMM. As a custom op the
kernel is one opaque node of the compiled decode step. docs/benchmarks.md has the figures.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from pdserve.common.utils import release_pages
from pdserve.engine.layers.compressed_tensors import CHECKPOINT_SCALE, QUANT_METHOD, CompressedTensorsConfig
from pdserve.engine.layers.int8_linear import build_kernel
from pdserve.engine.layers.base import ColumnParallelLinear, RowParallelLinear
from pdserve.engine.config import check_quantization_name

logger = logging.getLogger(__name__)

# (device type, model dtype) pairs quantized weights are tested on.
_SUPPORTED = {("cpu", torch.float32), ("cpu", torch.bfloat16)}


def check_quantization_target(name: str, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ValueError when weights quantized with ``name`` cannot run on ``device`` in ``dtype``
    (int8: CPU with float32 or bfloat16 activations)."""
    check_quantization_name(name)
    if (device.type, dtype) not in _SUPPORTED:
        raise ValueError(f"--quantization {name} supports a CPU with --dtype float32 or bfloat16; here the model "
                         f"runs on {device.type} in {str(dtype).removeprefix('torch.')}")


def checkpoint_quantization(model_dir: str, requested: str | None) -> str | None:
    """The quantization a worker runs: ``compressed-tensors`` for such a checkpoint (``requested``
    None or the same), ``requested`` for a float one. Raises ValueError for ``int8`` on an already
    quantized checkpoint, ``compressed-tensors`` on a float one, or an unsupported scheme."""
    scheme = CompressedTensorsConfig.from_model_dir(model_dir)
    if scheme is not None and requested not in (None, QUANT_METHOD):
        raise ValueError(f"{model_dir} is already quantized (compressed-tensors, int{scheme.num_bits} "
                         f"{scheme.strategy}); leave out --quantization {requested}")
    if scheme is None and requested == QUANT_METHOD:
        raise ValueError(f"--quantization {QUANT_METHOD}: {model_dir} has no compressed-tensors "
                         "quantization_config in its config.json")
    return QUANT_METHOD if scheme is not None else requested


def _is_quantizable(module: nn.Module, fqn: str = "") -> bool:
    return isinstance(module, (ColumnParallelLinear, RowParallelLinear))


def quantize_model(model: nn.Module, name: str) -> None:
    """Quantize ``model``'s tensor-parallel linear weights in place (see the module docstring).

    Each quantized layer's ``weight`` becomes an int8 ``nn.Parameter`` [out_features, in_features]
    and its ``weight_scale`` a float ``nn.Parameter`` [out_features, num_groups] (the layer's dtype;
    float32 for a float32 model); its ``weight_loader`` is gone (load before quantizing).
    ``int8``: every such layer, scales from the weights (torchao). ``compressed-tensors``: the
    layers the checkpoint quantized, with its scales (left by the loader as
    ``checkpoint_weight_scale``; see ``pdserve.engine.layers.compressed_tensors``), which gives back the
    checkpoint's int values exactly. Raises ValueError for an unknown ``name``, ImportError when
    torchao is not installed.
    """
    check_quantization_name(name)
    try:
        from torchao.quantization import Int8Tensor, PerGroup, PerRow
    except ImportError as e:
        raise ImportError(f"--quantization {name} needs torchao (pip install 'torchao>=0.18')") from e
    before = weight_bytes(model)
    build_kernel()  # the layers' forward reads whether it is there
    for module in model.modules():
        if not _is_quantizable(module):
            continue
        weight = module.weight.detach()  # (out, in); compressed-tensors: q * scale as loaded
        if name == "int8":  # torchao's Int8WeightOnlyConfig: symmetric, one absmax scale per output row
            quantized = Int8Tensor.from_hp(weight, PerRow())
        else:
            scale = getattr(module, CHECKPOINT_SCALE, None)
            if scale is None:  # a layer the checkpoint left in float
                continue
            num_groups = scale.shape[1]
            granularity = PerRow() if num_groups == 1 else PerGroup(weight.shape[1] // num_groups)
            quantized = Int8Tensor.from_hp(weight, granularity, scale=scale.to(weight.device))
            delattr(module, CHECKPOINT_SCALE)
        qdata, scale = quantized.qdata, quantized.scale  # int8 (out, in); (out, groups) or (out, 1)
        module.weight = nn.Parameter(qdata.contiguous(), requires_grad=False)
        module.weight_scale = nn.Parameter(scale.reshape(qdata.shape[0], -1).contiguous(), requires_grad=False)
        release_pages(weight)  # the float weight's pages in the loader's arena (weight_format.place_in_arenas)
    kept = [n for n, m in model.named_modules() if hasattr(m, "expected_shards")]  # stacked MoE experts
    logger.info("weights quantized (%s, weight-only; embedding and LM head kept%s): %.1f -> %.1f MiB",
                name, f"; the routed experts of {len(kept)} MoE layers kept in float (no int8 expert GEMM yet)"
                if kept else "", before / 2**20, weight_bytes(model) / 2**20)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters (a tied embedding / LM head counted once; a quantized layer's
    int8 weight and its scales)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def quantized_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) for each layer of ``model`` holding int8 weights (with ``weight_scale``)."""
    return [(name, m) for name, m in model.named_modules()
            if _is_quantizable(m) and getattr(m, "weight_scale", None) is not None]
