"""``pdserve plan``: the pool split and layouts that serve the most load within the SLOs (DistServe's placement search).

DistServe (Zhong et al., OSDI'24) picks each phase's parallelism and instance count by searching
placements with a simulator fitted to profiles, scoring each by its goodput: the highest request rate
at which at least 90% of requests meet both the TTFT and the TPOT SLO. ``plan`` does the same with
pdserve's simulator: for ``workers`` devices (cores or GPUs; a TP x PP worker holds TP x PP of them) it
tries every split into ``P`` prefill and as many decode workers as the rest of the devices hold
(``P >= 1``), and every worker colocated (``P = 0``), in every layout the profiles measured (one
profile per layout: ``pdserve profile -tp 2`` holds TP-2 workers; given several, each pool may take
any of them), and finds each one's goodput by simulating the workload at rising rates (doubling until
attainment falls below the target, then bisecting), each rate's attainment pooled over ``seeds`` runs
of different draws. The recommendation is the cluster with the highest goodput per device it holds
(then the highest goodput): with one TP-1 profile, the split with the highest goodput. With a trace
the rate searched is the trace's speed-up over its own arrival times (``rate_unit``).
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass

from pdserve.sizing.profile import Profile, WorkerProfile
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


def layout_name(wp: WorkerProfile) -> str:
    """A worker's parallel layout as the profile's transfer names it: ``tp{T}pp{P}``."""
    return f"tp{wp.tensor_parallel_size}pp{wp.pipeline_parallel_size}"


def ranks(wp: WorkerProfile) -> int:
    """Devices (cores' shares on CPU, GPUs) one worker of this profile holds: TP x PP."""
    return wp.tensor_parallel_size * wp.pipeline_parallel_size


@dataclass
class Candidate:
    """One cluster the planner tries: ``num_prefill`` prefill workers (0: every worker colocated) and
    ``num_decode`` decode (or colocated) workers, each pool in the layout of the profile it came from;
    ``profile``: the simulator's profile of that pair (one profile's kinds, or two profiles' joined:
    ``join_profiles``); ``ranks``: devices it holds."""

    num_prefill: int
    num_decode: int
    profile: Profile
    ranks: int

    @property
    def layout(self) -> dict:
        kinds = ("prefill", "decode") if self.num_prefill else ("colocated",)
        return {k: layout_name(self.profile.workers[k]) for k in kinds}


def join_profiles(prefill_from: Profile, decode_from: Profile) -> Profile:
    """A profile whose prefill workers are ``prefill_from``'s and decode workers ``decode_from``'s (two
    layouts measured apart, e.g. ``pdserve profile -tp 1`` and ``-tp 2``). The KV transfer between the two
    layouts is the one either profile measured for that pair (``pdserve profile --transfer-layouts``);
    where neither did, the prefill side's own figures stand for it, by bytes, under the pair's name, and
    the joined profile's ``extra["transfer_estimated_from"]`` names the pair they were measured on. The
    fixed latencies are the decode side's (it streams the tokens)."""
    if prefill_from is decode_from:
        return prefill_from
    pair = (layout_name(prefill_from.worker("prefill")), layout_name(decode_from.worker("decode")))
    transfer = prefill_from.transfer_for(*pair) or decode_from.transfer_for(*pair)
    extra = dict(decode_from.extra)
    measured = [t for p in (prefill_from, decode_from) for t in (p.transfer, *p.transfers) if t is not None]
    if transfer is None and measured:
        borrowed = measured[0]
        transfer = dataclasses.replace(borrowed, prefill_layout=pair[0], decode_layout=pair[1])
        extra["transfer_estimated_from"] = f"{borrowed.prefill_layout}->{borrowed.decode_layout}"
    return dataclasses.replace(decode_from, workers={"prefill": prefill_from.worker("prefill"),
                                                     "decode": decode_from.worker("decode")}, transfer=transfer,
                               transfers=[], extra=extra)


def candidates(profiles: Sequence[Profile], workers: int, colocated: str = "yes") -> list[Candidate]:
    """Every cluster of at most ``workers`` devices the profiles allow, each using as many as fit: all
    colocated in each colocated layout; and for each prefill layout and each decode layout, every number
    of prefill workers with the rest of the devices given to decode workers (DistServe searches each
    phase's parallelism and instance count the same way). A worker of TP x PP ranks takes that many
    devices; with one TP-1 profile these are the splits ``P + D = workers``."""
    found: list[Candidate] = []
    seen = set()

    def add(c: Candidate) -> None:
        key = (c.num_prefill, c.num_decode, tuple(sorted(c.layout.items())))
        if key not in seen:
            seen.add(key)
            found.append(c)

    if colocated in ("yes", "only"):
        for prof in profiles:
            if "colocated" in prof.workers and (n := workers // ranks(prof.workers["colocated"])):
                add(Candidate(0, n, prof, n * ranks(prof.workers["colocated"])))
    if colocated != "only":
        for pre in (p for p in profiles if "prefill" in p.workers):
            for dec in (p for p in profiles if "decode" in p.workers):
                if pre is not dec and not any(p.transfer or p.transfers for p in (pre, dec)):
                    continue
                joined = join_profiles(pre, dec)
                sp, sd = ranks(pre.workers["prefill"]), ranks(dec.workers["decode"])
                for num_prefill in range(1, (workers - sd) // sp + 1):
                    num_decode = (workers - num_prefill * sp) // sd
                    add(Candidate(num_prefill, num_decode, joined, num_prefill * sp + num_decode * sd))
    return found


def plan(profile: Profile | Sequence[Profile], config_for: Callable[[int, int], SimConfig],
         workload_at: Callable[[float, int], Iterable[SimRequest]], workers: int, slos: dict[str, float],
         attainment: float = 0.9, colocated: str = "yes", request_rate: float | None = None,
         on_try: Callable[[str], None] | None = None, rate_unit: str = "req/s", seeds: int = 1,
         jobs: int | None = 1) -> dict:
    """Every cluster tried (``candidates``) with its goodput (and, given ``request_rate``, its attainment
    at that rate), best first, and the recommendation: the most goodput per device held, then the most
    goodput.

    Args:
        profile: one profile, or several (each measured with other worker flags, e.g. ``-tp 2``): each
            pool may take any of their layouts.
        config_for: ``(num_prefill, num_decode) -> SimConfig`` (the router flags and the rest fixed).
        workers: devices to fill (a TP x PP worker holds TP x PP of them).
        workload_at: ``(rate, k) -> workload``: the workload arriving at a given rate, its ``k``-th draw
            (``k`` < ``seeds``; a trace may ignore it: then only the step jitter differs between runs).
        seeds: runs pooled at each rate (``attainment_at``).
        colocated: ``yes`` (try all-colocated too), ``no``, ``only``.
        rate_unit: what ``workload_at``'s rate is (``req/s``; a trace's is its speed-up over real time).
        jobs: candidates simulated at once, each in a forked process (None: one per core this process may
            use); every candidate's simulations are the same whatever the count, so is the result.

    Raises:
        ValueError: fewer than 1 worker, no SLO, or nothing to try (profiles without the kinds, or whose
            workers need more devices than ``workers``).
    """
    profiles = [profile] if isinstance(profile, Profile) else list(profile)
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if not slos:
        raise ValueError("plan needs at least one SLO (--slo ttft:MS tpot:MS)")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs must be >= 1, got {jobs}")
    tries = candidates(profiles, workers, colocated)
    if not tries:
        raise ValueError(f"nothing to try: the profiles lack the worker kinds (colocated, or prefill and decode) "
                         f"or their workers need more than {workers} devices")
    start = time.monotonic()
    global _JOB
    _JOB = (tries, config_for, workload_at, slos, attainment, seeds, request_rate)
    tried: list[dict | None] = [None] * len(tries)

    def done(i: int, entry: dict) -> None:
        tried[i] = entry
        if on_try is not None:
            on_try(f"tried {_name(entry)}: goodput {entry['goodput_rps']:.2f} {rate_unit} "
                   f"({entry['simulations']} simulations)")

    try:
        if jobs is None:
            jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        jobs = min(jobs, len(tries))
        if jobs > 1 and "fork" in mp.get_all_start_methods():  # forked: the callables need no pickling
            with ProcessPoolExecutor(jobs, mp_context=mp.get_context("fork")) as pool:
                futures = {pool.submit(_try, i): i for i in range(len(tries))}
                for future in as_completed(futures):
                    done(futures[future], future.result())
        else:
            for i in range(len(tries)):
                done(i, _try(i))
    finally:
        _JOB = None
    tried.sort(key=lambda e: (-e["goodput_per_worker_rps"], -e["goodput_rps"], e["num_prefill"]))
    return {"workers": workers, "slos_ms": slos, "attainment": attainment, "request_rate": request_rate,
            "rate_unit": rate_unit, "seeds": seeds,
            "recommended": tried[0], "tried": tried, "seconds": time.monotonic() - start}


_JOB: tuple | None = None  # plan()'s search, read by _try in this process or in the pool's forked workers


def _try(i: int) -> dict:
    """Candidate ``i`` of the search in ``_JOB``: its goodput (and attainment at the asked rate)."""
    tries, config_for, workload_at, slos, attainment, seeds, request_rate = _JOB
    c = tries[i]
    config = config_for(c.num_prefill, c.num_decode)
    rate, metrics, runs = max_rate(c.profile, config, workload_at, slos, attainment, seeds)
    entry = {"num_prefill": c.num_prefill, "num_decode": c.num_decode, "layout": c.layout, "ranks": c.ranks,
             "transfer_estimated_from": c.profile.extra.get("transfer_estimated_from") if c.num_prefill else None,
             "goodput_rps": rate, "goodput_per_worker_rps": rate / c.ranks, "simulations": runs,
             "median_ttft_ms": metrics["median_ttft_ms"] if metrics else None,
             "median_tpot_ms": metrics["median_tpot_ms"] if metrics else None}
    if request_rate is not None:
        entry["attainment_at_rate"], _ = attainment_at(c.profile, config, workload_at, request_rate, slos, seeds)
    return entry


def _name(entry: dict) -> str:
    if entry["num_prefill"] == 0:
        return f"{entry['num_decode']} colocated ({entry['layout']['colocated']})"
    return (f"{entry['num_prefill']}P ({entry['layout']['prefill']}) + "
            f"{entry['num_decode']}D ({entry['layout']['decode']})")


def format_plan(result: dict) -> str:
    """The alternatives tried, best first, and the recommendation, as text."""
    slos = ", ".join(f"{k} <= {v:g} ms" for k, v in result["slos_ms"].items())
    lines = [f"{result['workers']} devices, SLOs {slos}, attainment >= {100 * result['attainment']:.0f}%"
             f" (pooled over {result.get('seeds', 1)} draws a rate); goodput in {result.get('rate_unit', 'req/s')}",
             f"{'split':<36}{'devices':>8}{'goodput':>14}{'per device':>12}{'TTFT p50 ms':>13}{'TPOT p50 ms':>13}"
             + (f"{'attain@rate':>13}" if result["request_rate"] is not None else "")]
    for e in result["tried"]:
        ttft = f"{e['median_ttft_ms']:.1f}" if e["median_ttft_ms"] is not None else "n/a"
        tpot = f"{e['median_tpot_ms']:.1f}" if e["median_tpot_ms"] is not None else "n/a"
        line = (f"{_name(e):<36}{e.get('ranks', result['workers']):>8}{e['goodput_rps']:>14.2f}"
                f"{e['goodput_per_worker_rps']:>12.2f}{ttft:>13}{tpot:>13}")
        if result["request_rate"] is not None:
            line += f"{100 * e['attainment_at_rate']:>12.1f}%"
        if e.get("transfer_estimated_from"):
            line += f"  (KV transfer not measured for this pair: {e['transfer_estimated_from']}'s figures)"
        lines.append(line)
    best, unit = result["recommended"], result.get("rate_unit", "req/s")
    lines.append(f"recommended: {_name(best)} ({best['goodput_rps']:.2f} {unit} within the SLOs; searched in "
                 f"{result['seconds']:.1f} s)")
    return "\n".join(lines)
