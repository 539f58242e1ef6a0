"""Prefill side: pairs to decode workers, per-request layer-by-layer sends, completion.

Step loop usage (one ``OutgoingKV`` per request)::

    pair = pairs.get(decode_worker_id, generation)        # after pairs.request_pair(...)
    mailbox.put(KVTransferHeader(...))                     # header first, in stream order
    out = OutgoingKV(pair, request_id, num_layers)         # create in the same order as the headers
    out.start(kv_cache[0], block_ids)                      # optional: the meta goes out before the forward
    for each layer i (after the model wrote layer i's K/V):
        out.send_layer(i, kv_cache[i], block_ids)          # gather (or not: send_from_cache) + async send
    completer.submit(out)                                  # on_done(...) later, on a kvtransfer thread
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Callable

import torch

import pdserve.kvtransfer.wire as wire
from pdserve.common import faults
from pdserve.kvtransfer.checksum import ROW_BYTES, BlockGather, KVChecksum
from pdserve.kvtransfer.pair import KVPair, PendingSend
from pdserve.kvtransfer.staging import StagingPool
from pdserve.kvtransfer.wire import KVTransferError, layer_prefix

logger = logging.getLogger(__name__)

_JOIN_S = 0.5  # how long close() waits for each thread (seconds); threads are daemons


@dataclass
class _BlocksPlan:
    """How one list of block ids is gathered and sent, worked out once per request (KV cache groups give a
    request several lists: one per group and first block; every layer of a list reuses its plan)."""

    block_ids: list[int]  # the very list (kept alive, so its id() cannot be reused while planned)
    index: torch.Tensor  # [len(block_ids)] int64, on the cache's device
    gather: BlockGather | None  # the native one-pass gather and checksum (None: index_select, torch sums)
    runs: list[tuple[int, int, int]]  # the layer's messages (wire.layer_runs)
    by_runs: bool  # gathered, summed and sent run by run
    direct: list[int | None] | None  # per run, its first cache block where it is sent from the cache (direct_runs)
    direct_bytes: int  # the bytes of those runs, a layer


class OutgoingKV:
    """One request's KV on its way to the decode worker.

    Requests sharing a pair must be created in the order their
    ``KVTransferHeader``s were sent: that order is the stream order D expects.
    Layers must be sent in order 0 .. num_layers - 1. ``kv_dtype`` names the cache's KV dtype
    for the stream's meta (needed for a quantized cache, whose layers are uint8 packed rows).

    ``send_from_cache``: a run of a layer's message whose blocks lie next to each other in the cache
    goes on the wire from the cache itself, with no gather into staging (on a CPU cache, where the
    native gather is built). The caller must then leave those blocks unwritten and unfreed until
    ``wait`` returns (the prefill worker holds a request's blocks until its sends are reported, as
    vLLM's KV connectors delay the free). False: every layer is gathered into staging first, so the
    blocks may be reused as soon as the step that sent them ends.
    """

    def __init__(self, pair: KVPair, request_id: str, num_layers: int, kv_dtype: str | None = None,
                 layer_num_blocks: list[int] = (), send_from_cache: bool = False):
        if num_layers < 1:
            raise KVTransferError(f"request {request_id}: num_layers must be >= 1, got {num_layers}")
        self.pair = pair
        self.request_id = request_id
        self.num_layers = num_layers
        self.kv_dtype = kv_dtype  # the KV dtype name for the meta (None: the layers' torch dtype)
        # each layer's block count when they differ (KV cache groups: a window's layers send fewer); [] = all equal
        self.layer_num_blocks = list(layer_num_blocks)
        if self.layer_num_blocks and len(self.layer_num_blocks) != num_layers:
            raise KVTransferError(f"request {request_id}: {len(self.layer_num_blocks)} layer block counts for "
                                  f"{num_layers} layers")
        self._plans: dict[int, _BlocksPlan] = {}  # id(block_ids) -> its plan (_plan_for)
        self.send_from_cache = send_from_cache
        self.num_bytes = 0  # KV bytes handed to the pair so far
        self.num_bytes_from_cache = 0  # of those, sent from the cache itself (send_from_cache)
        self._next_layer = 0
        # [num_layers, kv_slots, num_blocks, block_size, H, row_len] from pair.staging: layer i is gathered into
        # _staging[i] and sent from there, so P may reuse its blocks once the request is done.
        self._staging: torch.Tensor | None = None
        self._checksum = KVChecksum()  # over each gathered layer, as it is gathered
        self._rows: tuple[torch.Tensor, ...] = ()  # _staging's layers
        self._faulty = False  # a test fault is set for this request (start): no run-by-run sends
        self._error: str | None = None
        self._send = PendingSend(on_fail=self._failed)  # its place in the pair's send order
        pair.register_send(self._send)

    def _failed(self, reason: str) -> None:
        self._error = self._error or reason

    def start(self, kv_layer: torch.Tensor, block_ids: list[int]) -> None:
        """Take the staging buffer and put the stream's meta on the wire now, before layer 0 exists.

        The decode side checks the meta and posts its layer receives while the forward computes
        layer 0, so the first layer flows as soon as it is sent. Optional (``send_layer(0)`` does it
        otherwise) and idempotent. ``kv_layer``: any layer of P's cache in the shape ``send_layer``
        takes (only its shape, dtype and device are read); ``block_ids``: the blocks the largest layer
        sends (every layer's count, without ``layer_num_blocks``); its gather is planned now. Misuse (a
        bad shape, a dtype the meta cannot name) raises KVTransferError.
        """
        if self._staging is not None or self._error is not None:
            return
        if kv_layer.dim() != 5 or kv_layer.shape[0] not in (1, 2):
            raise KVTransferError(f"request {self.request_id}: kv_layer must be [kv_slots (1 or 2), num_blocks, "
                                  f"block_size, H, D], got {list(kv_layer.shape)}")
        num_blocks = max(self.layer_num_blocks) if self.layer_num_blocks else len(block_ids)
        shape = (self.num_layers, kv_layer.shape[0], num_blocks, *kv_layer.shape[2:])
        staging = self.pair.staging.take(shape, kv_layer.dtype, kv_layer.device)
        meta = wire.make_meta(self.request_id, self.num_layers, staging[0], self.kv_dtype, self.layer_num_blocks)
        self._staging = staging
        self._rows = staging.unbind(0)  # each layer's staging row
        fault = faults.kv_send_fault(self.request_id)
        self._faulty = fault is not None
        if len(block_ids) <= num_blocks:
            self._plan_for(kv_layer, block_ids, layer_prefix(self._rows[0], len(block_ids)))
        if fault is None or fault["mode"] != "never":
            self.pair.enqueue_send(self._send, [meta], last=False)

    def _plan_for(self, kv_layer: torch.Tensor, block_ids: list[int], staged: torch.Tensor) -> _BlocksPlan:
        """The plan of ``block_ids`` (made on its first use: the layers of one KV cache group share one
        list) for gathering ``kv_layer``'s blocks into ``staged`` [kv_slots, len(block_ids), ...]."""
        plan = self._plans.get(id(block_ids))
        if plan is not None and plan.block_ids is block_ids:
            return plan
        index = torch.tensor(block_ids, dtype=torch.int64, device=kv_layer.device)
        gather = BlockGather.plan(kv_layer, index, staged)  # None: not the CPU, no kernel, another layout
        block_bytes = staged[0, 0].nbytes if staged.shape[1] else 0
        runs = wire.layer_runs(staged.shape[0], staged.shape[1], block_bytes, staged.device.type)
        by_runs = gather is not None and block_bytes % ROW_BYTES == 0 and not self._faulty \
            and (len(runs) > 1 or self.send_from_cache)
        direct = direct_runs(kv_layer, block_ids, runs) \
            if by_runs and self.send_from_cache and not self.pair.shared_memory else None
        direct_bytes = sum((end - first) * block_bytes for (_, first, end), d in zip(runs, direct or ())
                           if d is not None)
        plan = self._plans[id(block_ids)] = _BlocksPlan(block_ids, index, gather, runs, by_runs, direct, direct_bytes)
        return plan

    def send_layer(self, layer_idx: int, kv_layer: torch.Tensor, block_ids: list[int]) -> None:
        """Gather ``kv_layer[:, block_ids]`` and start sending it; returns without waiting.

        ``kv_layer``: this layer of P's paged cache, [kv_slots, num_blocks_total, block_size, num_kv_heads,
        head_dim] (any strides: a TP piece's head range is a view). ``block_ids``: this layer's own blocks
        (layers of different KV cache groups send different blocks, even where their counts agree): as
        many as the stream's block count, or with ``layer_num_blocks`` as many as the layer's count (they
        fill the front of its staging row). Pass the same list object for layers that share it: its gather
        is planned once (``_plan_for``). The blocks are gathered into this request's staging buffer (one
        contiguous [kv_slots, len(block_ids), block_size, num_kv_heads, head_dim] per layer), which goes on
        the wire as the layer's messages (``wire.layer_runs``). On a CPU cache the gather and its checksum
        are one native pass (``BlockGather``), run by run where blocks are whole checksum rows: each run
        is sent as soon as it is gathered. Otherwise the gathered layer is checksummed once its sends are
        issued, still in cache. A failed pair is not raised here (``wait`` reports it); misuse (layer
        order, shape change, a layer's block count) raises KVTransferError.
        """
        if layer_idx != self._next_layer:
            raise KVTransferError(
                f"request {self.request_id}: send_layer({layer_idx}) out of order, expected layer {self._next_layer}")
        if self._staging is None:
            self.start(kv_layer, block_ids)
        self._next_layer += 1
        if self._error is not None:
            return
        staged = self._rows[layer_idx]  # [kv_slots, num_blocks, block_size, H, D], contiguous
        want = self.layer_num_blocks[layer_idx] if self.layer_num_blocks else staged.shape[1]
        if len(block_ids) != want:
            raise KVTransferError(f"request {self.request_id}: layer {layer_idx} sends {len(block_ids)} blocks, "
                                  f"its count is {want}")
        if self.layer_num_blocks:  # this layer's own blocks, into the front of its staging row
            staged = layer_prefix(staged, len(block_ids))
        plan = self._plan_for(kv_layer, block_ids, staged)
        if plan.gather is not None:
            try:
                if plan.by_runs:  # each run leaves while it is still in this core's cache (wire.layer_runs)
                    direct = plan.direct
                    messages = [staged[slot, first:end] if direct is None or direct[i] is None
                                else kv_layer[slot, direct[i]:direct[i] + end - first]
                                for i, (slot, first, end) in enumerate(plan.runs)]
                    last = len(messages) - 1 if layer_idx == self.num_layers - 1 else -1
                    sums = plan.gather.in_runs(
                        kv_layer, staged, plan.runs,
                        lambda i: self.pair.enqueue_send(self._send, [messages[i]], last=i == last), direct)
                else:
                    sums = plan.gather(kv_layer, staged)
            except ValueError:  # not the planned layout: the checks below say what is wrong
                pass
            else:
                if plan.by_runs:
                    self.num_bytes += staged.nbytes
                    self.num_bytes_from_cache += plan.direct_bytes
                    self._checksum.add(sums, staged.nbytes)
                else:
                    self._issue(layer_idx, staged, sums)
                return
        if kv_layer.dim() != 5 or (kv_layer.shape[0], *kv_layer.shape[2:]) != (staged.shape[0], *staged.shape[2:]) \
                or kv_layer.dtype != staged.dtype:
            raise KVTransferError(f"request {self.request_id}: layer {layer_idx} is {list(kv_layer.shape)} "
                                  f"{kv_layer.dtype}, the stream's layers are {staged.shape[0]} x "
                                  f"{list(staged.shape[2:])} {staged.dtype} per block")
        torch.index_select(kv_layer, 1, plan.index, out=staged)
        self._issue(layer_idx, staged, None)

    def _issue(self, layer_idx: int, staged: torch.Tensor, sums: tuple[int, int] | None) -> None:
        """Queue the gathered layer ``staged`` on the pair; its checksum: ``sums`` (taken by the gather), or
        computed now, while the send is under way and ``staged`` is still in cache."""
        self.num_bytes += staged.nbytes
        tensors = wire.layer_messages(staged)
        if (fault := faults.kv_send_fault(self.request_id)) is None or self._inject(fault, layer_idx, tensors):
            self.pair.enqueue_send(self._send, tensors, last=layer_idx == self.num_layers - 1)
        if sums is not None:
            self._checksum.add(sums, staged.nbytes)
        else:
            self._checksum.update(staged)  # while the send is under way, and staged still in cache

    def _inject(self, fault: dict, layer_idx: int, tensors: list[torch.Tensor]) -> bool:
        """Test-only (``pdserve.common.faults``): misbehave as asked; False if nothing is to be sent."""
        mode = fault["mode"]
        if mode == "never":
            return False
        if mode == "delay" and layer_idx == 0:
            time.sleep(float(fault.get("delay_s", 5.0)))
        elif mode == "corrupt":  # the checksum stays that of the true layer (gathered in self._staging)
            wrong = tensors[-1].clone()
            wrong.view(-1)[0] += 1  # an int: a quantized cache's layers are uint8
            tensors[-1] = wrong
        elif mode == "truncate":  # half a layer: the receiver's buffer keeps stale bytes past the cut
            flat = tensors[-1].reshape(-1)
            tensors[-1] = flat[:flat.numel() // 2].clone()
        return True

    def abort(self, reason: str) -> None:
        """Give up on this request. If some layers were never sent the stream is broken, so the pair closes."""
        self._send.fail(f"request {self.request_id} aborted: {reason}")
        if self._next_layer < self.num_layers:
            self.pair.close(f"request {self.request_id} aborted after {self._next_layer}/{self.num_layers} "
                            f"layers: {reason}")

    def wait(self, timeout_s: float) -> tuple[int, int]:
        """Wait up to ``timeout_s`` seconds for every layer to be sent and delivered.

        Returns ``(num_bytes, checksum)``: the KV bytes sent and ``KVChecksum`` over the layers sent,
        computed from the very buffers sent as they were gathered. Raises KVTransferError (closing the
        pair) on timeout or a broken pair. On success the staging buffer goes back to the pair's pool.
        """
        deadline = time.monotonic() + timeout_s
        rid = self.request_id
        if not self._send.issued.wait(timeout_s):
            reason = (f"request {rid}: only {self._next_layer}/{self.num_layers} layers reached send_layer "
                      f"(or an earlier request on pair {self.pair.name} stalled) within {timeout_s:.1f}s")
            self.pair.close(reason)
            raise KVTransferError(reason)
        if self._error is not None:
            raise KVTransferError(f"request {rid}: KV send to {self.pair.peer_desc} failed: {self._error}")
        with self.pair.device_context():
            for i, work in enumerate(self._send.works):
                what = f"request {rid}: send of {'meta' if i == 0 else f'layer {i - 1}/{self.num_layers}'}"
                self.pair.wait(work, deadline - time.monotonic(), what)
            value = self._checksum.value
        self._send.works.clear()
        staging, self._staging = self._staging, None
        self._rows = ()
        self._plans.clear()
        if staging is not None:  # every send completed: nothing reads it any more
            self.pair.staging.give(staging)
        return self.num_bytes, value


def direct_runs(kv_layer: torch.Tensor, block_ids: list[int],
                runs: list[tuple[int, int, int]]) -> list[int | None] | None:
    """Per run of ``runs`` (``wire.layer_runs``), its first cache block where its blocks are next to each other
    in ``kv_layer`` [kv_slots, num_blocks_total, ...] (ascending ids, each slot's blocks one contiguous run
    of memory: the whole cache layer, not a TP piece's heads), else None; None if no run is."""
    if not kv_layer[0].is_contiguous():
        return None
    direct = [block_ids[first] if all(b + 1 == c for b, c in zip(block_ids[first:end - 1], block_ids[first + 1:end]))
              else None for _, first, end in runs]
    return direct if any(d is not None for d in direct) else None


class SendCompleter:
    """Waits for OutgoingKVs off the step loop and reports each once.

    ``on_done(outgoing, num_bytes, checksum, error)`` runs on a completer thread;
    ``error`` is None on success. One thread per pair (started on demand, gone
    after ``idle_s`` without work), so a stalled decode worker delays no one else.
    A failure closes the pair.
    """

    def __init__(self, timeout_s: float, on_done: Callable[[OutgoingKV, int, int, str | None], None],
                 idle_s: float = 5.0):
        self.timeout_s = timeout_s
        self.idle_s = idle_s
        self._on_done = on_done
        self._lock = threading.Lock()
        self._lanes: dict[KVPair, tuple[queue.Queue, threading.Thread]] = {}
        self._closed = False

    def submit(self, outgoing: OutgoingKV) -> None:
        with self._lock:
            if self._closed:
                raise KVTransferError("SendCompleter is closed")
            lane = self._lanes.get(outgoing.pair)
            if lane is None:
                q: queue.Queue = queue.Queue()
                thread = threading.Thread(target=self._run, args=(outgoing.pair, q), daemon=True,
                                          name=f"kv-send-{outgoing.pair.name}")
                lane = self._lanes[outgoing.pair] = (q, thread)
                thread.start()
            lane[0].put(outgoing)

    def _run(self, pair: KVPair, q: queue.Queue) -> None:
        while True:
            try:
                outgoing = q.get(timeout=self.idle_s)
            except queue.Empty:
                with self._lock:
                    if q.empty():
                        self._lanes.pop(pair, None)
                        return
                continue
            if outgoing is None:
                return
            try:
                num_bytes, checksum = outgoing.wait(self.timeout_s)
                error = None
            except Exception as exc:  # KVTransferError, or a torch error while waiting
                num_bytes, checksum, error = 0, 0, str(exc) if isinstance(exc, KVTransferError) else repr(exc)
                outgoing.pair.close(error)
            try:
                self._on_done(outgoing, num_bytes, checksum, error)
            except Exception:
                logger.exception("on_done failed for request %s", outgoing.request_id)

    def close(self) -> None:
        """Stop the threads; a thread inside a wait is left to finish it (daemon), never joined long."""
        with self._lock:
            self._closed = True
            lanes = list(self._lanes.values())
            self._lanes.clear()
        for q, _ in lanes:
            q.put(None)
        for _, thread in lanes:
            thread.join(_JOIN_S)


class PrefillPairs:
    """The prefill worker's pairs, keyed by (decode_worker_id, generation); thread-safe.

    ``request_pair`` starts connecting (rank 0) in a background thread; the step loop polls
    ``get``/``failure``. A failed generation is never retried: D moves to generation + 1.
    Requesting generation g closes this worker's pairs with the same D at generations < g;
    a request naming an older generation than one already requested fails at once.
    """

    def __init__(self, prefill_worker_id: str, device: torch.device | str, timeout_s: float):
        self.prefill_worker_id = prefill_worker_id
        self.device = torch.device(device)
        self.timeout_s = timeout_s
        self.staging = StagingPool()  # every pair's gather buffers
        self._lock = threading.Lock()
        self._pairs: dict[tuple[str, int], KVPair | None] = {}  # None while connecting or failed
        self._errors: dict[tuple[str, int], str] = {}
        self._newest: dict[str, int] = {}  # decode_worker_id -> newest generation requested
        self._threads: list[threading.Thread] = []
        self._closed = False

    def request_pair(self, decode_worker_id: str, store_host: str, store_port: int, generation: int) -> None:
        key = (decode_worker_id, generation)
        with self._lock:
            if self._closed or key in self._pairs or key in self._errors:
                return
            newest = self._newest.get(decode_worker_id, generation)
            if generation < newest:
                self._errors[key] = (f"pair {self.prefill_worker_id}->{decode_worker_id} g{generation}: stale "
                                     f"generation, g{newest} was already requested")
                return
            self._newest[decode_worker_id] = generation
            old = [k for k in self._pairs if k[0] == decode_worker_id and k[1] < generation]
            stale = [self._pairs.pop(k) for k in old]
            for k in [k for k in self._errors if k[0] == decode_worker_id and k[1] < generation]:
                self._errors.pop(k)
            self._pairs[key] = None
            self._threads = [t for t in self._threads if t.is_alive()]
            thread = threading.Thread(target=self._connect, args=(key, store_host, store_port), daemon=True,
                                      name=f"kv-connect-{decode_worker_id}-g{generation}")
            self._threads.append(thread)
            thread.start()
        for pair in stale:
            if pair is not None:
                pair.close(f"superseded by generation {generation}")

    def _connect(self, key: tuple[str, int], store_host: str, store_port: int) -> None:
        decode_worker_id, generation = key
        try:
            pair = KVPair.connect(store=None, store_host=store_host, store_port=store_port,
                                  prefill_worker_id=self.prefill_worker_id, decode_worker_id=decode_worker_id,
                                  generation=generation, rank=0, device=self.device, timeout_s=self.timeout_s,
                                  staging=self.staging)
        except Exception as exc:
            with self._lock:
                if key in self._pairs:
                    self._errors[key] = str(exc) if isinstance(exc, KVTransferError) else repr(exc)
            return
        with self._lock:
            keep = not self._closed and key in self._pairs
            if keep:
                self._pairs[key] = pair
        if not keep:
            pair.close("PrefillPairs closed or pair superseded while connecting")

    def get(self, decode_worker_id: str, generation: int) -> KVPair | None:
        """The ready, open pair, or None (still connecting, failed, closed or never requested)."""
        with self._lock:
            pair = self._pairs.get((decode_worker_id, generation))
        return pair if pair is not None and pair.is_open else None

    def failure(self, decode_worker_id: str, generation: int) -> str | None:
        """Why this pair is unusable (connect failed or pair closed), or None if ready/connecting."""
        key = (decode_worker_id, generation)
        with self._lock:
            if key in self._errors:
                return self._errors[key]
            newest = self._newest.get(decode_worker_id, generation)
            if key not in self._pairs and generation < newest:
                return f"pair {self.prefill_worker_id}->{decode_worker_id} g{generation}: superseded by g{newest}"
            pair = self._pairs.get(key)
        return pair.error if pair is not None and not pair.is_open else None

    def close_pair(self, decode_worker_id: str, generation: int, reason: str = "closed by prefill worker") -> None:
        with self._lock:
            pair = self._pairs.get((decode_worker_id, generation))
        if pair is not None:
            pair.close(reason)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pairs = [p for p in self._pairs.values() if p is not None]
            threads = list(self._threads)
        for pair in pairs:
            pair.close("PrefillPairs closed")
        for thread in threads:
            thread.join(_JOIN_S)
        for pair in pairs:
            pair.join_note(_JOIN_S)
