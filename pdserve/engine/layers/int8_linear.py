"""Weight-only int8 matmul: the native kernel (``kernels/int8_linear.cpp``) as a torch custom op,
and the dequantizing path it replaces.

A quantized linear layer (``pdserve.engine.layers.quantization``) holds ``weight`` int8 [N, K] and
``weight_scale`` float32 [N, G] (G = 1: one scale per output row; else groups of K / G input
features), so that ``W ~= weight * scale`` broadcast over each group. ``int8_linear`` computes
``x W^T`` from those without writing W in float32 anywhere: the kernel widens 8 int8 values at a
time to float32 in registers, so a decode step reads one byte per weight instead of four. On the
bench preset's shapes (one AVX2 core) that is 1.5-3x faster than float32 ``F.linear`` at 1-8 rows
and about even at 32; from ``KERNEL_MAX_ROWS`` rows up (prefill) a float32 GEMM over the
dequantized weight is as fast or faster, so those calls take it (docs/benchmarks.md).

The kernel's summation order for an output does not depend on the number of rows (see its
header), so in batch-invariant mode it serves every call whatever the row count.

It is a ``torch.library.custom_op``: the compiled decode step calls it as one opaque node
(inductor would otherwise generate the int8 -> float conversion itself, 3-4x slower than eager).
"""

from __future__ import annotations

import torch

from pdserve.kernels import load_int8_linear

# From this many rows up a call dequantizes the weight and runs a float32 GEMM (unless batch-invariant).
KERNEL_MAX_ROWS = 64

# Whether the kernel was built here: set by ``build_kernel`` (quantize_model calls it), read by
# ``kernel_applies`` as a plain global, which torch.compile can trace (loading the library cannot).
_kernel_built = False
_lib = None  # the loaded library (kept here: no lock per call)


def build_kernel() -> bool:
    """Build (or find in the cache) and load the native kernel; whether it is available here."""
    global _kernel_built, _lib
    _lib = load_int8_linear()
    _kernel_built = _lib is not None
    return _kernel_built


def kernel_applies(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, batch_invariant: bool) -> bool:
    """Whether ``int8_linear_kernel`` can (and should) compute ``x`` [M, K] against ``weight`` [N, K]
    int8 with ``scale`` [N, G]: float32 activations on the CPU, K and K / G multiples of 8, at
    most ``KERNEL_MAX_ROWS`` rows unless ``batch_invariant``, and the kernel built (``build_kernel``)."""
    num_rows, in_features = x.shape
    num_groups = scale.shape[1]
    return (x.dtype == torch.float32 and x.device.type == "cpu" and weight.dtype == torch.int8
            and scale.dtype == torch.float32
            and in_features % 8 == 0 and in_features % num_groups == 0 and (in_features // num_groups) % 8 == 0
            and (batch_invariant or num_rows <= KERNEL_MAX_ROWS) and _kernel_built)


@torch.library.custom_op("pdserve::int8_linear", mutates_args=())
def int8_linear_kernel(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ (weight [N, K] int8 * scale [N, G] float32)^T -> [M, N] float32, by the
    native kernel (call only where ``kernel_applies``). Raises RuntimeError if the kernel refuses
    the shapes."""
    x = x.contiguous()
    weight, scale = weight.contiguous(), scale.contiguous()
    num_rows, in_features = x.shape
    out = torch.empty(num_rows, weight.shape[0], dtype=torch.float32)
    if num_rows == 0:
        return out
    if _lib is None and not build_kernel():
        raise RuntimeError("the int8 linear kernel could not be built here")
    rc = _lib.pdserve_int8_linear(out.data_ptr(), x.data_ptr(), weight.data_ptr(), scale.data_ptr(), num_rows,
                                  weight.shape[0], in_features, in_features // scale.shape[1], torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"int8 linear kernel refused K={in_features} with {scale.shape[1]} scale groups")
    return out


@int8_linear_kernel.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


def dequantize_int8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """weight [N, K] int8, scale [N, G] -> W [N, K] in ``dtype`` (each group of K / G columns times its scale)."""
    num_out, in_features = weight.shape
    num_groups = scale.shape[1]
    grouped = weight.reshape(num_out, num_groups, in_features // num_groups).to(dtype)
    return (grouped * scale.to(dtype).unsqueeze(-1)).reshape(num_out, in_features)
