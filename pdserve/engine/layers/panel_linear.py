"""Linear layers on float32 weights packed in 16-feature column panels (``kernels/panel_linear.cpp``).

A decode step at batch 8-32 is neither memory-bound nor compute-bound alone: each weight is streamed
from memory once and used for one multiply-add per row. oneDNN's packed GEMM, on a Zen 5 class core,
ran the bench preset's 48 linears at 20 rows in about the time of streaming them plus computing at its
large-batch rate. The panel kernel keeps the weight [N, K] as [ceil(N / 16), K, 16] (one sequential
stream), prefetches it far ahead and multiplies each loaded line by up to 28 rows held in registers,
so the stream and the FMAs overlap: 14 against 20 ms at 20 rows, 9 against 12.5 at 8, level at 1. From 192
rows (prompt chunks) it takes two panels at a time on AVX-512: on a Zen 5 5% behind oneDNN at 128-256 rows and
5-7% ahead at 512-1,024 (``python benchmarks/bench_linear_formats.py``).

``weight_format.pack_panel_weights`` packs a model's layers once, at load (``--linear-weight-format
panel``, or ``auto`` where it times fastest). In a compiled decode step each linear is one opaque node,
``torch.ops.pdserve.panel_linear_by_handle``, which names its panels by an integer handle (as
``onednn_linear`` does): the graph never takes the weights as inputs, so dynamo does not guard 96
tensors (the panels and the plain weights' placeholders) before every step, nor fetch and pass them.
That operator's CPU kernel is C++ where ``kernels.load_torch_ops`` builds (``kernels/torch_ops.cpp``, which
reads the panels of a handle from a table ``register_panels`` keeps current), its Python implementation
below elsewhere.
"""

from __future__ import annotations

import weakref

import torch

from pdserve.kernels import load_panel_linear, load_torch_ops, ops
from pdserve.kernels.op_handles import OpHandles

LANES = 16  # output features per panel

_lib = None
_torch_ops = None  # kernels.load_torch_ops(): the C++ operators, where built (its panels' table is kept here)


def build_kernel() -> bool:
    """Build (or find in the cache) and load the native kernel, and the C++ operator that calls it
    (``kernels.load_torch_ops``; the panels registered so far are handed to it); whether the kernel is
    available here."""
    global _lib, _torch_ops
    _lib = load_panel_linear()
    if _lib is not None and _torch_ops is None:
        _torch_ops = load_torch_ops()
        if _torch_ops is not None:
            for handle, panels in _PANELS.items():  # a list: finalizers may run meanwhile
                _table_set(handle, panels)
    return _lib is not None


def panels_shape(out_features: int, in_features: int) -> tuple[int, int, int]:
    """The panels of a weight [out_features, in_features]: [ceil(out_features / 16), in_features, 16]."""
    return (out_features + LANES - 1) // LANES, in_features, LANES


def pack_panels(weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """weight [N, K] float32 (CPU) -> its panels [ceil(N / 16), K, 16], features past N zero: written into
    ``out`` (a contiguous float32 CPU tensor of ``panels_shape(N, K)``, e.g. a view of a weight arena on huge
    pages) where given, else into a new tensor.

    Raises:
        RuntimeError: the kernel cannot be built here.
        ValueError: not a 2-D float32 CPU tensor, or ``out`` not of the panels' shape.
    """
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"panels take a 2-D float32 CPU weight, got {tuple(weight.shape)} {weight.dtype} "
                         f"on {weight.device}")
    if _lib is None and not build_kernel():
        raise RuntimeError("the panel linear kernel could not be built here")
    weight = weight.detach().contiguous()
    out_features, in_features = weight.shape
    shape = panels_shape(out_features, in_features)
    if out is None:
        out = torch.empty(shape, dtype=torch.float32)
    elif (tuple(out.shape) != shape or out.dtype != torch.float32 or out.device.type != "cpu"
          or not out.is_contiguous()):
        raise ValueError(f"panels of a {tuple(weight.shape)} weight need a contiguous float32 CPU {shape}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if _lib.pdserve_f32_pack_panels(out.data_ptr(), weight.data_ptr(), out_features, in_features) != 0:
        raise ValueError(f"cannot pack a weight of shape {tuple(weight.shape)}")
    return out


# The operator's CPU kernel (its schema: pdserve/kernels/ops.py).
def _panel_linear_cpu(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [M, K] float32 @ W^T -> [M, out_features], W packed as ``panels`` [ceil(N / 16), K, 16] by
    ``pack_panels``. Raises RuntimeError if the kernel is missing or refuses the shapes."""
    x = x.contiguous()
    num_rows, in_features = x.shape
    out = torch.empty(num_rows, out_features, dtype=torch.float32)
    if num_rows == 0:
        return out
    if _lib is None and not build_kernel():
        raise RuntimeError("the panel linear kernel could not be built here")
    if panels.shape[1] != in_features or panels.shape[0] * LANES < out_features:
        raise RuntimeError(f"panels {tuple(panels.shape)} do not fit x {tuple(x.shape)} -> {out_features} features")
    rc = _lib.pdserve_f32_panel_linear(out.data_ptr(), x.data_ptr(), panels.data_ptr(), num_rows, out_features,
                                       in_features, torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"panel linear kernel refused x {tuple(x.shape)} -> {out_features} features")
    return out


ops.implement("panel_linear", _panel_linear_cpu)


@torch.library.register_fake("pdserve::panel_linear")
def _(x: torch.Tensor, panels: torch.Tensor, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


_PANELS: OpHandles[torch.Tensor] = OpHandles()  # handle -> panels (the layer owns them)


def register_panels(panels: torch.Tensor) -> int:
    """A handle for ``panels`` (a ``pack_panels`` result), valid while the caller keeps the tensor alive."""
    handle = _PANELS.register(panels)
    if _torch_ops is not None:
        _table_set(handle, panels)
    return handle


def _table_set(handle: int, panels: torch.Tensor) -> None:
    """Hand ``panels`` to the C++ operator's table under ``handle``, and take them out when the tensor is freed."""
    _torch_ops.pdserve_torch_ops_set_panels(handle, panels.data_ptr(), panels.shape[0], panels.shape[1])
    weakref.finalize(panels, _torch_ops.pdserve_torch_ops_set_panels, handle, None, 0, 0)




def _panel_linear_by_handle_cpu(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    """``panel_linear`` with the panels of ``handle`` (``register_panels``). Raises KeyError for a handle
    whose panels were freed (the C++ kernel: RuntimeError)."""
    return _panel_linear_cpu(x, _PANELS[handle], out_features)


# For CPU tensors wherever torch_ops.cpp's CPU kernel is not registered (a composite kernel serves every
# backend that has none of its own).
ops.implement("panel_linear_by_handle", _panel_linear_by_handle_cpu, ("CompositeExplicitAutograd",))


@torch.library.register_fake("pdserve::panel_linear_by_handle")
def _(x: torch.Tensor, handle: int, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def panel_linear(x2: torch.Tensor, panels: torch.Tensor, out_features: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """x2 [M, K] through a weight packed by ``pack_panels`` -> [M, out_features] (+ bias)."""
    y = torch.ops.pdserve.panel_linear(x2, panels, out_features)
    return y if bias is None else y + bias


def packed_linear(x2: torch.Tensor, layer, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] through ``layer``'s panels (``weight_format.pack_panel_weights``: ``panel_weight``, its
    ``panel_handle`` and ``packed_out_features`` N) -> [M, N] (+ bias): the op by handle under
    torch.compile, which never sees the panels, the kernel directly when eager."""
    if torch.compiler.is_compiling():
        y = torch.ops.pdserve.panel_linear_by_handle(x2, layer.panel_handle, layer.packed_out_features)
    else:
        y = _panel_linear_cpu(x2, layer.panel_weight, layer.packed_out_features)
    return y if bias is None else y + bias
