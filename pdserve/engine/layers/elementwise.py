"""RMSNorm, SwiGLU and rotary embedding in one pass each (``kernels/elementwise.cpp``), for eager forwards.

A 288-token prefill of the bench preset spent ~17 ms of ~220 (one core) in the torch operators of
these three layers: RMSNorm is six operators, SwiGLU's ``silu(gate) * up`` two over strided halves
of the fused projection, rotate-half RoPE five per tensor, each a full pass over memory. The
kernels read each row once and write it once. Each function returns None (or False) where its
kernel does not apply, and the caller runs its torch code, which is also the reference the tests
hold the kernels to:

- the tensors are not float32 on the CPU, or need gradients;
- a forward under ``torch.compile`` is being traced (inductor fuses these operators itself, and
  the compiled decode step keeps its graph free of opaque calls it need not have);
- no C++ compiler, or ``$PDSERVE_DISABLE_KERNELS``;
- torch's operators measured faster on this CPU when the engine loaded (``pdserve.engine.layers.kernel_choice``).
"""

from __future__ import annotations

import torch

from pdserve.engine.layers.native_switch import native
from pdserve.kernels import load_elementwise


def _library(*tensors: torch.Tensor):
    """The kernel library when every tensor is a float32 CPU tensor outside autograd and tracing, and the
    kernels measured faster than torch's operators here (``kernel_choice``)."""
    if torch.compiler.is_compiling() or not native("elementwise"):
        return None
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.requires_grad:
            return None
    return load_elementwise()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """``weight * x / sqrt(mean(x^2, -1) + eps)``: x [..., hidden], weight [hidden] -> a new [..., hidden]
    tensor; None where the kernel does not apply (module docstring)."""
    lib = _library(x, weight)
    if lib is None or not weight.is_contiguous() or x.shape[-1] != weight.shape[0]:
        return None
    hidden = x.shape[-1]
    rows = x.reshape(-1, hidden)
    if rows.stride(-1) != 1:
        return None
    out = torch.empty(rows.shape, dtype=x.dtype)
    lib.pdserve_rms_norm(out.data_ptr(), rows.data_ptr(), weight.data_ptr(), rows.shape[0], hidden, rows.stride(0),
                         hidden, eps, torch.get_num_threads())
    return out.view(x.shape)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """SwiGLU's ``silu(gate) * up`` for x [..., 2d] holding [gate | up] -> a new [..., d] tensor; None where
    the kernel does not apply (module docstring)."""
    lib = _library(x)
    if lib is None or x.shape[-1] % 2:
        return None
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        return None
    d = x.shape[-1] // 2
    out = torch.empty(rows.shape[0], d, dtype=x.dtype)
    lib.pdserve_silu_and_mul(out.data_ptr(), rows.data_ptr(), rows.shape[0], d, rows.stride(0), d,
                             torch.get_num_threads())
    return out.view(*x.shape[:-1], d)


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
    """x [N, H, D] rotated, rotate-half layout, over its first 2 * cos.shape[1] values per head (the rest
    copied): cos / sin [N, R/2] (one entry per frequency). Returns a new contiguous [N, H, D] tensor, or
    None where the kernel does not apply (module docstring)."""
    lib = _library(x, cos, sin)
    if lib is None or x.dim() != 3 or x.stride(2) != 1 or cos.stride(-1) != 1 or sin.stride() != cos.stride():
        return None
    out = torch.empty(x.shape, dtype=x.dtype)
    lib.pdserve_rope_rotate_half(out.data_ptr(), x.data_ptr(), cos.data_ptr(), sin.data_ptr(), x.shape[0], x.shape[1],
                                 x.shape[2], 2 * cos.shape[1], x.stride(0), x.stride(1), cos.stride(0),
                                 torch.get_num_threads())
    return out
