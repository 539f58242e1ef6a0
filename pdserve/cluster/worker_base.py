"""What the prefill and decode workers share: an EngineCore, a mailbox, liveness, the loop.

The loop is ``handle inbox -> step`` (each worker's step is the engine core's
``schedule -> execute -> update`` plus its own IO). IO threads own the
sockets: the ``Mailbox`` threads move messages, and the liveness thread sends
``RegisterWorker`` and ``Heartbeat`` on its own clock, so a step that runs for
minutes (a long CPU prefill) never makes a healthy worker look dead. Each
heartbeat carries ``loop_stall_s``, the seconds since the loop last finished an
iteration, so the router still notices a step that hangs.

A router tier. The worker registers with, heartbeats to and tells its comings
and goings to every router (``WorkerConfig.router_addr``: a list, or a DNS
name re-resolved at each re-registration); each request's outputs go to the
router that sent it (``GenerateRequest.router_addr``). The mailbox watches each
router's connection: a router whose connection is down for ``ROUTER_LOST_S``
while another router's is up is dead, and the requests it sent are dropped at
once (their client went with it), freeing their KV; with every router down, the
worker waits ``router_timeout_s`` first (the network may come back).

Leaving the cluster. SIGINT (or ``stop()``) exits at once; the router is told
(``WorkerExiting``) so it drops the worker without waiting for a timeout.
SIGTERM drains: the worker tells the router (``WorkerDraining``), which routes
nothing new to it and, once no request it holds still needs the worker, answers
``DrainWorker``; the worker then exits as soon as it is idle. A ``DrainWorker``
the router sends on its own (``pdserve scale``, ``/admin/workers/ID/drain``)
starts the same drain; the worker then tells every other router (each stops
routing to it), and exits once idle and every connected router has sent
``DrainWorker``. Whatever is still unfinished after ``drain_timeout_s`` is handed back and the worker exits: the router migrates a decode worker's
requests to another one, and a prefill worker's requests are recomputed by
their decode workers.
"""

from __future__ import annotations

import logging
import os
import pathlib
import signal
import threading
import time

import torch

from pdserve.common.auth import registration_token
from pdserve.common.config import WorkerConfig, resolve_router_addrs
from pdserve.common.curve import cluster_keys, warn_unauthenticated
from pdserve.common.protocol import (DrainWorker, ErrorKind, FinishReason, Heartbeat, KVEventsReplay, RankAttach,
                                     RegisterWorker, RequestDelta, RequestTiming, WorkerDraining, WorkerExiting,
                                     WorkerRole, WorkerStats)
from pdserve.common.sharding import KVLayoutSpec
from pdserve.common.transport import Mailbox
from pdserve.common.validation import ValidationError
from pdserve.cluster.core_lending import CoreBorrower, LenderFlag
from pdserve.cluster.kv_events import KVEventPublisher
from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

REGISTER_EVERY_S = 5.0
ROUTER_LOST_S = 0.5  # one router down this long while another is up: it died, its requests go
_IDLE_WAIT_S = 0.05
_RANK_PING_S = 1.0


class WorkerBase:
    """A worker process: ``EngineCore`` + mailbox + liveness thread + the step loop.

    Subclasses implement ``handle(msg)`` for inbound messages and events, and
    ``step() -> bool`` (True if it did any work). ``run()`` serves until
    ``stop()``; tests may instead call ``handle``/``step`` themselves.

    Attributes:
        core: the engine (runner, KV cache, block manager, scheduler).
        stats: the worker's KV transfer counters; the engine's are merged in heartbeats.
    """

    role: WorkerRole

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig):
        self.engine_config = engine_config
        self.config = worker_config
        self.worker_id = worker_config.worker_id
        self.core = EngineCore(engine_config)
        self.runner = self.core.runner
        self.stats = WorkerStats()
        # The routers this worker serves (resolved; replaced whole at each re-registration) and every
        # router it ever served (requests may still name one that left the DNS name).
        self.routers: list[str] = resolve_router_addrs(worker_config.router_addrs)
        self._all_routers: set[str] = set(self.routers)
        self._routers_lost: set[str] = set()  # routers whose outage was acted on
        try:
            warn_unauthenticated(worker_config.cluster_secret, f"worker {self.worker_id}")
            self.mailbox = Mailbox(worker_config.host, worker_config.port, watch=self.routers,
                                   keys=cluster_keys(worker_config.cluster_secret))
        except BaseException:
            self.core.close()
            raise
        self.model_name = engine_config.model.rstrip("/").split("/")[-1]
        # What the prefix cache gains and loses, for the routers' KV index (none without prefix caching)
        bm = self.core.block_manager
        self.kv_events = KVEventPublisher(self.worker_id, bm) if bm.enable_prefix_caching else None
        self._stop = threading.Event()
        self._loop_tick = time.monotonic()  # when the step loop last finished an iteration
        self._last_step = self._loop_tick  # when the ranks last heard from the driver
        self._liveness: threading.Thread | None = None
        self._drain_requested = threading.Event()  # SIGTERM (set from the signal handler)
        self._drain_deadline: float | None = None  # draining since the loop saw the request
        self._drain_acks: set[str | None] = set()  # routers that sent DrainWorker (None: one that did not say)
        self._exit_sent = False
        # core lending (pdserve.cluster.core_lending): a prefill worker publishes when it is idle, a decode
        # worker computes on its cores meanwhile
        self.lender = LenderFlag(worker_config.lend_flag) if worker_config.lend_flag else None
        self.borrower = CoreBorrower(worker_config.borrow_flag, torch.get_num_threads(), worker_config.borrow_threads) \
            if worker_config.borrow_flag else None
        if self.borrower is not None:
            logger.info("core lending: %d more thread(s) a step while the prefill worker publishing %s is idle "
                        "(GOMP_CPU_AFFINITY=%s)", worker_config.borrow_threads, worker_config.borrow_flag,
                        os.environ.get("GOMP_CPU_AFFINITY", "unset"))

    def attach_kv_agent(self) -> None:
        """Give every rank its KV transfer agent; ranks report back through this worker's mailbox."""
        try:
            self.runner.attach_kv_agent(RankAttach(worker_id=self.worker_id, role=self.role,
                                                   driver_addr=self.mailbox.address, host=self.config.host,
                                                   transfer_timeout_s=self.config.transfer_timeout_s),
                                        report=self.mailbox.inject)
        except BaseException:
            self.close()
            raise
        self.kv_layout = self.runner.kv_layout()
        self.kv_layout_spec = KVLayoutSpec(self.kv_layout.tensor_parallel_size, self.kv_layout.pipeline_parallel_size,
                                           self.kv_layout.num_layers, self.kv_layout.num_kv_heads)

    # ---- hooks ------------------------------------------------------------------

    def handle(self, msg) -> None:
        raise NotImplementedError

    def step(self) -> bool:
        raise NotImplementedError

    def idle(self) -> bool:
        """Nothing in hand: no request, no KV transfer in flight (subclasses add their own state)."""
        return not self.core.has_unfinished()

    def abandon_all(self, reason: str) -> int:
        """Drop everything still held (drain timeout), freeing its blocks; returns how many requests.

        ``reason`` goes to whoever must take the requests over (a prefill worker's decode workers)."""
        raise NotImplementedError

    def abandon_router(self, router_addr: str) -> int:
        """Drop, freeing their blocks, the requests the router at ``router_addr`` sent (it is gone, and
        their client with it); returns how many requests."""
        raise NotImplementedError

    def router_of(self, router_addr: str | None) -> str:
        """Where a request's outputs go: the router it names, else the first router."""
        return router_addr or self.routers[0]

    def _auth(self) -> str | None:
        secret = self.config.cluster_secret
        return registration_token(secret, self.worker_id, self.role, self.mailbox.address) if secret else None

    def registration(self, router_addr: str | None = None) -> RegisterWorker:
        """This worker's ``RegisterWorker``, for the router this worker reaches at ``router_addr``."""
        limits = self.core.limits
        return RegisterWorker(worker_id=self.worker_id, role=self.role, input_addr=self.mailbox.address,
                              model_name=self.model_name, num_blocks=limits.num_blocks,
                              block_size=limits.block_size, kv_group_caps=list(limits.kv_group_caps),
                              max_model_len=limits.max_model_len,
                              vocab_size=limits.vocab_size, kv_layout=self.runner.kv_layout(), auth=self._auth(),
                              router_addr=router_addr,
                              kernels={k: c.path for k, c in self.runner.kernel_choices.items()},
                              linear_weight_format=self.runner.linear_weight_format,
                              plan=self.runner.plan.as_dict(),
                              prefix_cache_salt=self.core.block_manager.salt if self.kv_events else None,
                              kv_offload_blocks=self.runner.num_offload_blocks + (
                                  self.runner.disk_store.capacity if self.runner.disk_store is not None else 0))

    def to_routers(self, msg, routers: list[str] | None = None) -> None:
        """Send ``msg`` to every router (or to ``routers``)."""
        for addr in self.routers if routers is None else routers:
            self.mailbox.put(addr, msg)

    def close(self) -> None:
        self._stop.set()
        if self._liveness is not None:
            self._liveness.join(timeout=2)
        self._send_exiting("the worker stopped")
        self.mailbox.close()
        for shared in (self.lender, self.borrower):
            if shared is not None:
                shared.close()
        self.core.close()

    def _send_exiting(self, reason: str) -> None:
        """Tell every router this worker is gone (once), so it leaves the pools at once."""
        if not self._exit_sent:
            self._exit_sent = True
            self.to_routers(WorkerExiting(
                worker_id=self.worker_id, role=self.role, input_addr=self.mailbox.address, auth=self._auth(),
                reason=reason))

    # ---- draining ---------------------------------------------------------------

    @property
    def draining(self) -> bool:
        return self._drain_deadline is not None

    def request_drain(self, *_args) -> None:
        """SIGTERM: leave gracefully; the step loop starts the drain at its next iteration."""
        self._drain_requested.set()

    def start_drain(self, reason: str, acked: bool = False, router_addr: str | None = None) -> None:
        """Stop taking new work: tell every router (but one that asked, ``acked`` from ``router_addr``;
        each then routes nothing new here and answers ``DrainWorker`` once it holds nothing that needs
        this worker), and exit once idle and acknowledged (``drain_acked``)."""
        if acked:
            self._drain_acks.add(router_addr)
        if self._drain_deadline is not None:
            return
        self._drain_deadline = time.monotonic() + self.config.drain_timeout_s
        logger.info("%s %s draining (%s): finishing what it holds, at most %.0f s", self.role.name.lower(),
                    self.worker_id, reason, self.config.drain_timeout_s)
        if None not in self._drain_acks:  # (a router that did not name itself is the only one)
            self.to_routers(WorkerDraining(worker_id=self.worker_id, role=self.role,
                                           input_addr=self.mailbox.address, auth=self._auth()),
                            [a for a in self.routers if a not in self._drain_acks])

    @property
    def drain_acked(self) -> bool:
        """Every router whose connection is up sent ``DrainWorker`` (one that did not say which router
        it is, an older router, counts for all), so nothing new will come."""
        if not self._drain_acks:
            return False
        return None in self._drain_acks or all(a in self._drain_acks for a in self.routers
                                                if self.mailbox.down_for(addr=a) == 0.0)

    def _check_drain(self, now: float) -> None:
        if self._drain_requested.is_set():
            self._drain_requested.clear()
            self.start_drain("SIGTERM")
        if self._drain_deadline is None:
            return
        if self.drain_acked and self.idle():
            logger.info("%s %s drained; exiting", self.role.name.lower(), self.worker_id)
            self._send_exiting("drained")
            self._stop.set()
        elif now >= self._drain_deadline:
            n = self.abandon_all(f"{self.role.name.lower()} worker {self.worker_id} shut down before the request "
                                 f"finished (drain timeout {self.config.drain_timeout_s:g} s)")
            logger.warning("%s %s: drain timed out; handing back %d unfinished requests", self.role.name.lower(),
                           self.worker_id, n)
            self._send_exiting("drain timed out")
            self._stop.set()

    def _check_router(self, now: float) -> None:
        """Workers outlive routers: drop the requests of a router whose connection is down (its
        clients went with it; a router restarted from scratch does not know those requests), so no
        KV block waits for a router that will not ask again. A router down ``ROUTER_LOST_S`` while
        another one is up is dead; with every router down, wait ``router_timeout_s`` (a network
        outage may end). Registration goes on (``_liveness_loop``), so a router that comes back
        finds this worker."""
        down = {addr: self.mailbox.down_for(now, addr) for addr in self._all_routers}
        any_up = any(down.get(addr) == 0.0 for addr in self.routers)
        for addr, down_s in down.items():
            if down_s == 0.0:
                self._routers_lost.discard(addr)
                continue
            if addr in self._routers_lost or down_s < (ROUTER_LOST_S if any_up else self.config.router_timeout_s):
                continue
            self._routers_lost.add(addr)
            n = self.abandon_router(addr)
            if n:
                logger.warning("%s %s: the connection to the router at %s has been down %.1f s%s; dropped %d "
                               "requests it sent", self.role.name.lower(), self.worker_id, addr, down_s,
                               "" if any_up else " (every router is down; waiting for one to register with)", n)

    # ---- liveness (IO thread) -----------------------------------------------------

    def start_liveness(self) -> None:
        """Start the thread that registers and heartbeats (``run`` does this)."""
        if self._liveness is None:
            self._liveness = threading.Thread(target=self._liveness_loop, name="liveness", daemon=True)
            self._liveness.start()

    def _liveness_loop(self) -> None:
        last_register = float("-inf")
        while True:
            now = time.monotonic()
            if now - last_register >= REGISTER_EVERY_S:
                last_register = now
                self._resolve_routers()
                for addr in self.routers:
                    self.mailbox.put(addr, self.registration(addr))
            try:
                beat = self.heartbeat()
                self.to_routers(beat)
                if self.config.health_file and beat.loop_stall_s < self.config.health_stall_s:
                    pathlib.Path(self.config.health_file).touch()
            except Exception:  # a figure read mid-update must not end liveness
                logger.exception("building a heartbeat failed")
            if self._stop.wait(self.config.heartbeat_interval_s):
                return

    def _resolve_routers(self) -> None:
        """Re-resolve the router entries (a headless Service gains and loses routers); watch new ones."""
        routers = resolve_router_addrs(self.config.router_addrs)
        for addr in routers:
            if addr not in self._all_routers:
                logger.info("%s %s: router at %s joined", self.role.name.lower(), self.worker_id, addr)
                self.mailbox.watch(addr)
                self._all_routers = self._all_routers | {addr}  # replaced, not changed: the loop iterates it
        self.routers = routers

    def heartbeat(self) -> Heartbeat:
        """Load figures, read from the step loop's objects without a lock (ints and lengths only)."""
        core, scheduler = self.core, self.core.scheduler
        return Heartbeat(worker_id=self.worker_id, role=self.role, num_running=scheduler.num_running,
                         num_waiting=scheduler.num_waiting, num_free_blocks=core.block_manager.num_free_blocks,
                         num_blocks=core.block_manager.num_blocks, max_step_batch_size=core.max_step_batch_size,
                         num_steps=core.num_steps, stats=core.stats(self.stats),
                         loop_stall_s=max(0.0, time.monotonic() - self._loop_tick), draining=self.draining,
                         decode_step=core.runner.decode_step_state,
                         **lora_heartbeat_fields(core))

    # ---- loop -------------------------------------------------------------------

    def stop(self, *_args) -> None:
        self._stop.set()

    def run(self) -> None:
        """Serve until SIGINT or ``stop()`` (at once), or until drained (SIGTERM, ``DrainWorker``)."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.request_drain)
            signal.signal(signal.SIGINT, self.stop)
        logger.info("%s %s listening on %s", self.role.name.lower(), self.worker_id, self.mailbox.address)
        self.start_liveness()
        try:
            while not self._stop.is_set():
                self.run_once()
        finally:
            self.close()

    def run_once(self) -> None:
        """One loop iteration: periodic checks, the inbox, one step.

        A multi-rank worker idle for ``_RANK_PING_S`` pings its ranks, so a dead rank ends the
        worker (an exception out of ``run``) even when no request arrives.
        """
        now = time.monotonic()
        self.periodic(now)
        self._check_drain(now)
        self._check_router(now)
        if self._stop.is_set():
            return
        busy = self.core.has_unfinished()
        if self.lender is not None:
            self.lender.set_idle(not busy)  # before waiting for work: a borrower may use the cores meanwhile
        self.drain_inbox(wait=0 if busy else _IDLE_WAIT_S)
        if self.lender is not None and not busy and self.core.has_unfinished():
            self.lender.set_idle(False)  # work came in: the cores are ours for the step below
        stepped = self.step()
        self.publish_kv_events()
        if stepped:
            self._last_step = now
        elif self.core.has_unfinished():
            time.sleep(0.001)  # waiting on remote KV / peers only
        elif self.core.world_size > 1 and now - self._last_step > _RANK_PING_S:
            self.core.ping_ranks()
            self._last_step = now
        self._loop_tick = time.monotonic()

    def drain_inbox(self, wait: float = 0) -> None:
        """Handle every queued message (waiting up to ``wait`` seconds for the first)."""
        msg = self.mailbox.get(timeout=wait) if wait else self.mailbox.get_nowait()
        while msg is not None:
            try:
                if isinstance(msg, DrainWorker):
                    self.start_drain(msg.reason or "the router asked", acked=True, router_addr=msg.router_addr)
                elif isinstance(msg, KVEventsReplay):
                    self.replay_kv_events(msg)
                else:
                    self.handle(msg)
            except Exception:  # a bad message must not kill the worker
                logger.exception("error handling %s", type(msg).__name__)
            msg = self.mailbox.get_nowait()

    def publish_kv_events(self) -> None:
        """Send what the prefix cache gained and lost since the last call to every router, as the next
        numbered batch (``pdserve.cluster.kv_events``)."""
        batch = self.kv_events.poll() if self.kv_events is not None else None
        if batch is not None:
            self.to_routers(batch)

    def replay_kv_events(self, msg: KVEventsReplay) -> None:
        """A router missed some KV event batches: send it those from ``msg.from_seq`` on, or a snapshot."""
        if self.kv_events is None:
            return
        self.publish_kv_events()  # first, so a snapshot is the state after the last batch numbered
        for batch in self.kv_events.replay(msg.from_seq):
            self.mailbox.put(self.router_of(msg.router_addr), batch)

    def periodic(self, now: float) -> None:
        """Subclass hook, called every loop iteration before the inbox is drained."""


def error_delta(request_id: str, error: str, kind: ErrorKind = ErrorKind.INTERNAL) -> RequestDelta:
    """The delta that fails a whole router request; the router answers ``kind.http_status``."""
    return RequestDelta(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error,
                        error_kind=kind)


def rejection_delta(request_id: str, error: ValueError) -> RequestDelta:
    """An ``error_delta`` for a request the engine refused at ``add_request``."""
    kind = ErrorKind.INVALID_REQUEST if isinstance(error, ValidationError) else ErrorKind.INTERNAL
    return error_delta(request_id, str(error), kind)


def stamp_prefill(timings: dict[str, RequestTiming], scheduled: list, started: float, done: float) -> None:
    """Stamp the prompt steps of a step that ran from ``started`` to ``done`` (``time.time()`` seconds).

    Call after ``execute`` and before ``update`` (``num_computed_tokens`` not yet advanced). For each
    scheduled ``(request, num_new_tokens)`` still in its prompt whose group has an entry in
    ``timings`` (keyed by the router's request_id): ``prefill_started`` is the first such step's
    start, ``prefill_done`` the end of the step that computed its last prompt token. Stamps already
    set are kept (a forked sample or a preempted request recomputing its prompt does not move them).
    """
    for request, num_new in scheduled:
        timing = timings.get(request.group_id)
        if timing is None or request.num_computed_tokens >= request.num_prompt_tokens:
            continue  # not timed, or decoding
        if timing.prefill_started is None:
            timing.prefill_started = started
        if timing.prefill_done is None and request.num_computed_tokens + num_new >= request.num_prompt_tokens:
            timing.prefill_done = done


def lora_heartbeat_fields(core) -> dict:
    """Heartbeat fields of vLLM's ``vllm:lora_requests_info``: slots and the adapters in use (none
    without --enable-lora)."""
    if core.runner.lora is None:
        return {}
    scheduler = core.scheduler
    running = [*scheduler.running, *scheduler.waiting_for_remote_kvs.values()]
    return {"max_lora": core.config.max_loras,
            "running_lora_adapters": sorted({r.lora.lora_name for r in running if r.lora is not None}),
            "waiting_lora_adapters": sorted({r.lora.lora_name for r in scheduler.waiting if r.lora is not None})}
