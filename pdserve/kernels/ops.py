"""The ``torch.ops.pdserve`` operators: one library fragment, every operator's schema in one table.

Each operator is what a compiled graph (``torch.compile``: the compiled decode step) calls as one opaque
node, where tracing the Python inside would break the graph or cost more than the kernel. They are
plain operator definitions with a kernel per dispatch key, not ``torch.library.custom_op``: its Python
wrappers (autograd, a mutation's version bump, dispatch checks) cost 9-90 us a call, more than some of
these kernels at batch 1. The implementations live beside the code that owns their data (the kernel
wrappers in ``engine/layers``, the MoE experts in ``engine/models``) and register through ``implement``;
each registers its fake (shape-only) kernel with ``torch.library.register_fake`` beside it.

(``int8_linear`` is a ``custom_op`` of its own: it runs in eager prefill steps as well, where
autograd's checks matter less than its simpler registration.)
"""

from __future__ import annotations

from typing import Callable

import torch

SCHEMAS = {
    # x [M, K] @ weight [N, K]^T -> [M, N]: the few-row native matmul (engine/layers/decode_linear.py)
    "decode_linear": "decode_linear(Tensor x, Tensor weight) -> Tensor",
    # x [M, K] through oneDNN's packed weight named by ``handle`` (engine/layers/onednn_linear.py)
    "onednn_linear": "onednn_linear(Tensor x, int handle, int out_features, Tensor? bias=None) -> Tensor",
    # x [M, K] through a weight packed in panels, given as a tensor or by handle (engine/layers/panel_linear.py)
    "panel_linear": "panel_linear(Tensor x, Tensor panels, int out_features) -> Tensor",
    "panel_linear_by_handle": "panel_linear_by_handle(Tensor x, int handle, int out_features) -> Tensor",
    # a decode step's paged attention: writes the new K/V into the cache, attends (engine/layers/paged_backend.py)
    "paged_decode_attention": (
        "paged_decode_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, int layer, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "int sliding_window, str kv_cache_dtype='', Tensor? sinks=None) -> Tensor"),
    # the same on a float32 cache of K and V (no quantized rows, no sinks): a C++ kernel (kernels/torch_ops.cpp)
    "paged_decode_attention_f32": (
        "paged_decode_attention_f32(Tensor query, Tensor key, Tensor value, Tensor(a!) kv_cache, int layer, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, float scale, "
        "int sliding_window) -> Tensor"),
    # the grouped experts of the MoE module named by ``op_key`` (engine/models/moe.py)
    "moe_experts": "moe_experts(Tensor x, Tensor topk_ids, Tensor topk_weights, int op_key) -> Tensor",
}

LIBRARY = torch.library.Library("pdserve", "FRAGMENT")
for _schema in SCHEMAS.values():
    LIBRARY.define(_schema)


def implement(name: str, kernel: Callable, dispatch_keys: tuple[str, ...] = ("CPU",)):
    """Register ``kernel`` as operator ``name``'s implementation for ``dispatch_keys``; returns
    ``torch.ops.pdserve.<name>``. Raises KeyError for a name without a schema in ``SCHEMAS``."""
    if name not in SCHEMAS:
        raise KeyError(f"no schema for torch.ops.pdserve.{name}: add it to pdserve/kernels/ops.py's SCHEMAS")
    for key in dispatch_keys:
        LIBRARY.impl(name, kernel, key)
    return getattr(torch.ops.pdserve, name)
