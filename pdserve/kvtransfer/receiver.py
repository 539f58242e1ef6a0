"""Decode side: host the rendezvous, receive each request's KV into a staging tensor.

The receiver never writes D's KV cache. Each request's KV lands in a staging
tensor ``[num_layers, kv_slots, num_blocks, block_size, num_kv_heads, head_dim]`` lent
by the pairs' ``StagingPool`` and handed to ``on_received``; D's step loop
copies it into the request's blocks if the request is still waiting, so blocks
freed by a timed-out request can never be overwritten by a late transfer. Once
copied (or dropped), the staging tensor goes back with ``DecodePairs.release``.

One lane (thread) per prefill worker and pair generation: it connects as rank 1,
then serves that pair's headers FIFO (the order P sent them, which is P's
stream order). Any failure on a lane (connect, timeout, peer gone, header vs
stream mismatch) fails that request and every header queued behind it, closes
the pair, and makes ``generation_for`` hand out generation + 1.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.common.protocol import KVTransferHeader
import pdserve.kvtransfer.wire as wire
from pdserve.kvtransfer.checksum import KVChecksum
from pdserve.kvtransfer.pair import KVPair, PairStoreServer
from pdserve.kvtransfer.staging import StagingPool
from pdserve.kvtransfer.wire import KVTransferError

logger = logging.getLogger(__name__)

_JOIN_S = 0.5  # how long close() waits for each lane thread (seconds); lanes are daemons


@dataclass
class ReceivedKV:
    """A request's KV, received whole. ``kv``: [num_layers, kv_slots, num_blocks, block_size, num_kv_heads, head_dim]
    (a staging tensor: hand it back with ``DecodePairs.release`` once it is copied out). With the header's
    ``layer_num_blocks``, layer i holds its own count of blocks in the front of its row (``wire.layer_prefix``)."""

    request_id: str
    kv: torch.Tensor
    num_bytes: int
    checksum: int  # KVChecksum over kv[0], ..., kv[num_layers - 1]
    source: str = ""  # the sending endpoint (the lane's prefill_worker_id)


@dataclass
class TransferFailed:
    request_id: str
    reason: str
    source: str = ""  # the sending endpoint (the lane's prefill_worker_id)


class _Lane:
    """One pair generation with one prefill worker: its header queue and receiver thread."""

    def __init__(self, owner: DecodePairs, prefill_worker_id: str, generation: int):
        self.owner = owner
        self.prefill_worker_id = prefill_worker_id
        self.generation = generation
        self.headers: deque[KVTransferHeader] = deque()
        self.cond = threading.Condition(owner._lock)
        self.dead = False
        self.pair: KVPair | None = None
        self.thread = threading.Thread(target=self._run, daemon=True,
                                       name=f"kv-recv-{prefill_worker_id}-g{generation}")

    @property
    def name(self) -> str:
        return f"{self.prefill_worker_id}->{self.owner.decode_worker_id} g{self.generation}"

    def _run(self) -> None:
        owner = self.owner
        try:
            pair = KVPair.connect(store=None, store_host=owner._store_host, store_port=owner.store_port,
                                  prefill_worker_id=self.prefill_worker_id, decode_worker_id=owner.decode_worker_id,
                                  generation=self.generation, rank=1, device=owner.device, timeout_s=owner.timeout_s,
                                  staging=owner.staging)
        except Exception as exc:
            self.die(f"KV pair {self.name} could not be set up: {exc}")
            return
        with self.cond:
            self.pair = pair
            dead = self.dead
        if dead:
            pair.close("DecodePairs closed or pair reset while connecting")
            return
        while True:
            with self.cond:
                while not self.headers and not self.dead:
                    self.cond.wait()
                if self.dead:
                    return
                header = self.headers.popleft()
            try:
                result = owner._receive(pair, header)
            except Exception as exc:
                reason = str(exc) if isinstance(exc, KVTransferError) else f"request {header.request_id}: {exc!r}"
                owner._emit(TransferFailed(header.request_id, reason, self.prefill_worker_id))
                self.die(reason)
                return
            result.source = self.prefill_worker_id
            owner._emit(result)

    def die(self, reason: str, emit: bool = True) -> None:
        """Close the pair; every queued header fails with ``reason`` (idempotent)."""
        with self.cond:
            if self.dead:
                return
            self.dead = True
            pending = list(self.headers)
            self.headers.clear()
            self.cond.notify_all()
            pair = self.pair
        if pair is not None:
            pair.close(reason)
        for header in pending if emit else []:
            self.owner._emit(TransferFailed(
                header.request_id, f"request {header.request_id}: KV pair {self.name} was reset before "
                                   f"its transfer started: {reason}", self.prefill_worker_id))


class DecodePairs:
    """The decode worker's pairs with prefill workers; hosts the ``PairStoreServer``.

    ``host`` is advertised to prefill workers (``.store_host``/``.store_port``).
    ``timeout_s`` bounds every wait: connecting, and each message of a request
    (so a request fails after ``timeout_s`` seconds without progress).
    ``on_received`` gets a ``ReceivedKV`` or ``TransferFailed`` per submitted header,
    on a kvtransfer thread. ``store_addr`` (host, port): use that store (another rank
    of the same decode worker hosts it) instead of hosting one.
    """

    def __init__(self, decode_worker_id: str, host: str, device: torch.device | str, timeout_s: float,
                 on_received: Callable[[ReceivedKV | TransferFailed], None], port: int = 0,
                 store_addr: tuple[str, int] | None = None):
        self.decode_worker_id = decode_worker_id
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.staging = StagingPool()  # every lane's landing buffers
        self._on_received = on_received
        self._server = PairStoreServer(host, port) if store_addr is None else None
        self._store_host, self._store_port = (self._server.local_host, self._server.port) if store_addr is None \
            else store_addr
        self._lock = threading.Lock()
        self._lanes: dict[str, _Lane] = {}  # prefill_worker_id -> current lane
        self._next_generation: dict[str, int] = {}
        self._closed = False

    @property
    def store_host(self) -> str:
        return self._server.host if self._server is not None else self._store_host

    @property
    def store_port(self) -> int:
        return self._store_port

    def open_lane(self, prefill_worker_id: str, generation: int) -> None:
        """Start receiving from ``prefill_worker_id`` at ``generation`` (a generation the driver chose);
        a lane of an older generation is closed first. Idempotent."""
        with self._lock:
            if self._closed:
                raise KVTransferError("DecodePairs is closed")
            lane = self._lanes.get(prefill_worker_id)
            if lane is not None and not lane.dead and lane.generation >= generation:
                return
        if lane is not None:
            lane.die(f"superseded by generation {generation}")
        with self._lock:
            self._next_generation[prefill_worker_id] = generation + 1
            lane = self._lanes[prefill_worker_id] = _Lane(self, prefill_worker_id, generation)
            lane.thread.start()

    def generation_for(self, prefill_worker_id: str) -> int:
        """The pair generation to put in RemotePrefillRequest; starts connecting (rank 1) if needed.

        A connected pair whose prefill side has closed it (close note in the local store, one
        loopback round trip) is dropped first, so the answer is then generation + 1.
        """
        with self._lock:
            lane = self._lanes.get(prefill_worker_id)
            pair = lane.pair if lane is not None and not lane.dead else None
        if pair is not None and (why := pair.peer_closed()) is not None:
            lane.die(f"prefill worker {prefill_worker_id} closed pair {pair.name}: {why}")
        with self._lock:
            if self._closed:
                raise KVTransferError("DecodePairs is closed")
            lane = self._lanes.get(prefill_worker_id)
            if lane is not None and not lane.dead:
                return lane.generation
            generation = self._next_generation.get(prefill_worker_id, 0)
            self._next_generation[prefill_worker_id] = generation + 1
            lane = self._lanes[prefill_worker_id] = _Lane(self, prefill_worker_id, generation)
            lane.thread.start()
            return generation

    def submit(self, header: KVTransferHeader) -> None:
        """Queue ``header`` for its pair's receiver (FIFO per pair); stale generations fail at once."""
        with self._lock:
            lane = self._lanes.get(header.prefill_worker_id)
            if lane is not None and not lane.dead and lane.generation == header.pair_generation and not self._closed:
                lane.headers.append(header)
                lane.cond.notify()
                return
            current = "none" if lane is None or lane.dead else str(lane.generation)
        self._emit(TransferFailed(header.request_id, (
            f"request {header.request_id}: header names pair generation {header.pair_generation} with prefill "
            f"worker {header.prefill_worker_id}, but the live generation is {current} (pair reset or closed)"),
            header.prefill_worker_id))

    def reset(self, prefill_worker_id: str, reason: str, generation: int | None = None) -> None:
        """Drop the pair with ``prefill_worker_id`` (e.g. after a checksum mismatch), if it is still at
        ``generation`` (None: any); queued headers fail, the next request uses a new generation."""
        with self._lock:
            lane = self._lanes.get(prefill_worker_id)
        if lane is not None and generation in (None, lane.generation):
            lane.die(reason)

    def _receive(self, pair: KVPair, header: KVTransferHeader) -> ReceivedKV:
        """Receive one request's stream: meta, checked against ``header``, then each layer."""
        rid = header.request_id
        expected = wire.expected_meta(header, self.device)  # KVTransferError on an unknown dtype
        with pair.device_context():
            meta = torch.empty_like(expected)
            pair.recv(meta, self.timeout_s, f"request {rid}: start of KV stream")
            if not torch.equal(meta, expected):
                diff = wire.describe_meta_mismatch(expected, meta)
                raise KVTransferError(f"request {rid}: header and KV stream from prefill worker "
                                      f"{header.prefill_worker_id} disagree ({diff})")
            kv = self.staging.take((header.num_layers, header.kv_slots, header.num_blocks, header.block_size,
                                    header.num_kv_heads,
                                    wire.row_len(header.dtype, header.head_dim)),  # + 4 scale bytes when quantized
                                   wire.dtype_from_name(header.dtype), self.device)
            # Every layer's receives (one a message: wire.layer_runs) are posted at once; each layer is
            # checksummed as soon as it is in,
            # while the next ones are still arriving.
            what = [f"request {rid}: layer {i}/{header.num_layers}" for i in range(header.num_layers)]
            layers = [kv[i] for i in range(header.num_layers)] if not header.layer_num_blocks else \
                [wire.layer_prefix(kv[i], n) for i, n in enumerate(header.layer_num_blocks)]  # a window's: fewer
            works = [[pair.irecv(message, what[i]) for message in wire.layer_messages(layer)]
                     for i, layer in enumerate(layers)]
            checksum = KVChecksum()
            for i, layer_works in enumerate(works):  # each layer may take timeout_s after the one before
                for work in layer_works:
                    pair.wait(work, self.timeout_s, what[i])
                if self.device.type == "cuda":
                    torch.cuda.current_stream(self.device).synchronize()
                checksum.update(layers[i])
            return ReceivedKV(rid, kv, checksum.num_bytes, checksum.value)

    def release(self, kv: torch.Tensor) -> None:
        """Hand back a ``ReceivedKV.kv`` for reuse, once nothing reads it any more (copied or dropped);
        the next transfer may land in it. Anything else (a tensor not received here) is ignored."""
        self.staging.give(kv)

    def _emit(self, result: ReceivedKV | TransferFailed) -> None:
        if self._closed:
            return
        try:
            self._on_received(result)
        except Exception:
            logger.exception("on_received failed for request %s", result.request_id)

    def close(self) -> None:
        """Close every pair and the store; lanes inside a wait are left to time out (daemons)."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for lane in lanes:
            lane.die("DecodePairs closed", emit=False)
        for lane in lanes:
            lane.thread.join(_JOIN_S)
        if self._server is not None:
            self._server.close()
