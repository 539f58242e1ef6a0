"""The ``paged`` attention backend on the CPU: the native kernel (``kernels/paged_attention.cpp``) and
what decides, per forward, which rows it takes.

``attend_native`` serves ``attention.paged_attention`` for the ``paged`` backend: decode rows and short
chunks go through the kernel, straight from the block tables; prompts prefilled from scratch and long
chunks after cached rows attend densely (``prefill_attention.causal_attention``), unless the batch must
be invariant (``native_plan``). ``torch.ops.pdserve.paged_decode_attention`` is the same for a decode-only
step as one opaque operator, which the compiled decode step (``compiled_step``) calls. Shapes and the
cache layout are ``attention``'s (its module docstring). The algorithm is PagedAttention (Kwon et al.,
SOSP'23).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.common.kv_quant import dequantize_rows, kv_cache_format
from pdserve.engine.layers.attention_metadata import AttentionMetadata, write_kv_cache
from pdserve.kernels import KV_DTYPE_CODES, load_paged_attention, ops
from pdserve.engine.layers.prefill_attention import causal_attention


CHUNK_DENSE_MIN_ROWS = 16  # a prefill chunk with this many new rows after cached ones: causal_attention


@dataclass
class NativePlan:
    """Host-side facts of one forward for the native kernel, computed once and shared by all layers.

    fresh: (begin, end) query-row ranges of sequences prefilled from scratch this step (no
    cached tokens, several new ones): these attend over their own new K/V (``prefill_attention.causal_attention``).
    chunks: (begin, end, seq, seq_len) of sequences whose ``end - begin >= CHUNK_DENSE_MIN_ROWS`` new
    rows follow cached ones (a prefill chunk after the first, or after prefix-cache hits): their K/V
    are gathered from the cache and they attend causally, shifted by the cached length
    (``prefill_attention.causal_attention``; with SDPA already 1.3-2x the paged kernel's speed at 244-512 rows over
    500-1,900 tokens of context).
    skip: [num_seqs] uint8, 1 for all those sequences (the kernel leaves their rows), or None."""

    fresh: list[tuple[int, int]]
    skip: torch.Tensor | None
    chunks: list[tuple[int, int, int, int]] = field(default_factory=list)
    chunk_masks: list[torch.Tensor | None] = field(default_factory=list)  # each chunk's [Q, L] mask, once made


def native_plan(metadata: AttentionMetadata, sliding_window: int | None, sinks: bool = False) -> NativePlan:
    """Which sequences skip the paged kernel for dense causal attention: fresh prefills and long chunks,
    unless the batch must be invariant.

    Under ``batch_invariant`` the kernel takes every row: per query row it reduces over that
    sequence's keys front to back in a fixed order (scores, softmax, then the weighted V sum,
    block by block), and OpenMP only hands whole (sequence, KV-head group) items to threads,
    so a row's result depends on its position and its sequence's K/V alone. Dense attention over a fresh
    prompt reduces in another order than the kernel over the same prompt in chunks."""
    if metadata.max_query_len <= 1 or sliding_window is not None or metadata.batch_invariant or sinks:
        # decode only, a window, batch-invariant, or attention sinks: the kernel takes every row. (A quantized cache's
        # fresh prefills do go to dense attention, over their K/V as the cache holds them: see attend_native.)
        return NativePlan([], None)
    if metadata._native is not None:
        return metadata._native
    qsl = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    fresh, chunks, skip = [], [], []
    for i, ctx in enumerate(seq_lens):
        q_len = qsl[i + 1] - qsl[i]
        is_fresh = q_len > 1 and q_len == ctx
        # a float cache's long chunk after cached rows (a quantized cache's rows stay with the kernel)
        is_chunk = CHUNK_DENSE_MIN_ROWS <= q_len < ctx and metadata.kv_cache_dtype is None
        skip.append(1 if is_fresh or is_chunk else 0)
        if is_fresh:
            fresh.append((qsl[i], qsl[i + 1]))
        elif is_chunk:
            chunks.append((qsl[i], qsl[i + 1], i, ctx))
    plan = NativePlan(fresh, torch.tensor(skip, dtype=torch.uint8) if fresh or chunks else None, chunks,
                       [None] * len(chunks))
    metadata._native = plan
    return plan


# ``torch.ops.pdserve.paged_decode_attention`` (schema in pdserve/kernels/ops.py): a plain operator, not a
# ``custom_op``, whose wrappers would cost ~90 us a call, more than the kernel itself at batch 1.
def paged_decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                           layer: int, slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           query_start_loc: torch.Tensor, scale: float, sliding_window: int,
                           kv_cache_dtype: str = "", sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Decode-only paged attention as one torch op (``torch.ops.pdserve.paged_decode_attention``):
    writes the new K/V into layer ``layer`` of ``kv_cache`` and attends through the native kernel.

    kv_cache: [num_layers, kv_slots, num_blocks, block_size, num_kv_heads, head_dim] (for a quantized
    ``kv_cache_dtype``, uint8 with head_dim + 4 bytes per row); other shapes as ``paged_attention``
    with one query token per sequence; sliding_window 0 = none; kv_cache_dtype "" = a plain cache;
    sinks: [num_heads] float32 attention-sink logits or None. An op of
    its own so that a compiled step (torch.compile) treats it as one opaque call that mutates
    the cache in place, never a copy of it. It takes the whole cache and an index because
    inductor (torch 2.13) loses the storage offset of a view passed to a mutating operator.
    """
    if takes_float32_kernel(query, kv_cache, kv_cache_dtype, sinks):
        return torch.ops.pdserve.paged_decode_attention_f32(query, key, value, kv_cache, layer, slot_mapping,
                                                            block_tables, seq_lens, query_start_loc, scale,
                                                            sliding_window or 0)
    kv_cache_layer = kv_cache[layer]
    kv_dtype = kv_cache_dtype or None
    write_kv_cache(key, value, kv_cache_layer, slot_mapping, kv_dtype)
    if kv_dtype is None and sinks is None and query.dtype == torch.float32:
        # A plain cache, one row per sequence: every row is the kernel's, so none of the general path's
        # planning (its metadata and plan cost ~15 us a call against ~15 us of kernel at batch 1).
        out = query.new_empty(*query.shape[:2], value.shape[-1])  # (N, H, V)
        _run_kernel(out, query.contiguous(), kv_cache_layer, _kernel_dtype_code(kv_cache.dtype, None), block_tables,
                    seq_lens, query_start_loc, None, scale, sliding_window or 0, None)
        return out
    metadata = AttentionMetadata(slot_mapping, block_tables, seq_lens, query_start_loc, max_query_len=1,
                                 max_seq_len=0, backend="paged", kv_cache_dtype=kv_dtype)
    return attend_native(query, key, value, kv_cache_layer, metadata, scale, sliding_window or None, sinks)


def takes_float32_kernel(query: torch.Tensor, kv_cache: torch.Tensor, kv_cache_dtype: str | None,
                         sinks: torch.Tensor | None) -> bool:
    """Whether a decode step's attention goes to ``torch.ops.pdserve.paged_decode_attention_f32``: a plain
    float32 cache of K and V (``kv_cache`` [L, 2, ...], contiguous), float32 queries, no sinks."""
    return (not kv_cache_dtype and sinks is None and query.dtype == kv_cache.dtype == torch.float32
            and kv_cache.shape[1] == 2 and kv_cache.is_contiguous())


def _decode_float32(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, layer: int,
                    slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, sliding_window: int) -> torch.Tensor:
    """``torch.ops.pdserve.paged_decode_attention_f32``'s Python implementation (the C++ one,
    ``kernels/torch_ops.cpp``, serves CPU tensors where it builds): ``paged_decode_attention`` on a float32
    cache of K and V, the new rows' write and the attention in one native call
    (``pdserve_paged_decode_attention``), with no torch op between them. Shapes as there; returns (N, H, D).
    Raises ValueError for what the kernel rejects (a slot out of range: nothing written)."""
    num_seqs, num_heads, head_dim = query.shape
    _, _, num_blocks, block_size, num_kv_heads, row_len = kv_cache.shape
    if row_len != head_dim or value.shape[-1] != head_dim:
        raise ValueError(f"K and V rows of {row_len} values do not fit a head_dim of {head_dim}")
    query, key, value = query.contiguous(), key.contiguous(), value.contiguous()  # kept alive for the call
    if not (block_tables.is_contiguous() and seq_lens.is_contiguous() and query_start_loc.is_contiguous()
            and slot_mapping.is_contiguous()):
        raise ValueError("the paged kernel reads the metadata as contiguous tensors")
    out = torch.empty(num_seqs, num_heads, head_dim)
    rc = load_paged_attention().pdserve_paged_decode_attention(
        out.data_ptr(), query.data_ptr(), key.data_ptr(), value.data_ptr(), kv_cache.data_ptr(), layer,
        slot_mapping.data_ptr(), block_tables.data_ptr(), block_tables.shape[1], seq_lens.data_ptr(),
        query_start_loc.data_ptr(), num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale,
        sliding_window, torch.get_num_threads())
    if rc != 0:
        raise ValueError(f"paged decode attention kernel rejected its inputs (code {rc}): {num_heads} heads, "
                         f"{num_kv_heads} KV heads, head_dim {head_dim}, slots {slot_mapping.tolist()}")
    return out


ops.implement("paged_decode_attention", paged_decode_attention)
ops.implement("paged_decode_attention_f32", _decode_float32, ("CompositeExplicitAutograd",))


@torch.library.register_fake("pdserve::paged_decode_attention_f32")
def _(query, key, value, kv_cache, layer, slot_mapping, block_tables, seq_lens, query_start_loc, scale, sliding_window):
    return query.new_empty(*query.shape[:2], value.shape[-1])  # (N, H, D)


@torch.library.register_fake("pdserve::paged_decode_attention")
def _(query, key, value, kv_cache, layer, slot_mapping, block_tables, seq_lens, query_start_loc, scale,
      sliding_window, kv_cache_dtype="", sinks=None):
    return query.new_empty(*query.shape[:2], value.shape[-1])  # (N, H, V), contiguous as the real op's output


def attend_native(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache_layer: torch.Tensor,
                   metadata: AttentionMetadata, scale: float, sliding_window: int | None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The ``paged`` backend (CPU): shapes as ``paged_attention``; K/V are already in the cache.

    A fresh prefill's dense attention takes its K/V as the cache holds them: for a quantized cache, its
    rows read back and dequantized (so it sees what the kernel, and a decode worker, would);
    for a latent cache, its values are the keys' first v_dim values."""
    num_tokens, num_heads, head_dim = query.shape
    v_dim = value.shape[-1] if value is not None else head_dim  # None: every row is cached already
    kv_slots, _, block_size, num_kv_heads, _ = kv_cache_layer.shape
    plan = native_plan(metadata, sliding_window, sinks is not None)
    sink_rows = sinks.to(torch.float32).contiguous() if sinks is not None else None  # (H,)
    out = query.new_empty(num_tokens, num_heads, v_dim, dtype=torch.float32)  # (N, H, V)
    num_seqs = metadata.seq_lens.shape[0]
    if len(plan.fresh) + len(plan.chunks) < num_seqs:  # some rows for the paged kernel
        _run_kernel(out, query.to(torch.float32).contiguous(), kv_cache_layer,
                    _kernel_dtype_code(kv_cache_layer.dtype, metadata.kv_cache_dtype), metadata.block_tables,
                    metadata.seq_lens, metadata.query_start_loc, plan.skip, scale, sliding_window or 0, sink_rows)
    num_rep = num_heads // num_kv_heads
    if plan.fresh and metadata.kv_cache_dtype is not None:  # the new K/V as the cache holds them
        fmt = kv_cache_format(metadata.kv_cache_dtype)
        flat = kv_cache_layer.view(kv_slots, -1, num_kv_heads, kv_cache_layer.shape[-1])  # (slots, S, H_kv, D + 4)
        kv_new = dequantize_rows(flat[:, metadata.slot_mapping], fmt, query.dtype)  # (slots, N, H_kv, D)
        key, value = kv_new[0], kv_new[-1][..., :v_dim]  # a latent row's value: its first v_dim values
    for begin, end in plan.fresh:  # causal attention over the sequence's own new K/V
        causal_attention(out[begin:end], query[begin:end], key[begin:end], value[begin:end], num_rep, scale)
    for i, (begin, end, seq, seq_len) in enumerate(plan.chunks):  # new rows over the cached ones and their own
        blocks = metadata.block_tables[seq, :-(-seq_len // block_size)]
        k_all = kv_cache_layer[0].index_select(0, blocks).flatten(0, 1)[:seq_len]  # (L, H_kv, D)
        v_all = kv_cache_layer[-1].index_select(0, blocks).flatten(0, 1)[:seq_len, :, :v_dim]  # latent: its head
        # row j (position seq_len - Q + j) sees keys 0 .. seq_len - Q + j: causal, shifted by the cached rows
        causal_attention(out[begin:end], query[begin:end], k_all, v_all, num_rep, scale, plan.chunk_masks, i)
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _run_kernel(out: torch.Tensor, query: torch.Tensor, kv_cache_layer: torch.Tensor, dtype_code: int,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                skip: torch.Tensor | None, scale: float, sliding_window: int, sinks: torch.Tensor | None) -> None:
    """The native paged-attention kernel over every row of ``query`` [N, H, D] (float32, contiguous)
    whose sequence ``skip`` [num_seqs] uint8 (or None) leaves to it, into ``out`` [N, H, V] float32.
    ``kv_cache_layer`` [kv_slots, num_blocks, block_size, H_kv, row] holds element type ``dtype_code``
    (``KV_DTYPE_CODES``); ``sinks``: [H] float32 or None; sliding_window 0: none. Raises ValueError
    for tensors that are not contiguous and for shapes the kernel rejects. Labelled
    ``pdserve::paged_attention`` only while a profiler runs (the label costs ~5 us a call)."""
    if not (kv_cache_layer.is_contiguous() and block_tables.is_contiguous() and seq_lens.is_contiguous()
            and query_start_loc.is_contiguous()):
        raise ValueError("the paged kernel reads the cache and the metadata as contiguous tensors")
    num_heads, head_dim, v_dim = query.shape[1], query.shape[2], out.shape[2]
    kv_slots, num_blocks, block_size, num_kv_heads, _ = kv_cache_layer.shape
    args = (out.data_ptr(), query.data_ptr(), kv_cache_layer.data_ptr(), dtype_code, block_tables.data_ptr(),
            block_tables.shape[1], seq_lens.data_ptr(), query_start_loc.data_ptr(),
            skip.data_ptr() if skip is not None else None, seq_lens.shape[0], num_heads, num_kv_heads, head_dim,
            v_dim, kv_slots, block_size, num_blocks, scale, sliding_window,
            sinks.data_ptr() if sinks is not None else None, torch.get_num_threads())
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function("pdserve::paged_attention"):
            rc = load_paged_attention().pdserve_paged_attention(*args)
    else:
        rc = load_paged_attention().pdserve_paged_attention(*args)
    if rc != 0:
        raise ValueError(f"paged attention kernel rejected its inputs (code {rc}): {num_heads} heads, "
                         f"{num_kv_heads} KV heads, head_dim {head_dim}, v_dim {v_dim}, {kv_slots} KV slots")


def _kernel_dtype_code(cache_dtype: torch.dtype, kv_cache_dtype: str | None) -> int:
    """The native kernel's code for a cache of ``cache_dtype`` elements holding KV dtype ``kv_cache_dtype``
    (None: a plain cache of ``cache_dtype``; ValueError if the kernel reads no such cache)."""
    name = kv_cache_dtype or str(cache_dtype).removeprefix("torch.")
    if name not in KV_DTYPE_CODES:
        raise ValueError(f"the paged attention kernel does not read a {name} KV cache")
    return KV_DTYPE_CODES[name]
