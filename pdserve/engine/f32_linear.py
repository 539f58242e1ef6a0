"""Float32 matmul for a few rows (decode steps): the native kernel (``kernels/f32_linear.cpp``) as
a torch custom op.

A decode step multiplies one row per sequence by every weight matrix, so at small batches it is
bound by how fast the weights stream from memory. torch's CPU GEMM (MKL) reads them at half the
bandwidth or less for 1-16 rows; the kernel loads each weight row once and multiplies it by every
row of x while it is in registers. Measured on the bench preset's 85 weight matrices (one AVX-512
core, weights cold, as in a step): 1 row 25 -> 19 ms, 4 rows 37 -> 23 ms, 8 rows 48 -> 33 ms, 16 rows
59 -> 51 ms; from ``KERNEL_MAX_ROWS`` rows up MKL's GEMM is as fast or faster, so those calls (prefill)
keep it (docs/benchmarks.md, "Decode at the memory roofline").

Like the int8 kernel, an output's summation order does not depend on the number of rows. It is a
``torch.library.custom_op`` so the compiled decode step calls it as one opaque node.
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels import load_f32_linear

# Up to this many rows a float32 CPU linear goes through the kernel (decode); more rows take torch's GEMM.
KERNEL_MAX_ROWS = 16

# Whether the kernel was built here: set by ``build_kernel`` (the model runner calls it at start-up),
# read by ``kernel_applies`` as a plain global, which torch.compile can trace (loading cannot).
_kernel_built = False
_lib = None


def build_kernel() -> bool:
    """Build (or find in the cache) and load the native kernel; whether it is available here."""
    global _kernel_built, _lib
    _lib = load_f32_linear()
    _kernel_built = _lib is not None
    return _kernel_built


def kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``f32_linear_kernel`` should compute ``x`` [M, K] against ``weight`` [N, K]: both float32
    on the CPU, 1 to ``KERNEL_MAX_ROWS`` rows, K a multiple of 16, and the kernel built."""
    return (_kernel_built and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.device.type == "cpu" and 0 < x.shape[0] <= KERNEL_MAX_ROWS and x.shape[1] % 16 == 0)


@torch.library.custom_op("pdserve::f32_linear", mutates_args=())
def f32_linear_kernel(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] float32 @ weight [N, K] float32 ^T -> [M, N] float32 by the native kernel (call only
    where ``kernel_applies``). Raises RuntimeError if the kernel is missing or refuses the shapes."""
    x = x.contiguous()
    weight = weight.contiguous()
    num_rows, in_features = x.shape
    out = torch.empty(num_rows, weight.shape[0], dtype=torch.float32)
    if num_rows == 0:
        return out
    if _lib is None and not build_kernel():
        raise RuntimeError("the float32 linear kernel could not be built here")
    rc = _lib.pdserve_f32_linear(out.data_ptr(), x.data_ptr(), weight.data_ptr(), num_rows, weight.shape[0],
                                 in_features, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"float32 linear kernel refused K={in_features} (a multiple of 16 is needed)")
    return out


@f32_linear_kernel.register_fake
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])
