"""Goodput the DistServe way: SLO attainment against request rate, for each system.

DistServe (Zhong et al., OSDI'24) rates a serving system by its **goodput**: the highest request
rate at which at least 90% of requests meet every SLO (here TTFT and TPOT). ``pdserve bench compare
--request-rates R1 R2 ... --slo-set ttft:2500,tpot:150 --slo-set ttft:1000,tpot:50`` measures it:

* each system's server starts once; a discarded warm-up run (8 requests of the same shapes, their
  own prompts) runs first, so compiled shapes and caches are warm;
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


def run_sweep(run_at: Callable[[float, int, int], object], rates: Sequence[float], slo_sets: Sequence[dict],
              duration_s: float, seed: int, warmup_prompts: int = 8,
              log: Callable[[str], None] = print) -> list[SweepPoint]:
    """Sweep ``rates`` (ascending) against one running server.

    ``run_at(rate, num_prompts, seed)`` runs one benchmark (fresh prompts of ``seed``) and returns a
    ``BenchResult``. A warm-up run of ``warmup_prompts`` requests at the lowest rate comes first and
    is discarded. Stops after the first rate past saturation.
    """
    rates = sorted(rates)
    if warmup_prompts:
        run_at(rates[0] * 4, warmup_prompts, seed + SEED_STRIDE - 1)
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
