"""Two-rank process groups between one prefill (rank 0) and one decode (rank 1) worker.

There is no global world. The decode worker D hosts one TCPStore server
(``PairStoreServer``) for all its pairs; each (prefill P, D, generation) pair
rendezvouses under the store prefix ``kv/{P}->{D}/g{generation}``, so a broken
pair is replaced by a fresh group at generation + 1 without touching others.
Each side connects through its own TCPStore client (a TCPStore object runs one
blocking operation at a time, so pairs sharing one would wait on each other).

Every blocking call takes a timeout in seconds and raises ``KVTransferError``
naming the pair, the peer and what timed out. After any failure the pair is
closed: gloo closes a pair's sockets on a wait timeout anyway, and dropping the
group makes the peer's pending operations fail at once ("Connection closed by
peer") once no wait still holds it. Closing also leaves a note under the
pair's store prefix (``closed/{rank}``), so a peer that is idle, with no
operation to fail, still learns about it (``peer_closed``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from datetime import timedelta
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

import pdserve.kvtransfer.wire as wire
from pdserve.common.utils import listen_socket
from pdserve.kvtransfer.shm import ArenaStaging, ShmArena, ShmLink, negotiate
from pdserve.kvtransfer.staging import StagingPool
from pdserve.kvtransfer.wire import KVTransferError

logger = logging.getLogger(__name__)


def transfer_backend(device: torch.device | str) -> str:
    """The torch.distributed backend for KV tensors on ``device``: the one place this is decided."""
    device = torch.device(device)
    if device.type == "cpu":
        return "gloo"
    if device.type == "cuda":
        return "nccl"
    raise KVTransferError(f"no KV transfer backend for device {device}")


def _new_group(store: dist.Store, rank: int, device: torch.device, timeout_s: float) -> dist.ProcessGroup:
    """A two-rank group of ``transfer_backend(device)``; blocks until both ranks joined (gloo)."""
    backend = transfer_backend(device)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=timeout_s))
    if not dist.is_nccl_available():
        raise KVTransferError("NCCL is not available in this torch build")
    options = dist.ProcessGroupNCCL.Options()
    # The NCCL watchdog tears the process down when an op outlives this, so keep
    # it well above the explicit wait timeouts (a failed wait aborts the group first).
    options._timeout = timedelta(seconds=max(4 * timeout_s, 60.0))
    return dist.ProcessGroupNCCL(store, rank, 2, options)


def _wait_for_port(host: str, port: int, deadline: float) -> None:
    """Return once ``host:port`` accepts TCP connections; OSError at ``deadline``.

    TCPStore's own client retries with backoff and can overrun its timeout by 2x,
    so a store that is not there is detected here instead.
    """
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(deadline - time.monotonic(), 0.01)):
                return
        except OSError:
            if time.monotonic() + 0.05 >= deadline:
                raise
            time.sleep(0.05)


def _leave_note(store: dist.Store, rank: int, reason: str) -> threading.Thread:
    """Set ``closed/{rank}`` = reason in the pair's store, best effort, from a daemon thread."""

    def run() -> None:
        with contextlib.suppress(Exception):
            store.set(f"closed/{rank}", reason[:1000])

    thread = threading.Thread(target=run, daemon=True, name="kv-close-note")
    thread.start()
    return thread


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:300]


class PairStoreServer:
    """The decode worker's TCPStore server for all its pairs.

    ``host`` is the address prefill workers connect to (advertised in
    ``RegisterWorker.transfer_host``), and the only one the server listens on
    (a socket bound here and handed to torch, never all interfaces); ``port`` 0
    picks a free port, read back from ``.port``.

    Raises:
        OSError: ``host:port`` cannot be bound (not an address of this machine, or taken).
    """

    def __init__(self, host: str, port: int = 0):
        self.host = host
        self._listener = listen_socket(host, port)
        self.port: int = self._listener.getsockname()[1]
        self.store: dist.TCPStore | None = dist.TCPStore(
            host, self.port, None, True, timeout=timedelta(seconds=30), wait_for_workers=False,
            master_listen_fd=os.dup(self._listener.fileno()))

    @property
    def local_host(self) -> str:
        """Where a client on this machine reaches the server."""
        return "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host

    def close(self) -> None:
        self.store = None
        self._listener.close()


@dataclass
class PendingSend:
    """One request's place in its pair's send order (the pair's sequencer owns it, under its lock).

    Messages go out strictly in order, one request after another: ``queued`` waits until every earlier
    request has issued its last message. ``works``: the issued sends to wait on; ``issued`` is set
    once the last message is issued, or when ``fail`` is called (the pair closed)."""

    on_fail: Callable[[str], None]
    queued: deque = field(default_factory=deque)  # [torch.Tensor], not yet issued
    all_queued: bool = False
    works: list = field(default_factory=list)
    issued: threading.Event = field(default_factory=threading.Event)

    def fail(self, reason: str) -> None:
        self.on_fail(reason)
        self.issued.set()


class KVPair:
    """One live two-rank group: prefill worker = rank 0 (sender), decode worker = rank 1.

    Sends go through a sequencer: an ``OutgoingKV`` registers on creation and
    its messages are issued only after every earlier-registered request's
    messages were issued, so the stream holds whole requests in registration
    order even when the step loop sends layer i of requests A and B before
    layer i + 1 (NCCL ignores tags, so order is the only way to match).

    ``staging`` lends the buffers a request's KV is gathered into (sender) or lands in
    (receiver); pairs of one worker rank share one (None: the pair gets its own). A pair whose ranks share
    a host moves its messages through shared memory (``kvtransfer.shm``, ``transport`` "shm"); its sender
    then lends its staging from the pair's arena, falling back to ``staging``.
    """

    def __init__(self, pg: dist.ProcessGroup, *, backend: str, device: torch.device, rank: int,
                 prefill_worker_id: str, decode_worker_id: str, generation: int, timeout_s: float,
                 staging: StagingPool | None = None):
        self.backend = backend
        self.device = device
        self.rank = rank
        self.peer_rank = 1 - rank
        self.prefill_worker_id = prefill_worker_id
        self.decode_worker_id = decode_worker_id
        self.generation = generation
        self.timeout_s = timeout_s
        self.staging = staging if staging is not None else StagingPool()
        self.error: str | None = None  # why the pair was closed
        self._pg: dist.ProcessGroup | None = pg
        self._store: dist.Store | None = None  # the pair's PrefixStore, for close notes
        self._note_thread: threading.Thread | None = None
        self._lock = threading.RLock()
        self._send_order: deque[PendingSend] = deque()
        self._arena: ShmArena | None = None  # both ranks on one host: the messages go through it (kvtransfer.shm)
        self._shm: ShmLink | None = None

    @property
    def shared_memory(self) -> bool:
        """Whether the pair's messages go through a shared-memory arena (both ranks on one host): the sender
        then gathers every layer into its staging, which lies in the arena, and sends nothing from its cache."""
        return self._shm is not None

    @property
    def transport(self) -> str:
        """``"shm"`` (``shared_memory``), else the group's backend (``"gloo"``, ``"nccl"``)."""
        return "shm" if self._shm is not None else self.backend

    @property
    def name(self) -> str:
        return f"{self.prefill_worker_id}->{self.decode_worker_id} g{self.generation}"

    @property
    def peer_desc(self) -> str:
        if self.rank == 0:
            return f"decode worker {self.decode_worker_id} (pair {self.name})"
        return f"prefill worker {self.prefill_worker_id} (pair {self.name})"

    @property
    def is_open(self) -> bool:
        return self._pg is not None

    @classmethod
    def connect(cls, *, store: dist.Store | None, store_host: str, store_port: int, prefill_worker_id: str,
                decode_worker_id: str, generation: int, rank: int, device: torch.device | str,
                timeout_s: float, staging: StagingPool | None = None) -> KVPair:
        """Join the pair's group and exchange a hello; blocks until the peer joined.

        ``store`` None connects a new TCPStore client to ``store_host:store_port``.
        Raises KVTransferError when the store or the peer is not there within ``timeout_s``.
        """
        device = torch.device(device)
        deadline = time.monotonic() + timeout_s
        name = f"{prefill_worker_id}->{decode_worker_id} g{generation}"
        peer = f"decode worker {decode_worker_id}" if rank == 0 else f"prefill worker {prefill_worker_id}"
        prefix = None
        try:
            if store is None:
                _wait_for_port(store_host, store_port, deadline)
                store = dist.TCPStore(store_host, store_port, None, False,
                                      timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
            prefix = dist.PrefixStore(f"kv/{prefill_worker_id}->{decode_worker_id}/g{generation}", store)
            pg = _new_group(prefix, rank, device, max(deadline - time.monotonic(), 0.05))
        except KVTransferError:
            raise
        except Exception as exc:  # OSError, DistStoreError, DistNetworkError, gloo errors
            reason = (f"pair {name}: {peer} did not join via store {store_host}:{store_port} "
                      f"within {timeout_s:.1f}s: {_short(exc)}")
            if prefix is not None:
                _leave_note(prefix, rank, reason).join(0.5)
            raise KVTransferError(reason) from None
        pair = cls(pg, backend=transfer_backend(device), device=device, rank=rank,
                   prefill_worker_id=prefill_worker_id, decode_worker_id=decode_worker_id,
                   generation=generation, timeout_s=timeout_s, staging=staging)
        pair._store = prefix
        pair._hello(deadline)
        pair._setup_shm()
        return pair

    def _setup_shm(self) -> None:
        """Move the pair's messages to shared memory where both ranks share a host (``shm.negotiate``); the
        sender's staging is then lent from the arena (its own pool where a request does not fit)."""
        try:
            arena = negotiate(self._store, self.rank, self.device)
        except Exception as exc:  # the store or the peer went away
            reason = f"pair {self.name}: {self.peer_desc} did not agree on a transport: {_short(exc)}"
            self.close(reason)
            raise KVTransferError(reason) from None
        if arena is not None:
            self._arena = arena
            self._shm = ShmLink(arena, self.peer_rank, self._live_pg, lambda: self._pg is not None, self.timeout_s)
            if self.rank == 0:
                self.staging = ArenaStaging(arena, self.staging)
        logger.info("KV pair %s (rank %d): messages through %s", self.name, self.rank, self.transport)

    def _post(self, pg: dist.ProcessGroup, tensor: torch.Tensor):
        """Issue ``tensor`` as the stream's next message (through the arena where the pair has one); its Work."""
        if self._shm is not None:
            return self._shm.post(tensor)
        return pg.send([tensor], self.peer_rank, wire.TAG)

    def _hello(self, deadline: float) -> None:
        """Exchange ``hello`` (and so create NCCL's communicator here, not in the step loop)."""
        values = [wire.MAGIC, self.generation, wire.crc(self.prefill_worker_id), wire.crc(self.decode_worker_id)]
        hello = torch.tensor(values, dtype=torch.int64, device=self.device)
        with self.device_context():
            if self.rank == 0:
                self.wait(self.send(hello), deadline - time.monotonic(), "hello")
                return
            got = torch.zeros_like(hello)
            self.recv(got, deadline - time.monotonic(), "hello")
        if not torch.equal(got, hello):
            reason = f"pair {self.name}: bad hello {got.tolist()}, expected {values}"
            self.close(reason)
            raise KVTransferError(reason)

    def device_context(self):
        return torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()

    def _live_pg(self) -> dist.ProcessGroup:
        pg = self._pg
        if pg is None:
            raise KVTransferError(f"pair {self.name} is closed: {self.error}")
        return pg

    def send(self, tensor: torch.Tensor) -> dist.Work:
        """Start sending ``tensor`` (contiguous, on ``device``) to the peer; returns the Work."""
        try:
            return self._post(self._live_pg(), tensor)
        except KVTransferError:
            raise
        except Exception as exc:
            reason = f"send to {self.peer_desc} failed: {_short(exc)}"
            self.close(reason)
            raise KVTransferError(reason) from None

    def wait(self, work: dist.Work, timeout_s: float, what: str) -> None:
        """Wait up to ``timeout_s`` seconds for ``work``; on failure close the pair and raise."""
        start = time.monotonic()
        try:
            ok = work.wait(timedelta(seconds=max(timeout_s, 0.001)))
            detail = None if ok is not False else "timed out"
        except Exception as exc:
            detail = _short(exc)
        if detail is None:
            return
        took = time.monotonic() - start
        reason = f"{what}: no completion from {self.peer_desc} after {took:.2f}s (timeout {timeout_s:.2f}s): {detail}"
        self.close(reason)
        raise KVTransferError(reason)

    def irecv(self, tensor: torch.Tensor, what: str) -> dist.Work:
        """Post a receive of the stream's next message into ``tensor`` (contiguous, exact size); returns
        the Work to ``wait`` on. Receives posted back to back complete in stream order."""
        try:
            pg = self._live_pg()
            if self._shm is not None:
                return self._shm.post_recv(tensor)
            return pg.recv([tensor], self.peer_rank, wire.TAG)
        except KVTransferError:
            raise
        except Exception as exc:
            reason = f"{what}: receive from {self.peer_desc} failed: {_short(exc)}"
            self.close(reason)
            raise KVTransferError(reason) from None

    def recv(self, tensor: torch.Tensor, timeout_s: float, what: str) -> None:
        """Receive the stream's next message into ``tensor`` (contiguous, exact size), waiting up to ``timeout_s``."""
        self.wait(self.irecv(tensor, what), timeout_s, what)

    # -- send sequencer (the sender's OutgoingKV holds a PendingSend) --------

    def register_send(self, send: PendingSend) -> None:
        """Take ``send``'s place in the stream order (it fails at once if the pair is closed)."""
        with self._lock:
            if self._pg is None:
                send.fail(f"pair {self.name} is closed: {self.error}")
            else:
                self._send_order.append(send)

    def enqueue_send(self, send: PendingSend, tensors: list[torch.Tensor], last: bool) -> None:
        """Queue ``send``'s next messages and issue whatever the stream order allows."""
        with self._lock:
            send.queued.extend(tensors)
            send.all_queued = last
            try:
                while self._send_order and self._pg is not None:
                    head = self._send_order[0]
                    while head.queued:
                        head.works.append(self._post(self._pg, head.queued.popleft()))
                    if not head.all_queued:
                        break
                    self._send_order.popleft()
                    head.issued.set()
            except Exception as exc:
                self.close(f"send to {self.peer_desc} failed: {_short(exc)}")

    def peer_closed(self) -> str | None:
        """The peer's reason if it closed its side (one round trip to the store), else None."""
        store = self._store
        key = f"closed/{self.peer_rank}"
        try:
            return store.get(key).decode(errors="replace") if store is not None and store.check([key]) else None
        except Exception:  # store gone: the next operation on the pair will say more
            return None

    def join_note(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the close note to reach the store (before a process exits)."""
        if self._note_thread is not None:
            self._note_thread.join(timeout_s)

    def close(self, reason: str | None = None) -> None:
        """Drop the group (idempotent); requests still queued in the sequencer fail with ``reason``.

        Leaves a close note for the peer from a background thread (the store may be remote and slow).
        """
        with self._lock:
            pg, self._pg = self._pg, None
            if pg is None:
                return
            self.error = self.error or reason or "closed"
            waiting = list(self._send_order)
            self._send_order.clear()
        for send in waiting:
            send.fail(f"pair {self.name} closed: {self.error}")
        if self._arena is not None:
            self._arena.close()
        if self._store is not None:
            self._note_thread = _leave_note(self._store, self.rank, self.error)
        if self.backend == "nccl":
            with contextlib.suppress(Exception):
                pg.abort()
        del pg  # gloo: the last reference closes the sockets, failing the peer's waits at once
