"""The router's side of the ZMQ protocol, inside the asyncio event loop.

Three background tasks share one ``zmq.asyncio`` context:

* ``_recv_loop`` reads the PULL socket workers push to: ``RegisterWorker`` and
  ``Heartbeat`` update the registry, ``RequestOutputs`` deltas go to the
  request's ``asyncio.Queue``.
* ``WorkerSockets.send_loop`` (``sockets.py``) drains the outbox into one PUSH
  socket per worker, each watched for its connection dropping. Handlers only
  ``put_nowait`` into the outbox, so submitting and aborting never await.
* ``_expire_loop`` drops workers that went silent, and fails the requests of
  those and of workers whose step loop is stuck; it also re-sends
  ``DrainWorker`` to drained workers that have not left yet.

Draining (``drain``, ``scale``, or a worker's own ``WorkerDraining`` after
SIGTERM): the worker gets nothing new, and once no request still needs it
(decode: none routed there unfinished; prefill: none naming it still waiting for
its KV) it is sent ``DrainWorker`` and exits when idle. Its ``WorkerExiting``
removes it from the pool at once, as it does for a worker stopped any other way.

A request's queue yields ``RequestDelta``s from its decode worker, or one
``RequestFailed`` if it cannot finish (the router stopped, or no decode worker
took it over in time).

A router tier: several routers may share one worker pool. Each worker registers
with every router, saying in ``RegisterWorker.router_addr`` how it reaches this
one; every request sent to a worker names that address
(``GenerateRequest.router_addr``), so its outputs come back to this router, the
one holding its state, and request ids start with this router's ``router_id``,
so no two routers' ids collide on a worker. When this router dies the workers
drop its requests; the other routers' requests are untouched.

Migration: when a decode worker is lost (its connection drops, as the PUSH
socket's monitor sees at once; it exits or re-registers as a new process; it
goes silent past ``worker_timeout_s``; its step loop is stuck), each request it
held moves to a live decode worker as a ``GenerateRequest`` with ``resume``:
every unfinished choice continues after the tokens the client already has, so
the stream goes on with no error and no token repeated or missing (greedy
output is what an undisturbed run gives; seeded sampling too, as each position's
draw depends only on the seed, the choice and the position). Deltas from the
old worker are dropped from then on. With no live decode worker the request
waits up to ``worker_wait_s`` for one; a request migrated ``max_migrations``
times fails (a request that kills every worker it lands on must not take the
pool down). Deltas for a
request the router no longer knows (failed over, timed out, aborted while the
deltas were in flight) that are not final get an ``AbortRequest`` back to
their worker, so no worker keeps decoding for nobody. A request with
``n`` choices gets deltas for all of them (``delta.index``); it is finished at
the worker, and forgotten here, once every choice has had a ``finish_reason``.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging

import time
import uuid
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio

from pdserve.common.curve import Gatekeeper, cluster_keys, secure_server, warn_unauthenticated
from pdserve.common.protocol import (AbortRequest, DrainWorker, GenerateRequest, Heartbeat, KVEventBatch,
                                     KVEventsReplay, LoRARequest, RegisterWorker, RequestDelta, RequestOutputs,
                                     ResumedChoice, SamplingParams, WarmKVPair, WorkerDraining, WorkerExiting,
                                     WorkerRole)
from pdserve.common.auth import token_matches
from pdserve.common.transport import ProtocolError, decode
from pdserve.engine.scheduling.request import lora_cache_root
from pdserve.router.kv_index import KVIndex
from pdserve.router.metrics import WorkerStatsCollector
from pdserve.router.registry import WorkerInfo, WorkerRegistry
from pdserve.router.routing import KVAwarePolicy, RoundRobinPolicy, RoutingPolicy
from pdserve.router.sockets import WorkerSockets

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RequestFailed:
    """Put in a request's queue when it cannot finish; ``status_code`` is the HTTP status."""

    message: str
    status_code: int = 503


@dataclasses.dataclass
class RequestHandle:
    """One in-flight request: where it runs and where its outputs arrive."""

    request_id: str
    decode_worker_id: str | None  # None while it waits for a decode worker to migrate to
    decode_addr: str | None
    prefill_worker_id: str | None
    queue: asyncio.Queue  # RequestDelta | RequestFailed
    num_choices: int = 1
    finished_choices: set[int] = dataclasses.field(default_factory=set)  # finished at the worker
    prefill_addr: str | None = None
    prefill_pending: bool = False  # its prefill worker has not delivered the KV yet (no delta seen)
    prompt_token_ids: list[int] = dataclasses.field(default_factory=list)
    sampling_params: SamplingParams | None = None
    output_token_ids: dict[int, list[int]] = dataclasses.field(default_factory=dict)  # per choice, delivered
    num_migrations: int = 0
    stranded_at: float | None = None  # lost its worker and found no other yet (time.monotonic())
    lost_reason: str = ""  # why it last lost its decode worker
    lost_worker_id: str | None = None  # the decode worker it last lost
    lora: LoRARequest | None = None  # its LoRA adapter (kept for a migration)
    prefill_site_id: str | None = None  # the worker prefilling its prompt (prefill or, locally, decode)
    prefill_site_tokens: int = 0  # its prompt tokens to compute, counted in that worker's prefill_pending_tokens
    sent_at: float | None = None  # GenerateRequest handed to the send loop (time.time(); request hops)

    @property
    def worker_label(self) -> str:
        """The decode worker to name in metrics and errors (the lost one while it waits)."""
        return self.decode_worker_id or self.lost_worker_id or "none"


class RouterEngine:
    """Owns the router's ZMQ sockets, the worker registry and the in-flight requests.

    Args:
        host, zmq_port: where to bind the PULL socket (port 0 = a free one);
            ``address`` is the bound ``tcp://host:port`` once ``start`` returned.
        registry: the worker registry to feed and route with.
        worker_stats: where heartbeats' ``WorkerStats`` go for ``/metrics`` (optional).
        cluster_secret: admit only registrations whose token proves the secret (``pdserve.common.auth``),
            and only connections that prove it (CurveZMQ on every socket, ``pdserve.common.curve``).
        worker_wait_s: how long a request that lost its decode worker waits for another.
        max_migrations: a request is migrated at most this many times, then fails.
        on_migration: called with (lost worker id, reason) for each request migrated (metrics).
        policy: picks the workers of new and migrated requests (``routing.py``; default round robin).
        on_route: called with (policy name, role, decision) for each worker picked (metrics).
        router_id: this router's name in a router tier; it starts every request id (``new_request_id``).
        kv_index: where the workers' KV events go (``kv_index.py``; the ``kv_aware`` policy reads it);
            a new one if None.
    """

    _DRAIN_RESEND_S = 5.0  # a drained worker that has not left gets DrainWorker again this often
    _MAX_ORPHANS = 4096  # request ids remembered as aborted-for-orphan-deltas (bounds the memory)

    def __init__(self, host: str, zmq_port: int, registry: WorkerRegistry,
                 worker_stats: WorkerStatsCollector | None = None, cluster_secret: str | None = None,
                 worker_wait_s: float = 30.0, max_migrations: int = 3,
                 on_migration: Callable[[str, str], None] | None = None, policy: RoutingPolicy | None = None,
                 on_route: Callable[[str, WorkerRole, str], None] | None = None, router_id: str = "router",
                 kv_index: KVIndex | None = None):
        self.host = host
        self.kv_index = kv_index if kv_index is not None else KVIndex()
        self.router_id = router_id
        self.policy = policy or RoundRobinPolicy()
        # what each worker holds of a prompt, by the KV index, whatever the policy (pulls from a peer)
        self.kv_prices = self.policy if isinstance(self.policy, KVAwarePolicy) else KVAwarePolicy(self.kv_index)
        self.on_route = on_route
        self.worker_wait_s = worker_wait_s
        self.max_migrations = max_migrations
        self.on_migration = on_migration
        self.num_migrations = 0
        self.cluster_secret = cluster_secret
        self.num_refused_registrations = 0
        self.zmq_port = zmq_port
        self.registry = registry
        self.worker_stats = worker_stats
        self.address: str | None = None
        self._requests: dict[str, RequestHandle] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._gatekeeper: Gatekeeper | None = None
        self._pull: zmq.asyncio.Socket | None = None
        self._sockets: WorkerSockets | None = None  # PUSH sockets to the workers, once started
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._orphans: collections.OrderedDict[str, None] = collections.OrderedDict()
        self.num_orphan_aborts = 0  # AbortRequests sent back for deltas of unknown requests

    # --- lifecycle ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        keys = cluster_keys(self.cluster_secret)
        warn_unauthenticated(self.cluster_secret, "router")
        self._gatekeeper = Gatekeeper(self._ctx, keys)  # its own thread: handshakes never wait on the event loop
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        secure_server(self._pull, keys)
        if self.zmq_port == 0:
            port = self._pull.bind_to_random_port(f"tcp://{self.host}")
        else:
            port = self.zmq_port
            self._pull.bind(f"tcp://{self.host}:{port}")
        self.address = f"tcp://{self.host}:{port}"
        self._sockets = WorkerSockets(self._ctx, on_disconnect=self._connection_lost, keys=keys)
        self._tasks = [asyncio.create_task(coro, name=name) for name, coro in (
            ("router-recv", self._recv_loop()),
            ("router-send", self._sockets.send_loop()),
            ("router-expire", self._expire_loop()),
        )]
        logger.info("router ZMQ PULL socket bound at %s", self.address)

    async def stop(self) -> None:
        """Abort every in-flight request at its worker, then close all sockets."""
        self.abort_all("the router is shutting down")
        if self._sockets is not None:
            await self._sockets.flush(timeout_s=1.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._sockets is not None:
            self._sockets.close_all(linger=100)
        if self._gatekeeper is not None:
            self._gatekeeper.stop()
            self._gatekeeper = None
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    # --- requests -------------------------------------------------------------------------

    @property
    def num_inflight(self) -> int:
        return len(self._requests)

    def waiting_load(self) -> tuple[int, int]:
        """(requests, their prompt tokens) sent to a worker that have not had a token back yet."""
        waiting = [h for h in self._requests.values() if not h.output_token_ids]
        return len(waiting), sum(len(h.prompt_token_ids) for h in waiting)

    def new_request_id(self) -> str:
        """A request id no other router of the tier makes: this router's id, then a random uuid."""
        return f"{self.router_id}-{uuid.uuid4().hex}"

    def route(self, role: WorkerRole, prompt_token_ids: list[int],
              accepts: Callable[[WorkerInfo], bool] | None = None,
              lora: LoRARequest | None = None) -> WorkerInfo | None:
        """The worker of ``role`` the routing policy picks for a prompt under LoRA adapter ``lora``
        (None: the base model), among the live ones that ``accepts`` (if given); None if there is none."""
        candidates = self.registry.candidates(role, accepts)
        if not candidates:
            return None
        salt = lora_cache_root(lora) if lora is not None else b""
        worker, decision = self.policy.pick(role, candidates, prompt_token_ids, salt)
        self.observe_route(role, decision)
        return worker

    def observe_route(self, role: WorkerRole, decision: str) -> None:
        """Count a routing decision (``pdserve:routing_decisions_total``) under this router's policy."""
        if self.on_route is not None:
            self.on_route(self.policy.name, role, decision)

    def submit(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
               decode_worker: WorkerInfo, prefill_worker: WorkerInfo | None,
               lora: LoRARequest | None = None) -> RequestHandle:
        """Send a request to ``decode_worker``, naming ``prefill_worker`` (None: D prefills locally),
        with LoRA adapter ``lora`` applied on both (None: the base model).

        The caller picked both from the registry among the workers that accept the request.
        """
        handle = RequestHandle(request_id, decode_worker.worker_id, decode_worker.input_addr,
                               prefill_worker.worker_id if prefill_worker else None, asyncio.Queue(),
                               num_choices=sampling_params.n,
                               prefill_addr=prefill_worker.input_addr if prefill_worker else None,
                               prefill_pending=prefill_worker is not None, prompt_token_ids=prompt_token_ids,
                               sampling_params=sampling_params, lora=lora)
        self._requests[request_id] = handle
        decode_worker.num_inflight += 1
        decode_worker.num_routed += 1
        if prefill_worker is not None:
            prefill_worker.num_routed += 1
            prefill_worker.num_prefill_pending += 1
        site = prefill_worker or decode_worker  # who prefills the prompt: its queue grows by what it computes
        work = len(prompt_token_ids) - self.policy.cached_tokens(site, prompt_token_ids,
                                                                 lora_cache_root(lora) if lora is not None else b"")
        site.prefill_pending_tokens += work
        handle.prefill_site_id, handle.prefill_site_tokens = site.worker_id, work
        self._send(decode_worker.input_addr, GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt_token_ids,
            sampling_params=sampling_params,
            prefill_worker_id=prefill_worker.worker_id if prefill_worker else None,
            prefill_addr=prefill_worker.input_addr if prefill_worker else None,
            prefill_layout=prefill_worker.kv_layout if prefill_worker else None, lora=lora,
            router_addr=decode_worker.router_addr))
        handle.sent_at = time.time()
        return handle

    def finish(self, request_id: str) -> None:
        """Forget a request that finished normally (its worker already freed it)."""
        handle = self._requests.pop(request_id, None)
        if handle is not None:
            self._release(handle)

    def abort(self, request_id: str) -> None:
        """Forget a request and tell its decode worker to drop it. Never awaits; idempotent."""
        handle = self._requests.pop(request_id, None)
        if handle is None:
            return
        self._release(handle)
        worker = self.registry.get(handle.decode_worker_id) if handle.decode_worker_id else None
        if worker is not None:
            self._send(handle.decode_addr, AbortRequest(request_id=request_id))

    def abort_all(self, message: str) -> None:
        """Fail every in-flight request with ``message`` (503) and abort it at its worker."""
        for handle in list(self._requests.values()):
            self.abort(handle.request_id)
            handle.queue.put_nowait(RequestFailed(message))

    def abort_all_threadsafe(self, message: str) -> None:
        """``abort_all`` from a signal handler or another thread."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.abort_all, message)

    def _release(self, handle: RequestHandle) -> None:
        self._release_prefill(handle)
        worker = self.registry.get(handle.decode_worker_id) if handle.decode_worker_id else None
        if worker is not None and worker.input_addr == handle.decode_addr:
            worker.num_inflight = max(0, worker.num_inflight - 1)
            self._maybe_send_drain(worker)

    def _release_prefill(self, handle: RequestHandle) -> None:
        """The request no longer needs its prefill worker (its KV arrived, or it ended)."""
        if handle.prefill_site_tokens:  # its prompt left that worker's prefill queue
            site = self.registry.get(handle.prefill_site_id)
            if site is not None:
                site.prefill_pending_tokens = max(0, site.prefill_pending_tokens - handle.prefill_site_tokens)
            handle.prefill_site_tokens = 0
        if not handle.prefill_pending:
            return
        handle.prefill_pending = False
        worker = self.registry.get(handle.prefill_worker_id) if handle.prefill_worker_id else None
        if worker is not None and worker.input_addr == handle.prefill_addr:
            worker.num_prefill_pending = max(0, worker.num_prefill_pending - 1)
            self._maybe_send_drain(worker)

    # --- pools ----------------------------------------------------------------------------

    def drain(self, worker_id: str, reason: str) -> WorkerInfo | None:
        """Route nothing new to ``worker_id``; it is told to leave once no request needs it.

        Returns the worker, or None if the router does not know it. Idempotent.
        """
        worker = self.registry.get(worker_id)
        if worker is None:
            return None
        if not worker.draining:
            worker.draining, worker.drain_reason = True, reason
            logger.info("draining %s worker %s (%s); %d requests still need it", worker.role.name.lower(),
                        worker_id, reason, worker.num_outstanding)
        self._maybe_send_drain(worker)
        return worker

    def scale(self, role: WorkerRole, num_workers: int) -> list[WorkerInfo]:
        """Set ``role``'s pool target to ``num_workers``; drain the surplus (returned).

        Growing is the launcher's part: it starts workers until the pool reaches the target.
        """
        self.registry.desired[role] = num_workers
        victims = self.registry.surplus(role)
        for worker in victims:
            self.drain(worker.worker_id, f"pool scaled to {num_workers}")
        return victims

    def _maybe_send_drain(self, worker: WorkerInfo, now: float | None = None) -> None:
        if not worker.draining or worker.num_outstanding > 0:
            return
        now = self.registry._now(now)
        if worker.drain_sent_at is not None and now - worker.drain_sent_at < self._DRAIN_RESEND_S:
            return
        worker.drain_sent_at = now
        self._send(worker.input_addr, DrainWorker(reason=worker.drain_reason, router_addr=worker.router_addr))

    def _worker_left(self, msg: WorkerExiting) -> None:
        worker = self.registry.get(msg.worker_id)
        if worker is None or worker.input_addr != msg.input_addr:
            return
        self.registry.remove(msg.worker_id)
        logger.info("%s worker %s left the pool (%s)", worker.role.name.lower(), msg.worker_id,
                    msg.reason or "exiting")
        self._worker_lost(worker, f"{worker.role.name.lower()} worker {msg.worker_id} exited "
                                  f"({msg.reason or 'stopped'})")

    def _authentic(self, msg: RegisterWorker | WorkerDraining | WorkerExiting) -> bool:
        """With a cluster secret: whether ``msg`` proves it (a stranger cannot join, drain or remove a worker)."""
        if self.cluster_secret is None or token_matches(self.cluster_secret, msg.auth, msg.worker_id, msg.role,
                                                        msg.input_addr):
            return True
        self.num_refused_registrations += 1
        if self.num_refused_registrations <= 10 or self.num_refused_registrations % 100 == 0:
            logger.warning("refused %s from %s at %s: it does not know the cluster secret", type(msg).__name__,
                           msg.worker_id, msg.input_addr)
        return False

    def _worker_lost(self, worker: WorkerInfo, reason: str) -> None:
        """``worker`` cannot finish its requests (gone, or stuck): migrate each one it holds."""
        lost = [h for h in self._requests.values()
                if h.decode_worker_id == worker.worker_id and h.decode_addr == worker.input_addr]
        still_registered = self.registry.get(worker.worker_id) is worker
        for handle in lost:
            if still_registered:  # stuck, not gone: it must not keep the blocks when it wakes up
                worker.num_inflight = max(0, worker.num_inflight - 1)
                self._send(worker.input_addr, AbortRequest(request_id=handle.request_id))
            self._migrate(handle, reason)
        if not still_registered:
            if self.registry.get(worker.worker_id) is None:  # (not replaced by a new process under its id)
                self.kv_index.forget(worker.worker_id)
            self._sockets.close(worker.input_addr)

    def _migrate(self, handle: RequestHandle, reason: str) -> None:
        """Move ``handle`` to a live decode worker, resuming its unfinished choices; or strand it."""
        self._release_prefill(handle)  # the new worker recomputes the prompt itself
        lost_worker = handle.lost_worker_id = handle.decode_worker_id or handle.lost_worker_id
        handle.decode_worker_id = handle.decode_addr = None
        if handle.num_migrations >= self.max_migrations:
            self._fail(handle, f"{reason}; the request was already moved {handle.num_migrations} times, "
                               "giving up")
            return
        params = handle.sampling_params
        needed = len(handle.prompt_token_ids) + params.max_tokens
        target = self.route(WorkerRole.DECODE, handle.prompt_token_ids,
                            lambda w: w.max_model_len <= 0 or w.max_model_len >= needed, handle.lora)
        if target is None:
            if handle.stranded_at is None:
                handle.stranded_at, handle.lost_reason = time.monotonic(), reason
                logger.warning("request %s: %s; waiting up to %.0f s for a decode worker", handle.request_id,
                               reason, self.worker_wait_s)
            return
        handle.stranded_at = None
        handle.num_migrations += 1
        handle.decode_worker_id, handle.decode_addr = target.worker_id, target.input_addr
        target.num_inflight += 1
        target.num_routed += 1
        resume = [ResumedChoice(index=i, output_token_ids=list(handle.output_token_ids.get(i, [])))
                  for i in range(handle.num_choices) if i not in handle.finished_choices]
        self._send(target.input_addr, GenerateRequest(request_id=handle.request_id,
                                                      prompt_token_ids=handle.prompt_token_ids,
                                                      sampling_params=params, resume=resume, lora=handle.lora,
                                                      router_addr=target.router_addr))
        self.num_migrations += 1
        if self.on_migration is not None:
            self.on_migration(lost_worker or "", reason)
        logger.warning("request %s: %s; migrated to decode worker %s (%s)", handle.request_id, reason,
                       target.worker_id, ", ".join(f"choice {c.index} after {len(c.output_token_ids)} tokens"
                                                   for c in resume))

    def _fail(self, handle: RequestHandle, message: str) -> None:
        self._requests.pop(handle.request_id, None)
        self._release(handle)
        handle.queue.put_nowait(RequestFailed(message))

    def _retry_stranded(self, now: float) -> None:
        """Migrate requests still waiting for a decode worker; fail those past ``worker_wait_s``."""
        for handle in list(self._requests.values()):
            if handle.stranded_at is None:
                continue
            if now - handle.stranded_at > self.worker_wait_s:
                self._fail(handle, f"{handle.lost_reason}; no other decode worker took the request within "
                                   f"{self.worker_wait_s:g} s")
            else:
                self._migrate(handle, "resuming on a decode worker that joined")

    # --- sockets --------------------------------------------------------------------------

    def _send(self, addr: str, msg: msgspec.Struct) -> None:
        if self._sockets is None:
            raise RuntimeError("RouterEngine.start() was not called")
        self._sockets.send(addr, msg)

    def _connection_lost(self, addr: str) -> None:
        worker = next((w for w in self.registry.all() if w.input_addr == addr), None)
        if worker is None:
            return
        self.registry.remove(worker.worker_id)
        logger.warning("%s worker %s: connection lost; removed from the pool", worker.role.name.lower(),
                       worker.worker_id)
        self._worker_lost(worker, f"{worker.role.name.lower()} worker {worker.worker_id} disconnected")

    async def _recv_loop(self) -> None:
        assert self._pull is not None
        while True:
            frames = await self._pull.recv_multipart()
            try:
                msg = decode(frames)
            except ProtocolError as e:
                logger.warning("dropping malformed message: %s", e)
                continue
            try:
                self._dispatch(msg)
            except Exception:  # one bad message must not stop the router
                logger.exception("failed to handle %s", type(msg).__name__)

    def _dispatch(self, msg: msgspec.Struct) -> None:
        if isinstance(msg, RequestOutputs):
            self.registry.touch(msg.worker_id)
            for delta in msg.deltas:
                self._deliver(delta, msg.worker_id)
        elif isinstance(msg, Heartbeat):
            if not self.registry.heartbeat(msg):
                logger.debug("heartbeat from unregistered worker %s ignored", msg.worker_id)
                return
            if self.worker_stats is not None:
                self.worker_stats.observe_heartbeat(msg)
            if msg.draining:  # e.g. the router restarted while the worker drained
                self.drain(msg.worker_id, "the worker is leaving")
        elif isinstance(msg, WorkerDraining):
            if self._authentic(msg):
                self.drain(msg.worker_id, "the worker is shutting down")
        elif isinstance(msg, WorkerExiting):
            if self._authentic(msg):
                self._worker_left(msg)
        elif isinstance(msg, KVEventBatch):
            worker = self.registry.get(msg.worker_id)
            if worker is not None:  # (a worker that left, or not yet registered here, is met at registration)
                self._ask_replay(worker, self.kv_index.apply(msg))
        elif isinstance(msg, RegisterWorker):
            if not self._authentic(msg):
                return
            known = self.registry.get(msg.worker_id)
            refresh = known is not None and known.input_addr == msg.input_addr and known.role == msg.role
            replaced = self.registry.register(msg)
            self._sockets.connect(msg.input_addr)  # connect now: a dead worker is seen at once
            if replaced is not None:
                self.kv_index.forget(msg.worker_id)
            if msg.prefix_cache_salt is not None:  # what it cached before this router knew it
                self._ask_replay(self.registry.get(msg.worker_id), self.kv_index.meet(msg.worker_id, msg.num_blocks + msg.kv_offload_blocks))
            if not refresh:  # a worker new to this router (workers re-register every few seconds)
                self._warm_pairs(msg.worker_id)
            if msg.role == WorkerRole.DECODE:
                self._retry_stranded(time.monotonic())
            if replaced is not None:
                if self.worker_stats is not None:
                    self.worker_stats.observe_restart(replaced.worker_id, replaced.role)
                self._worker_lost(replaced, f"worker {replaced.worker_id} restarted")
        else:
            logger.warning("router got an unexpected %s message; dropped", type(msg).__name__)

    def _ask_replay(self, worker: WorkerInfo, from_seq: int | None) -> None:
        """Ask ``worker`` for its KV event batches from ``from_seq`` on (None: nothing to ask)."""
        if from_seq is not None:
            self._send(worker.input_addr, KVEventsReplay(from_seq=from_seq, router_addr=worker.router_addr))

    def _warm_pairs(self, worker_id: str) -> None:
        """A worker registered: have each decode worker set up its KV transfer pair with each prefill
        worker it could receive from (``WarmKVPair``), so the first request does not wait seconds
        for the connection. Idempotent on the workers' side (one pair per generation)."""
        worker = self.registry.get(worker_id)
        if worker is None:
            return
        others = self.registry.live(WorkerRole.DECODE if worker.role == WorkerRole.PREFILL else WorkerRole.PREFILL)
        for other in others:
            prefill, decode = (worker, other) if worker.role == WorkerRole.PREFILL else (other, worker)
            if prefill.kv_compatible(decode):
                self._send(decode.input_addr, WarmKVPair(prefill_worker_id=prefill.worker_id,
                                                         prefill_addr=prefill.input_addr,
                                                         prefill_layout=prefill.kv_layout))

    def _deliver(self, delta: RequestDelta, worker_id: str) -> None:
        handle = self._requests.get(delta.request_id)
        if handle is None:  # finished, aborted or failed already
            if delta.finish_reason is None:
                self._abort_orphan(delta.request_id, worker_id)
            return
        if worker_id != handle.decode_worker_id:  # from a worker the request was migrated away from
            return
        if not 0 <= delta.index < handle.num_choices:
            logger.warning("request %s: delta for choice %d of %d dropped", delta.request_id,
                           delta.index, handle.num_choices)
            return
        handle.output_token_ids.setdefault(delta.index, []).extend(delta.new_token_ids)
        self._release_prefill(handle)  # a delta means the prompt's KV is in the decode worker
        if delta.finish_reason is not None:
            handle.finished_choices.add(delta.index)
            if len(handle.finished_choices) == handle.num_choices:
                self.finish(delta.request_id)
        handle.queue.put_nowait(delta)

    def _abort_orphan(self, request_id: str, worker_id: str) -> None:
        """A worker still generates for a request the router forgot: tell it to stop (once per id)."""
        if request_id in self._orphans:
            return
        worker = self.registry.get(worker_id)
        if worker is None:
            return
        self._orphans[request_id] = None
        if len(self._orphans) > self._MAX_ORPHANS:
            self._orphans.popitem(last=False)
        self.num_orphan_aborts += 1
        logger.info("request %s: deltas from %s for a request the router no longer serves; aborting it there",
                    request_id, worker_id)
        self._send(worker.input_addr, AbortRequest(request_id=request_id))

    async def _expire_loop(self) -> None:
        interval = min(1.0, self.registry.worker_timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            for worker, reason in self.registry.expire():
                self._worker_lost(worker, reason)
            self._retry_stranded(time.monotonic())
            for worker in self.registry.all():
                self._maybe_send_drain(worker)
