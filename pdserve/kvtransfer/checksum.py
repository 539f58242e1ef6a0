"""Integrity checksums for KV transfers.

NOT cryptographic: this catches corruption, truncation, reordering and
protocol bugs, not an adversary. It is a Fletcher-style pair of sums over the
tensor's bytes read as little-endian int32 words ``w_1 .. w_n`` (zero-padded)::

    s1 = (num_bytes + sum w_i)   mod p
    s2 = sum (i * w_i)           mod p          p = 2**31 - 1
    kv_checksum = s2 * 2**31 + s1                (an int below 2**62)

``s2`` weights each word by its position, so swapping two blocks or two words
changes it. Everything is exact int64 arithmetic done with torch ops on the
tensor's own device, so equal bytes give the same value on CPU and CUDA.

Per-layer checksums fold into one per request with ``combine_checksums``
(order-sensitive); ``KVChecksum`` does that incrementally and only turns the
device values into Python ints (a CUDA sync) when ``value`` is read.
"""

from __future__ import annotations

import torch

_P = 2**31 - 1  # prime modulus of the two sums
_Q = 2**61 - 1  # prime modulus of the fold
_MIX = 0x2545F4914F6CDD1D % _Q  # odd multiplier of the fold
_ROW = 256  # words per row; see _add_rows for why every float64 value stays exact
_SLAB_ROWS = 1 << 14  # rows per slab: bounds the float64 temporary (32 MiB)


def _add_rows(sums: torch.Tensor, rows: torch.Tensor, first_pos: int) -> None:
    """Add words ``rows`` [num_rows, row_len] int32, whose first word is at 1-based position ``first_pos``.

    Per-row sums run as float64 matrix-vector products (fast on CPU and CUDA, where int64
    matmul does not exist). They are exact whatever the summation order: every term and
    partial sum is an integer below 256 * 2**31 * 256 = 2**47 < 2**53.
    """
    num_rows, row_len = rows.shape
    w = rows.to(torch.float64)  # [num_rows, row_len]
    ones = torch.ones(row_len, dtype=torch.float64, device=w.device)
    local_pos = torch.arange(1, row_len + 1, dtype=torch.float64, device=w.device)  # [row_len]
    row_sum = (w @ ones).to(torch.int64) % _P  # [num_rows]
    row_wsum = (w @ local_pos).to(torch.int64) % _P  # [num_rows]
    row_offset = (torch.arange(num_rows, dtype=torch.int64, device=w.device) * row_len + first_pos - 1) % _P
    sums[0] += row_sum.sum()
    sums[1] += row_wsum.sum() + (row_offset * row_sum % _P).sum()
    sums %= _P


def _sums(t: torch.Tensor) -> torch.Tensor:
    """``[s1, s2]`` as an int64 tensor on ``t.device`` (no host sync)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [num_bytes]
    num_bytes = data.numel()
    if num_bytes % 4:
        data = torch.cat([data, data.new_zeros(4 - num_bytes % 4)])
    words = data.view(torch.int32)  # [num_words], signed; % _P maps them into [0, p)
    sums = torch.zeros(2, dtype=torch.int64, device=t.device)
    sums[0] = num_bytes % _P
    num_full = words.numel() // _ROW * _ROW
    slab = _SLAB_ROWS * _ROW
    for start in range(0, num_full, slab):
        stop = min(start + slab, num_full)
        _add_rows(sums, words[start:stop].view(-1, _ROW), start + 1)
    if num_full < words.numel():
        _add_rows(sums, words[num_full:].view(1, -1), num_full + 1)
    return sums


def _to_int(sums: torch.Tensor) -> int:
    s1, s2 = sums.tolist()
    return (s2 << 31) | s1


def kv_checksum(t: torch.Tensor) -> int:
    """Checksum of ``t``'s bytes (any shape, dtype and device); see the module doc."""
    return _to_int(_sums(t))


def combine_checksums(a: int, b: int) -> int:
    """Fold checksum ``b`` after ``a`` (order-sensitive); start a fold from 0."""
    return (a * _MIX + b + 1) % _Q


class KVChecksum:
    """Incremental checksum of a sequence of tensors (e.g. one request's layers).

    ``update`` only queues device work; ``value`` syncs and folds, giving
    ``combine_checksums(...combine_checksums(0, kv_checksum(t_0))..., kv_checksum(t_k))``.
    """

    def __init__(self) -> None:
        self._parts: list[torch.Tensor] = []
        self.num_bytes = 0

    def update(self, t: torch.Tensor) -> None:
        self._parts.append(_sums(t))
        self.num_bytes += t.numel() * t.element_size()

    @property
    def value(self) -> int:
        folded = 0
        if self._parts:
            for s1, s2 in torch.stack(self._parts).tolist():
                folded = combine_checksums(folded, (s2 << 31) | s1)
        return folded
