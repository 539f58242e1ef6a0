"""Paged attention over a block-structured KV cache, in plain torch ops.

The KV cache of one worker rank is a single tensor

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]   (index 0 = K, 1 = V)

and one layer's slice is ``kv_cache_layer: [2, num_blocks, block_size, num_kv_heads, head_dim]``.
A token's K/V lives at slot ``s = block_id * block_size + offset``. A sequence's
``block_table`` lists the block ids that hold its tokens, in order.

The algorithm is PagedAttention (Kwon et al., "Efficient Memory Management for
Large Language Model Serving with PagedAttention", SOSP'23; the vLLM project).
Here it is expressed with gathers and ``scaled_dot_product_attention`` so that
the same code runs on CPU and CUDA without custom kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Paged-attention inputs for one forward over a flattened batch of num_seqs sequences.

    A batch may mix prefilling sequences (many new tokens, possibly after some cached
    ones: chunked prefill / prefix caching) and decoding sequences (one new token).
    New token j of sequence i sits at position ``seq_lens[i] - q_len_i + j``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V is written to
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks_per_seq] int64, rows padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int64: context length after this step (cached + new tokens)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int64: cumulative new-token counts
    max_query_len: int
    max_seq_len: int
    # Derived once per forward by paged_attention and shared by all layers (see _plan).
    _groups: list["_Group"] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        num_computed_tokens: Sequence[int],
        num_new_tokens: Sequence[int],
        block_size: int,
        device: str | torch.device = "cpu",
    ) -> "AttentionMetadata":
        """Build metadata from per-sequence Python lists (a convenience for tests and runners).

        block_tables[i]: block ids of sequence i (must cover all its num_computed + num_new tokens);
        num_computed_tokens[i]: tokens already in the cache; num_new_tokens[i]: tokens in this step.
        """
        slots: list[int] = []
        for table, start, n in zip(block_tables, num_computed_tokens, num_new_tokens):
            for pos in range(start, start + n):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        max_blocks = max((len(t) for t in block_tables), default=0)
        padded = [list(t) + [0] * (max_blocks - len(t)) for t in block_tables]
        seq_lens = [c + n for c, n in zip(num_computed_tokens, num_new_tokens)]
        qsl = [0]
        for n in num_new_tokens:
            qsl.append(qsl[-1] + n)

        def as_tensor(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.int64, device=device)

        return cls(
            slot_mapping=as_tensor(slots),
            block_tables=as_tensor(padded).reshape(len(padded), max_blocks),
            seq_lens=as_tensor(seq_lens),
            query_start_loc=as_tensor(qsl),
            max_query_len=max(num_new_tokens, default=0),
            max_seq_len=max(seq_lens, default=0),
        )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter new K/V into the paged cache in place.

    key, value: [num_tokens, num_kv_heads, head_dim];
    kv_cache_layer: [2, num_blocks, block_size, num_kv_heads, head_dim] (contiguous);
    slot_mapping: [num_tokens] int64, every entry a valid slot.
    """
    _, _, _, num_kv_heads, head_dim = kv_cache_layer.shape
    flat = kv_cache_layer.view(2, -1, num_kv_heads, head_dim)  # (2, num_slots, H_kv, D)
    flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))


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
) -> torch.Tensor:
    """Write new K/V into the cache, then attend causally over each sequence's whole context.

    query: [num_tokens, num_heads, head_dim]; key/value: [num_tokens, num_kv_heads, head_dim];
    kv_cache_layer: [2, num_blocks, block_size, num_kv_heads, head_dim].
    Returns [num_tokens, num_heads, head_dim].

    A decode-only or prefill-only batch is one padded, batched call (_attend_padded); a
    mixed batch is two, one for its decode rows and one for its prefill rows.
    """
    write_kv_cache(key, value, kv_cache_layer, metadata.slot_mapping)
    groups = _plan(metadata)
    if len(groups) == 1:
        g = groups[0]
        return _attend_padded(query, kv_cache_layer, metadata.block_tables, metadata.seq_lens,
                              g.query_start_loc, g.max_query_len, g.max_seq_len, scale, sliding_window)
    out = torch.empty_like(query)  # (N, H, D)
    for g in groups:
        part = _attend_padded(query[g.token_ids], kv_cache_layer, metadata.block_tables[g.seq_ids],
                              metadata.seq_lens[g.seq_ids], g.query_start_loc, g.max_query_len,
                              g.max_seq_len, scale, sliding_window)
        out.index_copy_(0, g.token_ids, part)
    return out


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
) -> torch.Tensor:
    """Attention for num_seqs sequences whose K/V are already in the cache.

    query: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim].
    Queries are padded to (num_seqs, max_query_len), each sequence's context is gathered
    through its block table (one gather for the whole batch), and a boolean mask allows key
    position k for query position p iff k <= p (and p - k < sliding_window when set).
    Grouped-query attention folds the query heads that share a KV head into the query-length
    axis, so K/V are never repeated.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, _ = kv_cache_layer.shape
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
    kv = kv_cache_layer[:, tables]  # (2, S, B, block_size, H_kv, D): a fresh contiguous copy
    max_k = num_blocks_used * block_size
    kv = kv.view(2, num_seqs, max_k, num_kv_heads, head_dim)  # (2, S, Tk, H_kv, D)
    # Slots past a sequence's length (tail of its last block, padded table entries) hold stale
    # or uninitialized data; zero them in the copy so a NaN there cannot leak through 0 * NaN.
    k_pos = torch.arange(max_k, device=device)  # (Tk,)
    beyond = k_pos[None, :] >= seq_lens[:, None]  # (S, Tk)
    kv.masked_fill_(beyond[None, :, :, None, None], 0)
    kv = kv.transpose(2, 3).to(query.dtype)  # (2, S, H_kv, Tk, D)
    k_ctx, v_ctx = kv[0], kv[1]  # (S, H_kv, Tk, D) each

    # Causal mask with an offset: query j of seq i is at position seq_len_i - q_len_i + j.
    q_pos = (seq_lens - q_lens)[:, None] + torch.arange(max_q, device=device)  # (S, Tq)
    mask = k_pos[None, None, :] <= q_pos[:, :, None]  # (S, Tq, Tk)
    if sliding_window is not None:
        mask &= k_pos[None, None, :] > q_pos[:, :, None] - sliding_window
    mask = mask[:, None, None].expand(num_seqs, 1, num_rep, max_q, max_k)  # (S, 1, R, Tq, Tk)
    mask = mask.reshape(num_seqs, 1, num_rep * max_q, max_k)  # (S, 1, R*Tq, Tk)

    out = F.scaled_dot_product_attention(
        q_pad, k_ctx, v_ctx, attn_mask=mask, scale=scale
    )  # (S, H_kv, R*Tq, D)
    out = out.view(num_seqs, num_kv_heads, num_rep, max_q, head_dim)  # (S, H_kv, R, Tq, D)
    out = out.permute(0, 3, 1, 2, 4).reshape(num_seqs, max_q, num_heads, head_dim)  # (S, Tq, H, D)
    return out.view(num_tokens, num_heads, head_dim) if one_per_seq else out[seq_idx, tok_idx]  # (N, H, D)
