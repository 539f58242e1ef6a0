"""Goodput the DistServe way: SLO attainment against request rate, for each system.

DistServe (Zhong et al., OSDI'24) rates a serving system by its **goodput**: the highest request
rate at which at least 90% of requests meet every SLO (here TTFT and TPOT). ``pdserve bench compare
--request-rates R1 R2 ... --slo-set ttft:2500,tpot:150 --slo-set ttft:1000,tpot:50`` measures it:

* each system's server starts once; a discarded warm-up pass runs first, so compiled shapes, caches
  and allocators are warm: by default a full pass of the workload at the lowest rate (``duration_s``
  seconds of its arrivals, its own prompts), or a short run of N requests (``warmup="N"``);
* then, rate by rate (ascending), Poisson arrivals for ``duration_s`` seconds
  (``ceil(rate * duration_s)`` requests) of **fresh prompts**: every rate draws its own seed, so no
  rate hits the prefix cache of another;
* after each rate, every SLO set's attainment (``metrics.slo_attainment``: failures are misses);
  a system's sweep stops past saturation (``past_saturation``), since higher rates only queue more;
* goodput per SLO set = the highest swept rate whose attainment, and every lower rate's, is at or
  above the threshold (a rate of the grid, not interpolated).

The figure is DistServe's: attainment (y) against rate (x), a line per system, a panel per SLO set.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from pdserve.bench.metrics import parse_goodput, slo_attainment

ATTAINMENT_TARGET = 0.9  # DistServe's: goodput is the highest rate at which 90% of requests meet the SLOs
SATURATION_ATTAINMENT = 0.5  # a rate where every SLO set is met by fewer than half the requests is past saturation
SEED_STRIDE = 1000  # rate i of a sweep draws prompts with seed + (i + 1) * SEED_STRIDE; the warm-up seed + 999


def parse_slo_set(text: str) -> dict[str, float]:
    """``"ttft:2500,tpot:150"`` -> {"ttft": 2500.0, "tpot": 150.0} (ms). Raises ValueError."""
    items = [item for item in text.replace(" ", "").split(",") if item]
    if not items:
        raise ValueError("an SLO set needs at least one METRIC:MS")
    return parse_goodput(items)


def slo_label(slos: dict[str, float]) -> str:
    """{"ttft": 2500, "tpot": 150} -> "TTFT<=2500ms & TPOT<=150ms"."""
    return " & ".join(f"{name.upper()}<={ms:g}ms" for name, ms in slos.items())


@dataclass
class SweepPoint:
    """One rate of one system's sweep.

    Args:
        request_rate: offered requests per second; num_prompts: how many were sent.
        metrics: ``compute_metrics``' dict of the run.
        attainment: per SLO set label, the share of requests sent that met every SLO of the set.
    """

    request_rate: float
    num_prompts: int
    metrics: dict
    attainment: dict[str, float] = field(default_factory=dict)


def attainment_of(outputs, slo_sets: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each SLO set's attainment over ``outputs`` (``RequestOutput``s; failures are misses)."""
    return {slo_label(slos): slo_attainment(outputs, slos) or 0.0 for slos in slo_sets}


def past_saturation(point: SweepPoint) -> bool:
    """Whether a system is past its saturation at ``point``: every SLO set is met by fewer than
    ``SATURATION_ATTAINMENT`` of requests, so higher rates can only queue more. (Completed requests
    per second is no test: a run's duration includes draining its last requests, so even an
    unloaded system completes fewer per second than were offered.)"""
    return bool(point.attainment) and all(a < SATURATION_ATTAINMENT for a in point.attainment.values())


def goodput(points: Sequence[SweepPoint], label: str, target: float = ATTAINMENT_TARGET) -> float | None:
    """The highest swept rate at which SLO set ``label`` is met by at least ``target`` of requests, and
    by as many at every lower swept rate (a noisy pass above a failing rate does not count). None
    when even the lowest rate misses."""
    best = None
    for point in sorted(points, key=lambda p: p.request_rate):
        if point.attainment.get(label, 0.0) < target:
            break
        best = point.request_rate
    return best


def num_prompts_for(rate: float, duration_s: float) -> int:
    """Requests of a rate's run: ``duration_s`` seconds of arrivals at ``rate``, at least 8."""
    return max(8, math.ceil(rate * duration_s))


def parse_warmup(text: str) -> str:
    """``--sweep-warmup``: ``"full"`` (a whole pass at the lowest rate) or a request count ``"N"``
    (N >= 0; 0: none). Returns the normalized text; raises ValueError."""
    text = str(text).strip().lower()
    if text == "full":
        return text
    if not text.isdigit():
        raise ValueError(f"--sweep-warmup takes 'full' or a request count, got {text!r}")
    return str(int(text))


def describe_warmup(warmup: str, rates: Sequence[float], duration_s: float) -> str:
    """The warm-up of a sweep in words, for its report."""
    if warmup == "full":
        low = min(rates)
        return (f"a discarded full pass of the workload per system first ({num_prompts_for(low, duration_s)} "
                f"requests: {duration_s:g} s of arrivals at the lowest rate, {low:g} req/s, their own prompts)")
    if warmup == "0":
        return "no warm-up pass"
    return (f"a discarded warm-up run per system first ({warmup} requests of the workload's shapes, their own "
            f"prompts, at 4x the lowest rate; not a full pass)")


def run_sweep(run_at: Callable[[float, int, int], object], rates: Sequence[float], slo_sets: Sequence[dict],
              duration_s: float, seed: int, warmup: str = "full",
              log: Callable[[str], None] = print) -> list[SweepPoint]:
    """Sweep ``rates`` (ascending) against one running server.

    ``run_at(rate, num_prompts, seed)`` runs one benchmark (fresh prompts of ``seed``) and returns a
    ``BenchResult``. A discarded warm-up comes first (``parse_warmup``): ``"full"``, a whole pass of
    the workload at the lowest rate (as many requests as that rate's run, prompts of their own
    seed), or ``"N"`` requests at 4x the lowest rate. Stops after the first rate past saturation.
    """
    rates = sorted(rates)
    warmup = parse_warmup(warmup)
    if warmup == "full":
        log(f"  warm-up: a full pass at {rates[0]:g} req/s ({num_prompts_for(rates[0], duration_s)} requests, "
            "discarded)")
        run_at(rates[0], num_prompts_for(rates[0], duration_s), seed + SEED_STRIDE - 1)
    elif warmup != "0":
        run_at(rates[0] * 4, int(warmup), seed + SEED_STRIDE - 1)
    points: list[SweepPoint] = []
    for i, rate in enumerate(rates):
        n = num_prompts_for(rate, duration_s)
        result = run_at(rate, n, seed + (i + 1) * SEED_STRIDE)
        point = SweepPoint(rate, n, result.metrics, attainment_of(result.outputs, slo_sets))
        points.append(point)
        log(f"  rate {rate:g} req/s ({n} requests): " + ", ".join(
            f"{label} {a:.0%}" for label, a in point.attainment.items()) +
            f"; TTFT p50 {_fmt(result.metrics.get('p50_ttft_ms'))} ms, TPOT p50 "
            f"{_fmt(result.metrics.get('p50_tpot_ms'))} ms")
        if past_saturation(point):
            log(f"  past saturation at {rate:g} req/s: higher rates skipped")
            break
    return points


def _fmt(value) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def points_to_json(points: Sequence[SweepPoint]) -> list[dict]:
    return [dataclasses.asdict(p) for p in points]
