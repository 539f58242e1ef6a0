"""Building blocks of a Llama-family decoder: RMSNorm, tensor-parallel linears, SwiGLU (RoPE: ``rotary``).

Tensor parallelism (TP) follows Megatron-LM (Shoeybi et al., 2019): a ColumnParallelLinear
splits its output features across ranks, a RowParallelLinear splits its input features and
sums the partial results with an all-reduce. ``tp_group=None`` means a world of size 1.
Every parallel layer's parameters carry ``param.weight_loader(param, full_hf_tensor,
shard_id=None)``, which copies this rank's shard of an unsharded checkpoint tensor.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers import decode_linear, elementwise, onednn_linear, panel_linear
from pdserve.engine.layers.int8_linear import dequantize_int8, int8_linear_kernel, kernel_applies


def tp_rank_and_size(tp_group: Any | None) -> tuple[int, int]:
    """(rank, world size) of this process in ``tp_group``; (0, 1) when the group is None."""
    if tp_group is None:
        return 0, 1
    return dist.get_rank(tp_group), dist.get_world_size(tp_group)


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(f"{what}={numerator} is not divisible by the TP size {denominator}")
    return numerator // denominator


def _invariant_row_multiple() -> int:
    """The row count MKL's sgemm computes every row of the same way at, on this CPU: 4 where its
    kernels are AVX2 ones (AMD EPYC Zen 3, MKL 2024.2), 16 where the CPU has AVX-512 (an Intel Xeon:
    with 4, a row's bits changed with the batch; MKL picks its AVX-512 kernels from the CPU, whatever
    ``ATEN_CPU_CAPABILITY`` caps torch's own kernels to). 16 is a multiple of 4, so a wrong guess
    towards it costs only padding."""
    try:
        return 16 if torch.cpu._is_avx512_supported() else 4
    except AttributeError:  # an older torch without the query
        return 16


# Rows of every batch-invariant matmul are padded to a multiple of this (see batch_invariant_linear).
INVARIANT_ROW_MULTIPLE = _invariant_row_multiple()


def pad_rows(x: torch.Tensor, multiple: int = INVARIANT_ROW_MULTIPLE) -> torch.Tensor:
    """x [num_rows, d] -> [max(multiple, num_rows rounded up to ``multiple``), d]: zero rows appended
    (x itself when no padding is needed)."""
    num_rows = x.shape[0]
    padded = max(multiple, -(-num_rows // multiple) * multiple)
    return x if padded == num_rows else F.pad(x, (0, 0, 0, padded - num_rows))


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x W^T + b where each row of y has the same bits whatever the number of rows of x.

    x: [..., in_features]; weight: [out_features, in_features]; bias: [out_features] or None.
    Returns [..., out_features].

    Why: on CPU, MKL's sgemm computes one row differently depending on M (the number of rows):
    M = 1 is a GEMV, and the last M mod 4 rows of a GEMM go through a narrower micro-kernel,
    each with its own summation order, so one token's projection changes with what else is in
    the batch (He & Thinking Machines Lab, "Defeating Nondeterminism in LLM Inference", 2025).
    Padding the rows to a multiple of ``INVARIANT_ROW_MULTIPLE`` (at least that many) sends
    every row through the same full-width micro-kernel. Measured on MKL 2024.2, AVX2 (AMD EPYC), float32:
    a row's bits are identical for every M in 1..69 and up to 4100, at any position, with a multiple
    of 4; on an Intel Xeon with AVX-512 a multiple of 4 or 8 was not enough and 16 was
    (tests/test_batch_invariance.py checks it on the machine that runs the tests). The bias
    is added after the matmul, elementwise, so it cannot change the order either.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # (M, in)
    y = F.linear(pad_rows(x2), weight)[: x2.shape[0]]  # (M, out)
    if bias is not None:
        y = y + bias
    return y.reshape(*lead, weight.shape[0])


def quantized_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     batch_invariant: bool = False) -> torch.Tensor:
    """y = x (weight * scale)^T for a weight-only int8 layer (``pdserve.engine.layers.int8_linear``).

    x: [..., in_features] float; weight: [out_features, in_features] int8; scale: [out_features,
    num_groups] float32. Returns [..., out_features] in x's dtype. The native kernel where it
    applies (``kernel_applies``: float32 on CPU, few rows or ``batch_invariant``); otherwise the
    weight is dequantized to x's dtype for this call and multiplied as a float layer would
    (through ``batch_invariant_linear`` when ``batch_invariant``).
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])  # (M, in)
    if kernel_applies(x2, weight, scale, batch_invariant):
        y = int8_linear_kernel(x2, weight, scale)
    else:
        w = dequantize_int8(weight, scale, x.dtype)
        y = batch_invariant_linear(x2, w) if batch_invariant else F.linear(x2, w)
    return y.reshape(*lead, weight.shape[0])


def packed_linear(module: nn.Module, x2: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x2 [M, K] through ``module``'s packed weight [N, K] -> [M, N] (+ bias): 16-feature panels
    (``weight_format.pack_panel_weights``) or oneDNN's blocked layout (``pack_linear_weights``); None
    when its weight is not packed. A decoder linear or an LM head (``weight_format.pack_lm_head``).
    Reads only the packed layouts' handles and ints until it knows the layout: under torch.compile a
    tensor attribute read here would become a graph input, guarded before every step."""
    if getattr(module, "panel_handle", None) is not None:
        return panel_linear.packed_linear(x2, module, bias)
    if getattr(module, "packed_handle", None) is not None:
        return onednn_linear.packed_linear(x2, module, bias)
    return None


def _project(layer: ColumnParallelLinear | RowParallelLinear, x: torch.Tensor,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + bias for ``layer``: packed weights through oneDNN (``weight_format.pack_linear_weights``) or
    the panel kernel (``weight_format.pack_panel_weights``), int8 weights through ``quantized_linear``,
    float ones through ``batch_invariant_linear`` (batch-invariant), the few-row decode kernel (decode
    steps on the CPU, ``pdserve.engine.layers.decode_linear``) or ``F.linear``."""
    if (y := packed_linear(layer, x.reshape(-1, x.shape[-1]), bias)) is not None:
        return y.reshape(*x.shape[:-1], y.shape[-1])
    if layer.weight_scale is not None:
        y = quantized_linear(x, layer.weight, layer.weight_scale, layer.batch_invariant)
        return y if bias is None else y + bias
    if layer.batch_invariant:
        return batch_invariant_linear(x, layer.weight, bias)
    return linear(x, layer.weight, bias)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] @ weight [out, in]^T (+ bias) -> [..., out]: the few-row decode kernel where it
    applies (``decode_linear.kernel_applies``), else ``F.linear``."""
    x2 = x.reshape(-1, x.shape[-1])  # (M, in)
    if decode_linear.kernel_applies(x2, weight):
        y = decode_linear.decode_linear_kernel(x2, weight).reshape(*x.shape[:-1], weight.shape[0])
        return y if bias is None else y + bias
    return F.linear(x, weight, bias)


def _empty_param(*shape: int, dtype: torch.dtype, device: str | torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich, NeurIPS 2019), computed in float32.

    x: [..., hidden_size] -> [..., hidden_size], same dtype as x. Matches the HF Llama norm:
    normalize in float32, cast back, then scale by ``weight``.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype=torch.float32, device="cpu"):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := elementwise.rms_norm(x, self.weight, self.eps)) is not None:  # float32, eager: one pass
            return out
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Float32ScaleRMSNorm(RMSNorm):
    """RMSNorm that multiplies by the weight in float32 before casting back, ``(w * x).to(dtype)``
    (OLMo 2's and gpt-oss's order; Llama casts first). Same shapes as ``RMSNorm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := elementwise.rms_norm(x, self.weight, self.eps)) is not None:  # all float32: the same order
            return out
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b with W's output features split across TP ranks (no communication).

    x: [..., input_size] -> [..., output_size // tp_size] (this rank's slice).
    ``output_sizes`` makes one layer out of several fused projections (e.g. q/k/v or gate/up):
    each part is split across ranks on its own, and a rank's weight is the concatenation of
    its slices of each part. Load part i with ``weight_loader(param, hf_tensor, shard_id=i)``.

    ``num_shards[i]`` (default: the TP size) cuts part i into fewer pieces than there are
    ranks; rank r then holds piece ``r * num_shards[i] // tp_size``, so pieces are
    replicated over ``tp_size // num_shards[i]`` ranks. Grouped-query attention with fewer
    KV heads than ranks uses this: each rank holds (a copy of) one KV head, as in vLLM.

    ``batch_invariant`` (set by ``DecoderForCausalLM.set_batch_invariant``): compute through
    ``batch_invariant_linear``, so a row's output does not depend on the other rows.

    ``lora`` (``pdserve.engine.lora.layers.LoRASlots``, set by the LoRA manager): adds each token's
    adapter term to the output.
    """

    batch_invariant: bool = False
    lora = None
    packed_weight = None  # the weight in oneDNN's blocked layout (weight_format.pack_linear_weights), or None
    packed_handle = None  # packed_weight's handle for torch.ops.pdserve.onednn_linear (compiled graphs)
    panel_weight = None  # the weight in 16-feature panels (weight_format.pack_panel_weights), or None
    panel_handle = None  # panel_weight's handle for torch.ops.pdserve.panel_linear_by_handle (compiled graphs)
    packed_out_features = None  # N of the packed weight [N, K] (either layout)

    def __init__(
        self,
        input_size: int,
        output_sizes: int | Sequence[int],
        bias: bool = False,
        tp_group: Any | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        num_shards: Sequence[int] | None = None,
    ):
        super().__init__()
        self.output_sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
        self.num_shards = list(num_shards) if num_shards is not None else [self.tp_size] * len(self.output_sizes)
        for shards in self.num_shards:
            if shards < 1 or self.tp_size % shards:
                raise ValueError(f"a part split {shards} ways cannot be spread over {self.tp_size} TP ranks")
        self.local_sizes = [_divide(n, k, "output size") for n, k in zip(self.output_sizes, self.num_shards)]
        local_out = sum(self.local_sizes)
        self.weight = _empty_param(local_out, input_size, dtype=dtype, device=device)
        self.weight.weight_loader = self.weight_loader
        self.register_parameter("weight_scale", None)  # int8 weights' scales, set by quantization.quantize_model
        self.bias = None
        if bias:
            self.bias = _empty_param(local_out, dtype=dtype, device=device)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy this rank's rows of ``loaded`` (the full, unsharded HF tensor for part
        ``shard_id``, or for the whole layer when shard_id is None) into ``param``."""
        if shard_id is None and len(self.output_sizes) > 1:
            raise ValueError("a fused ColumnParallelLinear needs a shard_id per part")
        part = 0 if shard_id is None else shard_id
        if loaded.shape[0] != self.output_sizes[part]:
            raise ValueError(f"expected {self.output_sizes[part]} rows for part {part}, got {tuple(loaded.shape)}")
        local = self.local_sizes[part]
        dst_start = sum(self.local_sizes[:part])
        piece = self.tp_rank * self.num_shards[part] // self.tp_size
        src = loaded.narrow(0, piece * local, local)
        dst = param.data.narrow(0, dst_start, local)
        if src.shape != dst.shape:
            raise ValueError(f"shape mismatch: checkpoint shard {tuple(src.shape)} vs param {tuple(dst.shape)}")
        dst.copy_(src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _project(self, x, self.bias)
        return y if self.lora is None else self.lora.add_to(x, y)


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input features split across TP ranks, summed by all-reduce.

    x: [..., input_size // tp_size] (this rank's slice, e.g. the output of a
    ColumnParallelLinear) -> [..., output_size], identical on every rank. The bias is
    added once, after the reduction. ``batch_invariant``: as ``ColumnParallelLinear``'s (a
    sum of two ranks' partials is commutative, so TP 2 keeps it; EngineConfig refuses TP > 2).
    ``lora``: as ``ColumnParallelLinear``'s; the term of this rank's input slice is added before
    the all-reduce.
    """

    batch_invariant: bool = False
    lora = None
    # as ColumnParallelLinear's
    packed_weight = packed_handle = panel_weight = panel_handle = packed_out_features = None

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool = False,
        tp_group: Any | None = None,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ):
        super().__init__()
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
        self.local_input_size = _divide(input_size, self.tp_size, "input size")
        self.weight = _empty_param(output_size, self.local_input_size, dtype=dtype, device=device)
        self.weight.weight_loader = self.weight_loader
        self.register_parameter("weight_scale", None)  # int8 weights' scales, set by quantization.quantize_model
        self.bias = None
        if bias:
            self.bias = _empty_param(output_size, dtype=dtype, device=device)
            self.bias.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
        """Copy this rank's columns of the full HF weight (the bias is replicated)."""
        if shard_id is not None:
            raise ValueError("RowParallelLinear has no fused parts")
        if param.dim() == 2:
            loaded = loaded.narrow(1, self.tp_rank * self.local_input_size, self.local_input_size)
        if loaded.shape != param.shape:
            raise ValueError(f"shape mismatch: checkpoint shard {tuple(loaded.shape)} vs param {tuple(param.shape)}")
        param.data.copy_(loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _project(self, x)
        if self.lora is not None:
            y = self.lora.add_to(x, y)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        if self.bias is not None:
            y = y + self.bias
        return y


class SiluAndMul(nn.Module):
    """SwiGLU activation (Shazeer, "GLU Variants Improve Transformer", 2020).

    x: [..., 2 * d] holding [gate | up] -> silu(gate) * up: [..., d].
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (out := elementwise.silu_and_mul(x)) is not None:  # float32, eager: one pass
            return out
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
