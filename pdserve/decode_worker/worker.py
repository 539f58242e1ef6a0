"""The decode worker: continuous batching over a paged KV cache.

Life of a request here (DESIGN.md, "decode-first"); the driver (rank 0) runs
this, and every rank's ``KVRankAgent`` receives and installs its own slice:

1. ``GenerateRequest`` from the router. With a prefill worker named, the
   scheduler reserves blocks for the prompt and parks the request in
   ``WAITING_FOR_REMOTE_KVS``; the ranks open a lane for each prefill rank
   that sends to them (``KVLane``), and we send ``RemotePrefillRequest`` to the
   prefill worker with our KV store address, our layout and the pair generation.
2. The prefill worker sends one ``KVTransferHeader`` per piece (which layers
   and KV heads prefill rank i sends to decode rank j); each goes to the rank
   it names, whose lane receives the piece into a staging tensor and reports
   ``RECEIVED`` (bytes, checksum). ``RemotePrefillDone`` brings the first token
   and the sender's per-piece sums.
3. With every piece and the done message in hand we compare the sums, the
   ranks copy their staged pieces into the reserved blocks (``KVInstall``), and
   the request joins the running batch. Any failure or a missed deadline
   recomputes the prompt here (policy ``recompute``) or fails the request
   (policy ``fail``); the pair generation is then replaced.
4. Every step decodes all running requests as one batch; new ones join and
   finished ones leave between steps; token deltas go to the router that sent
   the request (``GenerateRequest.router_addr``; several routers may share this
   worker, and one's death drops only its requests, ``abandon_router``).

A decode worker also serves its peers: a peer that lacks a prefix this one holds pulls it, sending
this worker a ``RemotePrefillRequest`` as it would a prefill worker (the router names this worker as
the request's prefill worker); ``KVSource`` serves it here, computing only what the prefix cache
lacks and sending the KV from the cache (``pdserve.cluster.kv_source``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from pdserve.common.config import WorkerConfig
from pdserve.common.protocol import (AbortRequest, ConnectKVPair, ErrorKind, GenerateRequest, KVInstall, KVLane,
                                     RemotePrefillRequest,
                                     KVLayout, WarmKVPair,
                                     KVPieceSum, KVReset, KVStepOps, KVTransferHeader, RankReport,
                                     RankReportKind, RegisterWorker, RemotePrefillDone, RemotePrefillRequest,
                                     RequestDelta, RequestOutputs, RequestTiming, WorkerRole)
from pdserve.engine.config import EngineConfig
from pdserve.engine.scheduling.outputs import EngineCoreOutput
from pdserve.engine.scheduling.kv_cache_manager import NULL_BLOCK
from pdserve.engine.scheduling.request import Request, RequestStatus
from pdserve.common.sharding import KVPiece
from pdserve.decode_worker.first_token import FirstTokenWatch, header_fields, watchable
from pdserve.cluster.kv_source import KVSource
from pdserve.cluster.worker_base import WorkerBase, error_delta, rejection_delta, stamp_prefill
from pdserve.kvtransfer.agent import check_kv_dtype, layout_spec, pieces_for
from pdserve.kvtransfer.wire import dtype_name

logger = logging.getLogger(__name__)


@dataclass
class _RemotePrefill:
    """A request whose prompt KV is being computed by a prefill worker."""

    prefill_worker_id: str
    prefill_addr: str
    prefill_layout: KVLayout | None
    pieces: list[KVPiece]
    deadline: float | None = None  # set when the RemotePrefillRequest is sent (time.monotonic())
    sent_at: float | None = None
    pair_generation: int | None = None
    received: dict[tuple[int, int], RankReport] = field(default_factory=dict)  # (prefill rank, decode rank)
    done: RemotePrefillDone | None = None


class DecodeWorker(WorkerBase):
    role = WorkerRole.DECODE

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig):
        super().__init__(engine_config, worker_config)
        self.attach_kv_agent()
        self.pairs = self.runner.kv_agent.decode_pairs  # hosts the store every rank's lanes rendezvous in
        self.remote: dict[str, _RemotePrefill] = {}
        self.generations: dict[str, int] = {}  # prefill worker -> pair generation in use
        self._lanes_open: set[tuple[str, int]] = set()
        self._ops = KVStepOps()  # KV work for the ranks, flushed at the next step
        self._deltas: list[RequestDelta] = []
        self.request_router: dict[str, str] = {}  # router request_id -> the router its outputs go to
        # Stamps of each request still on its way to its first token (router request_id); they leave with
        # its first delta. Migrated requests (resume) are not timed.
        self.timings: dict[str, RequestTiming] = {}
        # first tokens sent from the mailbox's threads once their KV is verified, not after the step in flight
        self.first_tokens = FirstTokenWatch(self.worker_id, self.mailbox.put)
        # one rank: a piece's header goes to its lane as it arrives (a step in flight need not end first)
        self._early_headers = self.core.world_size == 1
        self.mailbox.tap = self._tap
        self.source = KVSource(self)  # the prefixes peers pull from here

    def registration(self, router_addr: str | None = None) -> RegisterWorker:
        reg = super().registration(router_addr)
        reg.transfer_host = self.pairs.store_host
        reg.transfer_port = self.pairs.store_port
        return reg

    # ---- inbound ------------------------------------------------------------------

    def handle(self, msg) -> None:
        if isinstance(msg, GenerateRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            if not self.source.drop(msg.request_id):
                self._abort(msg.request_id)
                self.request_router.pop(msg.request_id, None)
        elif isinstance(msg, KVTransferHeader):
            self._header(msg)
        elif isinstance(msg, RemotePrefillDone):
            self._remote_progress(msg.request_id, done=msg)
        elif isinstance(msg, RankReport):
            if msg.kind == RankReportKind.RECEIVED and msg.request_id is not None:
                self._remote_progress(msg.request_id, report=msg)
            else:
                self.source.report(msg)
        elif isinstance(msg, WarmKVPair):
            self._warm_pair(msg)
        elif isinstance(msg, RemotePrefillRequest):  # a peer pulls a prefix from us
            self.source.receive(msg)
        elif isinstance(msg, ConnectKVPair):
            self.source.connect(msg)
        else:
            logger.warning("decode worker ignores %s", type(msg).__name__)

    def _tap(self, msg) -> None:
        """Every inbound message, on the mailbox thread that received it (``Mailbox.tap``): headers to the
        lane (one rank), and what ``FirstTokenWatch`` waits for. Thread-safe: the agent and the watch lock."""
        if self._early_headers and isinstance(msg, KVTransferHeader):
            self.runner.kv_agent.submit(msg)
        self.first_tokens.observe(msg)

    def _open_lanes(self, prefill_worker_id: str, prefill_layout: KVLayout | None) -> int:
        """Open our ranks' lanes for ``prefill_worker_id`` at its current pair generation (once); returns it."""
        generation = self.generations.setdefault(prefill_worker_id, 0)
        key = (prefill_worker_id, generation)
        if key not in self._lanes_open:
            self._lanes_open.add(key)
            self._ops.lanes.append(KVLane(prefill_worker_id=prefill_worker_id, generation=generation,
                                          prefill_layout=prefill_layout))
            self._flush_ops()  # the lanes must be listening before the prefill worker connects
        return generation

    def _warm_pair(self, msg: WarmKVPair) -> None:
        """Set up the transfer pair with a prefill worker that just registered, before any request."""
        generation = self._open_lanes(msg.prefill_worker_id, msg.prefill_layout)
        self.mailbox.put(msg.prefill_addr, ConnectKVPair(
            decode_worker_id=self.worker_id, transfer_host=self.pairs.store_host,
            transfer_port=self.pairs.store_port, pair_generation=generation, decode_layout=self.kv_layout))

    def _add(self, msg: GenerateRequest) -> None:
        received = time.time()
        if self.source.drop(msg.request_id):  # a pull we served for a peer that died: the request is ours now
            logger.info("request %s: moved here while its prompt was served to a peer; dropping that", msg.request_id)
        self.request_router[msg.request_id] = self.router_of(msg.router_addr)
        remote = msg.prefill_worker_id is not None and msg.prefill_addr is not None and msg.resume is None
        pieces = []
        if remote:
            try:
                spec = self.kv_layout_spec
                check_kv_dtype(msg.prefill_worker_id, msg.prefill_layout, self.runner.kv_cache_format.name,
                               self.runner.quantization or "none")
                pieces = pieces_for(layout_spec(msg.prefill_layout, spec.num_layers, spec.num_kv_heads), spec)
            except ValueError as e:  # the prefill worker runs another model or KV dtype: prefill here
                logger.warning("request %s: %s; prefilling locally", msg.request_id, e)
                remote = False
        try:
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling_params, remote_prefill=remote,
                                  resume=msg.resume, lora=msg.lora)
        except ValueError as e:  # ValidationError included: a request sent past the router's checks
            self._deltas.append(rejection_delta(msg.request_id, e))
            return
        if msg.resume is None:
            self.timings[msg.request_id] = RequestTiming(decode_received=received)
        if remote:
            self.remote[msg.request_id] = _RemotePrefill(msg.prefill_worker_id, msg.prefill_addr,
                                                         msg.prefill_layout, pieces)

    def idle(self) -> bool:
        return super().idle() and not self.remote and not self._deltas and self.source.idle()

    def abandon_all(self, reason: str) -> int:
        """Free every request; the router migrates them to another decode worker when this one exits."""
        served = self.source.abandon_all(reason)  # the peers pulling from us recompute theirs
        group_ids = {r.group_id for r in self.core.scheduler.requests.values()}
        for group_id in group_ids:
            self._abort(group_id)
        self._flush_ops()
        self._flush()
        return len(group_ids) + served

    def abandon_router(self, router_addr: str) -> int:
        """Free the requests ``router_addr`` sent (that router is gone); returns how many."""
        group_ids = [gid for gid in self.core.scheduler.groups if self.request_router.get(gid) == router_addr]
        for group_id in group_ids:
            self._abort(group_id)
            self.request_router.pop(group_id, None)
        self._deltas = [d for d in self._deltas if d.request_id not in group_ids]
        self._flush_ops()
        return len(group_ids) + self.source.abandon_router(router_addr)

    def _abort(self, request_id: str) -> None:
        """Drop a request (the router asked, or is gone), freeing its blocks; tell its prefill worker."""
        state = self.remote.pop(request_id, None)
        self.first_tokens.forget(request_id)
        if state is not None:
            self.mailbox.put(state.prefill_addr, AbortRequest(request_id=request_id))
            self._ops.drops.append(request_id)  # pieces still arriving are dropped by their ranks
        self.timings.pop(request_id, None)
        self.core.abort(request_id)

    def _header(self, header: KVTransferHeader) -> None:
        """Check a piece's header against the request and this worker's layout; hand it to its rank now
        (the sender's layers wait for the receive), not at the next step."""
        state = self.remote.get(header.request_id)
        if not self._early_headers:  # (else the tap handed it to the lane already)
            self._ops.headers.append(header)  # received even when unwanted: the pair's stream must stay in order
        if state is None:  # aborted or failed over: the piece is received and dropped
            self._ops.drops.append(header.request_id)
        elif (error := self._check_header(header, state)) is not None:
            self._remote_failed(header.request_id, error, reset_pair=True)
        self._flush_ops()

    def _check_header(self, header: KVTransferHeader, state: _RemotePrefill) -> str | None:
        request = self.core.scheduler.waiting_for_remote_kvs.get(header.request_id)
        if request is None:
            return "request is no longer waiting for KV"
        piece = next((p for p in state.pieces if (p.prefill_rank, p.decode_rank) ==
                      (header.prefill_rank, header.decode_rank)), None)
        want = self._wanted_header(request, piece) if piece is not None else None
        got = header_fields(header)
        if got != want:
            return (f"KV piece {header.prefill_rank}->{header.decode_rank} (layers, KV heads, blocks, blocks per "
                    f"layer, block size, head dim, dtype, KV slots, prompt tokens, first block) {got} does not "
                    f"match this worker's {want}")
        return None

    def _wanted_header(self, request: Request, piece: KVPiece) -> tuple:
        """What ``piece``'s header must say for ``request`` (``header_fields``' order): its layers and KV
        heads, the blocks each layer receives (per layer: its KV cache group's first block after the hits
        and out of the window, to the prompt's end), this worker's block size, head dim, KV dtype and
        slots, the prompt's tokens and the first block any layer receives. Fixed while the request waits
        for its KV (its blocks were reserved when it was admitted)."""
        end = len(request.block_table)
        firsts = (self._layer_first_blocks(request)  # per global layer
                  or [self._first_sent_block(request)] * self.runner.model.config.num_hidden_layers)
        counts = [end - firsts[layer] for layer in range(piece.slice.layer_start, piece.slice.layer_end)]
        return (piece.slice.layer_start, piece.slice.num_layers, piece.slice.head_start, piece.slice.num_heads,
                max(counts), counts if min(counts) != max(counts) else [], self.runner.block_size,
                self.runner.head_dim, dtype_name(self.runner.kv_cache_format.name), self.runner.kv_slots,
                request.num_prompt_tokens, self._first_sent_block(request))

    # ---- remote prefill -----------------------------------------------------------

    def _group_first_blocks(self, request: Request) -> list[int]:
        """Per KV cache group, the first of ``request``'s blocks the prefill worker fills: after the
        prefix-cache hits and the blocks a sliding window left unreserved (``NULL_BLOCK``, always a prefix
        of the table)."""
        hits = request.num_cached_tokens // self.runner.block_size
        return [max(hits, next((i for i, b in enumerate(table) if b != NULL_BLOCK), len(table)))
                for table in request.block_tables]

    def _first_sent_block(self, request: Request) -> int:
        """The first block any layer of ``request`` receives (``_group_first_blocks``' least)."""
        return min(self._group_first_blocks(request))

    def _layer_first_blocks(self, request: Request) -> list[int] | None:
        """Per layer, the first block it receives, when the layers' groups differ in it; None: all
        ``_first_sent_block``. (Several groups mean one pipeline stage: local layers are global ones.)"""
        firsts = self._group_first_blocks(request)
        if min(firsts) == max(firsts):
            return None
        return [firsts[g] for g in self.runner.kv_groups.layer_groups]

    def _send_remote_prefill(self, request: Request) -> None:
        state = self.remote[request.request_id]
        state.sent_at = time.monotonic()
        state.deadline = state.sent_at + self.config.remote_prefill_timeout_s
        first_block = self._first_sent_block(request)
        state.pair_generation = self._open_lanes(state.prefill_worker_id, state.prefill_layout)
        timing = self.timings.get(request.request_id)
        if timing is not None:
            timing.remote_prefill_sent = time.time()
        if watchable(request.sampling_params):  # before the request goes: no piece of it can arrive sooner
            self.first_tokens.expect(request.request_id, self.request_router.get(request.request_id) or
                                     self.router_of(None),
                                     {(p.prefill_rank, p.decode_rank): self._wanted_header(request, p)
                                      for p in state.pieces}, request.num_prompt_tokens, request.num_cached_tokens,
                                     timing)
        self.mailbox.put(state.prefill_addr, RemotePrefillRequest(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params, lora=request.lora, decode_worker_id=self.worker_id,
            decode_addr=self.mailbox.address,
            transfer_host=self.pairs.store_host, transfer_port=self.pairs.store_port,
            pair_generation=state.pair_generation, dest_block_ids=request.block_table[first_block:],
            num_cached_tokens=request.num_cached_tokens, first_block=first_block, decode_layout=self.kv_layout,
            layer_first_blocks=self._layer_first_blocks(request),
            router_addr=self.request_router.get(request.request_id)))

    def _remote_progress(self, request_id: str, report: RankReport | None = None,
                         done: RemotePrefillDone | None = None) -> None:
        state = self.remote.get(request_id)
        if state is None:
            return  # aborted or already failed over; a late transfer is dropped
        if done is not None:
            if done.error is not None:  # a broken pair among them: the next request uses a new generation
                self._remote_failed(request_id, f"prefill worker {done.prefill_worker_id}: {done.error}",
                                    reset_pair=True)
                return
            state.done = done
        if report is not None:
            if report.error is not None:
                self._remote_failed(request_id, f"KV transfer failed: {report.error}", reset_pair=True)
                return
            prefill_rank = int(report.peer.rpartition("#")[2])
            state.received[(prefill_rank, report.rank)] = report
        if state.done is None or len(state.received) < len(state.pieces):
            return
        error = self._check_sums(request_id, state)
        if error is not None:
            self._remote_failed(request_id, error, reset_pair=True)
            return
        request = self.core.scheduler.waiting_for_remote_kvs[request_id]
        # blocks before each group's first were cache hits or out of the window
        blocks = [table[first:] for table, first in zip(request.block_tables, self._group_first_blocks(request))]
        self._ops.installs.append(KVInstall(request_id=request_id, block_ids=blocks[0], group_block_ids=blocks[1:]))
        self._flush_ops()  # every rank copies its pieces into the blocks before the next forward
        del self.remote[request_id]
        timing = self.timings.get(request_id)
        if timing is not None:
            timing.kv_installed = time.time()
            if (sent := state.done.timing) is not None:
                timing.prefill_received = sent.prefill_received
                timing.prefill_started, timing.prefill_done = sent.prefill_started, sent.prefill_done
        self.stats.num_kv_transfers += 1
        self.stats.kv_transfer_bytes += sum(r.num_bytes for r in state.received.values())
        self.stats.kv_transfer_seconds += time.monotonic() - state.sent_at
        output = self.core.remote_kv_arrived(request_id, state.done.first_token_id, state.done.first_logprob,
                                             state.done.prompt_logprobs)
        sent_early = self.first_tokens.claim(request_id)
        if sent_early:
            self.timings.pop(request_id, None)  # they went with the token
        if output is not None:
            self._emit(output, first_token_sent=sent_early)

    def _check_sums(self, request_id: str, state: _RemotePrefill) -> str | None:
        """What each rank received against what each sender says it sent."""
        done = state.done
        if request_id not in self.core.scheduler.waiting_for_remote_kvs:
            return "request is no longer waiting for KV"
        if done.first_token_id is None:
            return f"request {request_id}: prefill worker {done.prefill_worker_id} sent no first token"
        sent = {(s.prefill_rank, s.decode_rank): s for s in done.pieces}
        for key, got in state.received.items():
            want = sent.get(key, KVPieceSum(prefill_rank=key[0], decode_rank=key[1], num_bytes=-1, checksum=-1))
            if (got.num_bytes, got.checksum) != (want.num_bytes, want.checksum):
                return (f"request {request_id}: KV piece {key[0]}->{key[1]} from prefill worker "
                        f"{done.prefill_worker_id} does not match: received {got.num_bytes} bytes checksum "
                        f"{got.checksum:#x}, sent {want.num_bytes} bytes checksum {want.checksum:#x}")
        return None

    def _remote_failed(self, request_id: str, reason: str, reset_pair: bool = False) -> None:
        state = self.remote.pop(request_id, None)
        if state is None:
            return
        self.first_tokens.forget(request_id)
        self.stats.kv_transfer_failures += 1
        self._ops.drops.append(request_id)
        if reset_pair and state.pair_generation is not None:
            # that generation's streams can no longer be trusted (a newer one is left alone)
            if self.generations.get(state.prefill_worker_id) == state.pair_generation:
                self.generations[state.prefill_worker_id] = state.pair_generation + 1
            self._ops.resets.append(KVReset(peer_worker_id=state.prefill_worker_id,
                                            generation=state.pair_generation, reason=reason, sending=False))
        self.mailbox.put(state.prefill_addr, AbortRequest(request_id=request_id))
        if self.config.prefill_failure_policy == "recompute":
            logger.warning("request %s: %s; recomputing the prefill locally", request_id, reason)
            self.core.recompute_locally(request_id)
        else:
            logger.warning("request %s failed: %s", request_id, reason)
            self.core.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            self.timings.pop(request_id, None)
            self._deltas.append(error_delta(request_id, reason, ErrorKind.UNAVAILABLE))

    def periodic(self, now: float) -> None:
        # a request whose first token went out early has everything it waits for in the inbox
        expired = [rid for rid, s in self.remote.items() if s.deadline is not None and now > s.deadline
                   and self.first_tokens.withdraw(rid)]
        for request_id in expired:
            self._remote_failed(request_id, f"no KV from the prefill worker within "
                                            f"{self.config.remote_prefill_timeout_s:.0f} s", reset_pair=True)

    def _flush_ops(self) -> None:
        """Hand the pending KV work to every rank (a step of its own)."""
        ops = self._ops
        if ops.lanes or ops.headers or ops.installs or ops.drops or ops.resets:
            self._ops = KVStepOps()
            self.runner.broadcast_kv(ops)

    # ---- step ---------------------------------------------------------------------

    def step(self) -> bool:
        self._flush_ops()
        self._flush()  # first tokens that came with remote KV go out now, not after this step's forward
        self.source.admit_connected()
        scheduler_output = self.core.schedule()
        for request in scheduler_output.remote_prefills:
            self._send_remote_prefill(request)
        if scheduler_output.scheduled:
            # on the prefill worker's cores too while it is idle (not while the decode step compiles: inductor
            # writes the thread count of the moment into its kernels)
            if self.borrower is not None and self.runner.decode_step_state != "compiling" \
                    and self.borrower.before_step() > self.borrower.own:
                self.stats.num_borrowed_steps += 1
            started = time.time()
            served = {r.request_id for r, _ in scheduler_output.scheduled if self.source.serves(r.request_id)}
            sends = self.source.start_transfers(scheduler_output.scheduled) if served else []
            try:
                runner_output = self.core.execute(scheduler_output, kv_ops=KVStepOps(sends=sends) if sends else None)
            except Exception as e:  # noqa: BLE001  one failing batch must not take the worker down
                if self.core.world_size > 1:
                    raise  # the ranks may be mid-collective: leave, the router migrates the requests
                self._fail_step(scheduler_output, e)
            else:
                done = time.time()
                self._time_step(scheduler_output.scheduled, started, done)
                if served:
                    stamp_prefill(self.source.timings, scheduler_output.scheduled, started, done)
                    self.source.step_done(sends, runner_output)
                for output in self.core.update(scheduler_output, runner_output):
                    if output.request.request_id not in served:  # a peer's: its KV went, its token with it
                        self._emit(output)
        self._flush()
        return not scheduler_output.is_empty()

    def _time_step(self, scheduled: list[tuple[Request, int]], started: float, done: float) -> None:
        """Stamp local prefills (``stamp_prefill``); count a step whose every row decodes (only its last
        sampled token, and drafts, to compute) in ``num_decode_steps`` / ``decode_step_seconds``."""
        stamp_prefill(self.timings, scheduled, started, done)
        if all(r.num_computed_tokens >= max(r.num_prompt_tokens, r.num_tokens - 1) for r, _ in scheduled):
            self.stats.num_decode_steps += 1
            self.stats.decode_step_seconds += max(0.0, done - started)

    def _fail_step(self, scheduler_output, error: Exception) -> None:
        """Fail the requests of a step whose forward or sampling raised (500), free their blocks, go on."""
        logger.exception("decode step over %d requests failed; failing them", len(scheduler_output.scheduled))
        for group_id in self.source.step_failed(self.core.fail_step(scheduler_output), error):
            self._abort(group_id)
            self._deltas.append(error_delta(group_id, f"the forward pass failed: {type(error).__name__}: {error}",
                                            ErrorKind.INTERNAL))

    def _emit(self, output: EngineCoreOutput, first_token_sent: bool = False) -> None:
        """Queue ``output`` as a delta for its router. ``first_token_sent``: its first token already went
        (``FirstTokenWatch``): the delta carries the rest, or only the finish, or is not needed."""
        request, finished = output.request, output.finished
        if finished is not None:  # a request routed to a prefill worker but prefilled here leaves its entry
            self.remote.pop(request.group_id, None)
        new_token_ids = output.new_token_ids[1:] if first_token_sent else output.new_token_ids
        if first_token_sent and not new_token_ids and finished is None:
            return
        self._deltas.append(RequestDelta(
            request_id=request.group_id, new_token_ids=new_token_ids,
            finish_reason=finished.finish_reason() if finished else None,
            num_prompt_tokens=request.num_prompt_tokens, index=request.sample_index, logprobs=output.logprobs,
            num_cached_tokens=request.num_cached_tokens, prompt_logprobs=output.prompt_logprobs,
            timing=self.timings.pop(request.group_id, None)))

    def _flush(self) -> None:
        """Send the pending deltas, one ``RequestOutputs`` per router; forget the routers of requests
        that are over."""
        if not self._deltas:
            return
        by_router: dict[str, list[RequestDelta]] = {}
        for delta in self._deltas:
            by_router.setdefault(self.request_router.get(delta.request_id) or self.router_of(None), []).append(delta)
        for addr, deltas in by_router.items():
            self.mailbox.put(addr, RequestOutputs(worker_id=self.worker_id, deltas=deltas))
        groups = self.core.scheduler.groups
        for delta in self._deltas:
            if delta.finish_reason is not None and delta.request_id not in groups:
                self.request_router.pop(delta.request_id, None)
        self._deltas = []
