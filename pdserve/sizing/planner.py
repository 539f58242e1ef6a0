"""``pdserve plan``: the pool split that serves the most load within the SLOs (DistServe's placement search).

DistServe (Zhong et al., OSDI'24) picks each phase's parallelism and instance count by searching
placements with a simulator fitted to profiles, scoring each by its goodput: the highest request rate
at which at least 90% of requests meet both the TTFT and the TPOT SLO. ``plan`` does the same with
pdserve's simulator: for ``workers`` workers it tries every split into ``P`` prefill and ``D = workers
- P`` decode workers (``P >= 1``), and every worker colocated (``P = 0``), and finds each one's
goodput by simulating the workload at rising rates (doubling until attainment falls below the
target, then bisecting), each rate's attainment pooled over ``seeds`` runs of different draws. The layouts tried per pool are those the profile measured (a profile made
with ``-tp 2`` worker flags holds TP-2 workers). The recommendation is the split with the highest
goodput, i.e. the highest goodput per worker for the fixed count. With a trace the rate searched is
the trace's speed-up over its own arrival times (``rate_unit``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable

from pdserve.sizing.profile import Profile
from pdserve.sizing.simulator import SimConfig, Simulator
from pdserve.sizing.workload import SimRequest

MAX_DOUBLINGS = 16
BISECTIONS = 6


def attainment_at(profile: Profile, config: SimConfig, workload_at: Callable[[float, int], Iterable[SimRequest]],
                  rate: float, slos: dict[str, float], seeds: int = 1) -> tuple[float, dict]:
    """(SLO attainment, the first run's metrics) at ``rate``, pooled over ``seeds`` simulated runs: run
    ``k`` replays ``workload_at(rate, k)`` (its own arrivals and lengths) with the step jitter seeded
    ``config.seed + k``, and the attainment is the share of all their requests that met the SLOs. Near
    the knee one short run's attainment swings by tens of points with the seed; pooled runs swing less."""
    met = completed = 0.0
    first = None
    for k in range(seeds):
        run_config = dataclasses.replace(config, seed=config.seed + k)
        metrics = Simulator(profile, run_config).run(workload_at(rate, k), (50.0, 90.0, 99.0), slos).metrics
        first = first or metrics
        met += (metrics["slo_attainment"] or 0.0) * metrics["completed"]
        completed += metrics["completed"]
    return (met / completed if completed else 0.0), first


def max_rate(profile: Profile, config: SimConfig, workload_at: Callable[[float, int], Iterable[SimRequest]],
             slos: dict[str, float], attainment: float, seeds: int = 1) -> tuple[float, dict | None, int]:
    """(The highest rate found that keeps ``attainment`` (pooled over ``seeds`` runs: ``attainment_at``),
    its metrics, simulations run); 0 when even the lowest rate tried (1/64 per second) misses it."""
    runs = 0
    lo, lo_metrics, hi = 0.0, None, None
    rate = 1.0
    for _ in range(MAX_DOUBLINGS):
        got, metrics = attainment_at(profile, config, workload_at, rate, slos, seeds)
        runs += seeds
        if got >= attainment:
            lo, lo_metrics = rate, metrics
            if hi is not None:
                break
            rate *= 2
        else:
            hi = rate
            if lo:
                break
            rate /= 2
            if rate < 1 / 64:
                return 0.0, None, runs
    if hi is None:
        return lo, lo_metrics, runs
    for _ in range(BISECTIONS):
        mid = (lo + hi) / 2
        got, metrics = attainment_at(profile, config, workload_at, mid, slos, seeds)
        runs += seeds
        if got >= attainment:
            lo, lo_metrics = mid, metrics
        else:
            hi = mid
    return lo, lo_metrics, runs


def plan(profile: Profile, config_for: Callable[[int, int], SimConfig],
         workload_at: Callable[[float, int], Iterable[SimRequest]], workers: int, slos: dict[str, float],
         attainment: float = 0.9, colocated: str = "yes", request_rate: float | None = None,
         on_try: Callable[[str], None] | None = None, rate_unit: str = "req/s", seeds: int = 1) -> dict:
    """Every split tried with its goodput (and, given ``request_rate``, its attainment at that rate),
    best first, and the recommendation.

    Args:
        config_for: ``(num_prefill, num_decode) -> SimConfig`` (the router flags and the rest fixed).
        workload_at: ``(rate, k) -> workload``: the workload arriving at a given rate, its ``k``-th draw
            (``k`` < ``seeds``; a trace may ignore it: then only the step jitter differs between runs).
        seeds: runs pooled at each rate (``attainment_at``).
        colocated: ``yes`` (try all-colocated too), ``no``, ``only``.
        rate_unit: what ``workload_at``'s rate is (``req/s``; a trace's is its speed-up over real time).

    Raises:
        ValueError: fewer than 1 worker, no SLO, or nothing to try (a profile without the kinds).
    """
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if not slos:
        raise ValueError("plan needs at least one SLO (--slo ttft:MS tpot:MS)")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    splits = []
    if colocated in ("yes", "only") and "colocated" in profile.workers:
        splits.append((0, workers))
    if colocated != "only" and "prefill" in profile.workers and "decode" in profile.workers:
        splits += [(p, workers - p) for p in range(1, workers)]
    if not splits:
        raise ValueError("nothing to try: the profile lacks the worker kinds (colocated, or prefill and decode)")
    start = time.monotonic()
    tried = []
    for num_prefill, num_decode in splits:
        config = config_for(num_prefill, num_decode)
        rate, metrics, runs = max_rate(profile, config, workload_at, slos, attainment, seeds)
        entry = {"num_prefill": num_prefill, "num_decode": num_decode,
                 "layout": _layout(profile, num_prefill), "goodput_rps": rate,
                 "goodput_per_worker_rps": rate / workers, "simulations": runs,
                 "median_ttft_ms": metrics["median_ttft_ms"] if metrics else None,
                 "median_tpot_ms": metrics["median_tpot_ms"] if metrics else None}
        if request_rate is not None:
            entry["attainment_at_rate"], _ = attainment_at(profile, config, workload_at, request_rate, slos, seeds)
        tried.append(entry)
        if on_try is not None:
            on_try(f"tried {_name(entry)}: goodput {rate:.2f} {rate_unit} ({runs} simulations)")
    tried.sort(key=lambda e: (-e["goodput_rps"], e["num_prefill"]))
    return {"workers": workers, "slos_ms": slos, "attainment": attainment, "request_rate": request_rate,
            "rate_unit": rate_unit, "seeds": seeds,
            "recommended": tried[0], "tried": tried, "seconds": time.monotonic() - start}


def _layout(profile: Profile, num_prefill: int) -> dict:
    kinds = ("prefill", "decode") if num_prefill else ("colocated",)
    return {k: f"tp{profile.workers[k].tensor_parallel_size}pp{profile.workers[k].pipeline_parallel_size}"
            for k in kinds}


def _name(entry: dict) -> str:
    if entry["num_prefill"] == 0:
        return f"{entry['num_decode']} colocated ({entry['layout']['colocated']})"
    return (f"{entry['num_prefill']}P ({entry['layout']['prefill']}) + "
            f"{entry['num_decode']}D ({entry['layout']['decode']})")


def format_plan(result: dict) -> str:
    """The alternatives tried, best first, and the recommendation, as text."""
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in result["slos_ms"].items())
    lines = [f"{result['workers']} workers, SLOs {slos}, attainment >= {100 * result['attainment']:.0f}%; "
             f"goodput in {result.get('rate_unit', 'req/s')}",
             f"{'split':<36}{'goodput':>14}{'per worker':>12}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"
             + (f"{'attain@rate':>13}" if result["request_rate"] is not None else "")]
    for e in result["tried"]:
        ttft = f"{e['median_ttft_ms']:.1f}" if e["median_ttft_ms"] is not None else "n/a"
        tpot = f"{e['median_tpot_ms']:.1f}" if e["median_tpot_ms"] is not None else "n/a"
        line = f"{_name(e):<36}{e['goodput_rps']:>14.2f}{e['goodput_per_worker_rps']:>12.2f}{ttft:>13}{tpot:>13}"
        if result["request_rate"] is not None:
            line += f"{100 * e['attainment_at_rate']:>12.1f}%"
        lines.append(line)
    best, unit = result["recommended"], result.get("rate_unit", "req/s")
    lines.append(f"recommended: {_name(best)} ({best['goodput_rps']:.2f} {unit} within the SLOs; searched in "
                 f"{result['seconds']:.1f} s)")
    return "\n".join(lines)
