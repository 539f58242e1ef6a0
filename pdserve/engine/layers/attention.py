"""Paged attention over a block-structured KV cache, in plain torch ops.

The KV cache of one worker rank is a single tensor

    kv_cache: [num_layers, kv_slots, num_blocks, block_size, num_kv_heads, head_dim]

and one layer's slice is ``kv_cache_layer: [kv_slots, num_blocks, block_size, num_kv_heads, head_dim]``.
With ``kv_slots`` 2 (per-head K/V attention) index 0 is K and 1 is V. With ``kv_slots`` 1 (a
latent cache: DeepSeek's MLA) each token has one row, its key, and its value is the first
``v_dim`` values of that same row (``v_dim`` is ``value.shape[-1]``, the latent's
``kv_lora_rank``; the rest of the row is the rotary key); the output is then
``[num_tokens, num_heads, v_dim]``. Nothing but the cache's shape says which: every function
here reads ``kv_slots`` from ``kv_cache_layer.shape[0]``.
A token's K/V lives at slot ``s = block_id * block_size + offset``. A sequence's
``block_table`` lists the block ids that hold its tokens, in order.

A quantized cache (``AttentionMetadata.kv_cache_dtype`` ``int8`` / ``fp8_e4m3`` / ``fp8_e5m2``)
is uint8 with rows of ``head_dim + 4`` bytes, each the quantized K or V row and its float32
scale (``pdserve.common.kv_quant``). ``write_kv_cache`` quantizes as it writes and both
backends dequantize as they read (the native kernel folds a K row's scale into its score and
a V row's into its softmax weight). Every query row attends over what the cache holds, the
dequantized K/V, fresh prefills included (as vLLM's fp8 cache does): so a prefill worker's
first token, the decode worker that receives its KV, and a colocated worker all see the same
keys and values, and the accuracy measured is the quantized cache's.

The algorithm is PagedAttention (Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP'23; the vLLM project).
Two backends compute the same thing:

* ``paged`` (CPU): a small native kernel (``pdserve/kernels/paged_attention.cpp``)
  reads each sequence's K/V straight from the cache through its block table: no gather,
  no zero-fill, no padding. A sequence prefilled from scratch in this step (no cached
  tokens) instead attends over its own new K/V, and a long prefill chunk over its gathered
  cache, with a tiled causal kernel (``pdserve.engine.layers.prefill_attention``), which reads no
  block table at all. It lives in ``pdserve.engine.layers.paged_backend``, with the compiled decode
  step's operators ``torch.ops.pdserve.paged_decode_attention`` (``..._f32`` on a float32 cache: C++).
* ``reference``: gathers each sequence's context through its block table and runs one
  padded, masked ``scaled_dot_product_attention``, in plain torch ops on any device. The
  tests check the paged backend against it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.kernels import KV_DTYPE_CODES, load_paged_attention, load_torch_ops
from pdserve.common.kv_quant import dequantize_rows, kv_cache_format
from pdserve.engine.layers import paged_backend  # importing it registers the compiled decode step's op
from pdserve.engine.layers.attention_metadata import AttentionMetadata, write_kv_cache  # noqa: F401  (re-exported)


@dataclass
class _Group:
    """A subset of the batch attended in one padded call.

    seq_ids: [num_group_seqs] int64 rows of the batch, token_ids: [num_group_tokens] int64
    rows of query; both None for "the whole batch". query_start_loc is group-relative."""

    seq_ids: torch.Tensor | None
    token_ids: torch.Tensor | None
    query_start_loc: torch.Tensor
    max_query_len: int
    max_seq_len: int


def _plan(metadata: AttentionMetadata) -> list[_Group]:
    """Split a mixed batch into its decode (q_len <= 1) and prefill sequences.

    Padding every sequence to max_query_len would make a decode row as costly as the
    longest prefill chunk, so a mixed batch runs as two padded calls. Computed once per
    forward (one small device-to-host copy), then cached on the metadata.
    """
    if metadata.max_query_len <= 1:  # decode only: no host sync needed
        return [_Group(None, None, metadata.query_start_loc, metadata.max_query_len, metadata.max_seq_len)]
    if metadata._groups is not None:
        return metadata._groups
    qsl = metadata.query_start_loc.tolist()
    seq_lens = metadata.seq_lens.tolist()
    q_lens = [b - a for a, b in zip(qsl, qsl[1:])]
    decode = [i for i, n in enumerate(q_lens) if n <= 1]
    prefill = [i for i, n in enumerate(q_lens) if n > 1]
    if not decode or not prefill:
        groups = [_Group(None, None, metadata.query_start_loc, metadata.max_query_len, metadata.max_seq_len)]
    else:
        device = metadata.query_start_loc.device
        groups = []
        for seqs in (decode, prefill):
            tokens = [t for i in seqs for t in range(qsl[i], qsl[i + 1])]
            starts = [0]
            for i in seqs:
                starts.append(starts[-1] + q_lens[i])
            groups.append(_Group(
                seq_ids=torch.tensor(seqs, dtype=torch.int64, device=device),
                token_ids=torch.tensor(tokens, dtype=torch.int64, device=device),
                query_start_loc=torch.tensor(starts, dtype=torch.int64, device=device),
                max_query_len=max(q_lens[i] for i in seqs),
                max_seq_len=max(seq_lens[i] for i in seqs),
            ))
    metadata._groups = groups
    return groups


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    layer: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write new K/V into the cache, then attend causally over each sequence's whole context.

    query: [num_tokens, num_heads, head_dim]; key: [num_tokens, num_kv_heads, head_dim];
    value: [num_tokens, num_kv_heads, v_dim] (v_dim = head_dim, or for a latent cache the keys'
    first v_dim values); kv_cache_layer: [kv_slots, num_blocks, block_size, num_kv_heads, head_dim], or,
    with ``layer`` given, the whole cache [num_layers, kv_slots, ...] of which layer ``layer`` is used
    (so that a compiled graph hands the opaque decode op its input tensor itself, never a view of it).
    Returns [num_tokens, num_heads, v_dim].
    sinks: [num_heads] float32 attention-sink logits (gpt-oss; Xiao et al., "Efficient Streaming
    Language Models with Attention Sinks", 2023, learned per head): each head's softmax gets one
    more term, exp(sink), in its denominator, with no value; None: plain softmax.

    A decode-only or prefill-only batch is one padded, batched call (_attend_padded); a
    mixed batch is two, one for its decode rows and one for its prefill rows.
    """
    if metadata.backend == "paged" and metadata.max_query_len <= 1:  # decode only: one opaque op (torch.compile)
        kv_cache, index = (kv_cache_layer, layer) if layer is not None else (kv_cache_layer[None], 0)
        if paged_backend.takes_float32_kernel(query, kv_cache, metadata.kv_cache_dtype, sinks):
            return torch.ops.pdserve.paged_decode_attention_f32(query, key, value, kv_cache, index,
                                                                metadata.slot_mapping, metadata.block_tables,
                                                                metadata.seq_lens, metadata.query_start_loc, scale,
                                                                sliding_window or 0)
        return torch.ops.pdserve.paged_decode_attention(query, key, value, kv_cache, index, metadata.slot_mapping,
                                                        metadata.block_tables, metadata.seq_lens,
                                                        metadata.query_start_loc, scale, sliding_window or 0,
                                                        metadata.kv_cache_dtype or "", sinks)
    if layer is not None:
        kv_cache_layer = kv_cache_layer[layer]
    write_kv_cache(key, value, kv_cache_layer, metadata.slot_mapping, metadata.kv_cache_dtype)
    if metadata.backend == "paged":
        return paged_backend.attend_native(query, key, value, kv_cache_layer, metadata, scale, sliding_window,
                                           sinks)
    groups = _plan(metadata)
    kv_dtype = metadata.kv_cache_dtype
    if len(groups) == 1:
        g = groups[0]
        return _attend_padded(query, kv_cache_layer, metadata.block_tables, metadata.seq_lens,
                              g.query_start_loc, g.max_query_len, g.max_seq_len, scale, sliding_window, kv_dtype,
                              sinks, value.shape[-1])
    out = query.new_empty(*query.shape[:2], value.shape[-1])  # (N, H, V)
    for g in groups:
        part = _attend_padded(query[g.token_ids], kv_cache_layer, metadata.block_tables[g.seq_ids],
                              metadata.seq_lens[g.seq_ids], g.query_start_loc, g.max_query_len,
                              g.max_seq_len, scale, sliding_window, kv_dtype, sinks, value.shape[-1])
        out.index_copy_(0, g.token_ids, part)
    return out


def select_backend(name: str, device: torch.device, kv_cache_dtype: torch.dtype | str, head_dim: int = 64,
                   v_dim: int | None = None) -> str:
    """The attention backend for ``name`` (``auto`` | ``paged`` | ``reference``) on this device.

    ``auto`` is ``paged`` on CPU when the native kernel builds and supports the KV dtype
    (a torch dtype or KV dtype name: float32, bfloat16, int8, fp8_e4m3, fp8_e5m2),
    head_dim and the value width v_dim (None: head_dim; both multiples of 8), else ``reference``.

    Raises:
        ValueError: an unknown name, or ``paged`` where it cannot run.
    """
    if name not in ("auto", "paged", "reference"):
        raise ValueError(f"unknown attention backend {name!r}; choose from auto, paged, reference")
    if name == "reference":
        return name
    kv_name = str(kv_cache_dtype).removeprefix("torch.")
    usable = device.type == "cpu" and kv_name in KV_DTYPE_CODES and head_dim % 8 == 0 and (v_dim or head_dim) % 8 == 0
    if usable and load_paged_attention() is None:
        usable = False
    if usable:
        load_torch_ops()  # the decode step's float32 attention as a C++ operator, where it builds
    if name == "paged" and not usable:
        raise ValueError(f"the paged attention kernel cannot run here ({device.type}, KV {kv_cache_dtype}, "
                         f"head_dim {head_dim}, or no C++ compiler); use --attention-backend reference")
    return "paged" if usable else "reference"


def _attend_padded(
    query: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    sliding_window: int | None,
    kv_cache_dtype: str | None = None,
    sinks: torch.Tensor | None = None,
    v_dim: int | None = None,
) -> torch.Tensor:
    """Attention for num_seqs sequences whose K/V are already in the cache.

    query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, v_dim] (v_dim None: head_dim;
    a latent cache, one slot, takes its values from the key rows' first v_dim values).
    A quantized ``kv_cache_dtype``'s gathered rows are dequantized to the query's dtype.
    Queries are padded to (num_seqs, max_query_len), each sequence's context is gathered
    through its block table (one gather for the whole batch), and a boolean mask allows key
    position k for query position p iff k <= p (and p - k < sliding_window when set).
    Grouped-query attention folds the query heads that share a KV head into the query-length
    axis, so K/V are never repeated. ``sinks`` [num_heads]: one more key column per head whose
    score is the sink logit (a float mask bias over a zero key) and whose value is zero.
    """
    num_tokens, num_heads, head_dim = query.shape
    kv_slots, _, block_size, num_kv_heads, _ = kv_cache_layer.shape
    v_dim = v_dim or head_dim
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    num_rep = num_heads // num_kv_heads
    num_seqs = seq_lens.shape[0]
    max_q = max_query_len
    device = query.device

    # Where each new token sits in the padded (num_seqs, max_q) query grid.
    q_lens = query_start_loc[1:] - query_start_loc[:-1]  # (S,)
    one_per_seq = max_q == 1 and num_tokens == num_seqs  # pure decode: no padding needed
    if one_per_seq:
        q_pad = query.view(num_seqs, 1, num_heads, head_dim)  # (S, Tq=1, H, D)
    else:
        seq_idx = torch.repeat_interleave(
            torch.arange(num_seqs, device=device), q_lens, output_size=num_tokens
        )  # (N,)
        tok_idx = torch.arange(num_tokens, device=device) - query_start_loc[seq_idx]  # (N,)
        q_pad = query.new_zeros(num_seqs, max_q, num_heads, head_dim)  # (S, Tq, H, D)
        q_pad[seq_idx, tok_idx] = query
    q_pad = q_pad.view(num_seqs, max_q, num_kv_heads, num_rep, head_dim)  # (S, Tq, H_kv, R, D)
    q_pad = q_pad.permute(0, 2, 3, 1, 4).reshape(
        num_seqs, num_kv_heads, num_rep * max_q, head_dim
    )  # (S, H_kv, R*Tq, D)

    # Gather every sequence's context through its block table (only the columns in use).
    num_blocks_used = -(-max_seq_len // block_size)
    tables = block_tables[:, :num_blocks_used]  # (S, B)
    kv = kv_cache_layer[:, tables]  # (kv_slots, S, B, block_size, H_kv, D): a fresh contiguous copy
    if kv_cache_dtype is not None:  # (kv_slots, S, B, block_size, H_kv, D + 4) uint8 -> (..., D) query dtype
        kv = dequantize_rows(kv, kv_cache_format(kv_cache_dtype), query.dtype)
    max_k = num_blocks_used * block_size
    kv = kv.view(kv_slots, num_seqs, max_k, num_kv_heads, head_dim)  # (kv_slots, S, Tk, H_kv, D)
    # Slots past a sequence's length (tail of its last block, padded table entries) hold stale
    # or uninitialized data; zero them in the copy so a NaN there cannot leak through 0 * NaN.
    k_pos = torch.arange(max_k, device=device)  # (Tk,)
    beyond = k_pos[None, :] >= seq_lens[:, None]  # (S, Tk)
    kv.masked_fill_(beyond[None, :, :, None, None], 0)
    kv = kv.transpose(2, 3).to(query.dtype)  # (kv_slots, S, H_kv, Tk, D)
    k_ctx, v_ctx = kv[0], kv[-1][..., :v_dim]  # (S, H_kv, Tk, D), (S, H_kv, Tk, V): a latent's V is its K's head

    # Causal mask with an offset: query j of seq i is at position seq_len_i - q_len_i + j.
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=device)  # (S, Tq)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # (S, Tq, Tk)
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask = mask[:, None, None].expand(num_seqs, 1, num_rep, max_q, max_k)  # (S, 1, R, Tq, Tk)
    mask = mask.reshape(num_seqs, 1, num_rep * max_q, max_k)  # (S, 1, R*Tq, Tk)
    if sinks is not None:  # a zero key and value per sequence, its score the head's sink logit
        bias = torch.zeros(mask.shape, dtype=query.dtype, device=device).masked_fill_(~mask, float("-inf"))
        sink = sinks.to(query.dtype).view(1, num_kv_heads, num_rep, 1).expand(num_seqs, num_kv_heads, num_rep, max_q)
        mask = torch.cat([bias.expand(num_seqs, num_kv_heads, num_rep * max_q, max_k),
                          sink.reshape(num_seqs, num_kv_heads, num_rep * max_q, 1)], dim=-1)  # (S, H_kv, R*Tq, Tk+1)
        k_ctx = torch.cat([k_ctx, k_ctx.new_zeros(num_seqs, num_kv_heads, 1, head_dim)], dim=2)
        v_ctx = torch.cat([v_ctx, v_ctx.new_zeros(num_seqs, num_kv_heads, 1, v_dim)], dim=2)

    out = F.scaled_dot_product_attention(
        q_pad, k_ctx, v_ctx, attn_mask=mask, scale=scale
    )  # (S, H_kv, R*Tq, V)
    out = out.view(num_seqs, num_kv_heads, num_rep, max_q, v_dim)  # (S, H_kv, R, Tq, V)
    out = out.permute(0, 3, 1, 2, 4).reshape(num_seqs, max_q, num_heads, v_dim)  # (S, Tq, H, V)
    return out.view(num_tokens, num_heads, v_dim) if one_per_seq else out[seq_idx, tok_idx]  # (N, H, V)
