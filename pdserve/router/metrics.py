"""Prometheus metrics for ``GET /metrics``: the router's own observations and the workers' figures.

Each app owns a ``CollectorRegistry`` (never the global one, so a process can
build several apps). Names follow vLLM's where vLLM has one, so its dashboards
work; counters are named without ``_total`` and the client library appends it
(``vllm:prompt_tokens_total``). Every series is labelled ``model_name`` (the
served model name); per-worker series also ``worker`` (worker id) and ``role``
(``prefill``/``decode``).

From heartbeats, computed at scrape time by ``WorkerStatsCollector``:

    gauges    vllm:num_requests_running, vllm:num_requests_waiting,
              vllm:kv_cache_usage_perc (1 - num_free_blocks / num_blocks)
              -- latest heartbeat of each live worker;
              pdserve:num_workers{role} -- live workers per role;
              vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}
              -- with --enable-lora, the adapters in use (comma-separated names; value: read time)
    counters  vllm:prefix_cache_queries, vllm:prefix_cache_hits, vllm:num_preemptions,
              vllm:prompt_tokens, vllm:generation_tokens, vllm:spec_decode_num_drafts,
              vllm:spec_decode_num_draft_tokens, vllm:spec_decode_num_accepted_tokens, pdserve:kv_transfers,
              pdserve:kv_transfer_bytes, pdserve:kv_transfer_seconds,
              pdserve:kv_transfer_failures, pdserve:local_prefills, pdserve:decode_steps,
              pdserve:decode_step_seconds (decode-only steps' forward + sampling time; their ratio is the
              mean decode step) -- each worker's cumulative ``WorkerStats``

From the router's own clock (``RouterMetrics``; ``worker`` = the request's
decode worker, ``role="decode"``):

    counter    vllm:request_success{finished_reason=stop|length|abort|error}, one per choice
    counter    pdserve:requests_rejected: refused at admission (``--max-num-waiting-*``)
    counter    pdserve:routing_decisions{policy, role, decision}: workers picked (new and migrated
               requests), by the routing policy and its reason (round_robin, least_loaded,
               prefix_home, prefix_spill, short_prompt; ``routing.py``)
    counter    pdserve:request_migrations{worker=<the decode worker it left>}: requests moved to
               another decode worker because theirs was lost
    histograms vllm:time_to_first_token_seconds (arrival -> first token of any choice),
               vllm:inter_token_latency_seconds (between a choice's deltas, usually one token),
               vllm:e2e_request_latency_seconds, vllm:request_prompt_tokens,
               vllm:request_generation_tokens (summed over choices)
    histogram  pdserve:request_phase_seconds{phase}: each hop of a request's way to its first token
               (router_queue, decode_admission, prefill_queue, prefill_compute, kv_transfer,
               first_token_back; local prefills: decode_queue, local_prefill_compute), from the router's
               and the workers' wall-clock stamps (``tracing.py``); a request's hops sum to its TTFT

Times are taken when the HTTP handler reads a delta, so they are what the
client sees, give or take the event loop.
"""

from __future__ import annotations

import time
from typing import Iterable

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.common.protocol import Heartbeat, WorkerRole, WorkerStats
from pdserve.router.registry import WorkerRegistry
from pdserve.router.tracing import Phase

_WORKER_LABELS = ["model_name", "worker", "role"]

# (metric name, WorkerStats field, help)
_WORKER_COUNTERS = (
    ("vllm:prefix_cache_queries", "prefix_cache_queries",
     "Prefix cache queries, in prompt tokens looked up."),
    ("vllm:prefix_cache_hits", "prefix_cache_hits", "Prefix cache hits, in prompt tokens found cached."),
    ("vllm:num_preemptions", "num_preemptions", "Cumulative number of preemptions."),
    ("vllm:prompt_tokens", "num_prompt_tokens", "Prompt tokens of requests admitted."),
    ("vllm:generation_tokens", "num_generation_tokens", "Tokens sampled."),
    ("pdserve:kv_transfers", "num_kv_transfers",
     "Requests whose KV was sent (prefill workers) or received (decode workers)."),
    ("pdserve:kv_transfer_bytes", "kv_transfer_bytes", "KV bytes sent or received."),
    ("pdserve:kv_transfer_seconds", "kv_transfer_seconds", "Seconds spent moving KV."),
    ("pdserve:kv_transfer_failures", "kv_transfer_failures", "KV transfers that failed."),
    ("pdserve:kv_transfer_bytes_from_cache", "kv_transfer_bytes_from_cache",
     "KV bytes a prefill worker sent straight from its cache (runs of adjacent blocks), not gathered first."),
    ("pdserve:kv_offload_blocks", "kv_offload_blocks",
     "KV blocks copied from the KV cache to the host-memory offload tier as they were evicted."),
    ("pdserve:kv_onload_blocks", "kv_onload_blocks",
     "KV blocks copied back from the offload tier: prefix-cache hits there, instead of recomputing them."),
    ("pdserve:kv_offload_copy_seconds", "kv_offload_copy_seconds", "Seconds spent on offload tier copies."),
    ("pdserve:kv_disk_write_blocks", "kv_disk_write_blocks",
     "KV blocks the host tier evicted, written to the disk tier (--kv-offload-disk)."),
    ("pdserve:kv_disk_read_blocks", "kv_disk_read_blocks", "KV blocks read back from the disk tier: prefix hits there."),
    ("pdserve:prompt_tokens_computed", "prefill_compute_tokens",
     "Prompt tokens the worker computed: prefix-cache hits and KV received excluded."),
    ("pdserve:local_prefills", "num_local_prefills",
     "Prompts a decode worker kept from the remote prefill it was sent for (conditional disaggregation: too few "
     "uncached tokens, or all cached); those the router placed there are "
     "pdserve:routing_decisions_total{decision=\"local_prefill\"}."),
    ("vllm:spec_decode_num_drafts", "spec_decode_num_drafts",
     "Speculative decoding: verifications of a request with at least one draft token."),
    ("vllm:spec_decode_num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed."),
    ("vllm:spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens",
     "Draft tokens accepted by the target model."),
    ("pdserve:decode_steps", "num_decode_steps", "Decode-only steps (every row past its prompt)."),
    ("pdserve:decode_step_seconds", "decode_step_seconds",
     "Seconds of forward + sampling in decode-only steps (divide by pdserve:decode_steps for the mean)."),
    ("pdserve:borrowed_steps", "num_borrowed_steps",
     "Steps a decode worker ran on an idle prefill worker's cores too (pdserve up --core-lending)."),
)
_STAT_FIELDS = WorkerStats.__struct_fields__

# Per tier of the offload tiers (label ``medium``, as KV events name them): (metric name, {medium:
# WorkerStats field}, unit, help). A unit of "blocks" also gives a ``_bytes`` twin (blocks x the
# worker's kv_block_bytes). Hit rate of a tier: pdserve:kv_tier_hit_tokens / vllm:prefix_cache_queries;
# load bandwidth: pdserve:kv_tier_loaded_bytes / pdserve:kv_tier_load_seconds.
_TIER_COUNTERS = (
    ("pdserve:kv_tier_hit_tokens", {"device": "prefix_cache_hits", "host": "kv_onload_blocks",
                                    "disk": "kv_disk_read_blocks"}, "tokens",
     "Prefix cache hits by the tier they came from, in prompt tokens (device: the KV cache itself)."),
    ("pdserve:kv_tier_loaded", {"host": "kv_onload_blocks", "disk": "kv_disk_read_blocks"}, "blocks",
     "KV blocks copied back from an offload tier into the KV cache (its prefix hits)."),
    ("pdserve:kv_tier_stored", {"host": "kv_offload_blocks", "disk": "kv_disk_write_blocks"}, "blocks",
     "KV blocks written into an offload tier (host: evicted from the KV cache; disk: from the host tier)."),
    ("pdserve:kv_tier_load_seconds", {"host": "kv_onload_seconds", "disk": "kv_disk_read_seconds"}, "",
     "Seconds spent copying blocks back from an offload tier."),
    ("pdserve:kv_tier_store_seconds", {"host": "kv_offload_seconds", "disk": "kv_disk_write_seconds"}, "",
     "Seconds spent copying blocks into an offload tier."),
    ("pdserve:kv_tier_recomputed_hits", {"host": "kv_host_recomputed_hits", "disk": "kv_disk_recomputed_hits"}, "",
     "Prefix hits in an offload tier recomputed instead, loading from it measuring slower."),
    ("pdserve:kv_tier_saved_seconds", {"host": "kv_host_saved_seconds", "disk": "kv_disk_saved_seconds"}, "",
     "Prefill time an offload tier's hits saved against recomputing them (the worker's measured speeds)."),
)

# Buckets in the spirit of vLLM's.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0)
# Hops run from tens of microseconds (router_queue) to the whole TTFT (prefill_queue under load).
_PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                  5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


def _one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (token-count histograms)."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return buckets
            buckets.append(float(m * scale))
        scale *= 10


def _role(role: WorkerRole) -> str:
    return WorkerRole(role).name.lower()


class _WorkerTotals:
    """One worker's cumulative figures as exposed: ``base`` (its earlier runs) + ``last``.

    A run is one life of the worker process; its ``WorkerStats`` count from 0.
    A new run is noticed by a re-register under a new address (``restarted``)
    or by any figure going down, and then the old run's figures move to ``base``.
    """

    def __init__(self) -> None:
        self.base = dict.fromkeys(_STAT_FIELDS, 0)
        self.last = dict.fromkeys(_STAT_FIELDS, 0)
        self.block_size = 0  # the worker's tokens per block, as last registered
        self.block_bytes = 0  # its bytes per block (WorkerStats.kv_block_bytes), as last reported

    def update(self, stats: WorkerStats) -> None:
        new = msgspec.structs.asdict(stats)
        if any(new[k] < self.last[k] for k in _STAT_FIELDS):
            self.restarted()
        self.last = new
        self.block_bytes = stats.kv_block_bytes or self.block_bytes

    def tier_total(self, field: str, unit: str) -> float:
        """``field``'s total in ``unit``: "bytes" or "tokens" converted from blocks, anything else as counted."""
        total = self.total(field)
        if field == "prefix_cache_hits":  # the KV cache's own hits: the tiers' came back into it first
            return max(0.0, total - self.block_size * (self.total("kv_onload_blocks") + self.total("kv_disk_read_blocks")))
        return total * (self.block_bytes if unit == "bytes" else self.block_size if unit == "tokens" else 1)

    def restarted(self) -> None:
        for k in _STAT_FIELDS:
            self.base[k] += self.last[k]
        self.last = dict.fromkeys(_STAT_FIELDS, 0)

    def total(self, field: str) -> float:
        return self.base[field] + self.last[field]


class WorkerStatsCollector(Collector):
    """The workers' figures, read at scrape time.

    Gauges describe the present, so they come from live workers only. Counters
    come from every worker ever heard from since the router started: a
    worker's totals are kept after it dies or leaves, and a restarted worker's
    new run is added on top of its old one. So each counter series only ever
    grows while the router runs, and sums over workers (``sum(rate(...))``,
    cluster totals) never dip when a worker goes away. The cost is one small
    record per worker id ever seen, which the ids a cluster uses keep bounded.
    """

    def __init__(self, model_name: str, registry: WorkerRegistry):
        self.model_name = model_name
        self.registry = registry
        self._totals: dict[tuple[str, str], _WorkerTotals] = {}  # (worker id, role) -> totals

    def observe_heartbeat(self, msg: Heartbeat) -> None:
        key = (msg.worker_id, _role(msg.role))
        totals = self._totals.setdefault(key, _WorkerTotals())
        totals.update(msg.stats)
        worker = self.registry.get(msg.worker_id)
        if worker is not None and worker.block_size > 0:
            totals.block_size = worker.block_size

    def observe_restart(self, worker_id: str, role: WorkerRole) -> None:
        totals = self._totals.get((worker_id, _role(role)))
        if totals is not None:
            totals.restarted()

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        families = self._families()
        running, waiting, kv_usage, num_workers = families[:4]
        for w in self.registry.all():  # draining and stalled workers still hold KV
            hb = w.heartbeat
            if hb is None:
                continue
            labels = [self.model_name, w.worker_id, _role(w.role)]
            running.add_metric(labels, hb.num_running)
            waiting.add_metric(labels, hb.num_waiting)
            num_blocks = hb.num_blocks or w.num_blocks
            usage = 1.0 - hb.num_free_blocks / num_blocks if num_blocks > 0 else 0.0
            kv_usage.add_metric(labels, min(1.0, max(0.0, usage)))
        lora_info = families[-1]
        for w in self.registry.all():
            hb = w.heartbeat
            if hb is not None and hb.max_lora:  # vLLM's: the value is when it was read (max by time = newest)
                lora_info.add_metric([self.model_name, w.worker_id, _role(w.role), str(hb.max_lora),
                                      ",".join(hb.running_lora_adapters), ",".join(hb.waiting_lora_adapters)],
                                     time.time())
        for role in WorkerRole:
            num_workers.add_metric([self.model_name, _role(role)], self.registry.num_live(role))
        counters = families[4:4 + len(_WORKER_COUNTERS)]
        for family, (_, field, _) in zip(counters, _WORKER_COUNTERS):
            for (worker_id, role), totals in self._totals.items():
                family.add_metric([self.model_name, worker_id, role], totals.total(field))
        tiers = iter(families[4 + len(_WORKER_COUNTERS):-1])
        for _, fields, unit, _ in _TIER_COUNTERS:
            for unit_ in ["blocks", "bytes"] if unit == "blocks" else [unit]:
                family = next(tiers)
                for (worker_id, role), totals in self._totals.items():
                    if totals.block_bytes == 0:  # a worker that reports no tier figures
                        continue
                    for medium, field in fields.items():
                        family.add_metric([self.model_name, worker_id, role, medium], totals.tier_total(field, unit_))
        return families

    @staticmethod
    def _families() -> list[Metric]:
        return [
            GaugeMetricFamily("vllm:num_requests_running", "Requests running on the worker "
                              "(latest heartbeat).", labels=_WORKER_LABELS),
            GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting on the worker "
                              "(latest heartbeat).", labels=_WORKER_LABELS),
            GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV cache usage of the worker: "
                              "1 = full (latest heartbeat).", labels=_WORKER_LABELS),
            GaugeMetricFamily("pdserve:num_workers", "Live workers per role.",
                              labels=["model_name", "role"]),
            *(CounterMetricFamily(name, doc, labels=_WORKER_LABELS)
              for name, _, doc in _WORKER_COUNTERS),
            *(CounterMetricFamily(name + suffix, doc + extra, labels=[*_WORKER_LABELS, "medium"])
              for name, _, unit, doc in _TIER_COUNTERS
              for suffix, extra in ([("_blocks", ""), ("_bytes", " In bytes.")] if unit == "blocks" else [("", "")])),
            GaugeMetricFamily("vllm:lora_requests_info", "LoRA adapters of the worker's running and waiting "
                              "requests and its slots (latest heartbeat); the value is the time it was read.",
                              labels=[*_WORKER_LABELS, "max_lora", "running_lora_adapters",
                                      "waiting_lora_adapters"]),
        ]


class RouterMetrics:
    """All of one router app's metrics; ``render()`` is the ``/metrics`` body.

    The engine feeds ``workers`` with heartbeats and restarts; the serving
    layer reports each request's tokens and end.
    """

    def __init__(self, model_name: str, registry: WorkerRegistry, max_model_len: int):
        self.model_name = model_name
        self.prometheus = CollectorRegistry()
        self.workers = WorkerStatsCollector(model_name, registry)
        self.prometheus.register(self.workers)
        reg = self.prometheus
        self.request_success = Counter(
            "vllm:request_success", "Finished requests (choices) by finish reason.",
            _WORKER_LABELS + ["finished_reason"], registry=reg)
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time to first token in seconds (request arrival at the router).",
                              _WORKER_LABELS, buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Time between a choice's consecutive token deltas in seconds.",
                             _WORKER_LABELS, buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds",
                             "End-to-end request latency in seconds (any finish).",
                             _WORKER_LABELS, buckets=_E2E_BUCKETS, registry=reg)
        self.migrations = Counter(
            "pdserve:request_migrations", "Requests moved to another decode worker because theirs was lost.",
            ["model_name", "worker"], registry=reg)
        self.num_rejected = Counter(
            "pdserve:requests_rejected", "Requests refused at admission (503 + Retry-After): too many waiting.",
            ["model_name"], registry=reg)
        self.routing_decisions = Counter(
            "pdserve:routing_decisions", "Workers picked for requests, by routing policy, role and decision.",
            ["model_name", "policy", "role", "decision"], registry=reg)
        self.request_phase = Histogram(
            "pdserve:request_phase_seconds", "Seconds of each hop of a request's way to its first token "
            "(a request's hops sum to its TTFT; see docs/architecture.md, Tracing).",
            ["model_name", "phase"], buckets=_PHASE_BUCKETS, registry=reg)
        token_buckets = _one_two_five_buckets(max_model_len)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                       _WORKER_LABELS, buckets=token_buckets, registry=reg)
        self.generation_tokens = Histogram(
            "vllm:request_generation_tokens", "Generated tokens per request (all choices).",
            _WORKER_LABELS, buckets=token_buckets, registry=reg)

    def observe_migration(self, lost_worker_id: str, reason: str) -> None:
        self.migrations.labels(self.model_name, lost_worker_id).inc()

    def observe_route(self, policy: str, role: WorkerRole, decision: str) -> None:
        """The routing policy picked a worker of ``role`` (``decision``: why)."""
        self.routing_decisions.labels(self.model_name, policy, _role(role), decision).inc()

    def _labels(self, decode_worker_id: str) -> tuple[str, str, str]:
        return self.model_name, decode_worker_id, "decode"

    def observe_first_token(self, decode_worker_id: str, seconds: float) -> None:
        self.ttft.labels(*self._labels(decode_worker_id)).observe(seconds)

    def observe_phases(self, phases: list[Phase]) -> None:
        """One request's hops to its first token (``tracing.request_phases``), in seconds."""
        for phase in phases:
            self.request_phase.labels(self.model_name, phase.name).observe(phase.seconds)

    def observe_inter_token(self, decode_worker_id: str, seconds: float) -> None:
        self.itl.labels(*self._labels(decode_worker_id)).observe(seconds)

    def observe_request(self, decode_worker_id: str, e2e_s: float, num_prompt_tokens: int,
                        num_generation_tokens: int, finish_reasons: list[str]) -> None:
        """A request ended (any way); ``finish_reasons`` has one entry per choice."""
        labels = self._labels(decode_worker_id)
        self.e2e.labels(*labels).observe(e2e_s)
        self.prompt_tokens.labels(*labels).observe(num_prompt_tokens)
        self.generation_tokens.labels(*labels).observe(num_generation_tokens)
        for reason in finish_reasons:
            self.request_success.labels(*labels, reason).inc()

    def render(self, accept: str | None = None) -> tuple[bytes, str]:
        """The exposition (Prometheus text, or OpenMetrics if ``accept`` asks) and its content type."""
        encoder, content_type = choose_encoder(accept or "")
        return encoder(self.prometheus), content_type
