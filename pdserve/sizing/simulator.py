"""``pdserve simulate``: a discrete-event simulation of a pdserve cluster, calibrated by a profile.

What runs is pdserve's own code wherever the cluster decides something: each simulated worker holds a
real ``Scheduler`` over a real ``BlockManager`` (continuous batching, chunked prefill, prefix caching,
preemption, remote-prefill admission, delayed frees while a prompt's KV is sent), configured from the
worker's profiled flags; the router is the real routing policy (``routing.make_policy``, with the real
``KVIndex`` fed by the workers' real ``KVEventPublisher`` under ``kv_aware``), load-aware prefill
placement (``prefers_local_prefill``) and the router's own request counts (``WorkerInfo``, updated as
``RouterEngine.submit`` and its releases update them). Only the model runner is replaced: a step
lasts what the profile's cost model says (``WorkerProfile.step_seconds``) and samples a fixed token;
a KV transfer lasts ``TransferProfile.transfer_seconds`` of its bytes, overlapped with the prefill
step that produced it (the real sender ships each layer as the forward finishes it); a request pays
the profile's fixed ``request_overhead_s`` outside the steps, one that finds nothing in flight the
wake-up of a cluster that sat idle as long (``WorkerProfile.wake_overhead``), and under load
``loaded_overhead_s`` plus ``overhead_per_stream_s`` for each other stream in flight (fitted by replaying a
real Poisson pass: ``loaded_fit``).

Life of a simulated request (disaggregated)::

    arrival -> router picks decode worker D and prefill worker P (or none: local prefill)
    -> D.add_request(remote_prefill) -> D's schedule parks it, reserving blocks (remote_prefills)
    -> P.add_request(max_tokens=1) -> P's steps compute the prompt
    -> transfer ends at max(step end, step start + transfer seconds) -> D.remote_kv_arrived between
       D's steps (the step in progress ends first, as D's engine loop takes arrivals): first token
    -> D's decode steps -> last token: finished, the router's counts released

The event loop is a heap of (time, sequence, callback): each step, arrival and transfer is one event,
and per token only the scheduler's own bookkeeping runs; a run of identical decode-only steps is one
event, applied in bulk when it ends (``SimWorker._start_run``: the same tokens at the same times).
With ``machine_cores`` the workers are placed on the cores as ``pdserve up`` places them: a worker
given fewer cores than it was profiled with runs its steps slower by the one-core ratios the profile
measured (in proportion to the cores where it did not), and cores shared by
workers stretch a step by the number of busy workers on its cores when it starts (processor sharing,
fixed at the step's start; a decode run is cut at the step in progress when a worker on its cores starts or
stops a prompt step or its decode steps, so the run's later steps take the new load). Each step's length is
drawn around the model's with the jitter the profile measured in the real cluster (a lognormal factor of mean
1 and the measured coefficient of variation; seeded), which spreads the tail: a step of prompt tokens alone by
lone prompts' scatter, the others by the decode streams'.

Not modelled: the router's HTTP and tokenizer work under load beyond the per-stream term (a fixed overhead
per request by prompt length, measured at idle, plus a term linear in the streams in flight, fitted at one
load), contention that grows with load otherwise,
heartbeats' lag beyond ``heartbeat_interval_s`` (a worker's heartbeat is its state when the router
reads it, at most that old), speculative decoding, LoRA, structured outputs, KV offload tiers, pulls
from peers, failures and migration.
"""

from __future__ import annotations

import bisect
import gc
import heapq
import itertools
import math
import random
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pdserve.cluster.kv_events import KVEventPublisher
from pdserve.common.protocol import Heartbeat, SamplingParams, WorkerRole, WorkerStats
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.outputs import ModelRunnerOutput
from pdserve.engine.scheduling.request import Request
from pdserve.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from pdserve.router.config import (DEFAULT_LOCAL_PREFILL_MARGIN_PER_REQUEST_S, DEFAULT_LOCAL_PREFILL_MARGIN_S,
                                   RouterConfig)
from pdserve.router.kv_index import KVIndex
from pdserve.router.registry import WorkerInfo
from pdserve.router.routing import make_policy, prefers_local_prefill
from pdserve.sizing.profile import Profile, WorkerProfile
from pdserve.sizing.sim_result import SimRecords, SimResult
from pdserve.sizing.workload import SimRequest

SAMPLED_TOKEN = 11  # the token every simulated step samples (never an EOS: outputs run to max_tokens)
_SALT = 0x5EED  # the simulated workers' block-hash salt (one model)
UTILIZATION_WINDOW_S = 2.0  # the time constant of a worker's recent busy share (prompt steps slow with load)
HOST_WINDOW_S = 1.0  # the time constant of the host processes' recent CPU demand (``Simulator.host_share``)
HOST_SHARE_CAP = 0.5  # the most of a core they take from a busy worker (the scheduler shares a core fairly)
HOST_IDLE_FLOOR = 0.05  # below this idle share a core on average, the host's CPU is spread evenly
HOST_PLACED_MAX_CORES = 64  # on more cores the host's CPU is spread evenly (host_share reads every core a step)
HOST_LOADS = ("none", "router", "router+client")
JITTER_LEVELS = 4096  # a step's jitter is one of this many equally likely quantiles of its lognormal


@dataclass
class SimConfig:
    """The simulated cluster.

    Args:
        num_prefill, num_decode: pool sizes (0 prefill workers: colocated, each worker prefills and
            decodes with the profile's ``colocated`` kind).
        routing_policy, routing_prefix_blocks, routing_balance_factor, local_prefill_margin_s,
            local_prefill_margin_per_request_s: the router's flags (``pdserve up``'s defaults).
        heartbeat_interval_s: how old a worker's load figures may be when the router reads them.
        machine_cores: cores the workers share, placed as ``pdserve up`` places them (None: each
            worker has the cores it was profiled with to itself).
        kv_cache_memory: bytes of KV cache per worker (None: as profiled).
        max_num_seqs, max_num_batched_tokens: override the profiled worker flags (None: as profiled).
        step_jitter: draw each step's seconds from a lognormal distribution around the cost model's with
            the profile's ``serving_step_cv`` (False: every step exactly the model's).
        seed: seeds the jitter.
        decode_runs: advance a worker's identical decode-only steps as one event (``SimWorker._start_run``);
            False: an event per step (the same schedule: the tests compare the two).
        host_load: with ``machine_cores``, which of the cluster's other processes run on those cores
            too and take CPU from the steps by the profile's ``host_cpu_seconds``: ``router`` (the
            router: ``pdserve up`` on one machine), ``router+client`` (and the benchmark's client, as on
            a machine that runs the benchmark too), ``none``.
    """

    num_prefill: int
    num_decode: int
    routing_policy: str = RouterConfig.routing_policy
    routing_prefix_blocks: int = RouterConfig.routing_prefix_blocks
    routing_balance_factor: float = RouterConfig.routing_balance_factor
    local_prefill_margin_s: float = DEFAULT_LOCAL_PREFILL_MARGIN_S
    local_prefill_margin_per_request_s: float = DEFAULT_LOCAL_PREFILL_MARGIN_PER_REQUEST_S
    heartbeat_interval_s: float = 1.0
    machine_cores: int | None = None
    kv_cache_memory: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    step_jitter: bool = True
    seed: int = 0
    decode_runs: bool = True
    host_load: str = "router"

    def __post_init__(self):
        if self.host_load not in HOST_LOADS:
            raise ValueError(f"host_load is one of {', '.join(HOST_LOADS)}, got {self.host_load!r}")
        if self.num_decode < 1:
            raise ValueError(f"a cluster needs at least one decode worker, got {self.num_decode}")
        if self.num_prefill < 0:
            raise ValueError(f"num_prefill must be >= 0, got {self.num_prefill}")
        if self.machine_cores is not None and self.machine_cores < 1:
            raise ValueError(f"machine_cores must be >= 1, got {self.machine_cores}")


class _Tracked:
    """What the simulator keeps of one request in flight (the router's handle, the client's clock)."""

    __slots__ = ("index", "arrival", "prompt_len", "output_len", "decode", "prefill", "site", "site_tokens",
                 "prefill_pending", "first", "last", "tokens", "decode_cached", "half_overhead", "reached", "sent",
                 "computed")

    def __init__(self, sim_request: SimRequest):
        self.index = sim_request.index
        self.arrival = sim_request.arrival_s
        self.prompt_len = len(sim_request.prompt_token_ids)
        self.output_len = sim_request.output_len
        self.decode: SimWorker | None = None
        self.prefill: SimWorker | None = None
        self.site: SimWorker | None = None
        self.site_tokens = 0
        self.prefill_pending = False
        self.first = -1.0
        self.last = -1.0
        self.tokens = 0
        self.decode_cached = 0
        self.half_overhead = 0.0
        self.reached = self.sent = self.computed = -1.0  # reached the decode worker, prompt sent, computed


class _Run:
    """A run of decode steps: the scheduler's first step (``out``), when it began, each step's end time,
    and the token naming its current end event."""

    __slots__ = ("out", "start", "ends", "token")

    def __init__(self, out, start: float, ends: list[float], token: int):
        self.out, self.start, self.ends, self.token = out, start, ends, token


class SimWorker:
    """One simulated worker: a real scheduler and block manager, a profiled step time, the router's view."""

    def __init__(self, sim: "Simulator", worker_id: str, role: WorkerRole, profile: WorkerProfile,
                 num_blocks: int, max_num_seqs: int, max_num_batched_tokens: int, cores: tuple[int, ...]):
        self.sim = sim
        self.worker_id = worker_id
        self.role = role
        self.profile = profile
        self.cores = cores
        self.ranks = profile.tensor_parallel_size * profile.pipeline_parallel_size
        self.block_manager = BlockManager(num_blocks, profile.block_size,
                                          enable_prefix_caching=profile.enable_prefix_caching, salt=_SALT)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=profile.max_model_len, remote_prefill_threshold=profile.remote_prefill_threshold,
            long_prefill_token_threshold=profile.long_prefill_token_threshold,
            prefill_admission=profile.prefill_admission), self.block_manager)
        self.info = WorkerInfo(worker_id=worker_id, role=role, input_addr=worker_id, model_name="sim",
                               num_blocks=num_blocks, block_size=profile.block_size,
                               max_model_len=profile.max_model_len, registered_at=0.0, last_seen=0.0,
                               prefix_cache_salt=_SALT if profile.enable_prefix_caching else None)
        self.publisher = KVEventPublisher(worker_id, self.block_manager) if sim.index is not None \
            and profile.enable_prefix_caching else None
        # placed on fewer cores than profiled: (prompt steps, decode-only steps) this much slower
        self.core_shortfall = (profile.fewer_cores_slowdown(len(cores), True),
                               profile.fewer_cores_slowdown(len(cores), False))
        cv = profile.serving_step_cv
        # a step's length over the model's: levels[int(random() * JITTER_LEVELS)], lognormal of mean 1 and
        # coefficient of variation cv (None: no jitter)
        self.jitter_levels = sim.jitter_levels(cv) if cv > 0 and sim.config.step_jitter else None
        # a step of prompt tokens alone: the scatter lone prompts showed, where measured
        cv = profile.serving_prefill_cv
        self.prompt_jitter_levels = sim.jitter_levels(cv) if cv > 0 and sim.config.step_jitter else self.jitter_levels
        self.busy = False
        self.core_share = 1.0  # of its core the step in progress computes (a decode step waits part of its time)
        self.load_kind = 0  # what it runs on its cores: 0 nothing, 1 decode steps, 2 a step with prompt rows
        self.run: _Run | None = None  # the decode run in progress
        self.arrived_kv: list[str] = []  # requests whose KV arrived during the step in progress
        self.request_cpu = 0.0  # seconds of work on requests taken in since the last step (its next one waits)
        self.num_runs = 0
        self.heartbeat_at = -math.inf
        self.busy_seconds = 0.0
        self._busy_recent, self._busy_at = 0.0, 0.0  # step seconds, each decayed by its age at _busy_at
        # only a worker whose prompt steps slow with its load keeps its recent utilisation (a prefill worker)
        self.load_aware = profile.serving_prefill_utilization > 0 and bool(profile.serving_prefill_idle_seconds)
        self.num_steps = 0
        self.prefill_tokens = 0
        self.prefill_seconds = 0.0

    # ---- the router's view -----------------------------------------------------------------

    def refresh_heartbeat(self, now: float) -> None:
        """The worker's load as its latest heartbeat says it (at most ``heartbeat_interval_s`` old)."""
        if now - self.heartbeat_at < self.sim.config.heartbeat_interval_s:
            return
        self.heartbeat_at = now
        s = self.scheduler
        self.info.heartbeat = Heartbeat(
            worker_id=self.worker_id, role=self.role, num_running=s.num_running, num_waiting=s.num_waiting,
            num_free_blocks=self.block_manager.num_free_blocks, num_blocks=self.block_manager.num_blocks,
            stats=WorkerStats(prefill_compute_tokens=self.prefill_tokens,
                              prefill_compute_seconds=self.prefill_seconds))

    def _busy(self, end: float, seconds: float) -> None:
        """Count ``seconds`` of steps ending at ``end`` in the worker's recent busy share (``utilization``)."""
        self._busy_recent = self._busy_recent * math.exp((self._busy_at - end) / UTILIZATION_WINDOW_S) + seconds
        self._busy_at = end

    def utilization(self, now: float) -> float:
        """The worker's busy share lately: its step seconds weighted by ``exp(-age / UTILIZATION_WINDOW_S)``
        over the window (1 for a worker busy throughout; counts the steps this worker timed one by one,
        which every prompt step is)."""
        return min(1.0, self._busy_recent * math.exp((self._busy_at - now) / UTILIZATION_WINDOW_S)
                   / UTILIZATION_WINDOW_S)

    # ---- the step loop ---------------------------------------------------------------------

    def kick(self, now: float) -> None:
        """Start a step if the worker is idle and has something to schedule; cut its decode run short at
        the step in progress if it is in one (something new waits for the next step)."""
        if self.run is not None:
            self._cut_run(now)
        elif not self.busy and self.scheduler.has_unfinished():
            self.busy = True
            self.sim.at(now, self._step)

    def _step(self, now: float) -> None:
        out = self.scheduler.schedule()
        for request in out.remote_prefills:
            self.sim.send_remote_prefill(self, request, now)
        if not out.scheduled:
            self.busy = False  # waiting for KV, blocks or arrivals: an event kicks it again
            self._load_changed(now, 0)
            return
        prompt_tokens = pairs = num_decode = context = 0
        for request, num_new in out.scheduled:
            computed = request.num_computed_tokens
            if num_new == 1 and computed == request.num_tokens - 1 and request.num_output_tokens:
                num_decode += 1
                context += computed + 1
            else:
                prompt_tokens += num_new
                pairs += num_new * (computed + num_new / 2)
        self.core_share = 1.0 if prompt_tokens else self.profile.decode_cpu_share(num_decode, context / num_decode)
        self._load_changed(now, 2 if prompt_tokens else 1)
        if not prompt_tokens and self.sim.config.decode_runs and self._start_run(now, out, num_decode, context):
            return
        utilization = self.utilization(now) if prompt_tokens and self.load_aware else None
        seconds = self.profile.step_seconds(prompt_tokens, pairs, num_decode,
                                            context / num_decode if num_decode else 0.0, utilization)
        seconds *= self.sim.core_contention(self, prompt_tokens > 0, now, num_decode, seconds,
                                            (prompt_tokens, utilization) if utilization is not None else None)
        levels = self.prompt_jitter_levels if prompt_tokens and not num_decode else self.jitter_levels
        if levels:  # a shared machine's step times scatter around the model's (mean kept)
            seconds *= levels[int(self.sim.rng.random() * JITTER_LEVELS)]
        if self.request_cpu:  # the engine loop's work on the requests it took in runs before this step
            seconds += self.request_cpu * self.sim.core_contention(self, False, now)
            self.request_cpu = 0.0
        if self.load_aware or self.sim.host_placed:
            self._busy(now + seconds, seconds)
        self.busy_seconds += seconds
        self.num_steps += 1
        if prompt_tokens:
            self.prefill_tokens += prompt_tokens
            self.prefill_seconds += seconds
        self.sim.at(now + seconds, self._step_done, out, now)

    def _step_done(self, now: float, out, started: float) -> None:
        sampled = {request.request_id: SAMPLED_TOKEN for request, num_new in out.scheduled
                   if request.num_computed_tokens + num_new >= request.num_tokens}
        outputs = self.scheduler.update_from_output(out, ModelRunnerOutput(sampled_token_ids=sampled))
        sim = self.sim
        if self.role == WorkerRole.PREFILL:
            for output in outputs:
                sim.prefill_done(self, output.request, now, started)
        else:
            tokens = sim._tokens
            for output in outputs:
                tokens(output.request.request_id, len(output.new_token_ids), output.finished is not None, now)
        if self.publisher is not None:
            self.publish()
        if self.arrived_kv:  # KV that arrived during the step: the engine loop takes it before the next one
            arrived, self.arrived_kv = self.arrived_kv, []
            for request_id in arrived:
                sim.take_kv(self, request_id, now)
        if self.scheduler.has_unfinished():
            self._step(now)  # the next step starts as this one ends
        else:
            self.busy = False
            self._load_changed(now, 0)

    def _load_changed(self, now: float, kind: int) -> None:
        """This worker now runs ``kind`` on its cores (``load_kind``). Where that changed, a worker sharing
        its cores cuts its decode run at the step in progress, so the steps after it are priced with the
        cores' new load (``Simulator.core_contention``), not the load when the run began."""
        if kind == self.load_kind:
            return
        self.load_kind = kind
        for other in self.sim._shared[self.worker_id]:
            if other.run is not None:
                other._cut_run(now)

    # ---- decode runs: identical decode-only steps advanced in bulk -----------------------------------

    def _start_run(self, now: float, out, num_decode: int, context: int) -> bool:
        """If the scheduler's step ``out`` is a decode-only step of every running request with nothing
        waiting, the steps after it are the same decision until a request finishes or something new
        reaches the worker: schedule them as one run (ending when its first request finishes) instead of
        an event per step. True if a run started. ``_cut_run`` ends it early, ``_run_end`` applies it."""
        sched = self.scheduler
        if out.block_copies or out.remote_prefills or out.preempted or sched.waiting \
                or len(out.scheduled) != len(sched.running) or self.request_cpu:  # that work: one step first
            return False
        steps = min(min(r.sampling_params.max_tokens - r.num_output_tokens, sched.config.max_model_len - r.num_tokens)
                    for r, _ in out.scheduled)
        if steps < 2:
            return False
        bs = self.profile.block_size
        needed = sum(max(0, -(-(r.num_computed_tokens + steps) // bs) - len(r.block_table)) for r, _ in out.scheduled)
        if not self.block_manager.can_allocate(needed):  # the run's blocks must be there without preempting
            return False
        mean_context = context / num_decode
        # the step grows linearly with the context within a grid cell: its first and last length give the rest
        first = self.profile.step_seconds(0, 0.0, num_decode, mean_context)
        factor = self.sim.core_contention(self, False, now, num_decode, first)
        first *= factor
        last = self.profile.step_seconds(0, 0.0, num_decode, mean_context + steps - 1) * factor
        slope = (last - first) / (steps - 1)
        ends, t = [], now
        levels = self.jitter_levels
        if levels:
            draw = self.sim.rng.random
            for i in range(steps):
                t += (first + slope * i) * levels[int(draw() * JITTER_LEVELS)]
                ends.append(t)
        else:
            for i in range(steps):
                t += first + slope * i
                ends.append(t)
        self.run = _Run(out, now, ends, next(self.sim._seq))
        self.sim.at(ends[-1], self._run_end, self.run.token)
        return True

    def _cut_run(self, now: float) -> None:
        """End the run with the step in progress at ``now``."""
        run = self.run
        j = bisect.bisect_left(run.ends, now)
        if j >= len(run.ends) - 1:
            return  # in its last step already
        del run.ends[j + 1:]
        run.token = next(self.sim._seq)  # the event at the old end is stale
        self.sim.at(run.ends[-1], self._run_end, run.token)

    def _run_end(self, now: float, token: int) -> None:
        """The run's last step ended: its earlier steps are applied in bulk to each request (tokens, KV
        slots, full blocks cached, the client's token times), its last one through the scheduler's own
        ``update_from_output``; then the worker schedules again."""
        run = self.run
        if run is None or run.token != token:
            return
        self.run = None
        ends, out = run.ends, run.out
        bulk = len(ends) - 1
        self.num_steps += len(ends)
        self.num_runs += 1
        self.busy_seconds += ends[-1] - run.start
        if self.sim.host_placed:
            self._busy(ends[-1], ends[-1] - run.start)
        if bulk:
            kv = self.scheduler.kv
            sim = self.sim
            copies: list = []
            for request, _ in out.scheduled:
                request.output_token_ids.extend([SAMPLED_TOKEN] * bulk)
                request.num_computed_tokens += bulk
                if not kv.allocate_slots(request, request.num_computed_tokens + 1, copies):
                    raise AssertionError("a decode run's blocks were checked free at its start")
                kv.cache_full_blocks(request)
                sim.tokens_in_run(request.request_id, ends[0], bulk, ends[bulk - 1])
            sim._records.itl.add_gaps(ends, bulk, len(out.scheduled))
        self._step_done(now, out, ends[-2] if bulk else run.start)

    def publish(self) -> None:
        """Hand the step's KV events to the router's index (kv_aware)."""
        if self.publisher is not None:
            batch = self.publisher.poll()
            if batch is not None:
                self.sim.index.apply(batch)


class Simulator:
    """Runs a workload through a simulated cluster. ``run`` returns ``SimResult``.

    Args:
        profile: the measured workers (``pdserve profile``).
        config: the cluster (pools, router flags, shared cores).
        on_progress: called with the number of requests finished so far, every few thousand.
    """

    def __init__(self, profile: Profile, config: SimConfig, on_progress: Callable[[int], None] | None = None):
        self.profile = profile
        self.config = config
        self.on_progress = on_progress
        self.index = KVIndex(now=lambda: self.now) if config.routing_policy == "kv_aware" else None
        self.policy = make_policy(config.routing_policy, config.routing_prefix_blocks,
                                  config.routing_balance_factor, self.index)
        self.now = 0.0
        self.rng = random.Random(config.seed)
        self._jitter_levels: dict[float, list[float]] = {}
        self._heap: list = []
        self._seq = itertools.count()
        colocated = config.num_prefill == 0
        decode_kind = "colocated" if colocated else "decode"
        if not colocated and profile.transfer is None:
            raise ValueError("the profile has no KV transfer figures: disaggregated runs need them "
                             "(pdserve profile measures them unless --kinds leaves prefill or decode out)")
        placements = self._place(config.num_prefill, profile.worker("prefill") if not colocated else None,
                                 config.num_decode, profile.worker(decode_kind))
        self.prefill_workers = [self._worker(f"prefill-{i}", WorkerRole.PREFILL, profile.worker("prefill"),
                                             placements[f"prefill-{i}"]) for i in range(config.num_prefill)]
        self.decode_workers = [self._worker(f"decode-{i}", WorkerRole.DECODE, profile.worker(decode_kind),
                                            placements[f"decode-{i}"]) for i in range(config.num_decode)]
        self._core_users: dict[int, list[SimWorker]] = {}
        for w in (*self.prefill_workers, *self.decode_workers):
            for c in w.cores:
                self._core_users.setdefault(c, []).append(w)
        self._shared = {w.worker_id: sorted({u.worker_id: u for c in w.cores for u in self._core_users[c]
                                             if u is not w}.values(), key=lambda u: u.worker_id)
                        for w in (*self.prefill_workers, *self.decode_workers)}
        self._reads_heartbeats = config.routing_policy != "round_robin"
        self._infos = {WorkerRole.PREFILL: [w.info for w in self.prefill_workers],
                       WorkerRole.DECODE: [w.info for w in self.decode_workers]}
        self._by_id = {w.worker_id: w for w in (*self.prefill_workers, *self.decode_workers)}
        self.tracked: dict[str, _Tracked] = {}
        self._idle_since: float | None = None  # when the client last saw the cluster go idle (None: not yet)
        self._overhead_profile = profile.worker(decode_kind)
        # the host processes sharing the workers' cores: their CPU seconds per request and per token, as a
        # run of this config adds them and as the serving grid's measurement had them (router and client)
        self._host_cost: tuple[float, float] | None = None
        self._host_embedded = (0.0, 0.0)
        self._host_recent = self._host_at = 0.0
        self._host_recent_tokens = 0.0
        self.host_placed = False  # the host's CPU placed by the cores' idle time (host_share): set below
        figures = self._overhead_profile.host_cpu_seconds
        names = {"router": ("router",), "router+client": ("router", "client")}.get(config.host_load, ())
        if config.machine_cores and names and all(n in figures for n in names):
            self._host_cost = (sum(figures[n][0] for n in names), sum(figures[n][1] for n in names))
            self._host_embedded = (sum(f[0] for f in figures.values()), sum(f[1] for f in figures.values()))
            self._profiled_cores = profile.machine.get("cores") or self._overhead_profile.cores
            self.host_placed = config.machine_cores <= HOST_PLACED_MAX_CORES

    # ---- building -----------------------------------------------------------------------

    def _place(self, num_prefill: int, prefill: WorkerProfile | None, num_decode: int,
               decode: WorkerProfile) -> dict[str, tuple[int, ...]]:
        """Each worker's cores: its own (profiled count) unless ``machine_cores`` is set, then an even
        share with the least-used cores first, as ``ClusterLauncher._cores_for`` places them."""
        names = [(f"prefill-{i}", prefill) for i in range(num_prefill)] + \
                [(f"decode-{i}", decode) for i in range(num_decode)]
        if self.config.machine_cores is None:
            placed, next_core = {}, 0
            for name, wp in names:
                n = wp.cores * wp.tensor_parallel_size * wp.pipeline_parallel_size
                placed[name] = tuple(range(next_core, next_core + n))
                next_core += n
            return placed
        available = list(range(self.config.machine_cores))
        num_ranks = sum(wp.tensor_parallel_size * wp.pipeline_parallel_size for _, wp in names)
        per_rank = max(1, len(available) // max(1, num_ranks))
        used = {c: 0 for c in available}
        placed = {}
        for name, wp in names:
            want = min(len(available), per_rank * wp.tensor_parallel_size * wp.pipeline_parallel_size)
            cores = tuple(sorted(sorted(available, key=lambda c: (used[c], c))[:want]))
            for c in cores:
                used[c] += 1
            placed[name] = cores
        return placed

    def _worker(self, worker_id: str, role: WorkerRole, wp: WorkerProfile, cores: tuple[int, ...]) -> SimWorker:
        cfg = self.config
        num_blocks = wp.num_blocks if cfg.kv_cache_memory is None else max(1, cfg.kv_cache_memory // wp.block_bytes)
        return SimWorker(self, worker_id, role, wp, num_blocks, cfg.max_num_seqs or wp.max_num_seqs,
                         cfg.max_num_batched_tokens or wp.max_num_batched_tokens, cores)

    def jitter_levels(self, cv: float) -> list[float]:
        """``JITTER_LEVELS`` step-length factors, equally likely, of a lognormal distribution of mean 1 and
        coefficient of variation ``cv``: its quantiles at the levels' midpoints, scaled to mean 1 exactly.
        One uniform draw picks one (a Gaussian draw and an ``exp`` per step cost more than the rest of a
        decode run's step); the tail past the last level's quantile (p99.99) is cut."""
        levels = self._jitter_levels.get(cv)
        if levels is None:
            sigma = math.sqrt(math.log1p(cv * cv))
            normal = statistics.NormalDist(-sigma * sigma / 2, sigma)
            levels = [math.exp(normal.inv_cdf((k + 0.5) / JITTER_LEVELS)) for k in range(JITTER_LEVELS)]
            mean = sum(levels) / JITTER_LEVELS
            levels = self._jitter_levels[cv] = [v / mean for v in levels]
        return levels

    def core_contention(self, worker: SimWorker, prompt: bool, now: float = 0.0, batch: int = 0,
                        step: float = 0.0, loaded: tuple[int, float] | None = None) -> float:
        """How much slower ``worker``'s step (``prompt``: one with prompt rows; else ``batch`` decode rows in
        ``step`` seconds as the profile gives them) runs than profiled: fewer cores than it was profiled
        with (``WorkerProfile.fewer_cores_slowdown``), the workers sharing its cores that are busy now (one
        more share each: all of a core for a prompt step, a decode step's computing part,
        ``WorkerProfile.decode_cpu_share``), and the host processes' share of the machine
        (``host_share``: a step takes ``1 / (1 - share)`` as long), net of the share the profile's own
        measurement had: for a decode step priced from a colocated serving grid, the grid's requests through
        the router and the client (the host's work on the tokens the streams send is in the grid's steps
        as in serving's, so neither side counts it: ``host_share(tokens=False)``), and for a prompt
        step priced from the loaded prefill hop (``loaded``: its prompt tokens and the worker's
        utilisation, as ``prefill_slowdown`` took them) that pass's arrivals and tokens, in the part of its
        slowdown the step takes."""
        shared = self._shared[worker.worker_id]
        busy = 1.0 + sum(u.core_share for u in shared if u.busy and u is not worker) if shared else 1.0
        factor = busy * worker.core_shortfall[0 if prompt else 1]
        if self._host_cost is not None:
            # a colocated grid: its worker had every core, beside the router and the client; a decode worker's
            # grid (1P+1D) kept its core busy and the prefill worker's idle, and the router and the client ran on
            # the idle one (host_share): its steps hold none of their CPU
            grid = not prompt and batch > 0 and step > 0 and bool(worker.profile.serving_decode_seconds) \
                and worker.profile.kind != "decode"
            # a colocated grid's step already holds the host's work on the tokens its streams sent: the router and
            # the client take each token as the step makes it, in the grid as in serving, so only the requests'
            # part is swapped (the grid's out, the recent arrivals' in); the calibration runs of 2026-12-03 had
            # the simulated colocated TPOT p50 12-36% under the real one with both parts swapped
            factor /= 1.0 - self.host_share(now, worker, tokens=not grid)
            # the measurement the step is priced from ran its streams (of serving_stream_tokens tokens each)
            # at ``rate`` requests a second through the router and the client; ``taken``: of its slowdown
            rate, taken = 0.0, 1.0
            if grid:
                rate = batch / step / worker.profile.serving_stream_tokens
            elif loaded is not None:
                rate, taken = worker.profile.loaded_share(*loaded)
            if rate:
                per_request, per_token = self._host_embedded
                streamed = 0.0 if grid else per_token * worker.profile.serving_stream_tokens
                embedded = rate * (per_request + streamed)
                factor *= 1.0 - min(HOST_SHARE_CAP, embedded / self._profiled_cores) * taken
        return factor

    def host_share(self, now: float, worker: SimWorker | None = None, tokens: bool = True) -> float:
        """The share of ``worker``'s step time (None: of each of ``machine_cores``, spread evenly) the host
        processes (``SimConfig.host_load``) take now, at most ``HOST_SHARE_CAP``: their CPU demand, the requests
        and (``tokens``; False: the requests alone) tokens of the last ``HOST_WINDOW_S`` (decayed) times the
        profile's CPU seconds of each, spread over
        the cores in proportion to the time each core's workers left idle lately (their ``utilization``), evenly
        where the cores are all busy. A worker with a thread on each of several cores runs a step in lock step (a
        step waits for the thread whose core the router or the client took, while the others spin at the
        barrier): it loses the chance that any of its cores is taken. The kernel runs a woken router or client on
        an idle core: on the Xeon of 2026-12-02, beside a decode worker busy with 24 streams, a 1P+1D prefill
        worker's prompt took 33 ms where it took 12 alone (13-15 when the 24 did not stream), and the decode
        steps were as fast either way."""
        recent = self._host_recent if tokens else max(0.0, self._host_recent - self._host_recent_tokens)
        demand = recent * math.exp(min(0.0, self._host_at - now) / HOST_WINDOW_S) / HOST_WINDOW_S
        cores = self.config.machine_cores
        if worker is None:
            return min(HOST_SHARE_CAP, demand / cores)
        shares = [min(1.0, demand / cores)] * len(worker.cores)  # each of its cores': spread evenly
        if self.host_placed:  # or by the time each core's workers left idle lately
            idle = [1.0 - max((u.utilization(now) for u in self._core_users.get(c, ())), default=0.0)
                    for c in range(cores)]
            total = sum(idle)
            if total >= HOST_IDLE_FLOOR * cores:
                shares = [min(1.0, demand * idle[c] / total) for c in worker.cores]
        if worker.profile.threads < 2 or len(worker.cores) < 2:  # no lock step: the mean of its cores'
            return min(HOST_SHARE_CAP, sum(shares) / len(shares))
        kept = 1.0
        for share in shares:
            kept *= 1.0 - share
        return min(HOST_SHARE_CAP, 1.0 - kept)

    def _host_work(self, now: float, cpu_seconds: float, tokens: bool = False) -> None:
        """The host processes spent ``cpu_seconds`` at ``now`` (a request in, or ``tokens``: tokens out)."""
        now = max(now, self._host_at)
        decay = math.exp((self._host_at - now) / HOST_WINDOW_S)
        self._host_recent = self._host_recent * decay + cpu_seconds
        self._host_recent_tokens = self._host_recent_tokens * decay + (cpu_seconds if tokens else 0.0)
        self._host_at = now

    # ---- events -------------------------------------------------------------------------

    def at(self, t: float, fn: Callable, *args) -> None:
        """Run ``fn(t, *args)`` at simulated time ``t`` (events at equal times run in the order queued)."""
        heapq.heappush(self._heap, (t, next(self._seq), fn, args))

    def run(self, workload: Iterable[SimRequest], percentiles: Iterable[float] = (50.0, 90.0, 99.0),
            goodput_slos: dict[str, float] | None = None) -> "SimResult":
        """Simulate every request of ``workload`` (arrival order) to its last token."""
        wall = time.perf_counter()
        self._records = SimRecords()
        arrivals = iter(workload)
        self._next_arrival(arrivals)
        heap = self._heap
        num_events = 0
        # The workers' caches hold millions of objects that live for the whole run: the cyclic garbage
        # collector's passes over them cost a quarter of the run, and the simulation makes no cycles.
        collecting = gc.isenabled()
        gc.disable()
        try:
            while heap:
                t, _, fn, args = heapq.heappop(heap)
                self.now = t
                fn(t, *args)
                num_events += 1
        finally:
            if collecting:
                gc.enable()
        leftover = sum(w.scheduler.has_unfinished() for w in (*self.prefill_workers, *self.decode_workers))
        if self.tracked or leftover:
            raise RuntimeError(f"simulation stalled with {len(self.tracked)} requests unfinished "
                               f"({leftover} workers still hold requests)")
        return SimResult.build(self, list(percentiles), goodput_slos, num_events, time.perf_counter() - wall)

    def _next_arrival(self, arrivals) -> None:
        request = next(arrivals, None)
        if request is not None:
            self.at(request.arrival_s, self._arrive, request, arrivals)

    def _arrive(self, now: float, sim_request: SimRequest, arrivals) -> None:
        self._next_arrival(arrivals)
        self._records.sample_kv(self, now)
        if self._host_cost is not None:
            self._host_work(now, self._host_cost[0])
        tracked = _Tracked(sim_request)
        prompt = sim_request.prompt_token_ids
        decode = self._route(WorkerRole.DECODE, self.decode_workers, prompt, now)
        prefill = self._route(WorkerRole.PREFILL, self.prefill_workers, prompt, now) if self.prefill_workers \
            else None
        if prefill is not None:
            decode.refresh_heartbeat(now)
            prefill.refresh_heartbeat(now)
            if prefers_local_prefill(decode.info, prefill.info, len(prompt), self.config.local_prefill_margin_s,
                                     self.config.local_prefill_margin_per_request_s,
                                     self.policy.cached_tokens(decode.info, prompt),
                                     self.policy.cached_tokens(prefill.info, prompt)):
                prefill = None
        # RouterEngine.submit's counts
        tracked.decode, tracked.prefill = decode, prefill
        decode.info.num_inflight += 1
        decode.info.num_routed += 1
        if prefill is not None:
            prefill.info.num_routed += 1
            prefill.info.num_prefill_pending += 1
            tracked.prefill_pending = True
        site = prefill or decode
        tracked.site = site
        tracked.site_tokens = len(prompt) - self.policy.cached_tokens(site.info, prompt)
        site.info.prefill_pending_tokens += tracked.site_tokens
        request_id = f"r{sim_request.index}"
        self.tracked[request_id] = tracked
        request = Request(request_id, prompt, SamplingParams(max_tokens=sim_request.output_len, ignore_eos=True),
                          max_model_len=decode.profile.max_model_len)
        request.arrival_time = now
        overhead = self._overhead_profile.request_overhead(len(prompt)) or self.profile.request_overhead_s
        if len(self.tracked) == 1 and self._idle_since is not None:  # the first in flight wakes the cluster
            overhead += self._overhead_profile.wake_overhead(now - self._idle_since, len(prompt))
        # under load, and for each other stream in flight (the router's and the client's loops: loaded_fit)
        loaded, others = self._overhead_profile, len(self.tracked) - 1
        overhead = max(0.0, overhead + loaded.loaded_overhead_s + loaded.overhead_per_stream_s * others)
        tracked.half_overhead = overhead / 2  # half on the way in, half on the way out
        self.at(now + tracked.half_overhead, self._reach_decode, decode, request, prefill is not None)

    def _route(self, role: WorkerRole, workers: list[SimWorker], prompt: list[int], now: float) -> SimWorker:
        """The worker the routing policy picks among every one of ``role`` (the pools do not change)."""
        if self._reads_heartbeats:  # the policy reads every candidate's load, as the router does
            for w in workers:
                w.refresh_heartbeat(now)
        info, _ = self.policy.pick(role, self._infos[role], prompt)
        return self._by_id[info.worker_id]

    def _reach_decode(self, now: float, decode: SimWorker, request: Request, remote: bool) -> None:
        self.tracked[request.request_id].reached = now
        decode.scheduler.add_request(request, remote_prefill=remote)
        decode.kick(now)

    def send_remote_prefill(self, decode: SimWorker, request: Request, now: float) -> None:
        """``decode`` parked ``request`` for its prompt's KV: its prefill worker gets the prompt."""
        tracked = self.tracked[request.request_id]
        prefill = tracked.prefill
        if prefill is None:  # the decode worker prefills itself after all (never the case: it was routed)
            raise AssertionError(f"{request.request_id} waits for KV without a prefill worker")
        tracked.decode_cached = request.num_cached_tokens
        # the decode worker's own work on the request (its engine loop taking it in, the message on to the
        # prefill worker), as the profile measured it at idle, on the decode worker's core as shared now
        admission = decode.profile.admission_seconds(request.num_prompt_tokens)
        if admission:
            self.at(now + admission * self.core_contention(decode, False, now), self._send_prompt, request)
        else:
            self._send_prompt(now, request)

    def _send_prompt(self, now: float, request: Request) -> None:
        """The prefill worker gets ``request``'s prompt (``send_remote_prefill``)."""
        tracked = self.tracked[request.request_id]
        prefill = tracked.prefill
        tracked.sent = now
        self._records.hop("decode_admission", now - tracked.reached)
        remote = Request(request.request_id, request.prompt_token_ids, SamplingParams(max_tokens=1, ignore_eos=True),
                         max_model_len=prefill.profile.max_model_len)
        remote.delay_free_blocks = True  # its blocks are read by the sends until the KV has arrived
        remote.prompt_hashes = request.prompt_hashes  # the same prompt: hashed once (used if the salt matches)
        prefill.scheduler.add_request(remote)
        prefill.kick(now)

    def prefill_done(self, worker: SimWorker, request: Request, now: float, started: float) -> None:
        """A prefill worker computed ``request``'s prompt in the step that began at ``started``: its KV
        (the blocks the decode worker lacks) reaches the decode worker as the transfer allows."""
        tracked = self.tracked[request.request_id]
        tracked.computed = now
        hop = self._records.hop
        hop("prefill_queue", started - tracked.sent)
        hop("prefill_compute", now - started)
        bs = worker.profile.block_size
        num_blocks = -(-request.num_prompt_tokens // bs) - tracked.decode_cached // bs
        seconds = self.profile.transfer.transfer_seconds(num_blocks * worker.profile.block_bytes)
        # the sends overlap the step layer by layer; what the cluster measured after the last step (the last
        # layers' sends, the decode worker taking the KV) follows it, on cores shared as the step's are
        tail = tracked.decode.profile.kv_transfer_tail(request.num_prompt_tokens)
        if tail:
            tail *= self.core_contention(worker, True, now)
        self.at(max(now + tail, started + seconds), self._kv_arrived, worker, tracked.decode, request.request_id)

    def _kv_arrived(self, now: float, prefill: SimWorker, decode: SimWorker, request_id: str) -> None:
        """The prompt's KV is in ``decode``'s cache: the prefill worker frees its blocks; the decode worker
        takes the request in (its first token out) now if it is idle, else between its steps, as its
        engine loop does: the step in progress (a run: cut there) ends first. A single-rank decode worker
        sends the first token of a request with more than one to generate at once even so
        (``decode_worker.first_token.FirstTokenWatch`` checks the KV on the mailbox's threads while a step
        runs; a worker of several ranks receives between steps): until the forty-third session the
        simulator held it for the step, which a model of 40 ms decode steps and 0.8 s local prefills (the
        bench preset) priced at 150 ms of ``kv_transfer`` hop where the real one was 1.5 ms."""
        prefill.scheduler.free_delayed(request_id)
        prefill.publish()
        prefill.kick(now)
        if decode.busy:
            tracked = self.tracked[request_id]
            if decode.ranks == 1 and tracked.output_len > 1:
                self._records.hop("kv_transfer", now - tracked.computed)
                self._tokens(request_id, 1, False, now)
            decode.arrived_kv.append(request_id)
            if decode.run is not None:
                decode._cut_run(now)
            return
        self.take_kv(decode, request_id, now)
        decode.kick(now)

    def take_kv(self, decode: SimWorker, request_id: str, now: float) -> None:
        """``decode``'s scheduler takes in ``request_id``, whose KV has arrived: its first token."""
        tracked = self.tracked[request_id]
        sent_early = tracked.first >= 0  # its first token went while a step ran (``_kv_arrived``)
        if not sent_early:
            self._records.hop("kv_transfer", now - tracked.computed)
        # its process's work outside the steps (taking it in, its KV received, checked, installed). With the host
        # processes on the machine's cores it is CPU like theirs, on whichever core was left idle lately
        # (``host_share``): most of it is the KV receiving thread's, beside the engine loop, not in its way. Put
        # between the loop's steps, it had 1P+1D's simulated TPOT p50 at 4 and 12 req/s ~12% over the real one in
        # five calibration runs of the AVX2 EPYC (2026-12-03), within 1-4% as the cores' CPU. Else the next step waits.
        cpu = decode.profile.request_cpu_seconds(tracked.prompt_len)
        if self._host_cost is not None:
            self._host_work(now, cpu)
        else:
            decode.request_cpu += cpu
        output = decode.scheduler.remote_kv_arrived(request_id, SAMPLED_TOKEN)
        if output is not None and not sent_early:
            self._tokens(request_id, 1, output.finished is not None, now)
        decode.publish()

    def _tokens(self, request_id: str, num_tokens: int, finished: bool, now: float) -> None:
        tracked = self.tracked[request_id]
        seen = now + tracked.half_overhead
        if tracked.first < 0:
            tracked.first = seen
            self._release_prefill(tracked)
            hop = self._records.hop
            hop("router_in", tracked.half_overhead)
            if tracked.computed < 0:  # prefilled where it decodes: its queue and compute there, together
                hop("local_prefill", now - tracked.reached)
            hop("first_token_back", tracked.half_overhead)
        else:
            self._records.itl.add(seen - tracked.last)
        tracked.last = seen
        tracked.tokens += num_tokens
        if self._host_cost is not None:
            self._host_work(now, self._host_cost[1] * num_tokens, True)
        if finished:
            del self.tracked[request_id]
            if not self.tracked:
                self._idle_since = seen
            self._release_prefill(tracked)
            tracked.decode.info.num_inflight = max(0, tracked.decode.info.num_inflight - 1)
            self._records.finish(tracked)
            if self.on_progress is not None and self._records.completed % 2000 == 0:
                self.on_progress(self._records.completed)

    def tokens_in_run(self, request_id: str, first: float, count: int, last: float) -> None:
        """``count`` tokens of a decode run reached the client, the first at ``first``, the last at ``last``
        (the gaps between them are the run's steps, which the run records once for its whole batch)."""
        tracked = self.tracked[request_id]
        half = tracked.half_overhead
        self._records.itl.add(first + half - tracked.last)
        tracked.last = last + half
        tracked.tokens += count
        if self._host_cost is not None:
            self._host_work(last, self._host_cost[1] * count, True)

    def _release_prefill(self, tracked: _Tracked) -> None:
        if tracked.site_tokens:
            info = tracked.site.info
            info.prefill_pending_tokens = max(0, info.prefill_pending_tokens - tracked.site_tokens)
            tracked.site_tokens = 0
        if tracked.prefill_pending:
            tracked.prefill_pending = False
            info = tracked.prefill.info
            info.num_prefill_pending = max(0, info.num_prefill_pending - 1)

    @property
    def workers(self) -> list[SimWorker]:
        return [*self.prefill_workers, *self.decode_workers]
