"""What every attention layer of one forward reads (``AttentionMetadata``) and how new K/V enter the
paged cache (``write_kv_cache``): the data both attention backends share (``attention``, the
interface and the reference backend; ``paged_backend``, the native kernel's)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from pdserve.common.kv_quant import kv_cache_format, quantize_rows


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
    backend: str = "reference"  # "paged" (native CPU kernel) or "reference" (gather + SDPA); see select_backend
    # paged: every query row through the kernel, fresh prefills too (never SDPA), so a row's result
    # depends only on its sequence's cached K/V, not on the batch or the chunking (--batch-invariant).
    batch_invariant: bool = False
    # The cache's KV dtype name when it is quantized (int8, fp8_e4m3, fp8_e5m2; see kv_quant); None: the
    # cache tensor's own dtype (a plain float cache).
    kv_cache_dtype: str | None = None
    # [num_seqs] int64: each sequence's known length (prompt + outputs, drafts included), for a RoPE whose
    # frequencies depend on the length (longrope, dynamic NTK); None: seq_lens (see token_seq_lens).
    rope_seq_lens: torch.Tensor | None = None
    # KV cache groups 1.. (pdserve.common.kv_cache_groups; slot_mapping and block_tables are group 0's):
    # (slot_mapping, block_tables) of each, for the same sequences; None: one group. See for_group.
    group_tables: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # Derived once per forward by paged_attention and shared by all layers (see _plan, paged_backend.native_plan).
    _groups: list | None = field(  # attention._Group per group of sequences
        default=None, init=False, repr=False, compare=False)
    _native: object = field(  # paged_backend.NativePlan | None
        default=None, init=False, repr=False, compare=False)
    _token_seq_lens: torch.Tensor | None = field(default=None, init=False, repr=False, compare=False)
    _group_metadata: list["AttentionMetadata"] | None = field(default=None, init=False, repr=False, compare=False)

    def for_group(self, group: int) -> "AttentionMetadata":
        """The metadata of KV cache group ``group``'s layers: this one for group 0, else the same batch
        with that group's ``slot_mapping`` and ``block_tables`` (made once per forward)."""
        if group == 0:
            return self
        if self._group_metadata is None:
            self._group_metadata = [
                AttentionMetadata(slots, tables, self.seq_lens, self.query_start_loc, self.max_query_len,
                                  self.max_seq_len, self.backend, self.batch_invariant, self.kv_cache_dtype,
                                  self.rope_seq_lens)
                for slots, tables in self.group_tables]
        return self._group_metadata[group - 1]

    def token_seq_lens(self, positions: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64: for each new token, its sequence's known length (``rope_seq_lens``: the
        whole prompt while a chunk of it computes, position + 1 in a decode step; without it, the length
        after this step), what a length-dependent RoPE (longrope, dynamic NTK; ``RotaryEmbedding``)
        reads. Computed once per forward, only when such a RoPE asks.

        positions: [num_tokens] int64. A step of one new token per sequence without ``rope_seq_lens``
        (the compiled decode step) takes positions + 1, no gather; others repeat each sequence's length
        over its ``query_start_loc`` range."""
        if self._token_seq_lens is None:
            if self.max_query_len == 1 and self.rope_seq_lens is None:
                self._token_seq_lens = positions + 1
            else:
                lens = self.seq_lens if self.rope_seq_lens is None else self.rope_seq_lens
                counts = self.query_start_loc[1:] - self.query_start_loc[:-1]
                self._token_seq_lens = torch.repeat_interleave(lens, counts, output_size=positions.shape[0])
        return self._token_seq_lens

    @classmethod
    def build(
        cls,
        block_tables: Sequence[Sequence[int]],
        num_computed_tokens: Sequence[int],
        num_new_tokens: Sequence[int],
        block_size: int,
        device: str | torch.device = "cpu",
        backend: str = "reference",
        kv_cache_dtype: str | None = None,
    ) -> "AttentionMetadata":
        """Build metadata from per-sequence Python lists (a convenience for tests and runners).

        block_tables[i]: block ids of sequence i (must cover all its num_computed + num_new tokens);
        num_computed_tokens[i]: tokens already in the cache; num_new_tokens[i]: tokens in this step;
        kv_cache_dtype: a quantized KV dtype name, or None for a plain cache.
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
            backend=backend,
            kv_cache_dtype=_quantized_name(kv_cache_dtype),
        )


def _quantized_name(kv_cache_dtype: str | None) -> str | None:
    """``kv_cache_dtype`` if it names a quantized format, else None (ValueError if unknown)."""
    if kv_cache_dtype is None or not kv_cache_format(kv_cache_dtype).quantized:
        return None
    return kv_cache_dtype


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str | None = None,
) -> None:
    """Scatter new K/V into the paged cache in place (quantizing them for a quantized cache).

    key: [num_tokens, num_kv_heads, head_dim]; value: [num_tokens, num_kv_heads, v_dim];
    kv_cache_layer: [kv_slots, num_blocks, block_size, num_kv_heads, head_dim] (contiguous), or for a
    quantized ``kv_cache_dtype`` uint8 [kv_slots, num_blocks, block_size, num_kv_heads, head_dim + 4];
    slot_mapping: [num_tokens] int64, every entry a valid slot.
    A latent cache (kv_slots 1) stores the key rows only: ``value`` is then the keys' first v_dim
    values (the caller's promise) and is not written.
    """
    kv_slots, _, _, num_kv_heads, row_len = kv_cache_layer.shape
    flat = kv_cache_layer.view(kv_slots, -1, num_kv_heads, row_len)  # (kv_slots, num_slots, H_kv, D or D + 4)
    if kv_slots == 1:
        fmt = kv_cache_format(kv_cache_dtype) if kv_cache_dtype is not None else None
        rows = quantize_rows(key, fmt) if fmt is not None and fmt.quantized else key.to(flat.dtype)
        flat[0].index_copy_(0, slot_mapping, rows)
        return
    if kv_cache_dtype is not None:
        fmt = kv_cache_format(kv_cache_dtype)
        if fmt.quantized:
            # K and V rows in one quantize call: (2, N, H_kv, D) -> (2, N, H_kv, D + 4) uint8
            packed = quantize_rows(torch.stack((key, value)), fmt)
            flat[0].index_copy_(0, slot_mapping, packed[0])
            flat[1].index_copy_(0, slot_mapping, packed[1])
            return
    flat[0].index_copy_(0, slot_mapping, key.to(flat.dtype))
    flat[1].index_copy_(0, slot_mapping, value.to(flat.dtype))
