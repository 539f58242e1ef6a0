"""Where a benchmark run's TTFT went, from a pdserve router's hop histograms.

``bench serve`` scrapes the router's ``GET /metrics`` before and after the measured requests; the
difference of ``pdserve:request_phase_seconds{phase}`` (each hop of a request's way to its first
token, ``pdserve.router.tracing``) is this run's. A server without that metric (not a pdserve
router, or an older one) gives no summary. Decode-only step time comes from the workers'
``pdserve:decode_steps`` / ``pdserve:decode_step_seconds`` counters the same way.

Other requests the router served meanwhile count too; run the benchmark against an otherwise
idle cluster. The decode step counters arrive with heartbeats, so the last second of steps may
be missing from the "after" scrape.
"""

from __future__ import annotations

import dataclasses
import math

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.tracing import PHASES, PREFILL_COMPUTE_PHASES

PHASE_METRIC = "pdserve:request_phase_seconds"
_STEP_COUNTERS = ("pdserve:decode_steps_total", "pdserve:decode_step_seconds_total")


@dataclasses.dataclass
class Histogram:
    """One hop's histogram, summed over label sets: ``buckets`` maps each upper bound (seconds,
    ``inf`` last) to the cumulative count of observations at or under it."""

    count: float = 0.0
    sum: float = 0.0
    buckets: dict[float, float] = dataclasses.field(default_factory=dict)

    def minus(self, other: "Histogram") -> "Histogram":
        return Histogram(self.count - other.count, self.sum - other.sum,
                         {le: n - other.buckets.get(le, 0.0) for le, n in self.buckets.items()})

    def quantile(self, q: float) -> float | None:
        """The ``q`` quantile (0..1) by linear interpolation inside its bucket (Prometheus'
        ``histogram_quantile``); None without observations."""
        if self.count <= 0:
            return None
        rank, lower, below = q * self.count, 0.0, 0.0
        for le, cumulative in sorted(self.buckets.items()):
            if cumulative >= rank:
                if math.isinf(le):
                    return lower  # past the last finite bound: its bound is all that is known
                inside = cumulative - below
                return lower + (le - lower) * ((rank - below) / inside if inside > 0 else 1.0)
            lower, below = le, cumulative
        return lower


@dataclasses.dataclass
class RouterFigures:
    """What one scrape of a pdserve router's ``/metrics`` holds for the summary."""

    phases: dict[str, Histogram]
    decode_steps: float = 0.0
    decode_step_seconds: float = 0.0


def parse_figures(text: str) -> RouterFigures | None:
    """The hop histograms and decode step counters of a ``/metrics`` body (Prometheus text); None if
    it has no ``pdserve:request_phase_seconds`` family (not a pdserve router)."""
    phases: dict[str, Histogram] = {}
    steps = dict.fromkeys(_STEP_COUNTERS, 0.0)
    found = False
    for family in text_string_to_metric_families(text):
        if family.name == PHASE_METRIC:
            found = True
            for s in family.samples:
                hist = phases.setdefault(s.labels.get("phase", ""), Histogram())
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    hist.buckets[le] = hist.buckets.get(le, 0.0) + s.value
                elif s.name.endswith("_count"):
                    hist.count += s.value
                elif s.name.endswith("_sum"):
                    hist.sum += s.value
        for s in family.samples:
            if s.name in steps and s.labels.get("role") == "decode":
                steps[s.name] += s.value
    if not found:
        return None
    return RouterFigures(phases, *steps.values())


async def scrape(client: httpx.AsyncClient, url: str) -> RouterFigures | None:
    """``parse_figures`` of ``{url}/metrics``; None when the server has none (any HTTP error included)."""
    try:
        resp = await client.get(f"{url}/metrics")
        if resp.status_code != 200:
            return None
        return parse_figures(resp.text)
    except (httpx.HTTPError, ValueError):
        return None


def summarize(before: RouterFigures | None, after: RouterFigures | None) -> dict | None:
    """The run's hops (``after - before``) as JSON-ready figures, or None without both scrapes or
    without a request broken down. Seconds throughout.

    Returns ``{"phases": {hop: {"count", "mean_s", "p50_s", "share"}}, "num_requests",
    "mean_ttft_s", "non_prefill_compute_share", "mean_decode_step_s"}``; ``share`` is the hop's part
    of the summed TTFT, ``non_prefill_compute_share`` the part that is not prefill compute (local or
    remote), ``num_requests`` the requests broken down (each passes ``router_queue`` once).
    """
    if before is None or after is None:
        return None
    hops = {name: after.phases[name].minus(before.phases.get(name, Histogram()))
            for name in PHASES if name in after.phases}
    hops = {name: h for name, h in hops.items() if h.count > 0}
    total = sum(h.sum for h in hops.values())
    num_requests = hops["router_queue"].count if "router_queue" in hops else 0
    if not num_requests or total <= 0:
        return None
    compute = sum(hops[name].sum for name in PREFILL_COMPUTE_PHASES if name in hops)
    num_steps = after.decode_steps - before.decode_steps
    return {
        "phases": {name: {"count": int(h.count), "mean_s": h.sum / h.count, "p50_s": h.quantile(0.5),
                          "share": h.sum / total} for name, h in hops.items()},
        "num_requests": int(num_requests),
        "mean_ttft_s": total / num_requests,
        "non_prefill_compute_share": 1.0 - compute / total,
        "mean_decode_step_s": (after.decode_step_seconds - before.decode_step_seconds) / num_steps
        if num_steps > 0 else None,
    }


def format_summary(summary: dict, width: int = 50) -> str:
    """``summarize``'s figures as the table ``bench serve`` prints after its own (milliseconds)."""
    lines = [" Where TTFT went (router hops) ".center(width, "=")]

    def row(label: str, text: str) -> None:
        lines.append(f"{label:<{width - 10}}{text:>10}")

    row("Requests broken down:", str(summary["num_requests"]))
    lines.append(f"{'hop (ms)':<22}{'count':>7}{'mean':>8}{'p50':>7}{'share':>6}")
    for name, h in summary["phases"].items():
        p50 = "n/a" if h["p50_s"] is None else f"{h['p50_s'] * 1e3:.1f}"
        lines.append(f"{name:<22}{h['count']:>7}{h['mean_s'] * 1e3:>8.2f}{p50:>7}{h['share'] * 100:>5.0f}%")
    lines.append("-" * width)
    row("Mean TTFT, sum of hops (ms):", f"{summary['mean_ttft_s'] * 1e3:.2f}")
    row("TTFT not in prefill compute:", f"{summary['non_prefill_compute_share'] * 100:.1f}%")
    step = summary.get("mean_decode_step_s")
    row("Mean decode-only step (ms):", "n/a" if step is None else f"{step * 1e3:.2f}")
    lines.append("=" * width)
    return "\n".join(lines)
