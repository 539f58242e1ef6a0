"""What a request pays under load: the profiler's loaded pass, replayed in the simulator.

A lone request's time outside the steps is measured at idle, one request after another
(``WorkerProfile.request_overhead``); under Poisson arrivals the router's and the client's event loops are
also busy with the other streams' tokens, and a request's way in and its first token's way out queue behind
them. On a 2-core Xeon the colocated cluster's TTFT minus its prompt-compute hop was 3.7 ms for lone
prompts and 7.2-7.9 ms at 4 req/s (docs/benchmarks.md, thirty-fourth session), and the simulated colocated
TTFT p50 ran 28-47% under the real one.

The profiler streams one Poisson pass of prompts through the real cluster (``WorkerProfile.loaded_pass``:
each request's send time, its time to first token, the streams in flight when it was sent). This module
replays that very pass in the simulator (same arrivals, lengths and output tokens; pdserve's own
scheduler; everything the simulator builds: mixed steps, the host's CPU shares, the wake-up after idle)
and fits what it leaves out as a line in ``k``, the other streams in flight when a request arrives:
``loaded_overhead_s + overhead_per_stream_s * k`` seconds added to the request's overhead, through each
request's real TTFT less its replayed one. A correction fitted on the very workers the cluster serves with,
as Dynamo's SLA planner corrects its interpolated TTFT by the ratio it observes, here fitted once at
profile time.

Pure Python, no torch: the replay is a few dozen simulated requests, milliseconds.
"""

from __future__ import annotations

import statistics

from pdserve.sizing.profile import Profile
from pdserve.sizing.workload import SimRequest

FIT_ROUNDS = 4  # fixed-point rounds (each replays the pass with the value so far)
FIT_SEEDS = (0, 1, 2)  # the simulator's step jitter draws: a request's replayed TTFT is the mean over these
_TOLERANCE = 0.01  # stop when the simulated median TTFT is within this share of the real one


def _pass_requests(loaded: dict) -> list[SimRequest]:
    """The pass's requests for the simulator: the same arrivals, lengths and outputs, each prompt its own
    (the profiler's prompts share no prefix)."""
    requests = []
    for i, (arrival, tokens) in enumerate(zip(loaded["arrival_s"], loaded["prompt_tokens"])):
        prompt = [10 + (i * 7919 + j * 104729 + 17) % 30_000 for j in range(int(tokens))]
        prompt[0] = 10 + i  # never a shared first block
        requests.append(SimRequest(i, float(arrival), prompt, int(loaded["output_tokens"])))
    return requests


def replay_ttfts(profile: Profile, kind: str, base_s: float, per_stream_s: float) -> list[float]:
    """Each request's simulated TTFT (s, in the pass's order) of ``kind``'s loaded pass with
    ``loaded_overhead_s`` = ``base_s`` and ``overhead_per_stream_s`` = ``per_stream_s``: the mean over
    ``FIT_SEEDS`` of the replays, the cluster laid out as the profiler's (``colocated``: one colocated worker;
    ``decode``: one prefill and one decode worker) on the profiled machine's cores, its router and client
    beside it.

    Raises:
        ValueError: ``kind`` has no loaded pass.
    """
    from pdserve.sizing.simulator import SimConfig, Simulator

    worker = profile.worker(kind)
    if not worker.loaded_pass:
        raise ValueError(f"the profile's {kind} workers have no loaded pass")
    saved = worker.loaded_overhead_s, worker.overhead_per_stream_s
    worker.loaded_overhead_s, worker.overhead_per_stream_s = base_s, per_stream_s
    index = {r.arrival_s: r.index for r in _pass_requests(worker.loaded_pass)}
    sums = [0.0] * len(index)
    try:
        for seed in FIT_SEEDS:
            config = SimConfig(num_prefill=0 if kind == "colocated" else 1, num_decode=1,
                               machine_cores=profile.machine.get("cores") or None, host_load="router+client",
                               seed=seed)
            records = Simulator(profile, config).run(_pass_requests(worker.loaded_pass)).records
            for arrival, ttft in zip(records.arrival, records.ttft):
                sums[index[arrival]] += ttft
    finally:
        worker.loaded_overhead_s, worker.overhead_per_stream_s = saved
    return [s / len(FIT_SEEDS) for s in sums]


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """``(a, b)`` of ``y = a + b x`` by least squares, each ``y`` first clipped to its median +- 3 MADs (one
    stalled request of forty would tilt the line)."""
    med = statistics.median(ys)
    mad = statistics.median(abs(y - med) for y in ys) or 1e-12
    ys = [min(max(y, med - 3 * mad), med + 3 * mad) for y in ys]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def fit_loaded_overhead(profile: Profile, kind: str) -> tuple[float, float]:
    """``(loaded_overhead_s, overhead_per_stream_s)`` for ``kind``: the line ``a + b k`` through each request's
    real TTFT less its replayed one (``replay_ttfts``) against ``k``, the other streams in flight when it was
    sent, refined over ``FIT_ROUNDS`` replays with the terms so far (a longer way in keeps more streams in
    flight). ``b >= 0`` (the term only adds: a slope below 0 is noise); ``a`` never takes more than the
    profile's idle overhead away, nor adds more than it: a request that finds no other stream in flight pays
    the idle overhead again at most, the way in and out of the router, HTTP and the hops (fitted on the built-in
    model: -5 to +8.4 ms against an idle overhead of 2.6-4.2). More is the phase the pass fell in, not load: on
    the AVX2 EPYC of 2026-12-04 the bench preset's passes fitted 0.02-0.14 s against 4.5-6 ms, a 40-request pass's
    lone prompts running 0.95-1.3x their replay, and the colocated TTFT p50 simulated 27-35% over two real runs
    (-1 to -2% with the constant at 0). Stops once the replayed median TTFT is within ``_TOLERANCE`` of the real
    one.

    Raises:
        ValueError: ``kind`` has no loaded pass.
    """
    worker = profile.worker(kind)
    loaded = worker.loaded_pass
    if not loaded:
        raise ValueError(f"the profile's {kind} workers have no loaded pass")
    real, in_flight = loaded["ttft_s"], [float(k) for k in loaded["in_flight"]]
    # the idle overhead the simulator starts from (the worker's, else the profile's): ``a``'s bound either way
    idle = worker.request_overhead(statistics.fmean(loaded["prompt_tokens"])) or profile.request_overhead_s
    base = per_stream = 0.0
    for _ in range(FIT_ROUNDS):
        replayed = replay_ttfts(profile, kind, base, per_stream)
        if abs(statistics.median(replayed) - statistics.median(real)) <= _TOLERANCE * statistics.median(real):
            break
        a, b = _line(in_flight, [r - s for r, s in zip(real, replayed)])
        taken = max(0.0, per_stream + b) - per_stream  # b, less what would take the slope below 0
        per_stream += taken
        base = min(idle, max(-idle, base + a + (b - taken) * statistics.fmean(in_flight)))  # the line's mean
    return base, per_stream


def in_flight_at_sends(sends: list[float], ends: list[float]) -> list[int]:
    """For each request (its send time and its last chunk's, s), how many others were in flight when it was
    sent: sent before it and not yet done."""
    return [sum(1 for j, (s, e) in enumerate(zip(sends, ends)) if j != i and s < send < e)
            for i, send in enumerate(sends)]
