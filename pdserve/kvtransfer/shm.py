"""Same-host KV transport: the sender's staging in shared memory, published through a descriptor queue.

Gloo moves a CPU pair's bytes over TCP, and between two processes of one host that is the kernel's
loopback: the sender gathers a layer into its staging buffer, the kernel copies it into a socket
buffer and out again on the receiving core, and the receiver's staging takes it. Systems that move
KV between processes of one machine use shared memory instead of their network path: NCCL's SHM
and P2P transports inside a node, Mooncake's transfer engine with a local memcpy, NIXL over UCX's
shared-memory transports. This module is pdserve's CPU version. It removes the socket's two copies:
the sender gathers straight into memory the receiver maps, and the receiver copies each message out
of it once. (A ring of slots that the sender copied its staging into, behind a gloo notice a
message, was measured slower than gloo itself on a 2-core EPYC and not kept: docs/benchmarks.md,
forty-first session.)

When both ranks of a CPU pair run on one host (the same boot id and hostname: ``host_identity``),
the sender (rank 0) creates an ``ShmArena`` in ``/dev/shm``: a control page, a queue of message
descriptors, and a data region of ``arena_bytes`` from which the pair's sender staging is lent
(``ArenaStaging``). The receiver maps it and the file is unlinked as soon as it answered, so nothing
is left behind by a process that dies later (``negotiate``); a sender killed before the answer leaves its
file, which the next arena made on the host removes (``sweep_orphans``). Then each message of the pair's stream:

* is published by the sender as a descriptor (its offset in the data region and its size; offset -1:
  it went on the gloo stream instead, being outside the arena: meta, a staging buffer that did not
  fit, a test fault's copy) and the ``published`` counter is raised, waking the receiver (a futex);
* is taken by the receiver's ``wait`` in stream order: it waits for the descriptor, checks the size
  against the receive it posted, copies the bytes out of the arena (or receives them from gloo) and
  raises ``consumed``, waking a sender that waits for its send to complete.

A send is complete once the receiver consumed it: only then may the sender's staging be lent again.
Every wait checks, each ``_SLICE_S``, that the peer process still holds its lock on the arena (an
open-file-description lock, dropped by the kernel when the process dies) and that neither side closed the
pair (``closed``), so a dead or closed peer fails a transfer within a fraction of a second, as a
closed socket does for gloo.

x86-64 only: the counters are aligned 8-byte stores after the data's stores and loads, which x86
keeps in program order (TSO); other CPUs would need fences, and use gloo.
``PDSERVE_KV_TRANSPORT=gloo`` (on either side) keeps a pair on gloo; ``PDSERVE_KV_SHM_MIB`` sizes a
pair's data region (default 64; a request that does not fit goes on gloo).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import platform
import socket
import struct
import threading
import time
import uuid
import weakref
from datetime import timedelta

import torch
import torch.distributed as dist

import pdserve.kvtransfer.wire as wire
from pdserve.kvtransfer.staging import StagingPool
from pdserve.kvtransfer.wire import KVTransferError

NUM_DESCRIPTORS = 16384  # messages published and not yet consumed, at most (16 bytes each)
DEFAULT_ARENA_MIB = 64
_CONTROL_BYTES = 4096  # published (int64 at 0), consumed (8), closed (16); byte 64 + rank: each side's lock
_DESCRIPTORS_AT = _CONTROL_BYTES
_DATA_AT = _DESCRIPTORS_AT + NUM_DESCRIPTORS * 16  # page aligned
_ALIGN = 4096  # a staging buffer's alignment in the data region
_SLICE_S = 0.05  # longest futex sleep between checks of the peer, the pair and the deadline (seconds)
_SHM_DIR = "/dev/shm"
_ENV = "PDSERVE_KV_TRANSPORT"  # "gloo": never; unset, "auto" or "shm": where both ranks share a host
_ENV_MIB = "PDSERVE_KV_SHM_MIB"
_PUBLISHED, _CONSUMED, _CLOSED = 0, 1, 2  # int64 indices in the control page
_LOCK_AT = 64

_FLOCK = "=hh4xqqi4x"  # struct flock on x86-64 Linux: type, whence, start, len, pid


def _flock(kind: int, byte: int) -> bytes:
    """A ``struct flock`` for an open-file-description lock of one byte (released when the last descriptor
    of the open file is closed, the process's death included; held per open file, so two arenas opened in
    one process see each other's locks)."""
    return struct.pack(_FLOCK, kind, os.SEEK_SET, byte, 1, 0)


_libc = ctypes.CDLL(None, use_errno=True)
_SYS_FUTEX = 202  # x86-64
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _futex_wait(address: int, expected: int, timeout_s: float) -> None:
    """Sleep while the int32 at ``address`` (shared memory) holds ``expected``, at most ``timeout_s``; returns
    early on a wake, a change or a signal. The GIL is released (a ctypes call)."""
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAIT, ctypes.c_int32(expected), ctypes.byref(ts),
                  None, 0)


def _futex_wake(address: int) -> None:
    _libc.syscall(_SYS_FUTEX, ctypes.c_void_p(address), _FUTEX_WAKE, ctypes.c_int32(2**31 - 1), None, None, 0)


def host_identity() -> str:
    """This host's identity for deciding that two processes share memory: the kernel's boot id and the
    hostname (two containers of one host with separate /dev/shm differ in hostname)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = "no-boot-id"
    return f"{boot_id}/{socket.gethostname()}"


def shm_supported(device: torch.device) -> bool:
    """Whether a pair on ``device`` may use shared memory: a CPU pair on x86-64 with ``/dev/shm``, unless
    ``PDSERVE_KV_TRANSPORT=gloo``.

    Raises:
        KVTransferError: ``PDSERVE_KV_TRANSPORT`` is not auto, shm or gloo.
    """
    wanted = os.environ.get(_ENV, "auto").strip().lower()
    if wanted not in ("auto", "gloo", "shm"):
        raise KVTransferError(f"{_ENV}={wanted!r}: expected auto, shm or gloo")
    return (wanted != "gloo" and device.type == "cpu" and platform.machine().lower() in ("x86_64", "amd64")
            and os.path.isdir(_SHM_DIR))


def arena_bytes() -> int:
    """A pair's data region in bytes (``PDSERVE_KV_SHM_MIB``, default ``DEFAULT_ARENA_MIB``)."""
    try:
        mib = float(os.environ.get(_ENV_MIB, DEFAULT_ARENA_MIB))
    except ValueError:
        raise KVTransferError(f"{_ENV_MIB} must be a number of MiB") from None
    return max(int(mib * (1 << 20)) // _ALIGN * _ALIGN, _ALIGN)


class ShmArena:
    """One pair's shared mapping: the control page, ``NUM_DESCRIPTORS`` descriptors ``(offset, nbytes)``
    (int64 each) and ``data_bytes`` of data (``data``: a flat uint8 tensor over it).

    Each side holds an open-file-description write lock on its own byte of the control page while it has
    the arena open; ``peer_alive`` tests the other's. ``path`` is the file while it still has a name (see
    ``negotiate``).

    Raises:
        OSError: the file cannot be created, sized (``/dev/shm`` full: ENOSPC) or opened.
        KVTransferError: an opened file is not an arena of the expected size.
    """

    def __init__(self, path: str, rank: int, data_bytes: int, create: bool):
        size = _DATA_AT + data_bytes
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL if create else os.O_RDWR, 0o600)
        lock_fd = None
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # tmpfs pages now: ENOSPC here, never SIGBUS on a write
            elif os.fstat(fd).st_size != size:
                raise KVTransferError(f"shared-memory arena {path} has {os.fstat(fd).st_size} bytes, expected {size}")
            self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0))
            # the lock on an open file of its own: the mapping keeps ``fd``'s open, and so would keep a lock on it
            lock_fd = os.open(path, os.O_RDWR)
            fcntl.fcntl(lock_fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_WRLCK, _LOCK_AT + rank))
        except BaseException:
            if lock_fd is not None:
                os.close(lock_fd)
            if create:  # no arena was made: leave no file behind
                os.unlink(path)
            raise
        finally:
            os.close(fd)
        self._fd: int | None = lock_fd
        self.path, self.rank, self.data_bytes = path, rank, data_bytes
        self.control = (ctypes.c_int64 * 3).from_buffer(self._mm, 0)
        self.descriptors = (ctypes.c_int64 * (2 * NUM_DESCRIPTORS)).from_buffer(self._mm, _DESCRIPTORS_AT)
        self.data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=_DATA_AT, count=data_bytes)
        self.data_ptr = self.data.data_ptr()
        base = ctypes.addressof(self.control)
        self.published_address, self.consumed_address = base, base + 8

    @classmethod
    def create(cls, data_bytes: int) -> ShmArena:
        """A new arena (rank 0's) in ``/dev/shm`` under a unique name; ``unlink`` it once the peer mapped it.
        Arenas that dead senders left behind are removed first (``sweep_orphans``)."""
        sweep_orphans()
        return cls(os.path.join(_SHM_DIR, f"pdserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"), 0, data_bytes,
                   create=True)

    def unlink(self) -> None:
        """Remove the file's name (the mappings stay valid); idempotent."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def peer_alive(self) -> bool:
        """Whether the other rank's process still has the arena open (holds its lock)."""
        fd = self._fd
        if fd is None:
            return False
        try:
            held = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, _LOCK_AT + 1 - self.rank))
        except OSError:  # this side closed the arena meanwhile (another thread)
            return False
        return struct.unpack(_FLOCK, held)[0] != fcntl.F_UNLCK

    @property
    def closed(self) -> bool:
        return self.control[_CLOSED] != 0

    def close(self) -> None:
        """Mark the arena closed for both sides, wake every waiter and give up this side's lock (the peer
        sees it gone); the mapping lives on while tensors over it do. Idempotent."""
        self.control[_CLOSED] = 1
        _futex_wake(self.published_address)
        _futex_wake(self.consumed_address)
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # drops this side's lock

    def wait_until(self, index: int, value: int, deadline: float, what: str, is_open) -> bool:
        """Wait until control counter ``index`` exceeds ``value``: True; False at ``deadline`` (monotonic s).

        Raises:
            KVTransferError: the pair was closed (by either side, ``is_open()`` false) or the peer died.
        """
        address = self.published_address if index == _PUBLISHED else self.consumed_address
        while True:
            seen = self.control[index]
            if seen > value:
                return True
            if not is_open():
                raise KVTransferError(f"{what}: the pair was closed on this side")
            if self.closed:
                raise KVTransferError(f"{what}: the peer closed the pair (Connection closed by peer)")
            if not self.peer_alive():
                raise KVTransferError(f"{what}: the peer process is gone (Connection closed by peer)")
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            low = seen & 0xFFFFFFFF
            _futex_wait(address, low - (1 << 32) if low >= 1 << 31 else low, min(left, _SLICE_S))


def sweep_orphans() -> list[str]:
    """Remove the arena files of senders that died before their peer answered; returns their paths.

    ``negotiate`` unlinks an arena once the peer answered, so only a sender killed while waiting for that
    answer (SIGKILL, an OOM kill) leaves its file, ``pdserve-kv-<pid>-<id>``, holding ``/dev/shm`` memory.
    A file is an orphan when both its creator's pid is gone from this pid namespace and no process holds
    the creator's lock on it (a forked child would hold it still; a process of another pid namespace
    sharing ``/dev/shm`` holds it while its arena lives). Files that cannot be read are left alone.
    """
    removed = []
    try:
        names = os.listdir(_SHM_DIR)
    except OSError:
        return removed
    for name in names:
        parts = name.split("-")
        if len(parts) != 4 or parts[:2] != ["pdserve", "kv"] or not parts[2].isdigit():
            continue
        try:
            os.kill(int(parts[2]), 0)
            continue  # its creator (or a process of the same pid) runs
        except ProcessLookupError:
            pass
        except OSError:  # PermissionError: a live process of another user
            continue
        path = os.path.join(_SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except OSError:
            continue
        try:
            held = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, _LOCK_AT))
            if struct.unpack(_FLOCK, held)[0] == fcntl.F_UNLCK:
                os.unlink(path)
                removed.append(path)
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def negotiate(store: dist.Store, rank: int, device: torch.device) -> ShmArena | None:
    """Agree with the peer, through the pair's store, on shared memory: this side's arena, or None (gloo).

    Rank 0 offers ``host_identity``, a new arena's path and its data size (or nothing: not supported here,
    or ``/dev/shm`` too full); rank 1 answers "1" if its host is the same and the arena maps, else "0".
    Rank 0 unlinks the file once answered (or on any error), so an arena lives only as long as the
    mappings of the two processes. Store errors propagate (the caller fails the pair).
    """
    supported = shm_supported(device)
    if rank == 0:
        arena = None
        if supported:
            try:
                arena = ShmArena.create(arena_bytes())
            except OSError:
                arena = None
        try:
            offer = f"{host_identity()}\n{arena.data_bytes}\n{arena.path}" if arena is not None else ""
            store.set("shm/offer", offer)
            accepted = store.get("shm/answer") == b"1"
        finally:
            if arena is not None:
                arena.unlink()
        if arena is not None and not accepted:
            arena.close()
        return arena if accepted else None
    offer = store.get("shm/offer").decode()
    arena = None
    if supported and offer:
        host, data_bytes, path = offer.split("\n", 2)
        if host == host_identity():
            try:
                arena = ShmArena(path, 1, int(data_bytes), create=False)
            except (OSError, ValueError, KVTransferError):
                arena = None
    store.set("shm/answer", "1" if arena is not None else "0")
    return arena


class ArenaStaging:
    """The sender's staging lent from its arena's data region (first fit, 4 KiB aligned, freed regions
    merged with their neighbours), with ``StagingPool``'s interface; a request that does not fit takes a
    buffer from ``fallback`` (its messages then go on gloo). A lent buffer that dies unreturned (a failed or
    aborted request's) frees its region, as ``StagingPool`` forgets one: the receiver may still copy a
    message of it out, but that request's KV is dropped on the decode side. Thread-safe."""

    def __init__(self, arena: ShmArena, fallback: StagingPool):
        self.arena, self.fallback = arena, fallback
        self._lock = threading.RLock()  # a dying buffer's callback may run inside a locked section
        self._free: list[tuple[int, int]] = [(0, arena.data_bytes)]  # (offset, bytes), by offset
        self._lent: dict[int, tuple[int, weakref.ref]] = {}  # offset -> (bytes, the tensor take returned)

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return sum(size for _, size in self._free)

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype,
             device: torch.device | str) -> torch.Tensor:
        """A contiguous tensor of ``shape`` and ``dtype`` (CPU), in the arena where it fits."""
        num_bytes = torch.Size(shape).numel() * dtype.itemsize
        size = max(-(-num_bytes // _ALIGN) * _ALIGN, _ALIGN)
        with self._lock:
            index = next((i for i, (_, free) in enumerate(self._free) if free >= size), None)
            if index is None:
                return self.fallback.take(shape, dtype, device)
            offset, free = self._free[index]
            if free == size:
                del self._free[index]
            else:
                self._free[index] = (offset + size, free - size)
            out = self.arena.data[offset:offset + num_bytes].view(dtype).view(shape)
            self._lent[offset] = (size, weakref.ref(out, lambda ref, at=offset: self._release(at, ref)))
            return out

    def give(self, t: torch.Tensor) -> None:
        """Take back a tensor ``take`` returned, once nothing reads it (every send of it consumed); anything
        else is handed to the fallback pool (which ignores what it did not lend)."""
        offset = t.data_ptr() - self.arena.data_ptr
        with self._lock:
            lent = self._lent.get(offset)
            if lent is None or lent[1]() is not t:
                lent = None
            else:
                self._release(offset, lent[1])
        if lent is None:
            self.fallback.give(t)

    def _release(self, offset: int, ref: weakref.ref) -> None:
        """Free the region at ``offset`` if ``ref``'s buffer still holds it, merging free neighbours."""
        with self._lock:
            lent = self._lent.get(offset)
            if lent is None or lent[1] is not ref:
                return
            del self._lent[offset]
            self._free.append((offset, lent[0]))
            self._free.sort()
            merged = [self._free[0]]
            for start, length in self._free[1:]:
                last_start, last_length = merged[-1]
                if last_start + last_length == start:
                    merged[-1] = (last_start, last_length + length)
                else:
                    merged.append((start, length))
            self._free = merged


class _ShmSend:
    """A message published through the arena: complete (``wait``) once the receiver consumed it."""

    __slots__ = ("link", "seq")

    def __init__(self, link: ShmLink, seq: int):
        self.link, self.seq = link, seq

    def wait(self, timeout: timedelta) -> bool:
        link = self.link
        return link.arena.wait_until(_CONSUMED, self.seq, time.monotonic() + timeout.total_seconds(),
                                     f"send {self.seq}", link.is_open)


class _ShmRecv:
    """A posted receive: ``wait`` takes the stream's next descriptor, checks its size and copies the
    message out of the arena (or receives it from gloo), then marks it consumed. Waited in stream order."""

    __slots__ = ("link", "seq", "tensor", "done")

    def __init__(self, link: ShmLink, seq: int, tensor: torch.Tensor):
        self.link, self.seq, self.tensor, self.done = link, seq, tensor, False

    def wait(self, timeout: timedelta) -> bool:
        if self.done:
            return True
        link, seq = self.link, self.seq
        deadline = time.monotonic() + timeout.total_seconds()
        if not link.arena.wait_until(_PUBLISHED, seq, deadline, f"message {seq}", link.is_open):
            return False
        slot = 2 * (seq % NUM_DESCRIPTORS)
        offset, num_bytes = link.arena.descriptors[slot], link.arena.descriptors[slot + 1]
        out = self.tensor.reshape(-1).view(torch.uint8)
        if num_bytes != out.numel():
            raise KVTransferError(f"message {seq} has {num_bytes} bytes where {out.numel()} were expected")
        if offset < 0:
            work = link.live_pg().recv([self.tensor], link.peer_rank, wire.TAG)
            if work.wait(timedelta(seconds=max(deadline - time.monotonic(), 0.001))) is False:
                return False
        else:
            out.copy_(link.arena.data[offset:offset + num_bytes])
        link.arena.control[_CONSUMED] = seq + 1
        _futex_wake(link.arena.consumed_address)
        self.done, self.tensor = True, None
        return True


class ShmLink:
    """A pair's messages through its arena: ``post`` (sender) publishes one, ``post_recv`` (receiver) posts
    the receive of the next one. ``live_pg()`` returns the pair's gloo group or raises KVTransferError
    (closed); ``is_open()`` whether the pair is open. Posts come in stream order, under the pair's lock."""

    def __init__(self, arena: ShmArena, peer_rank: int, live_pg, is_open, timeout_s: float):
        self.arena, self.peer_rank, self.live_pg, self.is_open = arena, peer_rank, live_pg, is_open
        self.timeout_s = timeout_s
        self._seq = 0  # messages posted so far

    def post(self, tensor: torch.Tensor):
        """Publish ``tensor`` (contiguous, CPU) as the stream's next message; returns its Work. The tensor
        must stay unwritten until that Work completes.

        Raises:
            KVTransferError: the descriptor queue stayed full for ``timeout_s`` (the receiver stalled), or the
                pair closed meanwhile.
        """
        seq, arena = self._seq, self.arena
        if seq >= NUM_DESCRIPTORS and not arena.wait_until(_CONSUMED, seq - NUM_DESCRIPTORS,
                                                           time.monotonic() + self.timeout_s,
                                                           f"send {seq}", self.is_open):
            raise KVTransferError(f"the receiver consumed no message for {self.timeout_s:.1f}s "
                                  f"({NUM_DESCRIPTORS} published and waiting)")
        num_bytes = tensor.numel() * tensor.element_size()
        offset = tensor.data_ptr() - arena.data_ptr
        work = None
        if not (0 <= offset and offset + num_bytes <= arena.data_bytes and tensor.is_contiguous()):
            offset, work = -1, self.live_pg().send([tensor], self.peer_rank, wire.TAG)
        slot = 2 * (seq % NUM_DESCRIPTORS)
        arena.descriptors[slot], arena.descriptors[slot + 1] = offset, num_bytes
        self._seq = seq + 1
        arena.control[_PUBLISHED] = seq + 1  # after the descriptor and the data (x86 keeps store order)
        _futex_wake(arena.published_address)
        return _ShmSend(self, seq) if work is None else work

    def post_recv(self, tensor: torch.Tensor) -> _ShmRecv:
        """Post the receive of the stream's next message into ``tensor`` (contiguous, exact size).

        Raises:
            KVTransferError: ``tensor`` is not contiguous.
        """
        if not tensor.is_contiguous():
            raise KVTransferError(f"a receive needs a contiguous tensor, got strides {tensor.stride()}")
        self._seq += 1
        return _ShmRecv(self, self._seq - 1, tensor)
