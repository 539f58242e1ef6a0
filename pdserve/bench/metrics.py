"""What a serving benchmark measures, computed from per-request timings.

Per request (``RequestOutput``, all times in seconds):

* TTFT: send -> first streamed chunk with text.
* ITL: every gap between two consecutive chunks with text (a chunk may carry several tokens).
* E2EL: send -> end of the response.
* TPOT: ``(e2el - ttft) / (output_tokens - 1)``, for requests with more than one output token.

Aggregates (``compute_metrics``) follow vLLM's ``bench serve``: throughputs over the whole
run's duration, counting completed requests only; each latency's mean, median, std and the
asked percentiles in milliseconds (linear interpolation, as ``numpy.percentile``); goodput is
completed requests meeting every given SLO (``ttft``, ``tpot``, ``e2el``; in ms) per second, and
SLO attainment the share of all requests sent that completed within every SLO (a failed request is
a miss). DistServe (Zhong et al., OSDI'24) calls a system's goodput the highest request rate at
which attainment stays at or above 90%: ``pdserve bench compare --request-rates`` measures that
(``pdserve.bench.sweep``).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
METRIC_NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


@dataclass
class RequestOutput:
    """How one request went. Times in seconds (``time.perf_counter`` differences).

    Args:
        success: a full streamed response came back; otherwise ``error`` says why.
        prompt_len: prompt tokens (the server's usage count when given, else the workload's).
        output_tokens: tokens generated (the server's usage count; without usage, chunks with text).
        ttft_s, e2el_s: time to first token / end-to-end latency (0.0 on failure).
        itl_s: gaps between consecutive chunks with text.
        send_s: when it was sent, from the start of the run.
    """

    success: bool = False
    prompt_len: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    e2el_s: float = 0.0
    send_s: float = 0.0
    error: str = ""

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first; None for fewer than two tokens or a failure."""
        if not self.success or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def percentile(values: list[float], p: float) -> float:
    """The ``p``-th percentile (0..100) by linear interpolation between closest ranks (numpy's default).

    Raises ValueError for an empty list or ``p`` outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= p <= 100.0:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def percentile_label(p: float) -> str:
    """``99`` -> ``"p99"``, ``99.9`` -> ``"p99.9"`` (the key vLLM writes)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def parse_percentiles(text: str) -> list[float]:
    """``"50,90,99"`` -> ``[50.0, 90.0, 99.0]``. Raises ValueError outside [0, 100]."""
    values = [float(x) for x in text.split(",") if x.strip()]
    if not values or any(not 0.0 <= v <= 100.0 for v in values):
        raise ValueError(f"percentiles must be comma-separated numbers in [0, 100], got {text!r}")
    return values


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (SLOs in ms).

    Raises ValueError for an unknown metric (only ttft, tpot, e2el), a missing colon, or a
    negative or non-numeric value.
    """
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        name = name.strip().lower()
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"goodput SLOs are ttft:MS, tpot:MS or e2el:MS, got {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"goodput SLO {item!r}: {value!r} is not a number of milliseconds") from None
        if ms < 0 or math.isnan(ms):
            raise ValueError(f"goodput SLO {item!r} must be >= 0 ms")
        slos[name] = ms
    return slos


def meets_slos(out: RequestOutput, slos: dict[str, float]) -> bool:
    """Whether a completed request is within every SLO (ms). A request with one token has TPOT 0."""
    values_s = {"ttft": out.ttft_s, "tpot": out.tpot_s or 0.0, "e2el": out.e2el_s}
    return all(values_s[name] * 1000.0 <= slo_ms for name, slo_ms in slos.items())


def slo_attainment(outputs: list[RequestOutput], slos: dict[str, float]) -> float | None:
    """The share of ``outputs`` (every request sent) that completed within every SLO (ms); failed
    requests count as misses. None for no requests."""
    if not outputs:
        return None
    return sum(o.success and meets_slos(o, slos) for o in outputs) / len(outputs)


def latency_stats(values_s: list[float], percentiles: list[float]) -> dict[str, float | None]:
    """``mean``, ``median``, ``std`` and each ``pNN`` of ``values_s``, converted to ms (None when empty)."""
    keys = ["mean", "median", "std", *(percentile_label(p) for p in percentiles)]
    if not values_s:
        return dict.fromkeys(keys)
    ms = [v * 1000.0 for v in values_s]
    stats = {"mean": statistics.fmean(ms), "median": percentile(ms, 50), "std": statistics.pstdev(ms)}
    for p in percentiles:
        stats[percentile_label(p)] = percentile(ms, p)
    return stats


def compute_metrics(outputs: list[RequestOutput], duration_s: float, percentiles: list[float],
                    goodput_slos: dict[str, float] | None = None) -> dict:
    """The aggregate metrics of one run, as a flat dict with vLLM's result-file keys.

    ``duration`` (s), ``completed``, ``failed``, token totals, ``request_throughput`` (req/s),
    ``output_throughput`` and ``total_token_throughput`` (tok/s), ``request_goodput`` (req/s,
    None without SLOs), ``slo_attainment`` (0..1 of all requests, failures as misses; None without
    SLOs), and ``{mean,median,std,pNN}_{ttft,tpot,itl,e2el}_ms``.
    Raises ValueError if ``duration_s`` is not positive.
    """
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    done = [o for o in outputs if o.success]
    total_in = sum(o.prompt_len for o in done)
    total_out = sum(o.output_tokens for o in done)
    metrics: dict = {
        "duration": duration_s, "completed": len(done), "failed": len(outputs) - len(done),
        "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": len(done) / duration_s,
        "request_goodput": (sum(meets_slos(o, goodput_slos) for o in done) / duration_s) if goodput_slos else None,
        "slo_attainment": slo_attainment(outputs, goodput_slos) if goodput_slos else None,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    series = {"ttft": [o.ttft_s for o in done], "tpot": [t for o in done if (t := o.tpot_s) is not None],
              "itl": [x for o in done for x in o.itl_s], "e2el": [o.e2el_s for o in done]}
    for name in LATENCY_METRICS:
        for stat, value in latency_stats(series[name], percentiles).items():
            metrics[f"{stat}_{name}_ms"] = value
    return metrics


def format_table(metrics: dict, percentiles: list[float], title: str = "Serving Benchmark Result",
                 header: dict | None = None) -> str:
    """A human-readable summary of ``compute_metrics``' output (vLLM's layout), ``header`` rows first."""
    width = 50
    lines = [f" {title} ".center(width, "=")]

    def row(label: str, value) -> None:
        if value is None:
            text = "n/a"
        elif isinstance(value, float):
            text = f"{value:.2f}"
        else:
            text = str(value)
        lines.append(f"{label:<40}{text:>10}")

    for label, value in (header or {}).items():
        row(label, value)
    row("Successful requests:", metrics["completed"])
    row("Failed requests:", metrics["failed"])
    row("Benchmark duration (s):", metrics["duration"])
    row("Total input tokens:", metrics["total_input_tokens"])
    row("Total generated tokens:", metrics["total_output_tokens"])
    row("Request throughput (req/s):", metrics["request_throughput"])
    if metrics.get("request_goodput") is not None:
        row("Request goodput (req/s):", metrics["request_goodput"])
    if metrics.get("slo_attainment") is not None:
        row("SLO attainment (%):", 100.0 * metrics["slo_attainment"])
    row("Output token throughput (tok/s):", metrics["output_throughput"])
    row("Total token throughput (tok/s):", metrics["total_token_throughput"])
    for name in LATENCY_METRICS:
        lines.append(f" {METRIC_NAMES[name]} ".center(width, "-"))
        upper = name.upper()
        row(f"Mean {upper} (ms):", metrics[f"mean_{name}_ms"])
        row(f"Median {upper} (ms):", metrics[f"median_{name}_ms"])
        for p in percentiles:
            label = percentile_label(p)
            if p != 50:  # the median, printed above
                row(f"{label.upper()} {upper} (ms):", metrics[f"{label}_{name}_ms"])
    lines.append("=" * width)
    return "\n".join(lines)
