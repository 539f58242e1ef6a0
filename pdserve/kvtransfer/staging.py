"""Reusable host buffers for the KV that is on its way (sender gathers, receiver landings).

A fresh CPU tensor of tens of MiB costs a page fault per 4 KiB page the first
time it is written: about 0.4 ms per MiB on the bench machine, as much as
moving the bytes over loopback gloo. So each side keeps the buffers of
finished transfers and hands them out again::

    kv = pool.take((num_layers, kv_slots, num_blocks, block_size, H, row_len), dtype, device)
    ... fill it, send it or hand it on ...
    pool.give(kv)       # the very tensor take returned, once nothing reads or writes it any more

Only CPU buffers are pooled: on CUDA, torch's caching allocator already reuses
device memory (``take`` is ``torch.empty`` there and ``give`` does nothing).
The pool holds no reference to a lent buffer: one that is never given back
(a failed transfer, which gloo may still be writing) is simply freed by
Python once its last user drops it. ``give`` ignores any tensor that is not
one ``take`` returned and still lent, so a double ``give`` is harmless.
"""

from __future__ import annotations

import threading
import weakref

import torch

DEFAULT_MAX_FREE_BYTES = 256 << 20  # idle bytes a pool keeps for reuse (beyond that, buffers are freed)
_PRUNE_LENT = 256  # forget lent buffers that died unreturned once this many are on record


def _size_class(num_bytes: int) -> int:
    """``num_bytes`` rounded up to 8 steps per power of two (at most 1/8 more), at least 4 KiB."""
    num_bytes = max(num_bytes, 4096)
    step = 1 << max(num_bytes.bit_length() - 4, 0)
    return (num_bytes + step - 1) // step * step


class StagingPool:
    """CPU buffers lent by ``take`` and returned by ``give``; thread-safe.

    ``max_free_bytes``: how many idle bytes to keep; when a returned buffer takes the idle bytes
    past that, the smallest idle buffers are freed first (large ones serve more requests).
    Buffers are flat uint8 tensors of a size class; ``take`` lends the smallest idle one that
    fits, else allocates one. ``num_allocated`` counts allocations (tests, benchmarks).
    """

    def __init__(self, max_free_bytes: int = DEFAULT_MAX_FREE_BYTES):
        self.max_free_bytes = max_free_bytes
        self.num_allocated = 0
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []  # idle buffers, ascending size
        self._lent: dict[int, weakref.ref] = {}  # buffer address -> the tensor take returned

    @property
    def free_bytes(self) -> int:
        """Bytes of the idle buffers."""
        with self._lock:
            return sum(b.numel() for b in self._free)

    @property
    def num_lent(self) -> int:
        """Buffers out on loan and still alive."""
        with self._lock:
            return sum(ref() is not None for ref in self._lent.values())

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
             device: torch.device | str) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` on ``device``, contents undefined."""
        device = torch.device(device)
        if device.type != "cpu":
            return torch.empty(shape, dtype=dtype, device=device)
        num_bytes = torch.Size(shape).numel() * dtype.itemsize
        with self._lock:
            index = next((i for i, b in enumerate(self._free) if b.numel() >= num_bytes), None)
            buf = self._free.pop(index) if index is not None else None
            self.num_allocated += buf is None
        if buf is None:
            buf = torch.empty(_size_class(num_bytes), dtype=torch.uint8)
        out = buf[:num_bytes].view(dtype).view(shape)
        with self._lock:
            if len(self._lent) >= _PRUNE_LENT:
                self._lent = {ptr: ref for ptr, ref in self._lent.items() if ref() is not None}
            self._lent[buf.data_ptr()] = weakref.ref(out)
        return out

    def give(self, t: torch.Tensor) -> None:
        """Take back ``t``, a tensor ``take`` returned. The caller must be done with it (and with
        every view of it): the next ``take`` may hand its memory out and overwrite it."""
        if t.device.type != "cpu":
            return
        storage = t.untyped_storage()
        with self._lock:
            ref = self._lent.get(storage.data_ptr())
            if ref is None or ref() is not t:
                return
            del self._lent[storage.data_ptr()]
            buf = torch.empty(0, dtype=torch.uint8).set_(storage)  # the whole buffer, flat
            self._free.append(buf)
            self._free.sort(key=torch.Tensor.numel)
            free = sum(b.numel() for b in self._free)
            while free > self.max_free_bytes and self._free:
                free -= self._free.pop(0).numel()
