"""The SLA autoscaler: size the prefill and decode pools from the live load, every interval.

The loop of Dynamo's SLA planner, on pdserve's own figures. Every ``interval_s`` it reads the
router's Prometheus ``/metrics`` (requests routed to decode workers, the prompt and output tokens
of the requests that finished, the TTFT and inter-token latency histograms), turns the interval's
deltas into its load (request rate, mean input and output tokens) and its SLO attainment (the
share of first tokens within the TTFT SLO and of token gaps within the TPOT SLO, read at the
histograms' bucket bounds), predicts the next interval's load (Holt's double exponential smoothing:
a level and a trend, so a ramp is met a step ahead rather than followed a step behind), and asks
``size_pools(rate, mean input, mean output)`` how many workers each pool needs for it. ``pdserve up
--autoscale`` and ``pdserve autoscale`` pass the profile's sizing (``pdserve.sizing.sizer``).

Targets go through the router's scale API (``RouterPools``: ``POST /admin/scale``), the same as
``pdserve scale``: a growing pool is started by ``pdserve up`` / ``--ray`` (``reconcile``); a shrinking
pool's surplus is drained by the router (no request fails). On Kubernetes, where the Deployments own
the pool sizes (the routers run ``--pool-owner none`` and ``/admin/scale`` answers 409), they go to the
Deployments' replicas instead (``KubectlPools``: ``kubectl scale``; the pods' preStop hook drains).
Hysteresis: a pool grows as soon as an interval wants more; it shrinks only after
``scale_down_intervals`` intervals in a row all wanted fewer, to the largest of what they wanted, and
never within ``cooldown_s`` of its last change.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.scale import admin_request, scale_pools

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class RouterFigures:
    """Cumulative figures from one scrape of a router's ``/metrics``."""

    routed: float = 0.0  # requests routed to a decode worker
    prompt_tokens: float = 0.0  # sum over finished requests
    output_tokens: float = 0.0
    finished: float = 0.0
    ttft_buckets: dict[float, float] = dataclasses.field(default_factory=dict)  # le -> cumulative count
    itl_buckets: dict[float, float] = dataclasses.field(default_factory=dict)


def parse_router_metrics(text: str) -> RouterFigures:
    """The autoscaler's figures from a router's Prometheus exposition ``text`` (summed over labels)."""
    figures = RouterFigures()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, sample.value
            if name == "pdserve:routing_decisions_total" and labels.get("role") == "decode":
                figures.routed += value
            elif name == "vllm:request_prompt_tokens_sum":
                figures.prompt_tokens += value
            elif name == "vllm:request_prompt_tokens_count":
                figures.finished += value
            elif name == "vllm:request_generation_tokens_sum":
                figures.output_tokens += value
            elif name in ("vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket"):
                le = float(labels["le"])
                buckets = figures.ttft_buckets if name.startswith("vllm:time") else figures.itl_buckets
                buckets[le] = buckets.get(le, 0.0) + value
    return figures


def share_within(before: dict[float, float], after: dict[float, float], bound_s: float) -> float | None:
    """Of the observations between two scrapes of a histogram, the share at or below the largest bucket
    bound not above ``bound_s`` (a lower bound on the true share); None without observations."""
    total = after.get(math.inf, 0.0) - before.get(math.inf, 0.0)
    if total <= 0:
        return None
    bounds = [le for le in after if le <= bound_s]
    if not bounds:
        return 0.0
    le = max(bounds)
    return (after[le] - before.get(le, 0.0)) / total


class HoltForecaster:
    """Holt's linear trend (double exponential smoothing): ``level`` and ``trend`` of a series, and the
    next value ``level + trend`` (never below 0). ``alpha`` weighs new values, ``beta`` new trends."""

    def __init__(self, alpha: float = 0.6, beta: float = 0.4):
        if not (0 < alpha <= 1 and 0 <= beta <= 1):
            raise ValueError(f"alpha must be in (0, 1] and beta in [0, 1], got {alpha}, {beta}")
        self.alpha, self.beta = alpha, beta
        self.level: float | None = None
        self.trend = 0.0

    def update(self, value: float) -> float:
        """Fold in this interval's value; return the forecast of the next one."""
        if self.level is None:
            self.level = value
        else:
            last = self.level
            self.level = self.alpha * value + (1 - self.alpha) * (self.level + self.trend)
            self.trend = self.beta * (self.level - last) + (1 - self.beta) * self.trend
        return max(0.0, self.level + self.trend)


class RouterPools:
    """The pools' targets through a router's admin API (``GET /admin/pools``, ``POST /admin/scale``)."""

    def __init__(self, router: str, api_key: str | None = None):
        self.router, self.api_key = router, api_key

    def read(self) -> tuple[int, int]:
        pools = admin_request(self.router, "/admin/pools", self.api_key)

        def target(pool: dict) -> int:
            return pool["num_serving"] if pool.get("desired") is None else pool["desired"]

        return target(pools["prefill"]), target(pools["decode"])

    def write(self, prefill: int, decode: int) -> None:
        scale_pools(self.router, prefill=prefill, decode=decode, api_key=self.api_key)


class KubectlPools:
    """The pools' targets as two Kubernetes Deployments' replicas, through ``kubectl`` (k8s/base's names by
    default). Delete the HorizontalPodAutoscalers of k8s/base/autoscaling.yaml first: two controllers
    setting one Deployment's replicas fight. Raises RuntimeError with kubectl's message when it fails."""

    def __init__(self, namespace: str = "default", prefill: str = "pdserve-prefill", decode: str = "pdserve-decode",
                 kubectl: str = "kubectl"):
        self.namespace, self.deployments, self.kubectl = namespace, (prefill, decode), kubectl

    def _run(self, *args: str) -> str:
        done = subprocess.run([self.kubectl, "--namespace", self.namespace, *args], capture_output=True, text=True,
                              timeout=60)
        if done.returncode != 0:
            raise RuntimeError(f"kubectl {' '.join(args)}: {done.stderr.strip() or done.returncode}")
        return done.stdout

    def read(self) -> tuple[int, int]:
        return tuple(int(self._run("get", f"deployment/{name}", "-o", "jsonpath={.spec.replicas}") or 0)
                     for name in self.deployments)

    def write(self, prefill: int, decode: int) -> None:
        for name, replicas in zip(self.deployments, (prefill, decode)):
            self._run("scale", f"deployment/{name}", f"--replicas={replicas}")


@dataclasses.dataclass
class Interval:
    """What one interval saw and decided (the autoscaler's log line)."""

    time: float
    request_rate: float
    mean_input_tokens: float
    mean_output_tokens: float
    forecast_rate: float
    ttft_attainment: float | None
    tpot_attainment: float | None
    wanted: tuple[int, int]
    targets: tuple[int, int]
    changed: bool

    def line(self) -> str:
        def pct(x):
            return "n/a" if x is None else f"{100 * x:.0f}%"

        return (f"autoscaler: {self.request_rate:.2f} req/s (in {self.mean_input_tokens:.0f}, out "
                f"{self.mean_output_tokens:.0f} tokens), next {self.forecast_rate:.2f} req/s; SLO attainment "
                f"TTFT {pct(self.ttft_attainment)} TPOT {pct(self.tpot_attainment)}; wants {self.wanted[0]}P+"
                f"{self.wanted[1]}D -> targets {self.targets[0]}P+{self.targets[1]}D"
                + (" (scaled)" if self.changed else ""))


class Autoscaler:
    """Sizes a running cluster's pools every interval (the module's docstring has the loop).

    Args:
        router: the router's HTTP address (any router of a tier: every one shares the pools).
        size_pools: ``(request rate, mean input tokens, mean output tokens) -> (prefill, decode)``.
        slos_ms: ``{"ttft": ms, "tpot": ms}`` (either may be missing): what attainment is logged against.
        interval_s: seconds between decisions.
        min_prefill, max_prefill, min_decode, max_decode: bounds of each pool's target.
        scale_down_intervals, cooldown_s: the hysteresis (see the module's docstring).
        api_key: the router's API key, if it has one.
        on_interval: called with each ``Interval`` (default: logged).
        pools: where the targets are read and written (default ``RouterPools(router, api_key)``).
    """

    def __init__(self, router: str, size_pools: Callable[[float, float, float], tuple[int, int]],
                 slos_ms: dict[str, float], interval_s: float = 10.0, min_prefill: int = 0, max_prefill: int = 8,
                 min_decode: int = 1, max_decode: int = 8, scale_down_intervals: int = 3, cooldown_s: float = 0.0,
                 api_key: str | None = None, on_interval: Callable[[Interval], None] | None = None,
                 pools: RouterPools | KubectlPools | None = None, clock: Callable[[], float] = time.monotonic):
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        if not (0 <= min_prefill <= max_prefill and 1 <= min_decode <= max_decode):
            raise ValueError("pool bounds need 0 <= min_prefill <= max_prefill and 1 <= min_decode <= max_decode")
        if scale_down_intervals < 1:
            raise ValueError(f"scale_down_intervals must be >= 1, got {scale_down_intervals}")
        self.router = router
        self.size_pools = size_pools
        self.slos_ms = slos_ms
        self.interval_s = interval_s
        self.bounds = ((min_prefill, max_prefill), (min_decode, max_decode))
        self.scale_down_intervals = scale_down_intervals
        self.cooldown_s = cooldown_s
        self.api_key = api_key
        self.pools = pools or RouterPools(router, api_key)
        self.on_interval = on_interval or (lambda interval: logger.info(interval.line()))
        self.clock = clock
        self.forecaster = HoltForecaster()
        self.history: list[Interval] = []
        self._last: RouterFigures | None = None
        self._last_at: float | None = None
        self._mean_in = self._mean_out = None
        self._wanted_down: list[tuple[int, int]] = []
        self._changed_at = -math.inf

    def scrape(self) -> RouterFigures:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(f"{self.router.rstrip('/')}/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as resp:
            return parse_router_metrics(resp.read().decode())

    def step(self) -> Interval | None:
        """One decision: read the figures, forecast, size, scale. None on the first call (no interval yet).

        Raises OSError / RuntimeError when the router cannot be read or refuses the targets."""
        now = self.clock()
        figures = self.scrape()
        last, last_at = self._last, self._last_at
        self._last, self._last_at = figures, now
        if last is None:
            return None
        seconds = max(1e-6, now - last_at)
        rate = max(0.0, figures.routed - last.routed) / seconds
        finished = figures.finished - last.finished
        if finished > 0:
            self._mean_in = (figures.prompt_tokens - last.prompt_tokens) / finished
            self._mean_out = (figures.output_tokens - last.output_tokens) / finished
        forecast = self.forecaster.update(rate)
        current = self.pools.read()
        mean_in, mean_out = self._mean_in, self._mean_out
        if mean_in is None:  # nothing finished yet: no shape to size with, keep the pools
            wanted = current
        else:
            wanted = self.size_pools(max(rate, forecast), mean_in, mean_out)
        wanted = tuple(min(max(n, lo), hi) for n, (lo, hi) in zip(wanted, self.bounds))
        if current[0] == 0:  # a colocated cluster stays colocated
            wanted = (0, wanted[1])
        targets = self._hysteresis(current, wanted, now)
        changed = targets != current
        if changed:
            self.pools.write(*targets)
            self._changed_at = now
        slo_s = {name: ms / 1000 for name, ms in self.slos_ms.items()}
        interval = Interval(time=now, request_rate=rate, mean_input_tokens=mean_in or 0.0,
                            mean_output_tokens=mean_out or 0.0, forecast_rate=forecast,
                            ttft_attainment=share_within(last.ttft_buckets, figures.ttft_buckets, slo_s["ttft"])
                            if "ttft" in slo_s else None,
                            tpot_attainment=share_within(last.itl_buckets, figures.itl_buckets, slo_s["tpot"])
                            if "tpot" in slo_s else None,
                            wanted=wanted, targets=targets, changed=changed)
        self.history.append(interval)
        self.on_interval(interval)
        return interval

    def _hysteresis(self, current: tuple[int, int], wanted: tuple[int, int], now: float) -> tuple[int, int]:
        """Grow a pool at once; shrink it after ``scale_down_intervals`` intervals all wanting fewer."""
        if any(w > c for w, c in zip(wanted, current)):
            self._wanted_down.clear()
            return tuple(max(w, c) for w, c in zip(wanted, current))
        if wanted == current:
            self._wanted_down.clear()
            return current
        self._wanted_down.append(wanted)
        if len(self._wanted_down) < self.scale_down_intervals or now - self._changed_at < self.cooldown_s:
            return current
        recent = self._wanted_down[-self.scale_down_intervals:]
        self._wanted_down.clear()
        return tuple(max(w[i] for w in recent) for i in range(2))

    def run(self, stop: threading.Event) -> None:
        """Decide every ``interval_s`` until ``stop`` is set; a failed read or scale is logged and retried."""
        while not stop.is_set():
            try:
                self.step()
            except (OSError, RuntimeError, ValueError, KeyError) as e:
                logger.warning("autoscaler: %s", e)
            stop.wait(self.interval_s)

    def start(self) -> tuple[threading.Thread, threading.Event]:
        """Run in a daemon thread; set the returned event to stop it."""
        stop = threading.Event()
        thread = threading.Thread(target=self.run, args=(stop,), name="autoscaler", daemon=True)
        thread.start()
        return thread, stop
