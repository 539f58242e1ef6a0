"""Matmuls of a few rows (decode steps): the native kernel (``kernels/decode_linear.cpp``) as torch
custom ops, for float32 and bfloat16 weights.

A decode step multiplies one row per sequence by every weight matrix, so at small batches it is
bound by how fast the weights stream from memory. torch's CPU GEMMs (MKL for float32, oneDNN for
bfloat16) read them at half the bandwidth or less for 1-16 rows; the kernel loads each weight row
once and multiplies it by every row of x while it is in registers (bfloat16: 32 pairs per AVX-512
BF16 instruction), prefetching the next weight rows into L2. Measured on the bench preset's 84 weight
matrices and its LM head (one AVX-512 core, weights cold, as in a step), kernel against library,
float32: 1 row 14.0-14.9 against 25 ms, 4 rows 15 against 37, 16 rows 42 against 59, 32 rows 81-84
against 86-91, 48 rows 124 against 116; bfloat16: 1 row 9.6 against 19.9 ms, 8 rows 12.8 against 25.2,
32 rows 40.7 against 44.1. From ``KERNEL_MAX_ROWS`` rows up the library GEMM is as fast or faster, so
those calls (prefill, large decode batches) keep it (docs/benchmarks.md).

An output's summation order does not depend on the number of rows (see the kernel's header). The
kernel is the operator ``torch.ops.pdserve.decode_linear`` so the compiled decode step calls it as
one opaque node.
"""

from __future__ import annotations

import torch

from pdserve.kernels import load_decode_linear, load_torch_ops, ops

# Up to this many rows a CPU linear goes through the kernel (decode); more rows take torch's GEMM.
KERNEL_MAX_ROWS = 32
# The kernel's unit of K (input features) per dtype: one vector of float32, one AVX-512 BF16 pair-vector.
_K_MULTIPLE = {torch.float32: 16, torch.bfloat16: 32}

# Whether the kernel was built here: set by ``build_kernel`` (the model runner calls it at start-up),
# read by ``kernel_applies`` as a plain global, which torch.compile can trace (loading cannot).
_kernel_built = False
_enabled = True  # kernel_choice may turn it off where torch's GEMM measures faster on this CPU
_lib = None


def build_kernel() -> bool:
    """Build (or find in the cache) and load the native kernel, and the C++ operator that calls it
    (``kernels.load_torch_ops``); whether the kernel is available here."""
    global _kernel_built, _lib
    _lib = load_decode_linear()
    _kernel_built = _lib is not None
    if _kernel_built:
        load_torch_ops()
    return _kernel_built


def set_enabled(on: bool) -> None:
    """Use the kernel (``on``, where it is built) or torch's GEMM for every call from now on
    (``pdserve.engine.layers.kernel_choice``: whichever measured faster on this CPU)."""
    global _enabled
    _enabled = on


def kernel_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``decode_linear_kernel`` should compute ``x`` [M, K] against ``weight`` [N, K]: both
    float32 or both bfloat16, on the CPU, 1 to ``KERNEL_MAX_ROWS`` rows, K a multiple of 16 (float32)
    or 32 (bfloat16), and the kernel built and enabled (``set_enabled``)."""
    multiple = _K_MULTIPLE.get(x.dtype)
    return (_kernel_built and _enabled and multiple is not None and weight.dtype == x.dtype and x.device.type == "cpu"
            and 0 < x.shape[0] <= KERNEL_MAX_ROWS and x.shape[1] % multiple == 0)


# ``torch.ops.pdserve.decode_linear`` (schema in pdserve/kernels/ops.py): a plain operator, not a
# ``custom_op``, whose wrappers would cost ~9 us a call, ~0.5 ms of a decode step's 49 calls.
def _decode_linear_cpu(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ weight [N, K] ^T -> [M, N] in x's dtype (float32, or bfloat16 accumulated in float32
    and rounded once), by the native kernel (call only where ``kernel_applies``). Raises
    RuntimeError if the kernel is missing or refuses the shapes."""
    x = x.contiguous()
    weight = weight.contiguous()
    num_rows, in_features = x.shape
    out = torch.empty(num_rows, weight.shape[0], dtype=x.dtype)
    if num_rows == 0:
        return out
    if _lib is None and not build_kernel():
        raise RuntimeError("the decode linear kernel could not be built here")
    fn = _lib.pdserve_bf16_linear if x.dtype == torch.bfloat16 else _lib.pdserve_f32_linear
    rc = fn(out.data_ptr(), x.data_ptr(), weight.data_ptr(), num_rows, weight.shape[0], in_features,
            torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"decode linear kernel refused K={in_features} for {x.dtype} (a multiple of "
                           f"{_K_MULTIPLE.get(x.dtype, 16)} is needed)")
    return out


# For CPU tensors wherever torch_ops.cpp's CPU kernel is not registered (kernels.load_torch_ops).
ops.implement("decode_linear", _decode_linear_cpu, ("CompositeExplicitAutograd",))


@torch.library.register_fake("pdserve::decode_linear")
def _(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


# ``torch.ops.pdserve.decode_linear``: the kernel as one opaque node of a compiled graph.
decode_linear_kernel = torch.ops.pdserve.decode_linear
