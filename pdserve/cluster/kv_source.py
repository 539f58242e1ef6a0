"""Serving remote prefills: compute a prompt's uncached rest and send its KV to the decode worker that asked.

A prefill worker is one of these and nothing else. A decode worker is one too, for its peers: when
the router sends a request to a decode worker that lacks a prefix another decode worker holds, it
names that peer as the request's prefill worker, and the peer serves it as a prefill worker would,
its prefix-cache hit computed by nobody and sent over the same transfer path (a *pull*: Mooncake
and LMCache move cached KV between instances instead of recomputing it; here the holder sends it
with the first token). For each ``RemotePrefillRequest`` (the driver, rank 0, runs this; every rank's
``KVRankAgent`` moves its own bytes):

1. Make sure every pair (sender rank i -> decode rank j) this transfer needs is connected at the
   request's pair generation (``KVConnect`` to the ranks; each rank reports ``PAIR_READY``); the
   request waits in ``pending_pair``.
2. The scheduler batches prompts under the token budget (long prompts in chunks). In the step that
   computes a prompt's last chunk we send one ``KVTransferHeader`` per piece
   (``sharding.transfer_pieces``: the layers and KV heads sender rank i sends to decode rank j) and
   the step carries ``KVSendPlan``s: from the model's per-layer hook each rank sends its pieces of each
   layer as soon as that layer has written them, so sending layer i overlaps computing layer i+1
   (DistServe / Mooncake style layer-wise transfer).
3. The first token is sampled here. The sends read the request's blocks (runs of adjacent blocks leave
   from the cache itself, the rest from gathered copies), so the blocks stay the request's until every
   rank has reported its pieces delivered (``SENT``: bytes, checksum; ``Request.delay_free_blocks``, as
   vLLM's KV connectors delay the free). With all pieces in, the blocks are freed and we tell the
   decode worker ``RemotePrefillDone`` with the first token and the per-piece sums, or the error.

Each ``RemotePrefillRequest`` names the router that took the request (``router_addr``): when that
router dies, its requests are dropped here too (``abandon_router``), as their decode workers drop them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pdserve.common import faults
from pdserve.common.protocol import (ConnectKVPair, KVConnect, KVLayout, KVPieceSum, KVReset, KVSendPlan, KVStepOps,
                                     KVTransferHeader, RankReport, RankReportKind, RemotePrefillDone,
                                     RemotePrefillRequest, RequestTiming, TokenLogprob)
from pdserve.common.sharding import KVPiece, endpoint
from pdserve.common.validation import prefill_sampling_params
from pdserve.engine.scheduling.request import Request
from pdserve.kvtransfer.agent import layout_spec, pieces_for
from pdserve.kvtransfer.checksum import combine_checksums
from pdserve.kvtransfer.wire import dtype_name

logger = logging.getLogger(__name__)


def _worker_of(peer: str) -> str:
    """"decode-0#1" -> "decode-0"."""
    return peer.rpartition("#")[0]


@dataclass
class _Pairs:
    """The pairs of one (decode worker, generation): which (rank, peer endpoint) must connect, and how it goes."""

    needed: set[tuple[int, str]]
    ready: set[tuple[int, str]] = field(default_factory=set)
    error: str | None = None

    @property
    def is_ready(self) -> bool:
        return self.error is None and self.ready >= self.needed


@dataclass
class _Transfer:
    """A request whose KV is on its way: the pieces still to be reported by the ranks."""

    origin: RemotePrefillRequest
    pieces: list[KVPiece]
    started: float
    first_token: int | None = None
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # when the request asked
    sums: dict[tuple[int, int], KVPieceSum] = field(default_factory=dict)
    error: str | None = None
    num_bytes_from_cache: int = 0  # of the pieces reported so far, bytes sent straight from the cache


def _first_sent_block(origin: RemotePrefillRequest, block_size: int) -> int:
    """The first logical block of ``origin``'s prompt that goes to the decode worker (its earliest layer's)."""
    return origin.num_cached_tokens // block_size if origin.first_block is None else origin.first_block


def _layer_first_blocks(origin: RemotePrefillRequest, block_size: int, num_layers: int) -> list[int]:
    """Per global layer, the first logical block of ``origin``'s prompt that layer sends (a decode worker's
    sliding-window layers want only their window's)."""
    return origin.layer_first_blocks or [_first_sent_block(origin, block_size)] * num_layers


class KVSource:
    """The remote prefills one worker serves (its driver; the worker's step loop calls in).

    Args:
        worker: the ``WorkerBase`` it serves for: its engine (``core``, ``runner``), ``mailbox``, ``stats``,
            ``worker_id``, ``kv_layout_spec`` and ``router_of``.
    """

    def __init__(self, worker):
        self.worker = worker
        self.core = worker.core
        self.runner = worker.runner
        self.pending_pair: dict[str, RemotePrefillRequest] = {}  # waiting for its pairs to connect
        self.pairs: dict[tuple[str, int], _Pairs] = {}  # (decode_worker_id, generation)
        self.origin: dict[str, RemotePrefillRequest] = {}  # admitted, by request_id
        self.transfers: dict[str, _Transfer] = {}  # KV in flight, by request_id
        self.timings: dict[str, RequestTiming] = {}  # stamps sent with RemotePrefillDone, by request_id

    # ---- inbound ------------------------------------------------------------------

    def receive(self, msg: RemotePrefillRequest) -> None:
        """A decode worker asks for a prompt's KV."""
        self.timings[msg.request_id] = RequestTiming(prefill_received=time.time())
        self.connect(msg)
        self.pending_pair[msg.request_id] = msg

    def serves(self, request_id: str) -> bool:
        """Whether ``request_id`` is a remote prefill served here (not the worker's own) still to be
        computed: waiting for its pairs, or in the scheduler. (One whose KV is on its way is past that.)"""
        return request_id in self.origin or request_id in self.pending_pair

    def idle(self) -> bool:
        return not self.pending_pair and not self.origin and not self.transfers

    def abandon_all(self, reason: str) -> int:
        """Fail every remote prefill in hand (the worker is leaving); returns how many."""
        origins = {**self.pending_pair, **self.origin, **{rid: t.origin for rid, t in self.transfers.items()}}
        for request_id, origin in origins.items():
            self.core.abort(request_id)
            self.core.free_delayed(request_id)  # a send still under way fails with its pair, or reads freed blocks
            self._fail(origin, reason)
        self.pending_pair.clear()
        self.origin.clear()
        self.transfers.clear()
        self.timings.clear()
        return len(origins)

    def drop(self, request_id: str) -> bool:
        """Forget a request (aborted), freeing its blocks; a transfer already under way completes and the
        decode worker drops what arrives. Returns whether it was served here."""
        served = self.serves(request_id)
        self.pending_pair.pop(request_id, None)
        self.timings.pop(request_id, None)
        if served:
            self.core.abort(request_id)  # (one already computed keeps its blocks until its sends end)
            self.origin.pop(request_id, None)
        return served

    def abandon_router(self, router_addr: str) -> int:
        """Drop the requests the router at ``router_addr`` took (it is gone; their decode workers drop
        them too); returns how many."""
        origins = {**self.pending_pair, **self.origin}
        dropped = [rid for rid, o in origins.items() if self.worker.router_of(o.router_addr) == router_addr]
        for request_id in dropped:
            self.drop(request_id)
        return len(dropped)

    def _pieces(self, decode_layout: KVLayout | None) -> list[KVPiece]:
        spec = self.worker.kv_layout_spec
        return pieces_for(spec, layout_spec(decode_layout, spec.num_layers, spec.num_kv_heads))

    def connect(self, msg: RemotePrefillRequest | ConnectKVPair) -> None:
        """Ask every rank to connect its pairs with that decode worker's ranks (once per generation)."""
        key = (msg.decode_worker_id, msg.pair_generation)
        if key in self.pairs:
            return
        needed = {(p.prefill_rank, endpoint(msg.decode_worker_id, p.decode_rank))
                  for p in self._pieces(msg.decode_layout)}
        self.pairs[key] = _Pairs(needed)
        for old in [k for k in self.pairs if k[0] == msg.decode_worker_id and k[1] < msg.pair_generation]:
            del self.pairs[old]
        self.runner.broadcast_kv(KVStepOps(connects=[KVConnect(
            decode_worker_id=msg.decode_worker_id, generation=msg.pair_generation, store_host=msg.transfer_host,
            store_port=msg.transfer_port, decode_layout=msg.decode_layout)]))

    def report(self, report: RankReport) -> bool:
        """A rank's report on a pair or a send; returns False for one that is not about sending."""
        if report.kind in (RankReportKind.PAIR_READY, RankReportKind.PAIR_FAILED):
            pairs = self.pairs.get((_worker_of(report.peer), report.generation))
            if pairs is not None:
                was_ready = pairs.is_ready
                if report.kind == RankReportKind.PAIR_READY:
                    pairs.ready.add((report.rank, report.peer))
                else:
                    pairs.error = pairs.error or report.error or "KV pair failed"
                if pairs.is_ready and not was_ready:
                    logger.info("KV transfer pairs with decode worker %s (generation %d) are ready",
                                _worker_of(report.peer), report.generation)
            return True
        if report.kind != RankReportKind.SENT:
            return False
        transfer = self.transfers.get(report.request_id) if report.request_id else None
        if transfer is None:
            return True
        decode_rank = int(report.peer.rpartition("#")[2])
        if report.error is not None:
            transfer.error = transfer.error or report.error
        transfer.num_bytes_from_cache += report.num_bytes_from_cache
        transfer.sums[(report.rank, decode_rank)] = KVPieceSum(prefill_rank=report.rank, decode_rank=decode_rank,
                                                               num_bytes=report.num_bytes, checksum=report.checksum)
        if len(transfer.sums) == len(transfer.pieces) and transfer.first_token is not None:
            self._finish(report.request_id, transfer)
        return True

    def _finish(self, request_id: str, transfer: _Transfer) -> None:
        """Every piece reported: tell the decode worker (first token and per-piece sums, or the error)."""
        del self.transfers[request_id]
        self.core.free_delayed(request_id)  # every send from its blocks is done (or failed)
        self.origin.pop(request_id, None)
        origin = transfer.origin
        sums = [transfer.sums[(p.prefill_rank, p.decode_rank)] for p in transfer.pieces]
        stats = self.worker.stats
        if transfer.error is not None:
            stats.kv_transfer_failures += 1
            self.runner.broadcast_kv(KVStepOps(resets=[KVReset(
                peer_worker_id=origin.decode_worker_id, generation=origin.pair_generation, reason=transfer.error,
                sending=True)]))
            self.pairs.pop((origin.decode_worker_id, origin.pair_generation), None)
            self._fail(origin, transfer.error)
            return
        num_bytes = sum(s.num_bytes for s in sums)
        checksum = 0
        for s in sums:
            checksum = combine_checksums(checksum, s.checksum)
        stats.num_kv_transfers += 1  # count successes only, as the decode worker does
        stats.kv_transfer_seconds += time.monotonic() - transfer.started
        stats.kv_transfer_bytes += num_bytes
        stats.kv_transfer_bytes_from_cache += transfer.num_bytes_from_cache
        self.worker.mailbox.put(origin.decode_addr, RemotePrefillDone(
            request_id=request_id, prefill_worker_id=self.worker.worker_id, first_token_id=transfer.first_token,
            num_tokens=len(origin.prompt_token_ids), num_bytes=num_bytes, checksum=checksum,
            first_logprob=transfer.first_logprob, pieces=sums, prompt_logprobs=transfer.prompt_logprobs,
            timing=self.timings.pop(request_id, None)))

    def _fail(self, origin: RemotePrefillRequest, error: str) -> None:
        self.timings.pop(origin.request_id, None)
        self.worker.mailbox.put(origin.decode_addr, RemotePrefillDone(
            request_id=origin.request_id, prefill_worker_id=self.worker.worker_id, error=error))

    def admit_connected(self) -> None:
        """Move requests whose pairs are all connected into the scheduler."""
        for request_id, origin in list(self.pending_pair.items()):
            pairs = self.pairs.get((origin.decode_worker_id, origin.pair_generation))
            if pairs is not None and not pairs.is_ready and pairs.error is None:
                continue  # still connecting
            del self.pending_pair[request_id]
            if pairs is None or pairs.error is not None:
                self._fail(origin, pairs.error if pairs is not None else "KV pair generation superseded")
                continue
            try:  # only the first token is sampled here; the decode worker produces the rest
                request = self.core.add_request(request_id, origin.prompt_token_ids,
                                                prefill_sampling_params(origin.sampling_params), lora=origin.lora)
                request.keep_blocks_from = self._keep_blocks_from(origin)
            except ValueError as e:  # ValidationError included: D then recomputes or fails it
                self._fail(origin, str(e))
                continue
            self.origin[request_id] = origin

    # ---- the step -------------------------------------------------------------------

    def step_failed(self, request_ids: list[str], error: Exception) -> list[str]:
        """A step's forward failed and the engine finished ``request_ids`` as errors: fail those served here
        (their decode workers recompute them). Returns the others, the worker's own."""
        own = []
        for request_id in request_ids:
            transfer = self.transfers.pop(request_id, None)
            origin = self.origin.pop(request_id, None) or (transfer.origin if transfer else None)
            if origin is None:
                own.append(request_id)
                continue
            self.core.free_delayed(request_id)  # its sends were aborted with the forward (abort_sends)
            self._fail(origin, f"the prefill forward pass failed: {type(error).__name__}: {error}")
        return own

    def step_done(self, sends: list[KVSendPlan], runner_output) -> None:
        """The step that computed ``sends``' prompts ended: their first tokens are in; a transfer whose
        pieces were all reported during the step is finished now."""
        for plan in sends:
            transfer = self.transfers.get(plan.request_id)
            if transfer is None:
                continue
            transfer.first_token = runner_output.sampled_token_ids[plan.request_id]
            transfer.first_logprob = runner_output.logprobs.get(plan.request_id)
            transfer.prompt_logprobs = self.core.prompt_logprobs_of(plan.request_id)
            if len(transfer.sums) == len(transfer.pieces):  # every piece reported during the step
                self._finish(plan.request_id, transfer)

    def _keep_blocks_from(self, origin: RemotePrefillRequest) -> list[int]:
        """Per KV cache group of this worker, the first block a window must not free: the earliest any of
        the group's layers sends."""
        groups = self.runner.kv_groups
        firsts = _layer_first_blocks(origin, self.runner.block_size, self.runner.model.config.num_hidden_layers)
        if groups.is_single:  # pipeline stages included: layer indices here are global, so hybrid means one stage
            return [min(firsts)]
        return [min(firsts[layer] for layer in groups.group_layers(g)) for g in range(groups.num_groups)]

    def start_transfers(self, scheduled: list[tuple[Request, int]]) -> list[KVSendPlan]:
        """Headers (one per piece) and send plans for each request served here whose prompt completes in
        this step. Blocks the decode worker already holds (its prefix-cache hits) are not sent."""
        plans = []
        runner = self.runner
        dtype = dtype_name(runner.kv_cache_format.name)  # the KV dtype (int8, fp8_e4m3, ...: quantized rows)
        for seq_index, (request, num_new) in enumerate(scheduled):
            if request.num_computed_tokens + num_new != request.num_tokens:
                continue  # an earlier chunk: nothing to send yet
            origin = self.origin.get(request.request_id)
            if origin is None:
                continue  # the worker's own request (a decode worker's)
            first_block = _first_sent_block(origin, runner.block_size)
            num_blocks = len(request.block_table) - first_block
            end = first_block + num_blocks
            firsts = origin.layer_first_blocks
            pieces = self._pieces(origin.decode_layout)
            for piece in pieces:  # header order = each pair's stream order (the agents send in this order)
                s = piece.slice
                counts = [end - firsts[layer] for layer in range(s.layer_start, s.layer_end)] if firsts else []
                piece_blocks = max(counts) if counts else num_blocks
                self.worker.mailbox.put(origin.decode_addr, KVTransferHeader(
                    request_id=request.request_id, prefill_worker_id=self.worker.worker_id,
                    layer_num_blocks=counts if counts and min(counts) != max(counts) else [],
                    pair_generation=origin.pair_generation, num_layers=s.num_layers, num_blocks=piece_blocks,
                    block_size=runner.block_size, num_kv_heads=s.num_heads, head_dim=runner.head_dim, dtype=dtype,
                    num_tokens=request.num_tokens, first_block=first_block, prefill_rank=piece.prefill_rank,
                    decode_rank=piece.decode_rank, first_layer=s.layer_start, first_kv_head=s.head_start,
                    kv_slots=runner.kv_slots))
            faults.mark_kv_send(request.request_id, origin.prompt_token_ids)
            request.delay_free_blocks = True  # the sends read its blocks: freed in _finish
            self.transfers[request.request_id] = _Transfer(origin, pieces, time.monotonic())
            plans.append(KVSendPlan(request_id=request.request_id, seq_index=seq_index, first_block=first_block,
                                    num_blocks=num_blocks, decode_worker_id=origin.decode_worker_id,
                                    generation=origin.pair_generation, decode_layout=origin.decode_layout,
                                    layer_first_blocks=firsts))
        return plans
