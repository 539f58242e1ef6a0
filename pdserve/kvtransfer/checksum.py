"""Integrity checksums for KV transfers.

NOT cryptographic: this catches corruption, truncation, stale bytes and
reordering (protocol bugs), not an adversary. It is a Fletcher-style pair of
sums over the tensor's bytes, read as little-endian 64-bit words in rows of
``_ROW_WORDS`` words (256 bytes; the last row zero-padded), all modulo 2**64::

    r_k = sum of row k's words                     k = 0 .. R-1
    s1  = num_bytes + sum_k r_k
    s2  = sum_k (R - k) * r_k
    kv_checksum = (s2 * _MIX + s1) mod q            q = 2**61 - 1

Any changed word changes ``s1``; a cut or a stale tail changes ``num_bytes``
or the words; moving a row (a block, a layer, a slice of a message) changes
``s2``. Two words swapped *inside* one 256-byte row are not caught: nothing
on the way (TCP, gloo, NCCL, our gather) moves data at that grain.

It costs one reduction over the data (the row sums) and a few small torch ops
over those, on the tensor's own device, with no temporaries the size of the
data: about 0.015 ms per MiB on one CPU core when the bytes are in cache,
0.04 ms when they are not, against 0.2-0.9 ms for the float64 matrix-vector
sums this replaced. The sums rely on int64 additions and
multiplications wrapping modulo 2**64 (two's complement), which torch's CPU
and CUDA kernels do; sums modulo 2**64 do not depend on the order of the
additions, so equal bytes give the same value on CPU and CUDA.

On CPU the sums come from the native kernel ``kv_gather.cpp`` where it builds: one
vectorized pass with no temporaries (``s2`` as the sum of the running row sums, so no
weights), and ``BlockGather`` sums each block as it copies it out of the paged
cache, so the sending core reads the bytes once. Without a compiler the torch reductions
below give the same values.

Per-layer checksums fold into one per request with ``combine_checksums``
(order-sensitive); ``KVChecksum`` does that incrementally and only turns the
device values into Python ints (a CUDA sync) when ``value`` is read.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from pdserve.kernels import load_kv_gather

_ROW_WORDS = 32  # int64 words per row: 256 bytes, the grain at which moved data is caught
ROW_BYTES = 8 * _ROW_WORDS
_Q = 2**61 - 1  # prime modulus of the fold
_MIX = 0x2545F4914F6CDD1D % _Q  # odd multiplier of the fold
_U64 = 2**64 - 1


def _row_sums(t: torch.Tensor) -> torch.Tensor:
    """``r`` [R] int64 on ``t.device``: the sum of each 256-byte row of ``t``'s bytes, the last row
    zero-padded (no host sync; one pass over the data, no copy when ``t`` is contiguous and 8-byte
    aligned)."""
    data = t.detach().contiguous().reshape(-1).view(torch.uint8)  # [num_bytes]
    num_bytes = data.numel()
    num_full = num_bytes // ROW_BYTES * ROW_BYTES
    full = data[:num_full]
    if full.storage_offset() % 8:  # int64 words must be aligned: a view at an odd offset is copied
        full = full.clone()
    row_sums = full.view(torch.int64).view(-1, _ROW_WORDS).sum(1)  # [R_full]
    if num_full == num_bytes:
        return row_sums
    tail = data.new_zeros(ROW_BYTES)
    tail[:num_bytes - num_full] = data[num_full:]
    return torch.cat([row_sums, tail.view(torch.int64).sum().view(1)])


def _kernel():
    """The native library (``load_kv_gather``), or None where it is not built."""
    global _LIB
    if _LIB is False:
        _LIB = load_kv_gather()
    return _LIB


_LIB = False  # not looked up yet


def _native_sums(t: torch.Tensor) -> tuple[int, int] | None:
    """``(sum_k r_k, s2)`` of a CPU tensor's bytes from the native kernel, or None where it is not built
    (or ``t`` is not on the CPU)."""
    if t.device.type != "cpu" or (lib := _kernel()) is None:
        return None
    t = t.detach().contiguous()
    out = (ctypes.c_int64 * 2)()
    lib.pdserve_kv_checksum(t.data_ptr(), t.numel() * t.element_size(), out)
    return out[0], out[1]


class BlockGather:
    """One request's blocks out of each layer of a paged cache, into a staging row, with the checksum sums of
    what was written: the native one pass (``kv_gather.cpp``), planned once per request and run per layer.

    ``plan(kv_layer, block_ids, out)`` checks the layout once; each call then only checks that the layer and
    the row have the planned shape, strides and dtype (every layer of one cache does) and passes their
    addresses. ~20 us of Python a layer less than taking each layer from scratch.
    """

    __slots__ = ("_layout", "_out_shape", "_index", "_args", "_lib", "_ids_in_range")

    def __init__(self, layout: tuple, out_shape: torch.Size, index: torch.Tensor, args: tuple, lib) -> None:
        self._layout, self._out_shape, self._index, self._args, self._lib = layout, out_shape, index, args, lib
        self._ids_in_range: bool | None = None  # in_runs' check of the (fixed) block ids, once

    @classmethod
    def plan(cls, kv_layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor) -> BlockGather | None:
        """The plan for ``out[:] = kv_layer[:, block_ids]``, or None where the native kernel cannot take it
        (not built, not on the CPU, a layout it does not walk): the caller then gathers and checksums
        with torch.

        ``kv_layer``: one layer of a paged cache, [kv_slots, num_blocks_total, block_size, H, row] (a view
        of some KV heads is fine: each token's heads must be one run); ``block_ids``: [n] int64 on the
        CPU (kept by the plan); ``out``: a staging row [kv_slots, n, block_size, H, row], contiguous, same dtype.
        """
        if kv_layer.device.type != "cpu" or kv_layer.dim() != 5 or kv_layer.dtype != out.dtype \
                or block_ids.dtype != torch.int64 or not block_ids.is_contiguous() or not out.is_contiguous():
            return None
        slots, total, block_size, heads, row = kv_layer.shape
        if out.shape != (slots, block_ids.numel(), block_size, heads, row):
            return None
        stride, elem = kv_layer.stride(), kv_layer.element_size()
        if stride[4] != 1 or (heads > 1 and stride[3] != row) or (lib := _kernel()) is None:
            return None  # a token's heads not one run (never so in a paged cache), or no kernel
        args = (slots, stride[0] * elem, total, block_ids.data_ptr(), block_ids.numel(), stride[1] * elem,
                block_size, stride[2] * elem, heads * row * elem)
        return cls((kv_layer.shape, stride, kv_layer.dtype), out.shape, block_ids, args, lib)

    def _check(self, kv_layer: torch.Tensor, out: torch.Tensor) -> None:
        if (kv_layer.shape, kv_layer.stride(), kv_layer.dtype) != self._layout or out.shape != self._out_shape \
                or out.dtype != self._layout[2] or not out.is_contiguous():
            raise ValueError(f"layer {list(kv_layer.shape)} {kv_layer.stride()} {kv_layer.dtype} -> row "
                             f"{list(out.shape)} is not the planned {self._layout} -> {list(self._out_shape)}")

    def __call__(self, kv_layer: torch.Tensor, out: torch.Tensor) -> tuple[int, int]:
        """Gather this layer's blocks into ``out`` (a staging row); ``(sum_k r_k, s2)`` of its bytes, for
        ``KVChecksum.add``. Raises ValueError if ``kv_layer`` or ``out`` is not laid out as planned, and
        IndexError for a block id outside the cache (nothing is copied)."""
        self._check(kv_layer, out)
        sums = (ctypes.c_int64 * 2)()
        if self._lib.pdserve_kv_gather_checksum(kv_layer.data_ptr(), *self._args, out.data_ptr(), sums):
            raise IndexError(f"block ids {self._index.tolist()} outside a cache of {self._args[2]} blocks")
        return sums[0], sums[1]

    def in_runs(self, kv_layer: torch.Tensor, out: torch.Tensor, runs: list[tuple[int, int, int]],
                each: Callable[[int], None], direct: list[int | None] | None = None) -> tuple[int, int]:
        """``self(kv_layer, out)`` a run at a time: for each ``(slot, first, end)`` of ``runs``
        (``wire.layer_runs``, in order) ``out[slot, first:end]`` is gathered and summed, then ``each(i)``
        is called (the sender sends run i while it is still in cache). Every run must be whole
        ``ROW_BYTES`` rows (blocks of a multiple of 256 bytes), so their sums join (``join_sums``).
        ``direct[i]``, where not None, says run i's blocks lie next to each other in the cache from that
        block id on (``kv_layer[slot]`` contiguous): the run is not gathered (``out[slot, first:end]`` is
        left as it was; the sender sends the cache's bytes): it is summed where it lies, then ``each(i)``
        sends it from this core's cache (summing after the send was 1.3x slower on the bench machine:
        the socket's copy had already moved on).
        Returns the layer's sums, as ``self(kv_layer, out)`` would. Raises ValueError as ``__call__``,
        or if a run is not whole rows, and IndexError for a block id outside the cache, before anything
        is gathered."""
        self._check(kv_layer, out)
        slots, slot_stride, total, ids, n, block_stride, block_size, token_stride, token_bytes = self._args
        block_bytes = block_size * token_bytes
        if block_bytes % ROW_BYTES:
            raise ValueError(f"blocks of {block_bytes} bytes are not whole {ROW_BYTES}-byte checksum rows")
        if self._ids_in_range is None:
            self._ids_in_range = not n or (int(self._index.min()) >= 0 and int(self._index.max()) < total)
        if not self._ids_in_range:
            raise IndexError(f"block ids {self._index.tolist()} outside a cache of {total} blocks")
        src, dst = kv_layer.data_ptr(), out.data_ptr()
        sums = (ctypes.c_int64 * 2)()
        parts = []
        for i, (slot, first, end) in enumerate(runs):
            if direct is not None and direct[i] is not None:
                self._lib.pdserve_kv_checksum(src + slot * slot_stride + direct[i] * block_stride,
                                              (end - first) * block_bytes, sums)
            else:
                self._lib.pdserve_kv_gather_checksum(src + slot * slot_stride, 1, slot_stride, total,
                                                     ids + 8 * first, end - first, block_stride, block_size,
                                                     token_stride, token_bytes, dst + (slot * n + first) * block_bytes,
                                                     sums)
            each(i)
            parts.append(((sums[0], sums[1]), (end - first) * block_bytes))
        return join_sums(parts)


def join_sums(parts: list[tuple[tuple[int, int], int]]) -> tuple[int, int]:
    """The ``(sum_k r_k, s2)`` of byte ranges laid end to end, from each range's own sums and byte
    count (``[((words, s2), num_bytes), ...]``, e.g. ``BlockGather`` results, in order). For A then B
    the words add, and s2(A B) = s2(A) + R_B * words(A) + s2(B), R_B being B's row count: each of A's
    rows is R_B rows further from the end. Every range but the last must be whole 256-byte rows.

    Raises:
        ValueError: a range before the last is not whole rows.
    """
    words = s2 = 0
    for i, ((w, s), num_bytes) in enumerate(parts):
        if num_bytes % ROW_BYTES and i < len(parts) - 1:
            raise ValueError(f"range {i} of {len(parts)} is {num_bytes} bytes, not whole {ROW_BYTES}-byte rows")
        s2 = (s2 + -(-num_bytes // ROW_BYTES) * words + s) & _U64
        words = (words + w) & _U64
    return words, s2


def _weights(num_rows: int, device: torch.device) -> torch.Tensor:
    """[R] int64: row k's weight in ``s2``, R - k."""
    return torch.arange(num_rows, 0, -1, dtype=torch.int64, device=device)


def _word_sums(t: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[sum_k r_k, s2]`` int64 on ``t.device`` (no host sync): ``s1`` less ``num_bytes``, and ``s2``.
    ``weights``: ``_weights(R)`` if the caller keeps them (a request's layers share one R)."""
    row_sums = _row_sums(t)  # [R]
    if weights is None or weights.numel() != row_sums.numel():
        weights = _weights(row_sums.numel(), row_sums.device)
    if t.device.type == "cpu":  # int64 dot: no temporary (a fresh MiB-sized one costs page faults)
        s2 = torch.dot(row_sums, weights)
    else:  # torch's CUDA dot takes floating-point types only; the caching allocator makes this cheap
        s2 = (row_sums * weights).sum()
    return torch.stack([row_sums.sum(), s2])


def _to_int(words: int, s2: int, num_bytes: int) -> int:
    """The checksum from ``_word_sums`` (as Python ints) and the byte count."""
    return ((s2 & _U64) % _Q * _MIX + ((words + num_bytes) & _U64)) % _Q


def kv_checksum(t: torch.Tensor) -> int:
    """Checksum of ``t``'s bytes (any shape, dtype and device): an int in [0, 2**61 - 1); see the module doc."""
    sums = _native_sums(t)
    return _to_int(*(sums if sums is not None else _word_sums(t).tolist()), t.numel() * t.element_size())


def combine_checksums(a: int, b: int) -> int:
    """Fold checksum ``b`` after ``a`` (order-sensitive); start a fold from 0."""
    return (a * _MIX + b + 1) % _Q


class KVChecksum:
    """Incremental checksum of a sequence of tensors (e.g. one request's layers).

    ``update`` only queues device work (no sync); ``value`` syncs and folds, giving
    ``combine_checksums(...combine_checksums(0, kv_checksum(t_0))..., kv_checksum(t_k))``.
    """

    def __init__(self) -> None:
        # per tensor: (its sums, num_bytes); the sums are _word_sums' [2] tensor (queued device work) or
        # the native kernel's two ints
        self._parts: list[tuple[torch.Tensor | tuple[int, int], int]] = []
        self._weights: torch.Tensor | None = None  # [R] of the last part (a request's layers share R)
        self.num_bytes = 0

    def update(self, t: torch.Tensor) -> None:
        """Append ``t``'s bytes (any shape, dtype and device; a CUDA tensor's sums stay queued on it)."""
        num_bytes = t.numel() * t.element_size()
        sums = _native_sums(t)
        if sums is not None:
            self.add(sums, num_bytes)
            return
        num_rows = -(-num_bytes // ROW_BYTES)
        weights = self._weights
        if weights is None or weights.numel() != num_rows or weights.device != t.device:
            weights = self._weights = _weights(num_rows, t.device)
        self._parts.append((_word_sums(t, weights), num_bytes))
        self.num_bytes += num_bytes

    def add(self, sums: tuple[int, int], num_bytes: int) -> None:
        """Append a tensor of ``num_bytes`` bytes whose sums were taken already (``BlockGather``)."""
        self._parts.append((sums, num_bytes))
        self.num_bytes += num_bytes

    @property
    def value(self) -> int:
        folded = 0
        if self._parts:
            queued = [s for s, _ in self._parts if isinstance(s, torch.Tensor)]
            done = iter(torch.stack(queued).tolist() if queued else [])
            sums = [next(done) if isinstance(s, torch.Tensor) else s for s, _ in self._parts]
            for (words, s2), (_, num_bytes) in zip(sums, self._parts):
                folded = combine_checksums(folded, _to_int(words, s2, num_bytes))
        return folded
