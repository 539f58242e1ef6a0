"""One rank's share of its worker's KV transfers (every rank has one, the driver too).

The drivers decide; the agents move bytes. A prefill driver or decode driver
puts the transfer work of a step into ``ExecuteModel.kv`` (``KVStepOps``), which
every rank of the worker receives, and each rank's agent does the part that
names it (``sharding.transfer_pieces``: which prefill rank sends which layers
and KV heads to which decode rank)::

    prefill rank i                                       decode rank j
      connects: request the pairs (i, j) it sends to  ◀──▶  lanes: open the pairs (i, j) it receives from
      sends:    one OutgoingKV per piece; each layer's    headers: queue the piece's header on lane (i, j)
                slice leaves from on_layer_done            (receiver thread: staging tensor, checksum)
      SENT report (bytes, checksum) ──▶ prefill driver     RECEIVED report ──▶ decode driver
                                                          installs: staging -> this rank's KV cache blocks

Reports from non-driver ranks reach their driver's mailbox over ZMQ
(``RankReport``); the driver's own agent reports in-process. Pairs are named by
endpoint, "worker_id#rank", so each (prefill rank, decode rank) pair is its own
two-rank group with its own ordered stream. A single-rank worker is the case
with one rank and one piece.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import torch

from pdserve.common.protocol import (KVLayout, KVSendPlan, KVStepOps, KVTransferHeader, RankAttach, RankReport,
                                     RankReportKind, WorkerRole)
from pdserve.common.kv_cache_groups import KVCacheGroups
from pdserve.common.sharding import KVLayoutSpec, KVPiece, endpoint, rank_slice, transfer_pieces
from pdserve.kvtransfer.receiver import DecodePairs, ReceivedKV, TransferFailed
from pdserve.kvtransfer.sender import OutgoingKV, PrefillPairs, SendCompleter
from pdserve.kvtransfer.wire import KVTransferError, layer_prefix

logger = logging.getLogger(__name__)

_WATCH_S = 0.01  # how often connecting pairs are checked (seconds)
_MAX_DROPPED = 4096


def layout_spec(layout: KVLayout | None, num_layers: int, num_kv_heads: int) -> KVLayoutSpec:
    """A message's layout (None: one rank) as a ``KVLayoutSpec``."""
    if layout is None:
        return KVLayoutSpec(1, 1, num_layers, num_kv_heads)
    return KVLayoutSpec(layout.tensor_parallel_size, layout.pipeline_parallel_size, layout.num_layers,
                        layout.num_kv_heads)


def check_kv_dtype(prefill_worker_id: str, prefill_layout: KVLayout | None, kv_cache_dtype: str,
                   quantization: str | None = None) -> None:
    """Refuse to pair with a prefill worker whose KV cache dtype differs from ours (``kv_cache_dtype``),
    or whose weights are quantized otherwise (``quantization``: ours, "none" for float weights).

    KV moves between workers as the cache holds it (quantized rows included), never converted, so
    both caches must hold the same dtype; and KV built by an int8 model is not the KV a float model
    would build. A layout that does not say (None) is not refused here; the transfer header's
    dtype is still checked per request.

    Raises:
        ValueError: the dtypes or the quantizations differ (the message names both).
    """
    theirs = prefill_layout.kv_cache_dtype if prefill_layout is not None else None
    if theirs is not None and theirs != kv_cache_dtype:
        raise ValueError(f"prefill worker {prefill_worker_id} holds a {theirs} KV cache and this decode worker a "
                         f"{kv_cache_dtype} one: KV is shipped as the cache holds it, so the pair is refused (start "
                         f"both with the same --kv-cache-dtype)")
    theirs = prefill_layout.quantization if prefill_layout is not None else None
    if theirs is not None and quantization is not None and theirs != quantization:
        raise ValueError(f"prefill worker {prefill_worker_id} runs {theirs} weights and this decode worker "
                         f"{quantization} ones: their KV differs, so the pair is refused (start both with the same "
                         f"--quantization)")


def pieces_for(prefill: KVLayoutSpec, decode: KVLayoutSpec) -> list[KVPiece]:
    """``transfer_pieces``, cached (the same few layouts meet again and again)."""
    key = (prefill, decode)
    pieces = _PIECES.get(key)
    if pieces is None:
        pieces = _PIECES[key] = transfer_pieces(prefill, decode)
    return pieces


_PIECES: dict[tuple[KVLayoutSpec, KVLayoutSpec], list[KVPiece]] = {}


@dataclass
class _Outgoing:
    send: OutgoingKV
    piece: KVPiece
    layer_block_ids: list[list[int]]  # per layer of the piece, the blocks it sends (one shared list: all alike)


class KVRankAgent:
    """This rank's pairs, sends (prefill; a decode worker too, for a peer that pulls a prefix from it)
    and receives and installs (decode).

    Args:
        attach: whom the rank works for (worker id, role, driver mailbox, transfer host, store).
        rank: this rank; layout: the worker's ``KVLayoutSpec``.
        kv_cache: this rank's cache [num_local_layers, kv_slots, num_blocks, block_size, local_kv_heads,
            head_dim] (kv_slots 2: K and V; 1: a latent, which every piece ships and installs the same way).
        report: where ``RankReport``s go (the driver's mailbox, or in-process on the driver).
        timeout_s: every pair wait.
        kv_cache_dtype: the cache's KV dtype name (a quantized cache is uint8: its name says which
            format), for the streams' meta; None takes the cache tensor's torch dtype.
        kv_groups: which block table each of this rank's layers reads and its position in ``kv_cache``
            (``pdserve.common.kv_cache_groups``); None: one group, layer i at position i.
    """

    def __init__(self, attach: RankAttach, rank: int, layout: KVLayoutSpec, kv_cache: torch.Tensor,
                 report: Callable[[RankReport], None], timeout_s: float, kv_cache_dtype: str | None = None,
                 kv_groups: KVCacheGroups | None = None):
        self.attach = attach
        self.worker_id = attach.worker_id
        self.role = attach.role
        self.rank = rank
        self.layout = layout
        self.slice = rank_slice(layout, rank)
        self.kv_cache = kv_cache
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_groups = kv_groups if kv_groups is not None and not kv_groups.is_single else None
        self.device = kv_cache.device
        self.report = report
        self.endpoint = endpoint(self.worker_id, rank)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # peer worker id -> the endpoints this rank sends to / receives from
        self._send_peers: dict[str, set[str]] = {}
        self._recv_peers: dict[str, set[str]] = {}
        # Every agent can send: a prefill worker's prompts, and a decode worker's cached prefixes to a
        # peer decode worker that pulls them (it serves that peer as a prefill worker would).
        self.prefill_pairs = PrefillPairs(self.endpoint, self.device, timeout_s)
        self.completer = SendCompleter(timeout_s, on_done=self._sent)
        self._outgoing: list[_Outgoing] = []
        self._watching: dict[tuple[str, int], None] = {}  # (decode endpoint, generation)
        self._watch_wake = threading.Event()
        self._watcher = threading.Thread(target=self._watch_pairs, daemon=True, name="kv-pair-watch")
        self._watcher.start()
        if self.role != WorkerRole.PREFILL:
            store = None if rank == 0 else (attach.store_host, attach.store_port)
            self.decode_pairs = DecodePairs(self.endpoint, attach.host, self.device, timeout_s,
                                            on_received=self.received, store_addr=store)
            self._headers: dict[tuple[str, str], KVTransferHeader] = {}  # (request_id, source endpoint)
            self._staged: dict[str, list[tuple[KVTransferHeader, torch.Tensor]]] = {}
            self._dropped: dict[str, None] = {}

    @property
    def sending(self) -> bool:
        """Whether this step has pieces to send from ``on_layer_done``."""
        return bool(self._outgoing)

    # ---- every step -------------------------------------------------------------------------

    def apply(self, ops: KVStepOps, group_tables: list[list[list[int]]]) -> None:
        """Do this rank's part of a step's KV work (before the forward). ``group_tables``: per KV cache
        group, the step's block tables [num_seqs][width] (``ExecuteModel``'s, group 0 first)."""
        for reset in ops.resets:
            self._reset(reset.peer_worker_id, reset.generation, reset.reason, reset.sending)
        for c in ops.connects:
            self._connect(c.decode_worker_id, c.generation, c.store_host, c.store_port, c.decode_layout)
        for plan in ops.sends:
            self._start_sends(plan, [tables[plan.seq_index] for tables in group_tables])
        if self.role != WorkerRole.PREFILL:
            for lane in ops.lanes:
                self._open_lanes(lane.prefill_worker_id, lane.generation, lane.prefill_layout)
            for header in ops.headers:
                if header.decode_rank == self.rank:
                    self.submit(header)
            for request_id in ops.drops:
                self.drop(request_id)
            for install in ops.installs:
                self.install(install.request_id, [install.block_ids, *install.group_block_ids])

    # ---- prefill side ----------------------------------------------------------------------------

    def _my_pieces(self, prefill: KVLayoutSpec, decode: KVLayoutSpec, as_prefill: bool) -> list[KVPiece]:
        return [p for p in pieces_for(prefill, decode)
                if (p.prefill_rank if as_prefill else p.decode_rank) == self.rank]

    def _decode_spec(self, layout: KVLayout | None) -> KVLayoutSpec:
        return layout_spec(layout, self.layout.num_layers, self.layout.num_kv_heads)

    def _connect(self, decode_worker_id: str, generation: int, host: str, port: int, layout: KVLayout) -> None:
        for piece in self._my_pieces(self.layout, self._decode_spec(layout), as_prefill=True):
            peer = endpoint(decode_worker_id, piece.decode_rank)
            self.prefill_pairs.request_pair(peer, host, port, generation)
            with self._lock:
                self._watching[(peer, generation)] = None
                self._send_peers.setdefault(decode_worker_id, set()).add(peer)
            self._watch_wake.set()

    def _watch_pairs(self) -> None:
        """Report each requested pair once it is connected (or failed); sleeps while none is pending."""
        while not self._stop.is_set():
            with self._lock:
                keys = list(self._watching)
            if not keys:
                self._watch_wake.wait(1.0)
                self._watch_wake.clear()
                continue
            self._stop.wait(_WATCH_S)
            for peer, generation in keys:
                ready = self.prefill_pairs.get(peer, generation) is not None
                failure = None if ready else self.prefill_pairs.failure(peer, generation)
                if not ready and failure is None:
                    continue
                with self._lock:
                    self._watching.pop((peer, generation), None)
                self.report(RankReport(rank=self.rank, kind=RankReportKind.PAIR_READY if ready
                                       else RankReportKind.PAIR_FAILED, peer=peer, generation=generation,
                                       error=failure))

    def pair_ready(self, decode_worker_id: str, generation: int, layout: KVLayout | None) -> str | bool:
        """Driver's own check: True when all its pairs with that decode worker are up, an error text
        if one failed, False while connecting."""
        for piece in self._my_pieces(self.layout, self._decode_spec(layout), as_prefill=True):
            peer = endpoint(decode_worker_id, piece.decode_rank)
            if self.prefill_pairs.get(peer, generation) is None:
                return self.prefill_pairs.failure(peer, generation) or False
        return True

    def _layer_blocks(self, plan: KVSendPlan, piece: KVPiece, tables: list[list[int]]) -> list[list[int]]:
        """Per layer of ``piece``, the blocks it sends: its group's table (``tables``, one per group, of the
        plan's sequence) from the layer's first block (``layer_first_blocks``) to the plan's end."""
        end = plan.first_block + plan.num_blocks
        if self.kv_groups is None and plan.layer_first_blocks is None:
            return [tables[0][plan.first_block:end]] * piece.slice.num_layers
        firsts = plan.layer_first_blocks or [plan.first_block] * self.layout.num_layers
        groups = self.kv_groups.layer_groups if self.kv_groups is not None else None
        lists: dict[tuple[int, int], list[int]] = {}  # layers of one group and first block share one list
        out = []
        for layer in range(piece.slice.layer_start, piece.slice.layer_end):
            group = groups[layer - self.slice.layer_start] if groups is not None else 0
            key = (group, firsts[layer])
            if key not in lists:
                lists[key] = tables[group][firsts[layer]:end]
            out.append(lists[key])
        return out

    def _start_sends(self, plan: KVSendPlan, tables: list[list[int]]) -> None:
        request_id, decode_worker_id, generation = plan.request_id, plan.decode_worker_id, plan.generation
        for piece in self._my_pieces(self.layout, self._decode_spec(plan.decode_layout), as_prefill=True):
            peer = endpoint(decode_worker_id, piece.decode_rank)
            pair = self.prefill_pairs.get(peer, generation)
            if pair is None:
                self.report(RankReport(rank=self.rank, kind=RankReportKind.SENT, peer=peer, generation=generation,
                                       request_id=request_id, error=f"no KV pair {self.endpoint}->{peer} "
                                                                    f"g{generation}"))
                continue
            layer_blocks = self._layer_blocks(plan, piece, tables)
            counts = [len(ids) for ids in layer_blocks]
            widest = max(layer_blocks, key=len)
            # the prefill worker keeps the request's blocks until this rank reports its sends (SENT):
            # runs of adjacent blocks go on the wire from the cache, not gathered first
            send = OutgoingKV(pair, request_id, piece.slice.num_layers, self.kv_cache_dtype,
                              layer_num_blocks=counts if min(counts) != max(counts) else [], send_from_cache=True)
            try:  # the meta goes out now: the decode rank checks it and posts its receives during the forward
                send.start(self._piece_layer(piece, piece.slice.layer_start - self.slice.layer_start), widest)
            except KVTransferError as exc:  # a meta that cannot be made (a dtype the wire cannot name)
                send.abort(str(exc))
                self.report(RankReport(rank=self.rank, kind=RankReportKind.SENT, peer=peer, generation=generation,
                                       request_id=request_id, error=str(exc)))
                continue
            self._outgoing.append(_Outgoing(send, piece, layer_blocks))

    def _piece_layer(self, piece: KVPiece, local_layer: int) -> torch.Tensor:
        """``piece``'s KV heads of this rank's layer ``local_layer``: a view, [kv_slots, num_blocks, block_size,
        piece heads, head_dim (+ 4 quantized)]."""
        s = piece.slice
        position = self.kv_groups.layer_slots[local_layer] if self.kv_groups is not None else local_layer
        return self.kv_cache[position][:, :, :, s.head_start - self.slice.head_start:s.head_end - self.slice.head_start]

    def on_layer_done(self, local_layer: int) -> None:
        """Send this layer's part of every piece in flight (called by the model after each layer)."""
        if not self._outgoing:
            return
        layer = self.slice.layer_start + local_layer
        for out in self._outgoing:
            s = out.piece.slice
            if s.layer_start <= layer < s.layer_end:
                j = layer - s.layer_start
                out.send.send_layer(j, self._piece_layer(out.piece, local_layer), out.layer_block_ids[j])

    def after_forward(self) -> None:
        """Hand this step's sends to the completer (they finish off the step loop)."""
        for out in self._outgoing:
            self.completer.submit(out.send)
        self._outgoing = []

    def abort_sends(self, reason: str) -> None:
        """The forward failed: the sends of this step will never complete."""
        for out in self._outgoing:
            out.send.abort(reason)
        self._outgoing = []

    def _sent(self, send: OutgoingKV, num_bytes: int, checksum: int, error: str | None) -> None:
        self.report(RankReport(rank=self.rank, kind=RankReportKind.SENT, peer=send.pair.decode_worker_id,
                               generation=send.pair.generation, request_id=send.request_id, num_bytes=num_bytes,
                               checksum=checksum, error=error,
                               num_bytes_from_cache=send.num_bytes_from_cache if error is None else 0))

    # ---- decode side -----------------------------------------------------------------------------

    def _open_lanes(self, prefill_worker_id: str, generation: int, layout: KVLayout | None) -> None:
        prefill = layout_spec(layout, self.layout.num_layers, self.layout.num_kv_heads)
        for piece in self._my_pieces(prefill, self.layout, as_prefill=False):
            peer = endpoint(prefill_worker_id, piece.prefill_rank)
            self.decode_pairs.open_lane(peer, generation)
            with self._lock:
                self._recv_peers.setdefault(prefill_worker_id, set()).add(peer)

    def submit(self, header: KVTransferHeader) -> None:
        """Queue one piece's header on its lane (the lanes are keyed by the sending endpoint)."""
        source = endpoint(header.prefill_worker_id, header.prefill_rank)
        with self._lock:
            self._headers[(header.request_id, source)] = header
        self.decode_pairs.submit(msgspec.structs.replace(header, prefill_worker_id=source))

    def received(self, result: ReceivedKV | TransferFailed) -> None:
        """A lane finished a piece (any thread): stage it and report to the driver."""
        with self._lock:
            header = self._headers.pop((result.request_id, result.source), None)
            dropped = result.request_id in self._dropped
            staged = isinstance(result, ReceivedKV) and header is not None and not dropped
            if staged:
                self._staged.setdefault(result.request_id, []).append((header, result.kv))
        if isinstance(result, ReceivedKV) and not staged:
            self.decode_pairs.release(result.kv)
        peer, generation = result.source, header.pair_generation if header is not None else -1
        if isinstance(result, ReceivedKV) and header is None:  # never staged: must not count as arrived
            result = TransferFailed(result.request_id, f"KV piece from {peer} arrived without its header", peer)
        if isinstance(result, ReceivedKV):
            self.report(RankReport(rank=self.rank, kind=RankReportKind.RECEIVED, peer=peer, generation=generation,
                                   request_id=result.request_id, num_bytes=result.num_bytes, checksum=result.checksum))
        else:
            self.report(RankReport(rank=self.rank, kind=RankReportKind.RECEIVED, peer=peer, generation=generation,
                                   request_id=result.request_id, error=result.reason))

    def install(self, request_id: str, group_block_ids: list[list[int]]) -> None:
        """Copy every staged piece of ``request_id`` into this rank's cache: each layer into its KV cache
        group's blocks, ``group_block_ids[g]`` (one list: one group)."""
        with self._lock:
            staged = self._staged.pop(request_id, [])
        indices = [torch.tensor(ids, dtype=torch.int64, device=self.device) for ids in group_block_ids]
        for header, kv in staged:  # kv: [piece layers, kv_slots, len(block_ids), block_size, piece heads, head_dim]
            l0 = header.first_layer - self.slice.layer_start
            h0 = header.first_kv_head - self.slice.head_start
            heads = slice(h0, h0 + header.num_kv_heads)
            if self.kv_groups is None and not header.layer_num_blocks:
                self.kv_cache[l0:l0 + header.num_layers, :, indices[0], :, heads] = kv.to(self.device)
            else:  # each layer at its cache position, in its group's blocks (a window's layer: fewer of them)
                for j in range(header.num_layers):
                    local = l0 + j
                    group = self.kv_groups.layer_groups[local] if self.kv_groups is not None else 0
                    position = self.kv_groups.layer_slots[local] if self.kv_groups is not None else local
                    layer = layer_prefix(kv[j], len(group_block_ids[group]))
                    self.kv_cache[position, :, indices[group], :, heads] = layer.to(self.device)
            self.decode_pairs.release(kv)  # copied (CPU: synchronously; CUDA staging is not pooled)

    def drop(self, request_id: str) -> None:
        """Forget ``request_id``'s pieces, including ones still on their way."""
        with self._lock:
            staged = self._staged.pop(request_id, [])
            self._dropped[request_id] = None
            if len(self._dropped) > _MAX_DROPPED:
                self._dropped.pop(next(iter(self._dropped)))
        for _, kv in staged:
            self.decode_pairs.release(kv)

    # ---- both ------------------------------------------------------------------------------------

    def _reset(self, peer_worker_id: str, generation: int, reason: str, sending: bool | None = None) -> None:
        if sending is None:
            sending = self.role == WorkerRole.PREFILL
        with self._lock:
            peers = list((self._send_peers if sending else self._recv_peers).get(peer_worker_id, ()))
        for peer in peers:
            if sending:
                self.prefill_pairs.close_pair(peer, generation, reason)
            else:
                self.decode_pairs.reset(peer, reason, generation=generation)

    def close(self) -> None:
        self._stop.set()
        self._watch_wake.set()
        self.completer.close()
        self.prefill_pairs.close()
        if self.role != WorkerRole.PREFILL:
            self.decode_pairs.close()
