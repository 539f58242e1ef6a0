"""What a simulated run leaves: per-request records, the ITL histogram, KV usage samples, and ``SimResult`` with
``pdserve bench serve --result-file``'s keys (``pdserve.sizing.simulator`` fills them as its events run; it
imports this module, never the other way round, so its ``Simulator``, workers and tracked requests are
passed in, not named here)."""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field

from pdserve.bench.metrics import latency_stats, percentile_label

ITL_BIN_RATIO = 1.0005  # ITL histogram bins: each 0.05% wider than the last (percentiles to that precision)
KV_SAMPLES = 512  # most KV-usage samples kept (the interval doubles when they fill)


class LatencyHistogram:
    """Weighted latencies in log-spaced bins (``ITL_BIN_RATIO`` apart): mean and std exact, percentiles to
    the bins' precision, memory by the spread of the values, not their count. A run of decode steps adds
    each step's gap once, weighted by its batch."""

    def __init__(self):
        self.bins: dict[int, float] = {}
        self.count = 0.0
        self.total = 0.0
        self.total_sq = 0.0
        self._scale = 1.0 / math.log(ITL_BIN_RATIO)

    def add(self, value: float, weight: float = 1.0) -> None:
        key = math.floor(math.log(value) * self._scale) if value > 0 else -(1 << 40)
        self.bins[key] = self.bins.get(key, 0.0) + weight
        self.count += weight
        self.total += value * weight
        self.total_sq += value * value * weight

    def add_gaps(self, times: list[float], count: int, weight: float) -> None:
        """``add`` each gap between ``times[0..count-1]`` (increasing), weighted by ``weight``."""
        bins, get, log, floor, scale = self.bins, self.bins.get, math.log, math.floor, self._scale
        total = total_sq = 0.0
        for a, b in zip(times, times[1:count]):
            gap = b - a
            key = floor(log(gap) * scale) if gap > 0 else -(1 << 40)
            bins[key] = get(key, 0.0) + weight
            total += gap
            total_sq += gap * gap
        self.count += weight * max(0, count - 1)
        self.total += total * weight
        self.total_sq += total_sq * weight

    def stats(self, percentiles: list[float]) -> dict[str, float | None]:
        """``latency_stats``' keys in ms: mean, median, std, each ``pNN``."""
        keys = ["mean", "median", "std", *(percentile_label(p) for p in percentiles)]
        if not self.count:
            return dict.fromkeys(keys)
        mean = self.total / self.count
        out = {"mean": 1000 * mean, "std": 1000 * math.sqrt(max(0.0, self.total_sq / self.count - mean * mean))}
        ordered = sorted(self.bins.items())
        for name, p in [("median", 50.0), *((percentile_label(p), p) for p in percentiles)]:
            target, seen = p / 100 * self.count, 0.0
            for key, weight in ordered:
                seen += weight
                if seen >= target:
                    out[name] = 1000 * (ITL_BIN_RATIO ** (key + 0.5) if key > -(1 << 40) else 0.0)
                    break
        return {k: out[k] for k in keys}


class SimRecords:
    """Per-request outcomes in flat arrays (a million requests: a few tens of MB), the ITL histogram,
    and the KV usage samples."""

    def __init__(self):
        self.arrival = array("d")
        self.ttft = array("d")
        self.e2el = array("d")
        self.tokens = array("l")
        self.prompt = array("l")
        self.itl = LatencyHistogram()
        self.hops: dict[str, list] = {}  # a request's way to its first token: hop -> [seconds summed, count]
        self.kv_times: list[float] = []
        self.kv_usage: list[dict[str, float]] = []
        self._kv_every = 1.0
        self._kv_next = 0.0

    @property
    def completed(self) -> int:
        return len(self.ttft)

    def hop(self, name: str, seconds: float) -> None:
        entry = self.hops.get(name)
        if entry is None:
            entry = self.hops[name] = [0.0, 0]
        entry[0] += seconds
        entry[1] += 1

    def finish(self, tracked) -> None:
        """A finished request (the simulator's ``_Tracked``: arrival, first and last token times, counts)."""
        self.arrival.append(tracked.arrival)
        self.ttft.append(tracked.first - tracked.arrival)
        self.e2el.append(tracked.last - tracked.arrival)
        self.tokens.append(tracked.tokens)
        self.prompt.append(tracked.prompt_len)

    def sample_kv(self, sim, now: float) -> None:
        """Each pool's mean KV cache usage (``sim``: the ``Simulator``), sampled at arrivals at most every
        ``_kv_every`` seconds."""
        if now < self._kv_next:
            return
        self._kv_next = now + self._kv_every
        usage = {}
        for name, pool in (("prefill", sim.prefill_workers), ("decode", sim.decode_workers)):
            if pool:
                usage[name] = sum(1.0 - w.block_manager.num_free_blocks / w.block_manager.num_blocks
                                  for w in pool) / len(pool)
        self.kv_times.append(now)
        self.kv_usage.append(usage)
        if len(self.kv_times) >= KV_SAMPLES:  # keep every other one; sample half as often
            self.kv_times, self.kv_usage = self.kv_times[::2], self.kv_usage[::2]
            self._kv_every *= 2


@dataclass
class SimResult:
    """A simulated run: ``metrics`` with ``pdserve bench serve --result-file``'s keys, and the simulator's own
    (``sim``: pools' utilisation, preemptions and hit rates, KV usage over time, events, wall time, and
    ``ttft_hops_mean_ms``: the mean of each hop to the first token, named as the router's
    ``pdserve:request_phase_seconds`` hops where they match: ``router_in`` and ``first_token_back`` the
    two halves of the per-request overhead, ``decode_admission``, ``prefill_queue``, ``prefill_compute``,
    ``kv_transfer``, or ``local_prefill`` (queue and compute where the request decodes); each request's
    hops add up to its TTFT)."""

    metrics: dict
    sim: dict = field(default_factory=dict)
    records: "SimRecords | None" = None  # per request, in the order they finished (arrival, ttft, e2el, ...)

    @classmethod
    def build(cls, simulator, percentiles: list[float], slos: dict[str, float] | None,
              num_events: int, wall_s: float) -> "SimResult":
        """The result of ``simulator`` (a ``Simulator`` whose ``run`` just ended: its records and workers), with
        ``percentiles``, goodput under ``slos`` (ms by metric name), and the run's event count and wall time."""
        r = simulator._records
        n = r.completed
        duration = max((a + e for a, e in zip(r.arrival, r.e2el)), default=0.0) or 1e-9
        tpots = [(e - t) / (k - 1) for t, e, k in zip(r.ttft, r.e2el, r.tokens) if k > 1]
        total_in, total_out = sum(r.prompt), sum(r.tokens)
        good = None
        if slos:
            good = 0
            for t, e, k in zip(r.ttft, r.e2el, r.tokens):
                values = {"ttft": t, "tpot": (e - t) / (k - 1) if k > 1 else 0.0, "e2el": e}
                good += all(values[name] * 1000.0 <= ms for name, ms in slos.items())
        metrics = {"duration": duration, "completed": n, "failed": 0, "total_input_tokens": total_in,
                   "total_output_tokens": total_out, "request_throughput": n / duration,
                   "request_goodput": good / duration if slos else None,
                   "slo_attainment": good / n if slos and n else None,
                   "output_throughput": total_out / duration,
                   "total_token_throughput": (total_in + total_out) / duration}
        for name, values in (("ttft", list(r.ttft)), ("tpot", tpots), ("e2el", list(r.e2el))):
            for stat, value in latency_stats(values, percentiles).items():
                metrics[f"{stat}_{name}_ms"] = value
        for stat, value in r.itl.stats(percentiles).items():
            metrics[f"{stat}_itl_ms"] = value
        workers = simulator.workers
        pools = {}
        for name, pool in (("prefill", simulator.prefill_workers), ("decode", simulator.decode_workers)):
            if pool:
                pools[name] = {"num_workers": len(pool),
                               "utilization": sum(w.busy_seconds for w in pool) / len(pool) / duration,
                               "num_steps": sum(w.num_steps for w in pool),
                               "num_preemptions": sum(w.scheduler.stats.num_preemptions for w in pool),
                               "prefix_cache_hit_rate": _hit_rate(pool),
                               "num_local_prefills": sum(w.scheduler.stats.num_local_prefills for w in pool)}
        sim = {"num_events": num_events, "wall_seconds": wall_s, "simulated_seconds": duration,
               "num_itls": r.itl.count, "num_decode_runs": sum(w.num_runs for w in workers), "pools": pools,
               "kv_usage": {"times_s": r.kv_times, "usage": r.kv_usage},
               "max_kv_usage": {name: max((u.get(name, 0.0) for u in r.kv_usage), default=0.0)
                                for name in pools},
               "num_workers": len(workers),
               "ttft_hops_mean_ms": {name: 1000 * total / count for name, (total, count) in r.hops.items()}}
        return cls(metrics, sim, r)


def _hit_rate(pool: list) -> float | None:
    """A pool of simulated workers' prefix-cache hit rate (None: no queries)."""
    queries = sum(w.scheduler.stats.prefix_cache_queries for w in pool)
    return sum(w.scheduler.stats.prefix_cache_hits for w in pool) / queries if queries else None
