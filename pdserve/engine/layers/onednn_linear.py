"""Linear layers on oneDNN-packed weights as one torch op, so a compiled decode step can call them.

``weight_format.pack_linear_weights`` reorders a layer's weight into oneDNN's blocked layout once, at load
(the layout vLLM's CPU backend keeps in its ``onednn_mm`` handles). That tensor has torch's opaque
``_mkldnn`` layout, which torch.compile cannot take as a graph input (inductor asserts on it), so a
worker with packed weights used to run its decode step eagerly (on the bench preset, one Zen 5
core: 14.1 ms at batch 1, 13.1-13.4 ms compiled this way). Here each packed weight gets an integer handle,
and ``torch.ops.pdserve.onednn_linear(x, handle, out_features, bias)`` multiplies by the weight the
handle names: the compiled graph sees an int, the op stays one opaque node (as
``pdserve::decode_linear`` and ``pdserve::paged_decode_attention`` do), and inductor compiles
everything around it.
"""

from __future__ import annotations

import torch

from pdserve.kernels import ops
from pdserve.kernels.op_handles import OpHandles

_PACKED: OpHandles[torch.Tensor] = OpHandles()  # handle -> packed weight (the layer owns it)


def register_packed_weight(packed: torch.Tensor) -> int:
    """A handle for ``packed`` (a ``torch.ops.mkldnn._reorder_linear_weight`` result), valid while the
    caller keeps the tensor alive."""
    return _PACKED.register(packed)


# The operator's CPU kernel (its schema: pdserve/kernels/ops.py).
def _onednn_linear_cpu(x: torch.Tensor, handle: int, out_features: int,
                       bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) -> [M, out_features], W the packed weight of ``handle``. Raises
    KeyError for a handle whose weight was freed."""
    return torch.ops.mkldnn._linear_pointwise(x, _PACKED[handle], bias, "none", [None], "")


ops.implement("onednn_linear", _onednn_linear_cpu)


@torch.library.register_fake("pdserve::onednn_linear")
def _(x: torch.Tensor, handle: int, out_features: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


def packed_linear(x2: torch.Tensor, layer, bias: torch.Tensor | None) -> torch.Tensor:
    """x2 [M, K] through ``layer``'s packed weight [N, K] (``weight_format.pack_linear_weights``) -> [M, N]:
    oneDNN directly when eager, the op by handle under torch.compile, which never sees the packed
    tensor."""
    if torch.compiler.is_compiling():
        return torch.ops.pdserve.onednn_linear(x2, layer.packed_handle, layer.packed_out_features, bias)
    return torch.ops.mkldnn._linear_pointwise(x2, layer.packed_weight, bias, "none", [None], "")
