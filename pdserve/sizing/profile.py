"""The profile file (``pdserve profile --out``) and the cost model the simulator reads from it.

A profile holds what real workers measured, per kind of worker (``prefill``, ``decode``,
``colocated``: a role with its flags and its share of the machine's cores):

* prefill step seconds against new prompt tokens (one prompt, nothing cached), and a few steps of
  prompts after a cached prefix, which give the attention's cost per (query, key) pair;
* decode step seconds on a grid of batch size x context tokens per sequence;
* the engine's limits as the worker computed them (KV blocks, block size, bytes per block, budgets);
* inside a real cluster (router, workers, a streaming client on the same machine): the decode grid
  again, the steps' jitter, and for prompts of a few lengths at idle the prefill-compute hop and the
  rest of their time to first token (the request's fixed latency);

and, for the cluster, KV transfer seconds against bytes between the profiled workers' layouts (and
any other layout pairs asked for). The model interpolates
the measured tables piecewise linearly and extends them linearly past their ends, as Vidur and
DistServe's simulator interpolate operator and step profiles; one coefficient is fitted, the prompt
attention's.

A step's seconds (``WorkerProfile.step_seconds``):

* decode rows only: ``decode(B, mean context)``, the serving grid where measured;
* prompt rows (chunks of any number of prompts, decode rows mixed in):
  ``linear(T) + attention_pair_seconds * sum(n * (k + n / 2))`` over its prompt rows of ``n`` new
  tokens after ``k`` cached or computed ones, where ``T`` counts every row's tokens (a decode row
  is one more token through every linear layer) and ``linear(N) = prefill(N) -
  attention_pair_seconds * N**2 / 2`` is the measured prompt step without its attention; plus what
  the decode rows' context adds over a short one, ``engine_decode(B, C) - engine_decode(B, smallest
  C)``; all of it times the slowdown the cluster measured for a prompt step against the engine's
  (``prefill_slowdown``: on a prefill worker the steps also send the KV, and it grows with the
  worker's load from the idle hop's to the loaded hop's); plus what serving adds to a decode step
  of that batch over the engine's, ``decode(B, C) - engine_decode(B, C)`` (the decode rows' tokens
  on their way out through the router to the client, who share the cores). That is added, not a
  ratio: a colocated profile's serving grid ran 2-3.7x the engine's steps at batches of 1-16 on a
  2-core Zen 4, and that ratio laid over a step's prompt rows made the simulated colocated TPOT and
  TTFT p50 40-180% longer than the real ones (the thirty-first session's calibration runs).

Pure Python (no torch, no numpy): the simulator calls it once per simulated step.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
from dataclasses import dataclass, field

PROFILE_VERSION = 1
# The loaded prefill pass (``serving_profiler.measure_serving``) sends its prompts at this share of what the
# idle hop allows: its hop holds the router's and the client's CPU at that arrival rate.
LOADED_UTILIZATION = 0.5
PROFILE_KIND = "pdserve-profile"
WORKER_KINDS = ("prefill", "decode", "colocated")
# a worker's time tables of prompt computation and of decode steps (``Profile.rescaled`` scales them)
PREFILL_TABLES = ("prefill_seconds", "serving_prefill_seconds", "serving_prefill_idle_seconds")
DECODE_TABLES = ("decode_seconds", "serving_decode_seconds")


def interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through the points (``xs`` increasing), extended linearly past both ends
    by the nearest segment's slope; a single point is a constant. Never below 0."""
    n = len(xs)
    if n == 1:
        return max(0.0, ys[0])
    i = bisect.bisect_right(xs, x) - 1
    i = min(max(i, 0), n - 2)
    x0, x1 = xs[i], xs[i + 1]
    y0, y1 = ys[i], ys[i + 1]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def isotonic(values: list[float]) -> list[float]:
    """The non-decreasing sequence closest to ``values`` in least squares (pool adjacent violators): a
    step takes no less time for more tokens or sequences, so a measured dip is noise, averaged away."""
    blocks: list[list[float]] = []  # [mean, weight]
    for v in values:
        blocks.append([v, 1.0])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, w2), (m1, w1) = blocks[-2], blocks.pop()
            blocks[-1] = [(m2 * w2 + m1 * w1) / (w2 + w1), w2 + w1]
    return [m for m, w in blocks for _ in range(int(w))]


def isotonic_grid(grid: list[list[float]]) -> list[list[float]]:
    """``isotonic`` along both axes of ``grid[i][j]`` (rows, then columns)."""
    rows = [isotonic(row) for row in grid]
    columns = [isotonic(list(col)) for col in zip(*rows)]
    return [list(row) for row in zip(*columns)] if columns else rows


def interp2(xs: list[float], ys: list[float], table: list[list[float]], x: float, y: float) -> float:
    """Bilinear ``table[i][j] = f(xs[i], ys[j])`` at ``(x, y)``, each axis as ``interp`` (only the two rows
    around ``x`` are read: ``interp`` along ``x`` uses no others)."""
    n = len(xs)
    if n == 1:
        return interp(ys, table[0], y)
    i = min(max(bisect.bisect_right(xs, x) - 1, 0), n - 2)
    return interp(xs[i:i + 2], [interp(ys, table[i], y), interp(ys, table[i + 1], y)], x)


@dataclass
class WorkerProfile:
    """What one kind of worker measured, and its engine's limits.

    Args:
        kind: ``prefill``, ``decode`` or ``colocated``.
        role: the role its flags were read with (``prefill`` or ``decode``).
        cores, threads: cores it was pinned to and torch threads per rank.
        tensor_parallel_size, pipeline_parallel_size: its layout.
        flags: the worker flags profiled (besides ``--model``).
        num_blocks, block_size, block_bytes: its KV cache: blocks, tokens per block, bytes of one
            block over every layer and rank (what a transfer of that block ships).
        max_num_seqs, max_num_batched_tokens, max_model_len, long_prefill_token_threshold,
            prefill_admission, remote_prefill_threshold, enable_prefix_caching: its scheduler's settings.
        prefill_tokens, prefill_seconds: seconds of a step computing one prompt of that many tokens.
        prefill_cached_points: ``[new tokens, cached tokens, seconds]`` of steps computing one prompt
            after a cached prefix.
        attention_pair_seconds: the prompt attention's seconds per (query, key) pair, fitted to them.
        decode_batch, decode_context, decode_seconds: the engine's decode grid (seconds[i][j] for a step
            of decode_batch[i] sequences of decode_context[j] tokens each).
        serving_decode_seconds: the same grid measured inside a real cluster, as streaming clients see
            the steps (every cost of the serving loop and of sharing the machine with the router and the
            client included; where the engine's step measured slower at a point, the engine's is read as this
            one: a column measured in a slow phase of the machine); empty when not measured.
        request_overhead_s: seconds a request spends outside the steps before its first token in a
            cluster of this kind (router, hops, HTTP), measured at idle; 0 when not measured.
        overhead_tokens, overhead_seconds: the same fixed latency for prompts of these lengths (the
            router's and the workers' per-request work grows with the prompt: JSON, validation, hashing).
        wake_tokens, wake_overhead_seconds, wake_idle_seconds: how much longer a lone prompt of that many
            tokens takes to its first token when the cluster has sat idle before it for that long than when
            it follows the previous request at once (every hop and the prompt's steps run slower on a woken
            machine: on a 2-core Xeon VM a 256-token prompt took 6.2 ms back to back and 11-19 ms after 200
            ms idle), ``wake_overhead_seconds[i][j]`` after ``wake_idle_seconds[i]`` for ``wake_tokens[j]``
            tokens (profiles before 2026-12-02: one flat list for one gap, a plateau reached there); empty
            when not measured (``wake_overhead``).
        serving_prefill_tokens, serving_prefill_seconds: one prompt's steps of that many tokens as a
            real cluster ran them (its prefill-compute hop): a colocated worker's at idle; a prefill
            worker's among other prompts at half its capacity (sharing its core with their KV sends and
            the machine with the rest of the cluster: ``serving_profiler.measure_serving``). Prompt steps are
            scaled by their ratio to ``prefill``.
        serving_prefill_idle_seconds, serving_prefill_utilization: the same hop at idle, and how busy
            the worker was when ``serving_prefill_seconds`` was measured (0: at idle, a colocated worker's
            case); a step's slowdown moves from the idle hop's to the loaded one's with the worker's
            recent utilisation (``prefill_slowdown``).
        serving_step_cv: the coefficient of variation of the decode steps the clients saw (their
            jitter on a shared machine; the simulator draws each step's length around the model's with
            it); 0 when not measured.
        serving_prefill_cv: the worker that prefills: the scatter of a lone prompt's time to first token
            between prompts of one length at idle (their standard deviation over the prompt's steps' mean,
            the median over ``serving_prefill_tokens``); the simulator draws a step of prompt tokens
            alone (no decode rows) around the model's with it; 0 when not measured (such a step then
            takes the worker's ``serving_step_cv``).
        one_core_prefill_ratio, one_core_decode_ratio: a prompt step's and a decode step's seconds on one
            of its cores over its seconds on all ``cores`` (medians over a few points; how a worker placed
            on fewer cores than profiled slows: a small model's steps barely use a second thread); 0 when
            not measured (profiled on one core, or an older profile).
        host_cpu_seconds: CPU seconds the cluster's other processes spent while the serving grid and the
            idle prompts ran, per request and per streamed token: ``{"router": [per request, per token],
            "client": [...]}`` (the router process; the streaming client on the same machine), fitted
            to the serving passes (``serving_profiler.host_cpu_fit``); empty when not measured. On a
            machine they share with the workers they take cores from the steps (``Simulator.host_share``).
        serving_stream_tokens: tokens each stream of the serving grid decoded (its requests' length).
        serving_kv_transfer_seconds: a decode worker's: for prompts of ``overhead_tokens`` tokens at idle,
            each streaming ``serving_stream_tokens`` tokens as a benchmark's requests do, the KV's arrival after
            the prompt's last step on the prefill worker (the router's ``kv_transfer`` hop, the median: the last
            layers' sends and the decode worker taking the KV), left out of ``overhead_seconds``; empty when not
            measured (``kv_transfer_tail``). Profiles before 2026-12-03 hold one-token requests' mean, 2-3x longer.
        serving_admission_seconds: a decode worker's: for the same streaming prompts, the router's
            ``decode_admission`` hop, the median (the request's way to the decode worker, its engine loop taking it
            in, reserving its blocks and sending the prompt to the prefill worker), left out of
            ``overhead_seconds``; empty when not measured (``admission_seconds``).
        serving_request_cpu_seconds: a decode worker's: for idle one-token prompts of those lengths, the CPU
            seconds its process spent on each outside decode steps (taking the request in, receiving, checking
            and installing its KV, emitting its first token), over its idle loop's; empty when not measured
            (``request_cpu_seconds``). The simulator puts it on the machine's cores beside the host
            processes' CPU where it models them (most of it is the KV receiving thread's), else between
            the worker's steps.
        loaded_overhead_s, overhead_per_stream_s: what a request's time outside the steps takes under
            Poisson arrivals beyond ``request_overhead`` (measured at idle, one request after another): a
            constant, and seconds for each other stream in flight when it arrives (the router's and the
            client's event loops busy with those streams' tokens, the request's way in and its first
            token's way out queued behind them), beyond what the simulator builds itself (mixed steps, the
            host's CPU shares, the wake-up); fitted by replaying ``loaded_pass`` in the simulator
            (``sizing.loaded_fit``); 0 when not measured.
        loaded_pass: the Poisson pass that fit came from, as the client saw it: ``{"arrival_s": [...],
            "prompt_tokens": [...], "output_tokens": N, "ttft_s": [...], "in_flight": [...]}`` (each
            request's send time from the first's, its prompt length, the tokens each streamed, its time to
            first token, the other requests in flight when it was sent); empty when not measured.

    The tables are read made monotone (``isotonic``): a measured dip in a noisy machine's step times is
    averaged with its neighbours.
    """

    kind: str
    role: str
    cores: int
    threads: int
    flags: list[str]
    num_blocks: int
    block_size: int
    block_bytes: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    long_prefill_token_threshold: int
    prefill_admission: str
    remote_prefill_threshold: int
    enable_prefix_caching: bool
    prefill_tokens: list[int]
    prefill_seconds: list[float]
    prefill_cached_points: list[list[float]]
    attention_pair_seconds: float
    decode_batch: list[int]
    decode_context: list[int]
    decode_seconds: list[list[float]]
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    serving_decode_seconds: list[list[float]] = field(default_factory=list)
    request_overhead_s: float = 0.0
    serving_step_cv: float = 0.0
    one_core_prefill_ratio: float = 0.0
    one_core_decode_ratio: float = 0.0
    overhead_tokens: list[int] = field(default_factory=list)
    overhead_seconds: list[float] = field(default_factory=list)
    wake_idle_seconds: list[float] = field(default_factory=list)
    wake_tokens: list[int] = field(default_factory=list)
    wake_overhead_seconds: list[list[float]] = field(default_factory=list)
    serving_prefill_tokens: list[int] = field(default_factory=list)
    serving_prefill_seconds: list[float] = field(default_factory=list)
    serving_prefill_idle_seconds: list[float] = field(default_factory=list)
    serving_prefill_utilization: float = 0.0
    serving_prefill_cv: float = 0.0
    host_cpu_seconds: dict = field(default_factory=dict)
    serving_stream_tokens: int = 48
    serving_kv_transfer_seconds: list[float] = field(default_factory=list)
    serving_admission_seconds: list[float] = field(default_factory=list)
    serving_request_cpu_seconds: list[float] = field(default_factory=list)
    loaded_overhead_s: float = 0.0
    overhead_per_stream_s: float = 0.0
    loaded_pass: dict = field(default_factory=dict)

    def __post_init__(self):
        # measured tables, made monotone (more tokens or sequences never take less time): noise averaged
        q = self.attention_pair_seconds
        prefill = isotonic(self.prefill_seconds)
        self._linear = isotonic([max(s - q * n * n / 2, 0.0) for n, s in zip(self.prefill_tokens, prefill)])
        engine = self.decode_seconds
        served = self.serving_decode_seconds
        if served and len(served) == len(engine) and all(len(row) == len(erow) for row, erow in zip(served, engine)):
            # the engine's own step is never slower than the served one at that batch and context, which runs it and
            # more: where the engine grid says so, it caught a slow phase of a shared machine (its columns are
            # measured one after the other, minutes apart, each in one go; the serving grid is a mean over
            # GRID_PASSES passes over the whole grid). On the AVX2 EPYC of 2026-12-03 the bench preset's colocated
            # engine steps at context 256 measured 1.2-1.6x those at 32, batch 1-16, where the served ones grew -8 to
            # +17% and the real runs' mean steps were 21-25 ms (batch 1-2, context ~340; the engine grid: 32-36).
            # (A profile from before a392a5b, whose serving grid priced a batch that never formed as the few streams
            # that did, is now read too fast there, where its served steps were read up to the engine's: profile
            # again.)
            engine = [[min(e, s) for s, e in zip(row, erow)] for row, erow in zip(served, engine)]
        self._engine = isotonic_grid(engine)
        self._serving = isotonic_grid(served) if served else None

    def linear(self, num_tokens: float) -> float:
        """Seconds of a step's ``num_tokens`` rows through everything but the prompt attention."""
        return interp(self.prefill_tokens, self._linear, num_tokens)

    def prefill(self, num_tokens: float, num_cached: float = 0.0) -> float:
        """Seconds of a step computing one prompt's ``num_tokens`` tokens after ``num_cached`` cached ones."""
        return self.linear(num_tokens) + self.attention_pair_seconds * num_tokens * (num_cached + num_tokens / 2)

    def kv_transfer_tail(self, num_prompt_tokens: float) -> float:
        """Seconds from a prompt's last step on the prefill worker until this decode worker holds its KV,
        at idle (``serving_kv_transfer_seconds`` interpolated; 0 when not measured)."""
        if not self.serving_kv_transfer_seconds:
            return 0.0
        return max(0.0, interp(self.overhead_tokens, self.serving_kv_transfer_seconds, num_prompt_tokens))

    def admission_seconds(self, num_prompt_tokens: float) -> float:
        """Seconds this decode worker takes, at idle, from a request's arrival to the prompt sent on to its
        prefill worker (``serving_admission_seconds`` interpolated; 0 when not measured)."""
        if not self.serving_admission_seconds:
            return 0.0
        return max(0.0, interp(self.overhead_tokens, self.serving_admission_seconds, num_prompt_tokens))

    def request_cpu_seconds(self, num_prompt_tokens: float) -> float:
        """CPU seconds this decode worker spends on a disaggregated request of ``num_prompt_tokens`` prompt
        tokens outside its decode steps (``serving_request_cpu_seconds`` interpolated; 0 when not measured)."""
        if not self.serving_request_cpu_seconds:
            return 0.0
        return max(0.0, interp(self.overhead_tokens, self.serving_request_cpu_seconds, num_prompt_tokens))

    def request_overhead(self, num_prompt_tokens: float) -> float:
        """Seconds a request of ``num_prompt_tokens`` spends outside the steps before its first token."""
        if self.overhead_tokens:
            return interp(self.overhead_tokens, self.overhead_seconds, num_prompt_tokens)
        return self.request_overhead_s

    def wake_overhead(self, idle_seconds: float, num_prompt_tokens: float) -> float:
        """Seconds a request of ``num_prompt_tokens`` arriving after the cluster sat idle ``idle_seconds``
        (nothing in flight) waits beyond ``request_overhead``: ``wake_overhead_seconds`` interpolated by
        length (clamped to the lengths measured) and by idle time (linearly from nothing at no idle time to
        the first gap measured, between gaps, flat past the last); 0 when not measured. A flat list (an
        older profile) is one gap's row."""
        rows = self.wake_overhead_seconds
        if not rows or idle_seconds <= 0:
            return 0.0
        if not isinstance(rows[0], list):
            rows = [rows]
        tokens = min(max(num_prompt_tokens, self.wake_tokens[0]), self.wake_tokens[-1])
        by_gap = [interp(self.wake_tokens, [max(0.0, s) for s in row], tokens) for row in rows]
        gaps = self.wake_idle_seconds[:len(by_gap)]
        return interp([0.0, *gaps], [0.0, *by_gap], min(idle_seconds, gaps[-1]))  # nothing at no idle time

    def engine_decode(self, batch: float, context: float) -> float:
        """Seconds of the engine's decode step of ``batch`` sequences of ``context`` tokens each."""
        return interp2(self.decode_batch, self.decode_context, self._engine, batch, context)

    def decode(self, batch: float, context: float) -> float:
        """Seconds of a decode step of ``batch`` sequences of ``context`` tokens each while serving (the
        serving grid where measured, else the engine's)."""
        if self._serving is not None:
            return interp2(self.decode_batch, self.decode_context, self._serving, batch, context)
        return self.engine_decode(batch, context)

    def decode_cpu_share(self, batch: float, context: float) -> float:
        """The share of a served decode step of ``batch`` sequences of ``context`` tokens the worker spends
        computing (the engine's step over the serving grid's, 0..1; the rest of a served step it waits on
        the router, the client and the sockets, leaving its core to others): how much of a core it takes
        from a worker it shares one with. 1 where the serving grid was not measured."""
        if self._serving is None:
            return 1.0
        served = self.decode(batch, context)
        return min(1.0, self.engine_decode(batch, context) / served) if served > 0 else 1.0

    def step_seconds(self, prompt_tokens: int, attention_pairs: float, num_decode: int, mean_context: float,
                     utilization: float | None = None) -> float:
        """Seconds of one step: ``prompt_tokens`` prompt tokens (chunks of any number of prompts) whose
        attention covers ``attention_pairs`` (query, key) pairs (``n * (k + n / 2)`` summed over
        the prompt rows), and ``num_decode`` decoding sequences of ``mean_context`` tokens on average
        (the module's docstring has the rule); ``utilization``: the worker's recent busy share
        (``prefill_slowdown``)."""
        if not prompt_tokens:
            return self.decode(num_decode, mean_context) if num_decode else 0.0
        seconds = self.linear(prompt_tokens + num_decode) + self.attention_pair_seconds * attention_pairs
        serving = 0.0  # what serving adds to the decode rows' step: their tokens' way out, the cores shared
        if num_decode:  # the decode rows' context
            engine = self.engine_decode(num_decode, mean_context)
            seconds += max(0.0, engine - self.engine_decode(num_decode, self.decode_context[0]))
            if self._serving is not None:
                serving = max(0.0, self.decode(num_decode, mean_context) - engine)
        return seconds * self.prefill_slowdown(prompt_tokens, utilization) + serving

    def prefill_slowdown(self, num_tokens: float, utilization: float | None = None) -> float:
        """How much slower a prompt step of ``num_tokens`` runs in a serving cluster than in the engine alone
        (``serving_prefill_seconds`` over ``prefill``; 1 when not measured, never below 1). Where the hop
        was measured both at idle and at ``serving_prefill_utilization`` busy, a worker ``utilization``
        busy (0..1; None: loaded) takes the idle hop plus that share of the difference, up to the loaded
        hop (which the real hops under heavier load stayed near)."""
        if not self.serving_prefill_tokens:
            return 1.0
        engine = self.prefill(num_tokens)
        if engine <= 0:
            return 1.0
        served = interp(self.serving_prefill_tokens, self.serving_prefill_seconds, num_tokens)
        if utilization is not None and self.serving_prefill_utilization > 0 and self.serving_prefill_idle_seconds:
            idle = interp(self.serving_prefill_tokens, self.serving_prefill_idle_seconds, num_tokens)
            served = idle + (served - idle) * min(1.0, utilization / self.serving_prefill_utilization)
        return max(1.0, served / engine)

    def loaded_share(self, num_tokens: float, utilization: float) -> tuple[float, float]:
        """What of the loaded prefill pass ``prefill_slowdown(num_tokens, utilization)`` carries: (the requests
        per second that pass sent prompts of ``num_tokens`` tokens at, ``LOADED_UTILIZATION`` of what the
        idle hop allows; the fraction of the loaded hop's excess over the idle one taken, 0..1). (0, 0)
        where the hop was not measured loaded."""
        if not (self.serving_prefill_tokens and self.serving_prefill_idle_seconds and self.serving_prefill_utilization):
            return 0.0, 0.0
        idle = interp(self.serving_prefill_tokens, self.serving_prefill_idle_seconds, num_tokens)
        taken = min(1.0, utilization / self.serving_prefill_utilization)
        return (LOADED_UTILIZATION / idle if idle > 0 else 0.0), taken

    def fewer_cores_slowdown(self, num_cores: int, prompt: bool) -> float:
        """How much slower a step (``prompt``: one with prompt rows; else decode-only) runs on ``num_cores``
        cores than on the ``cores * TP * PP`` profiled: from the one-core ratios where measured (linear in
        the fraction of cores taken away: 1 on all of them, the ratio on one), else in proportion to the
        cores; never below 1."""
        profiled = self.cores * self.tensor_parallel_size * self.pipeline_parallel_size
        num_cores = max(1, num_cores)
        if num_cores >= profiled:
            return 1.0
        ratio = self.one_core_prefill_ratio if prompt else self.one_core_decode_ratio
        if ratio <= 0 or profiled == 1:
            return profiled / num_cores
        return max(1.0, 1.0 + (ratio - 1.0) * (profiled / num_cores - 1.0) / (profiled - 1.0))

    def transfer_for(self, prefill_layout: str, decode_layout: str) -> TransferProfile | None:
        """The transfer measured between these layouts (``tpTppP``), or None where no pair of them was."""
        for t in (self.transfer, *self.transfers):
            if t is not None and (t.prefill_layout, t.decode_layout) == (prefill_layout, decode_layout):
                return t
        return None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def fit_attention_pair_seconds(prefill_tokens: list[int], prefill_seconds: list[float],
                               cached_points: list[list[float]]) -> float:
    """The prompt attention's seconds per (query, key) pair: what a cached prefix of ``k`` tokens adds to
    a prompt step of ``n`` tokens is ``q * n * k``; least squares over ``cached_points`` (never below 0)."""
    num = den = 0.0
    for n, k, seconds in cached_points:
        extra = seconds - interp(prefill_tokens, prefill_seconds, n)
        num += extra * n * k
        den += (n * k) ** 2
    return max(0.0, num / den) if den else 0.0


@dataclass
class TransferProfile:
    """KV transfer seconds against bytes, from a prefill worker of ``prefill_layout`` to a decode worker
    of ``decode_layout`` (``tpNppM``), over ``backend`` (gloo on CPU)."""

    prefill_layout: str
    decode_layout: str
    backend: str
    bytes: list[int]
    seconds: list[float]

    def transfer_seconds(self, num_bytes: float) -> float:
        """Seconds to ship ``num_bytes`` of KV (interpolated, extended linearly past the measured sizes)."""
        return interp(self.bytes, self.seconds, num_bytes)


@dataclass
class Profile:
    """A profile file: the machine, the model, each worker kind, the transfer, the fixed latencies.

    ``transfer``: the KV transfer between the profiled prefill and decode workers' own layouts;
    ``transfers``: between other layout pairs (``pdserve profile --transfer-layouts``; ``transfer_for``
    finds a pair's). ``request_overhead_s``: seconds a request spends outside every step between the client sending it
    and reading its first token (HTTP, the router's work, the ZeroMQ hops), measured on a real cluster
    at idle; ``token_overhead_s``: the same for each later token (0: not measured).
    """

    model: str
    machine: dict
    workers: dict[str, WorkerProfile]
    transfer: TransferProfile | None = None
    transfers: list[TransferProfile] = field(default_factory=list)  # more layout pairs measured
    request_overhead_s: float = 0.0
    token_overhead_s: float = 0.0
    created: str = ""
    profile_seconds: float = 0.0  # how long profiling took
    version: int = PROFILE_VERSION
    extra: dict = field(default_factory=dict)

    def worker(self, kind: str) -> WorkerProfile:
        """The profile of worker kind ``kind``. Raises ValueError naming the kinds the file has."""
        try:
            return self.workers[kind]
        except KeyError:
            raise ValueError(f"the profile has no {kind!r} workers (it has {', '.join(self.workers) or 'none'}); "
                             f"run pdserve profile with --kinds {kind}") from None

    def transfer_for(self, prefill_layout: str, decode_layout: str) -> TransferProfile | None:
        """The transfer measured between these layouts (``tpTppP``), or None where no pair of them was."""
        for t in (self.transfer, *self.transfers):
            if t is not None and (t.prefill_layout, t.decode_layout) == (prefill_layout, decode_layout):
                return t
        return None

    def rescaled(self, prefill: float = 1.0, decode: float = 1.0) -> "Profile":
        """This profile with every worker's prompt computation taking ``prefill`` times as long as measured and
        every decode step ``decode`` times (the engine's and the serving grids alike); the fixed latencies, the
        KV transfer and the host's CPU are kept.

        A drift correction in the spirit of the correction factors of Dynamo's SLA planner (observed latency
        over predicted, applied to the next predictions): on a shared machine whose speed moves over minutes, a
        short probe of the live cluster just before a run gives each factor (``benchmarks/bench_sim_calibration.py``
        takes lone requests' TTFT and TPOT over their simulated ones).

        Raises:
            ValueError: a factor that is not a positive finite number."""
        for name, factor in (("prefill", prefill), ("decode", decode)):
            if not (0 < factor < float("inf")):
                raise ValueError(f"the {name} factor must be a positive number, not {factor}")
        d = self.to_dict()
        for w in d["workers"].values():
            for key in PREFILL_TABLES:
                w[key] = [s * prefill for s in w[key]]
            w["prefill_cached_points"] = [[new, cached, s * prefill] for new, cached, s in w["prefill_cached_points"]]
            w["attention_pair_seconds"] *= prefill
            for key in DECODE_TABLES:
                w[key] = [[s * decode for s in row] for row in w[key]]
        return Profile.from_dict(d)

    def to_dict(self) -> dict:
        return {"kind": PROFILE_KIND, "version": self.version, "created": self.created, "model": self.model,
                "machine": self.machine, "profile_seconds": self.profile_seconds,
                "request_overhead_s": self.request_overhead_s, "token_overhead_s": self.token_overhead_s,
                "workers": {k: w.to_dict() for k, w in self.workers.items()},
                "transfer": dataclasses.asdict(self.transfer) if self.transfer else None,
                "transfers": [dataclasses.asdict(t) for t in self.transfers], "extra": self.extra}

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")

    @classmethod
    def from_dict(cls, d: dict) -> "Profile":
        """Raises ValueError for a file that is not a pdserve profile or has another version."""
        if d.get("kind") != PROFILE_KIND:
            raise ValueError("not a pdserve profile (no \"kind\": \"pdserve-profile\")")
        if d.get("version") != PROFILE_VERSION:
            raise ValueError(f"profile version {d.get('version')} is not {PROFILE_VERSION}: profile again")
        names = {f.name for f in dataclasses.fields(WorkerProfile)}
        workers = {k: WorkerProfile(**{n: v for n, v in w.items() if n in names}) for k, w in d["workers"].items()}
        transfer = TransferProfile(**d["transfer"]) if d.get("transfer") else None
        return cls(model=d["model"], machine=d.get("machine", {}), workers=workers, transfer=transfer,
                   transfers=[TransferProfile(**t) for t in d.get("transfers", [])],
                   request_overhead_s=d.get("request_overhead_s", 0.0), token_overhead_s=d.get("token_overhead_s", 0.0),
                   created=d.get("created", ""), profile_seconds=d.get("profile_seconds", 0.0),
                   version=d["version"], extra=d.get("extra", {}))


def load_profile(path: str) -> Profile:
    """Read a profile file. Raises OSError (unreadable) or ValueError (not a profile, other version)."""
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e})") from None
    return Profile.from_dict(data)
