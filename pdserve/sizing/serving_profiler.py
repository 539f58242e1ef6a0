"""``pdserve profile``'s serving passes: a worker kind measured inside a real ``pdserve up`` cluster.

The engine alone (``profiler.measure_worker``) does not show what serving adds: the serving loop's
outputs, the router's streaming, a prefill worker's prompts sharing its core with earlier prompts' KV
sends, and the router's and a client's share of the machine's cores. ``measure_serving`` starts the
cluster, streams requests through its router with an HTTP client on this machine (as a benchmark
runs), and reads what the clients see, the router's hops (``pdserve:request_phase_seconds``) and the
router's and the client's CPU time (``host_cpu_fit``).
"""

from __future__ import annotations

import statistics
import time

from pdserve.sizing.profile import LOADED_UTILIZATION, WorkerProfile
from pdserve.sizing.serving_client import (ServingCluster, hop_means, lone_ttfts, scrape_phases, stream_batch,
                                              stream_poisson)

OVERHEAD_TOKENS = (16, 128, 512, 1500)
LOADED_PROMPTS = 24
IDLE_LOOP_S = 0.5  # how long the idle cluster's decode worker is timed before its requests are
# A request arriving at an idle cluster pays more than one right behind another, and the more the longer the
# cluster idled (the 2-core Xeon of 2026-12-02, the default model's colocated worker, 256-token prompts: TTFT median
# 6.1-6.4 ms back to back, 11.3-19.3 ms after 200 ms idle; the 2-core VM of 2026-11-29, 96 tokens: 8.3-12.3 ms,
# 10.7-12.5 after 50 ms, 13.1-20.3 after 400 ms: every hop and the prompt's own steps run slower on a machine
# woken from idle): lone prompts of WAKE_TOKENS after each of these gaps, taking turns with back-to-back ones (a
# shared machine's speed drifts between passes), WAKE_ROUNDS of each, a median per gap and length
WAKE_IDLE_S = (0.05, 0.2, 0.8)
WAKE_TOKENS = (16, 512)
WAKE_ROUNDS = 10
# The serving decode grid is measured in this many passes over all its points, a round of each point a pass. A
# shared VM's speed moves in phases: on the 2-core Zen 4 of 2026-12-02 a 1 ms Python loop ran at its fastest in
# ~30% of 3,000 back-to-back calls and ~1.7x slower in the rest, in runs of a few to 650 calls, so a point's two
# rounds taken back to back (0.1-0.5 s) mostly fell in one phase, and the grid's points scattered by up to that
# factor (a colocated profile's batch-1 step: 1.95 ms at 32 tokens, 4.03 at 768, where a batch of 4 took 3.32)
GRID_PASSES = 2
# The lone prompts' hop (``serving_prefill_seconds``, over the engine's prompt: the cost model's slowdown) is taken
# in its first pass per length and again in PROMPT_ROUNDS rounds spread over the profile (before each grid pass and
# after the last), PROMPT_ROUND_PROMPTS prompts a length each; a length's hop is the median over them. From its
# first pass alone a colocated worker's 128-512-token prompts read 1.30-1.37x the engine's in one profile and
# 0.95-1.0x in another taken an hour later, where the real runs' hop was ~1.1x (the bench preset on the AVX2 EPYC
# of 2026-12-03, whose TTFT p50 the first profile put 20-58% over)
PROMPT_ROUNDS = GRID_PASSES + 1
PROMPT_ROUND_PROMPTS = 3
# Passes for the host's CPU fit (``host_cpu_fit``) besides the idle prompts and the grid: HOST_FIT_STREAMS streams of
# a HOST_FIT_PROMPT-token prompt decoding each of these many tokens
HOST_FIT_TOKENS = (8, 192)
HOST_FIT_STREAMS = 8
HOST_FIT_PROMPT = 63
# The colocated worker's loaded pass (``loaded_fit``): LOADED_PASS_PROMPTS prompts of lengths spread evenly over
# LOADED_PASS_TOKENS (the idle overheads' lengths, so the fit does not lean on one noisy point of them), each streaming
# the pass's tokens, arriving (Poisson) at LOADED_PASS_STREAMS streams in flight on average (the rate from a lone
# request's whole time, measured first on LOADED_PASS_PROBES of them), but no faster than keeps the worker's prompts
# to LOADED_PASS_PROMPT_SHARE of its time (the rate times a lone request's TTFT). Without that bound a model whose
# prompts are most of a request's time is driven past saturation: the bench preset on the AVX2 EPYC of 2026-12-04
# (lone request ~1.2 s, TTFT ~0.37 s) got 2.4 req/s, 16-19 streams in flight and TTFTs of 2-2.7 s, and the fit,
# made in that queue, added 0.26 s + 77 ms a stream to every colocated request at the 0.4-1 req/s it serves
LOADED_PASS_PROMPTS = 40
LOADED_PASS_TOKENS = (16, 512)
LOADED_PASS_STREAMS = 2.0
LOADED_PASS_PROMPT_SHARE = 0.35
LOADED_PASS_PROBES = 3
# The passes' sizes above suit a model whose request takes milliseconds; a larger one's would take an hour (the bench
# preset, ~100M parameters, on one core of the AVX2 EPYC of 2026-12-03: its first prompt length's passes had not ended
# after 16 minutes, and one grid point primes up to 64 prompts of 2,047 tokens). Each pass is sized from the engine
# grids measured just before (``budgeted_counts``, ``grid_point_seconds``): a prompt length's passes take about
# LENGTH_BUDGET_S, with at least the MIN_ counts of requests; a length whose passes would still take longer is left
# out once MIN_LENGTHS lengths are measured (the profile's curves extend past the last length by its slope); a grid
# point that would take longer than POINT_BUDGET_S is priced from the engine's step as the unformed ones are
# (``fill_unformed``). A millisecond model meets none of these bounds: its passes are as they were.
LENGTH_BUDGET_S = 45.0
POINT_BUDGET_S = 10.0
MIN_IDLE, MIN_LOADED, MIN_WAKE_ROUNDS, MIN_LENGTHS = 3, 8, 3, 3


def budgeted_counts(prompt_s: float, stream_s: float, num_idle: int, loaded: int, wake: bool, measured: int
                    ) -> tuple[int, int, int] | None:
    """How many requests a prompt length's passes send, ``(idle, loaded, wake rounds)``: the defaults
    (``num_idle`` one-token and as many streaming requests, ``loaded`` streaming ones, ``WAKE_ROUNDS`` rounds of
    one-token ones if ``wake``, else 0) scaled down together so that the passes take about ``LENGTH_BUDGET_S``, a
    one-token request priced ``prompt_s`` seconds and a streaming one ``stream_s`` (``request_seconds``), each
    count at least its ``MIN_`` one; None (leave the length out) where even those would take longer and
    ``measured`` lengths, at least ``MIN_LENGTHS``, are already in."""
    def total(idle: int, load: int, rounds: int) -> float:  # two unmeasured one-token requests first
        wake_s = rounds * ((1 + len(WAKE_IDLE_S)) * prompt_s + sum(WAKE_IDLE_S)) if wake else 0.0
        return (2 + idle) * prompt_s + (idle + load) * stream_s + wake_s

    scale = min(1.0, LENGTH_BUDGET_S / max(total(num_idle, loaded, WAKE_ROUNDS), 1e-9))
    counts = (max(min(num_idle, MIN_IDLE), round(num_idle * scale)),
              max(min(loaded, MIN_LOADED), round(loaded * scale)),
              max(MIN_WAKE_ROUNDS, round(WAKE_ROUNDS * scale)) if wake else 0)
    if scale < 1.0 and measured >= MIN_LENGTHS and total(*counts) > LENGTH_BUDGET_S:
        return None
    return counts


def request_seconds(prefiller: WorkerProfile, decoder: WorkerProfile, num_tokens: int, max_tokens: int) -> float:
    """A lone request's seconds as the engine grids price them: its prompt's steps on ``prefiller`` and
    ``max_tokens - 1`` decode steps of one sequence on ``decoder`` (no overheads: an estimate to size passes)."""
    return prefiller.prefill(num_tokens) + (max_tokens - 1) * decoder.engine_decode(1, num_tokens)


def grid_point_seconds(prefiller: WorkerProfile, decoder: WorkerProfile, batch: int, context: int,
                       max_tokens: int) -> float:
    """A serving grid point's seconds as the engine grids price them: its priming pass, ``batch`` prompts of
    ``context - 1`` tokens computed one after another, and ``max_tokens`` steps of the batch."""
    return batch * prefiller.prefill(context - 1) + max_tokens * decoder.engine_decode(batch, context)


def serving_step_seconds(streams: list[list[float]]) -> float | None:
    """The decode step the clients saw while every stream of ``stream_batch`` decoded: the window from the last
    stream's first token to the first stream's last token, times the streams, over the tokens (chunks) that
    arrived in it; None where that window holds fewer than four a stream (the batch never formed)."""
    streams = [t[1:] for t in streams]  # each stream's send time left out
    start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
    chunks = sum(sum(1 for x in t if start < x <= end) for t in streams)
    if end - start > 0 and chunks >= 4 * len(streams):
        return (end - start) * len(streams) / chunks
    return None


def fill_unformed(grid: list[list[float | None]], engine: list[list[float]]) -> list[list[float]]:
    """The serving grid ``grid[batch][context]`` with each point whose batch never formed (None) priced as the
    engine's step there (``engine``, same shape) times what serving added at the nearest smaller batch measured
    at that context (its served step over its engine step; the nearest larger one where no smaller was, the
    median of every measured point's where the context has none, 1 where nothing was measured)."""
    known = [[(i, s / erow[j]) for i, (row, erow) in enumerate(zip(grid, engine))
              if (s := row[j]) is not None and erow[j] > 0] for j in range(len(engine[0]) if engine else 0)]
    measured = [r for column in known for _, r in column]
    overall = statistics.median(measured) if measured else 1.0
    out = [list(row) for row in grid]
    for j, column in enumerate(known):
        for i, row in enumerate(out):
            if row[j] is None:
                below = [r for k, r in column if k < i]
                row[j] = engine[i][j] * (below[-1] if below else column[0][1] if column else overall)
    return out


def step_jitter(streams: list[list[float]]) -> float | None:
    """The coefficient of variation of the gaps between a stream's chunks while every stream decoded
    (``stream_batch``'s streams); None with too few gaps."""
    streams = [t[1:] for t in streams]
    start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
    gaps = [b - a for t in streams for a, b in zip(t, t[1:]) if start <= a and b <= end]
    if len(gaps) < 8:
        return None
    mean = statistics.fmean(gaps)
    return statistics.pstdev(gaps) / mean if mean > 0 else None


def wake_differences(gaps: list[float], ttfts: list[float]) -> list[float]:
    """A lone prompt's extra time to first token after each of ``WAKE_IDLE_S``'s idle gaps (s), from prompts
    sent after ``gaps`` (0: back to back) that took ``ttfts``: per gap, the median TTFT after it over the median
    back to back, kept only where it stands out of the TTFTs' scatter, else 0.0.

    The test is twice the standard error of a difference of two medians of ``k`` draws (each ``1.2533 sigma /
    sqrt(k)`` for a normal scatter), ``sigma`` the ``robust_std`` of every TTFT's distance from its own group's
    median. With the few rounds a large model's budget allows, a gap's median is mostly noise: on the AVX2 EPYC
    of 2026-12-03, the bench preset's 512-token prompts (~700 ms) with 3 rounds a gap measured 36-55 ms of wake-up
    inside ~50 ms of scatter, which the simulator then added to every request finding the cluster idle (its
    colocated TTFT p50 17-31% over the real runs')."""
    groups = {gap: [t for g, t in zip(gaps, ttfts) if g == gap] for gap in (0.0, *WAKE_IDLE_S)}
    medians = {gap: statistics.median(times) for gap, times in groups.items()}
    residuals = [t - medians[gap] for gap, times in groups.items() for t in times]
    sigma = 1.4826 * statistics.median(abs(r) for r in residuals)
    differences = []
    for idle in WAKE_IDLE_S:
        k = min(len(groups[idle]), len(groups[0.0]))
        noise = 2 * 1.2533 * sigma * (2 / k) ** 0.5
        difference = medians[idle] - medians[0.0]
        differences.append(difference if abs(difference) > noise else 0.0)
    return differences


def robust_std(values: list[float]) -> float:
    """The standard deviation of ``values`` (at least one) estimated from their median absolute deviation
    (times 1.4826, its ratio to the standard deviation of a normal distribution): a few outliers, such as a
    request that met a stalled core, do not move it."""
    middle = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - middle) for v in values)


class _HostMeter:
    """CPU seconds (user + system) of a cluster's router processes and of this process (the streaming
    client), read before and after a pass; ``decoders``: of its decode worker processes."""

    def __init__(self, launcher_pid: int):
        import psutil

        children = psutil.Process(launcher_pid).children(recursive=True)
        self.routers = [c for c in children if "router" in c.cmdline()]  # python -m pdserve router ... (workers: --router)
        # python -m pdserve decode ...
        self.decode_workers = [c for c in children if "decode" in c.cmdline()[:4]]

    def decoders(self) -> float:
        """CPU seconds of the decode worker processes so far."""
        total = 0.0
        for proc in self.decode_workers:
            times = proc.cpu_times()
            total += times.user + times.system
        return total

    def read(self) -> tuple[float, float]:
        router = 0.0
        for proc in self.routers:
            times = proc.cpu_times()
            router += times.user + times.system
        return router, time.process_time()


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Coefficients ``x`` minimising ``|rows x - ys|`` (normal equations, Gaussian elimination with
    pivoting); None when the columns do not determine them."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(n)]
    scale = max(abs(a[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def host_cpu_fit(passes: list[tuple[int, int, int, float, float]]) -> dict[str, list[float]]:
    """CPU seconds per request and per streamed token of the router and of the client, from passes of
    ``(requests, tokens, client calls, router CPU s, client CPU s)``: the least-squares fit of ``cpu = a x
    requests + b x tokens`` over them (``benchmarks/bench_router.py``'s split), the client's with a third
    term per call (each ``asyncio.run`` of the profiler's client opens a connection pool: its own cost,
    not a request's). Passes with one token per request, the grid's streams (``max_tokens`` each) at several
    batch sizes and streams of other lengths (``HOST_FIT_TOKENS``) determine it. Coefficients below zero
    (noise) are refitted without that term. ``{}`` when the passes cannot separate the terms."""
    fit = {}
    for name, i, columns in (("router", 3, 2), ("client", 4, 3)):
        terms = list(range(columns))
        while terms:
            x = _least_squares([[p[t] for t in terms] for p in passes], [p[i] for p in passes]) \
                if len(passes) >= len(terms) else None
            if x is None:
                return {}
            if min(x) >= 0:
                break
            terms.pop(min(range(len(terms)), key=lambda k: x[k]))  # drop the term fitted below zero
        coef = dict(zip(terms, x)) if terms else {}
        fit[name] = [coef.get(0, 0.0), coef.get(1, 0.0)]
    return fit


def measure_serving(model: str, flags: list[str], kind: str, worker: dict, prefill: dict | None,
                    on_point=None, num_idle: int = 8, max_tokens: int = 48) -> dict:
    """Measure a worker kind inside a real cluster (``colocated``: ``pdserve up --colocated``; ``decode``:
    one prefill and one decode worker) with a streaming client on this machine, as a benchmark runs:

    * ``serving_decode_seconds``: the decode step grid (the profiled batches and contexts) as the clients
      see it: every overhead of the serving loop (outputs to the router, its streaming, the client's and
      router's share of the cores) on top of the engine's step; each point a mean over ``GRID_PASSES``
      rounds taken in passes over the whole grid;
    * ``serving_prefill_seconds``: for prompts of ``OVERHEAD_TOKENS`` tokens, the router's
      prefill-compute hop (``pdserve:request_phase_seconds``: the prefill worker's, or the colocated
      worker's local one): the prompt's steps as the cluster runs them. A colocated worker's at idle (its
      steps among decodes are the cost model's mixed steps): the median over the first pass's mean and
      ``PROMPT_ROUNDS`` rounds' means spread over the profile (``PROMPT_ROUNDS``'s comment says why); a
      prefill worker's with
      ``LOADED_PROMPTS`` such prompts arriving (Poisson) at ``LOADED_UTILIZATION`` of what the idle hop
      allows, each decoding ``max_tokens`` tokens: its prompts then share its core with the previous
      ones' KV sends and the machine with the decode worker, the router and the client, which an idle
      prompt never does (on a 2-core machine the hop under load is 1.5-3x the idle one), times the idle
      hop's median over the rounds over its first pass (the machine's phase then);
      ``serving_prefill_idle_seconds`` the idle hop (that median), ``serving_prefill_utilization`` how busy the loaded
      pass kept the prefill worker (its arrivals paced by the idle hop: ``LOADED_UTILIZATION`` times
      the loaded hop over the idle one, at most 1; 0 for a colocated worker);
    * ``serving_kv_transfer_seconds`` (disaggregated): the ``kv_transfer`` hop, the KV's arrival at the decode
      worker after the prompt's last step, of prompts of those lengths streaming ``max_tokens`` tokens each (the
      requests of ``overhead_seconds`` below; the median): the simulator adds it after the step, stretched as the
      cores are shared;
    * ``serving_admission_seconds`` (disaggregated): the same streaming requests' ``decode_admission`` hop
      (median), the decode worker taking the request in and sending the prompt on (the simulator adds it
      before the prefill worker gets the prompt, stretched as the decode worker's core is shared);
    * ``serving_request_cpu_seconds`` (disaggregated): the decode worker process's CPU seconds per such
      prompt (its requests carry one token: no decode steps), over what its loop spends idle (timed for
      ``IDLE_LOOP_S`` first);
    * ``overhead_seconds``: the time to first token of prompts of those lengths, each streaming ``max_tokens``
      tokens as a benchmark's requests do, minus that request's own hops (the median over the requests): the
      router, the other hops, HTTP, the first token's way back beside its stream's next steps, and the
      per-request work that grows with the prompt (``request_overhead_s``: the shortest's);
    * ``wake_overhead_seconds``: for prompts of ``WAKE_TOKENS`` tokens (``wake_tokens``) sent alone, back to
      back or after the cluster sat idle for each of ``WAKE_IDLE_S`` (``wake_idle_seconds``; taking turns),
      the median time to first token after that gap over the median back to back, ``[gap][length]``, 0 where
      that is inside the scatter of its rounds (``wake_differences``);
    * ``serving_step_cv``: the steps' jitter the clients saw (``step_jitter``, the median over the grid);
    * ``serving_prefill_cv``: the idle prompts' scatter: their TTFTs' standard deviation (``robust_std``: one
      stalled request of eight triples a plain one) over the prompt hop's mean, per length, the median (a
      step of prompt tokens alone is drawn around the model's with it; the TTFT's other hops scatter too
      and are counted in it, as the simulator keeps them fixed).
    """
    import asyncio

    from pdserve.bench.commands import quiet_http_logs
    from pdserve.bench.phases import summarize

    quiet_http_logs()
    # a disaggregated cluster's router never prefills on the decode worker here (its local-prefill placement off):
    # every pass below times the path it names (the prefill worker's hop, the KV's tail, the decode worker's CPU a
    # request); the simulator runs the router's placement itself and prices a local prefill from the decode kind's
    # own grid. With placement on, the bench preset's 512-token prompts all went local (the decode worker, which
    # computes a prompt in one step, measured faster than a prefill worker chunking at 512 and sending), and the
    # profile took their whole prefill for 0.3 s of overhead and 1.3 s of the decode worker's CPU a request
    # (the forty-third session)
    placement = ["--local-prefill-margin-s", "inf"] if kind == "decode" else []
    cluster = ServingCluster(model, [*flags, *placement], colocated=kind == "colocated")
    counter = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        i = next(counter)
        return [10 + (i * 7919 + j * 104729 + 17) % 900 for j in range(n)]

    try:
        model_id = cluster.wait_ready()
        meter = _HostMeter(cluster.proc.pid)
        host_passes = []  # (requests, tokens, client calls, router CPU s, client CPU s): idle prompts, grid points
        engine = WorkerProfile(**(prefill or worker))
        decoder = WorkerProfile(**worker)
        hop = "local_prefill_compute" if kind == "colocated" else "prefill_compute"

        def prompt_round(n: int) -> float | None:
            """A round of lone prompts of about ``n`` tokens, each new to the cluster: their hop's mean (s)."""
            before = scrape_phases(cluster.url)
            lone_ttfts(cluster.url, model_id, [prompt(n + k) for k in range(PROMPT_ROUND_PROMPTS)])
            return hop_means(summarize(before, scrape_phases(cluster.url))).get(hop)

        overhead_tokens, overhead_seconds, prefill_seconds, idle_seconds, kv_seconds, admission_seconds = \
            [], [], [], [], [], []
        request_cpu = []  # a decode worker's CPU seconds per request outside its steps (disaggregated)
        scatter = []  # per length: the idle prompts' TTFT standard deviation over the prompt's steps
        wake_tokens, wake = [], []  # a lone prompt's extra time to first token after the cluster idled, by length
        idle_at, idle_cpu = time.monotonic(), meter.decoders()
        time.sleep(IDLE_LOOP_S)  # the decode worker's loop with nothing to do: its CPU is not a request's
        idle_rate = (meter.decoders() - idle_cpu) / (time.monotonic() - idle_at)
        for n in OVERHEAD_TOKENS:
            if n + num_idle + 2 >= engine.max_model_len - 1:
                continue
            # the passes' sizes for this length, from the engine grids (LENGTH_BUDGET_S's comment says why)
            counts = budgeted_counts(request_seconds(engine, decoder, n, 1),
                                     request_seconds(engine, decoder, n, max_tokens), num_idle,
                                     LOADED_PROMPTS if kind == "decode" else 0, n in WAKE_TOKENS, len(overhead_tokens))
            if counts is None:
                continue
            idle_count, loaded_count, wake_rounds = counts
            for k in range(2):  # the first lengths of this size: unmeasured
                asyncio.run(stream_batch(cluster.url, model_id, [prompt(n + num_idle + k)], 1))
            before = scrape_phases(cluster.url)
            cpu_before = meter.read()
            decode_before, pass_at = meter.decoders(), time.monotonic()
            # lengths n, n + 1, ...: each new to the cluster, as in serving
            ttfts = lone_ttfts(cluster.url, model_id, [prompt(n + k) for k in range(idle_count)])
            cpu_after = meter.read()
            decode_cpu = meter.decoders() - decode_before - idle_rate * (time.monotonic() - pass_at)
            host_passes.append((idle_count, idle_count, 1, cpu_after[0] - cpu_before[0],  # one client for the pass
                                cpu_after[1] - cpu_before[1]))
            hops = hop_means(summarize(before, scrape_phases(cluster.url)))
            compute = hops.get(hop, engine.prefill(n))
            # the KV's arrival after the prompt's last step (the last layers' sends, the decode worker taking it)
            kv_tail = hops.get("kv_transfer", 0.0)
            # the decode worker taking the request in and sending the prompt on, before the prefill worker has it
            admission = hops.get("decode_admission", 0.0)
            served = compute
            if kind == "decode":  # the prefill worker's prompts among others (the docstring says why)
                before = scrape_phases(cluster.url)
                prompts = [prompt(n + num_idle + 2 + k) for k in range(loaded_count)]
                asyncio.run(stream_poisson(cluster.url, model_id, prompts, max_tokens,
                                            LOADED_UTILIZATION / max(compute, 1e-3)))
                served = hop_means(summarize(before, scrape_phases(cluster.url))).get(hop, compute)
            overhead_tokens.append(n)
            prefill_seconds.append(served)
            idle_seconds.append(compute)
            request_cpu.append(max(0.0, decode_cpu / idle_count))
            # the overhead from prompts of this length again, each streaming max_tokens tokens as a benchmark's do:
            # the first token's way to the client then meets the stream's next steps on the cores (the colocated
            # worker's two threads hold both), which a one-token request never does (on the Xeon of 2026-12-02,
            # 2.0 ms a request with one token out, 5.2 with 48)
            # Each request's own hops (the router scraped around each): the overhead is the median of the requests'
            # TTFT less their own hops, so one request stalled in either part does not move it (a mean over eight
            # requests and their hops' means gave 3.1-18.0 ms at one length between five colocated profiles on the
            # AVX2 EPYC of 2026-12-03, a stall or two in a mean of eight)
            overheads, stream_tails, stream_admissions = [], [], []
            for k in range(idle_count):
                before = scrape_phases(cluster.url)
                ttft = lone_ttfts(cluster.url, model_id, [prompt(n + k)], max_tokens=max_tokens)[0]
                own = hop_means(summarize(before, scrape_phases(cluster.url)))
                overheads.append(ttft - own.get(hop, compute) - own.get("kv_transfer", kv_tail)
                                 - own.get("decode_admission", admission))
                if "kv_transfer" in own:
                    stream_tails.append(own["kv_transfer"])
                if "decode_admission" in own:
                    stream_admissions.append(own["decode_admission"])
            overhead_seconds.append(max(0.0, statistics.median(overheads)))
            # The KV tail and the admission as these streaming requests saw them (medians), the very hops their
            # overhead leaves out, so the simulator's parts add up to their time to first token. A one-token
            # request's KV tail is 2-3x longer (on the AVX2 EPYC of 2026-12-03: 1.4-2.6 ms at 16-512 tokens,
            # against 0.6-0.7 streaming 48 tokens, which is what the benchmark's requests at 4 req/s saw in the
            # calibration's real runs: 0.7-1.1 ms)
            kv_seconds.append(statistics.median(stream_tails) if stream_tails else kv_tail)
            admission_seconds.append(statistics.median(stream_admissions) if stream_admissions else admission)
            if len(ttfts) > 2 and compute > 0:
                scatter.append(robust_std(ttfts) / compute)
            if n in WAKE_TOKENS:  # these prompts again, taking turns: back to back and after each idle gap
                gaps = [0.0, *WAKE_IDLE_S] * wake_rounds
                ttfts_by = lone_ttfts(cluster.url, model_id, [prompt(n + k) for k in range(len(gaps))], gaps)
                wake_tokens.append(n)
                wake.append(wake_differences(gaps, ttfts_by))
        # the grid in GRID_PASSES passes, each over every point: a point's rounds fall minutes apart, in whatever
        # phases of speed the machine is in then, not in one phase (GRID_PASSES's comment says why)
        points = [(b, c) for b in worker["decode_batch"] for c in worker["decode_context"]]
        # a point too long to stream (POINT_BUDGET_S) is priced as an unformed one: from the engine's step
        skipped = {(b, c) for b, c in points if grid_point_seconds(engine, decoder, b, c, max_tokens) > POINT_BUDGET_S}
        steps: dict[tuple[int, int], list[float]] = {point: [] for point in points}
        jitters = []
        rounds: list[list[float | None]] = []  # per round, the lone prompts' hop per measured length
        for _ in range(GRID_PASSES):
            rounds.append([prompt_round(n) for n in overhead_tokens])
            for b, c in points:
                if (b, c) in skipped:
                    if on_point:
                        on_point()
                    continue
                prompts = [prompt(c - 1) for _ in range(b)]
                # their prompts computed once first (one token out each), so the measured batch's prompts are
                # prefix-cache hits and its streams start decoding together: in a disaggregated cluster a batch
                # of long prompts through one prefill worker otherwise starts its streams one by one, the first
                # ending before the last begin (on the 2-core Xeon of 2026-12-02 a batch of 16-64 never formed,
                # and the grid priced it as the few streams that did decode together)
                asyncio.run(stream_batch(cluster.url, model_id, prompts, 1))
                cpu_before = meter.read()
                streams = asyncio.run(stream_batch(cluster.url, model_id, prompts, max_tokens))
                cpu_after = meter.read()
                chunks = sum(len(t) - 1 for t in streams)  # the tokens, or fewer chunks
                host_passes.append((b, chunks, 1, cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1]))
                if (step := serving_step_seconds(streams)) is not None:
                    steps[b, c].append(step)
                if (j := step_jitter(streams)) is not None:
                    jitters.append(j)
                if on_point:
                    on_point()
        rounds.append([prompt_round(n) for n in overhead_tokens])
        # each length's idle hop: the median over its first pass and the rounds; a loaded hop moves with it
        for i, first in enumerate(list(idle_seconds)):
            median = statistics.median([first, *(r[i] for r in rounds if r[i] is not None)])
            idle_seconds[i] = median
            prefill_seconds[i] *= median / first if first > 0 else 1.0
        # every grid point streams max_tokens tokens a request, so its passes alone cannot tell the host's CPU per
        # request from its CPU per token (tokens = max_tokens x requests; profiles flipped between ~5 ms a request
        # and ~100 us a token for the client): streams of other lengths, a pass each
        for tokens in HOST_FIT_TOKENS:
            if HOST_FIT_PROMPT + tokens >= engine.max_model_len:
                continue
            cpu_before = meter.read()
            streams = asyncio.run(stream_batch(cluster.url, model_id,
                                                [prompt(HOST_FIT_PROMPT) for _ in range(HOST_FIT_STREAMS)], tokens))
            cpu_after = meter.read()
            host_passes.append((HOST_FIT_STREAMS, sum(len(t) - 1 for t in streams), 1, cpu_after[0] - cpu_before[0],
                                cpu_after[1] - cpu_before[1]))
        grid = fill_unformed([[statistics.fmean(steps[b, c]) if steps[b, c] else None for c in worker["decode_context"]]
                              for b in worker["decode_batch"]], worker["decode_seconds"])
        # colocated only: a 1P+1D cluster's pass at two streams queued at its prefill worker, whose queue the replay
        # did not follow, and the fit put 12.7 ms on each stream in flight (TTFT p50 +59% / +113% at 12 / 30 req/s
        # against +8% / -35% in another run without it, AVX2 EPYC of 2026-12-03)
        loaded = _loaded_pass(cluster.url, model_id, prompt, engine.max_model_len, max_tokens) \
            if kind == "colocated" else {}
        return {"request_overhead_s": overhead_seconds[0], "overhead_tokens": overhead_tokens,
                "overhead_seconds": overhead_seconds, "wake_idle_seconds": list(WAKE_IDLE_S) if wake else [],
                # [gap][length], as WorkerProfile.wake_overhead reads it
                "wake_tokens": wake_tokens, "wake_overhead_seconds": [list(row) for row in zip(*wake)],
                "serving_prefill_seconds": prefill_seconds,
                "serving_prefill_idle_seconds": idle_seconds,
                # how busy the loaded pass kept the prefill worker: its arrivals were paced by the idle hop
                "serving_prefill_utilization": min(1.0, LOADED_UTILIZATION * statistics.fmean(
                    s / i for s, i in zip(prefill_seconds, idle_seconds) if i > 0)) if kind == "decode" else 0.0,
                "serving_decode_seconds": grid,
                "serving_kv_transfer_seconds": kv_seconds if kind == "decode" else [],
                "serving_admission_seconds": admission_seconds if kind == "decode" else [],
                "serving_request_cpu_seconds": request_cpu if kind == "decode" else [],
                "serving_step_cv": statistics.median(jitters) if jitters else 0.0,
                "serving_prefill_cv": statistics.median(scatter) if scatter else 0.0,
                "host_cpu_seconds": host_cpu_fit(host_passes) if meter.routers else {},
                "serving_stream_tokens": max_tokens, "loaded_pass": loaded}
    finally:
        cluster.close()


def _loaded_pass(url: str, model_id: str, prompt, max_model_len: int, max_tokens: int) -> dict:
    """The colocated cluster under Poisson arrivals, as ``WorkerProfile.loaded_pass`` keeps it (``loaded_fit``
    fits the overhead under load to it): ``LOADED_PASS_PROMPTS`` new prompts (``prompt(n)`` makes one of
    ``n`` tokens) of lengths spread over ``LOADED_PASS_TOKENS`` (in a fixed shuffled order), each streaming
    ``max_tokens`` tokens, arriving at ``LOADED_PASS_STREAMS`` streams in flight on average or at
    ``LOADED_PASS_PROMPT_SHARE`` of the worker's time in prompts, whichever is the lower rate; {} where the
    model's length leaves no room."""
    import asyncio
    import random

    low, high = LOADED_PASS_TOKENS[0], min(LOADED_PASS_TOKENS[1], max_model_len - max_tokens - 8)
    if high < low:
        return {}
    lengths = [round(low + (high - low) * k / (LOADED_PASS_PROMPTS - 1)) for k in range(LOADED_PASS_PROMPTS)]
    random.Random(2).shuffle(lengths)
    mean = round(statistics.fmean(lengths))
    lone = [asyncio.run(stream_batch(url, model_id, [prompt(mean)], max_tokens))[0] for _ in range(LOADED_PASS_PROBES)]
    duration, ttft = statistics.fmean(t[-1] - t[0] for t in lone), statistics.fmean(t[1] - t[0] for t in lone)
    rate = min(LOADED_PASS_STREAMS / max(duration, 1e-3), LOADED_PASS_PROMPT_SHARE / max(ttft, 1e-3))
    prompts = [prompt(n) for n in lengths]
    streams = asyncio.run(stream_poisson(url, model_id, prompts, max_tokens, rate, seed=1))
    from pdserve.sizing.loaded_fit import in_flight_at_sends

    first = min(t[0] for t in streams)
    return {"arrival_s": [t[0] - first for t in streams], "prompt_tokens": [len(p) for p in prompts],
            "output_tokens": max_tokens, "ttft_s": [t[1] - t[0] for t in streams],
            "in_flight": in_flight_at_sends([t[0] for t in streams], [t[-1] for t in streams])}
