"""Router metrics: ``GET /metrics`` in Prometheus text format, parsed back with the client's parser.

Worker figures come from ``FakeDecodeWorker`` heartbeats (see test_router.py);
the collector's counter bookkeeping (restarts, dead workers) is checked on its own.
"""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.protocol import Heartbeat, RegisterWorker, WorkerRole, WorkerStats
from pdserve.router import RouterConfig, build_app
from pdserve.router.metrics import RouterMetrics
from pdserve.router.registry import WorkerRegistry
# The fixtures tok, router and worker (a FakeDecodeWorker) come from test_router; model_dir from conftest.
from tests.helpers.fake_peers import COMPLETION, router, tok, wait_for, worker  # noqa: F401

WORKER_GAUGES = ["vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"]
WORKER_COUNTERS = {  # metric name -> WorkerStats field
    "vllm:prefix_cache_queries": "prefix_cache_queries",
    "vllm:prefix_cache_hits": "prefix_cache_hits",
    "vllm:num_preemptions": "num_preemptions",
    "vllm:prompt_tokens": "num_prompt_tokens",
    "vllm:generation_tokens": "num_generation_tokens",
    "pdserve:kv_transfer_bytes": "kv_transfer_bytes",
    "pdserve:kv_transfer_seconds": "kv_transfer_seconds",
    "pdserve:kv_transfer_failures": "kv_transfer_failures",
    "pdserve:kv_transfers": "num_kv_transfers",
    "pdserve:local_prefills": "num_local_prefills",
    "pdserve:kv_transfer_bytes_from_cache": "kv_transfer_bytes_from_cache",
}
REQUEST_HISTOGRAMS = ["vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                      "vllm:e2e_request_latency_seconds", "vllm:request_prompt_tokens",
                      "vllm:request_generation_tokens"]
STATS = WorkerStats(num_preemptions=1, prefix_cache_queries=64, prefix_cache_hits=32, num_prompt_tokens=100,
                    num_generation_tokens=50, num_kv_transfers=3, kv_transfer_bytes=4096,
                    kv_transfer_seconds=0.25, kv_transfer_failures=2, num_local_prefills=4,
                    kv_transfer_bytes_from_cache=3072)


def scrape(text: str) -> dict[str, list]:
    """Sample name -> [(labels, value)], from the client library's own parser."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def value(samples, name, **labels):
    hits = [v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(hits) == 1, (name, labels, samples.get(name))
    return hits[0]


def test_metrics_after_heartbeat_and_request(router, worker, tok):
    worker.stats, worker.num_waiting, worker.num_free_blocks = STATS, 2, 250
    wait_for(lambda: "kv_transfer_seconds_total{" in router.get("/metrics").text
             and 'worker="fake-d0"} 0.25' in router.get("/metrics").text)
    worker.script = tok.encode(" one two three")
    resp = router.post("/v1/completions", json={**COMPLETION, "n": 2, "max_tokens": 20, "stop": "two"})
    assert resp.status_code == 200, resp.text
    assert [c["finish_reason"] for c in resp.json()["choices"]] == ["stop", "stop"]
    resp = router.get("/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    text = resp.text
    samples = scrape(text)
    w = {"model_name": "tiny", "worker": "fake-d0", "role": "decode"}
    for name in WORKER_GAUGES:
        value(samples, name, **w)
    assert value(samples, "vllm:num_requests_waiting", **w) == 2
    assert value(samples, "vllm:kv_cache_usage_perc", **w) == pytest.approx(0.75)
    for name, field in WORKER_COUNTERS.items():
        assert f"\n{name}_total{{" in text  # the library's suffix, as vLLM dashboards expect
        assert value(samples, name + "_total", **w) == pytest.approx(getattr(STATS, field)), name
    assert value(samples, "pdserve:num_workers", model_name="tiny", role="decode") == 1
    assert value(samples, "pdserve:num_workers", model_name="tiny", role="prefill") == 0
    # The router's own observations: one request, two choices.
    assert value(samples, "vllm:request_success_total", finished_reason="stop", **w) == 2
    for name in REQUEST_HISTOGRAMS:
        assert f"# TYPE {name} histogram" in text
    assert value(samples, "vllm:time_to_first_token_seconds_count", **w) == 1
    assert value(samples, "vllm:e2e_request_latency_seconds_count", **w) == 1
    assert value(samples, "vllm:inter_token_latency_seconds_count", **w) >= 1
    assert value(samples, "vllm:request_prompt_tokens_sum", **w) == len(tok.encode("hello"))
    assert value(samples, "vllm:request_generation_tokens_sum", **w) == 2 * len(tok.encode(" one two"))
    e2e = value(samples, "vllm:e2e_request_latency_seconds_sum", **w)
    assert 0 < value(samples, "vllm:time_to_first_token_seconds_sum", **w) <= e2e


def test_metrics_count_aborted_and_failed_choices(router, worker, tok):
    worker.script = tok.encode(" never arrives")
    worker.heartbeating = False  # goes silent: its requests fail
    assert router.post("/v1/completions", json={**COMPLETION, "n": 3}).status_code == 503
    samples = scrape(router.get("/metrics").text)
    assert value(samples, "vllm:request_success_total", finished_reason="error", worker="fake-d0") == 3
    assert value(samples, "pdserve:num_workers", role="decode") == 0
    assert "vllm:num_requests_running" not in samples  # gauges: live workers only
    assert value(samples, "vllm:num_preemptions_total", worker="fake-d0") == 0  # counters: kept


def test_openmetrics_on_request(router):
    resp = router.get("/metrics", headers={"accept": "application/openmetrics-text; version=1.0.0"})
    assert resp.headers["content-type"].startswith("application/openmetrics-text")
    assert resp.text.rstrip().endswith("# EOF")


def test_each_app_has_its_own_registry(model_dir, tok):
    config = RouterConfig(model=model_dir, zmq_port=0)
    apps = [build_app(config, tokenizer=tok) for _ in range(2)]
    assert apps[0].state.metrics.prometheus is not apps[1].state.metrics.prometheus
    with TestClient(apps[1]) as client:
        assert "pdserve:num_workers" in client.get("/metrics").text


def heartbeat(worker_id, stats, role=WorkerRole.PREFILL, **kw):
    return Heartbeat(worker_id=worker_id, role=role, stats=stats, **kw)


def test_worker_counters_survive_restarts_and_death():
    registry = WorkerRegistry(worker_timeout_s=5)
    metrics = RouterMetrics("m", registry, max_model_len=128)
    collector = metrics.workers

    def totals():
        samples = scrape(metrics.render()[0].decode())
        return value(samples, "vllm:prompt_tokens_total", worker="p0", role="prefill")

    def beat(stats, now):
        msg = heartbeat("p0", stats, num_blocks=10, num_free_blocks=10)
        assert registry.heartbeat(msg, now=now)
        collector.observe_heartbeat(msg)

    registry.register(RegisterWorker(worker_id="p0", role=WorkerRole.PREFILL, input_addr="tcp://a:1",
                                     model_name="m"), now=0)
    beat(WorkerStats(num_prompt_tokens=10), now=1)
    beat(WorkerStats(num_prompt_tokens=30), now=2)
    assert totals() == 30
    beat(WorkerStats(num_prompt_tokens=5), now=3)  # the process restarted (same address): 30 + 5
    assert totals() == 35
    # A restart under a new address is told by the re-register, before any figure went down.
    old = registry.register(RegisterWorker(worker_id="p0", role=WorkerRole.PREFILL, input_addr="tcp://a:2",
                                           model_name="m"), now=4)
    collector.observe_restart(old.worker_id, old.role)
    beat(WorkerStats(num_prompt_tokens=40), now=5)
    assert totals() == 75
    registry.expire(now=100)  # dead: its counters stay, its gauges go
    samples = scrape(metrics.render()[0].decode())
    assert value(samples, "vllm:prompt_tokens_total", worker="p0") == 75
    assert "vllm:kv_cache_usage_perc" not in samples


def test_offload_tier_figures_are_exposed_per_medium():
    """Issue 39's per-tier metrics: hits (tokens; the KV cache's own as "device"), blocks and bytes each
    way, copy seconds, hits recomputed and time saved, labelled by tier."""
    registry = WorkerRegistry(worker_timeout_s=5)
    metrics = RouterMetrics("m", registry, max_model_len=128)
    registry.register(RegisterWorker(worker_id="d0", role=WorkerRole.DECODE, input_addr="tcp://a:1",
                                     model_name="m", block_size=16), now=0)
    stats = WorkerStats(prefix_cache_queries=1000, prefix_cache_hits=800, kv_onload_blocks=20, kv_disk_read_blocks=5,
                        kv_offload_blocks=30, kv_disk_write_blocks=10, kv_block_bytes=4096, kv_onload_seconds=0.5,
                        kv_disk_read_seconds=2.0, kv_offload_seconds=0.25, kv_disk_write_seconds=1.0,
                        kv_host_recomputed_hits=1, kv_disk_recomputed_hits=3, kv_host_saved_seconds=1.5,
                        kv_disk_saved_seconds=0.5)
    msg = heartbeat("d0", stats, role=WorkerRole.DECODE)
    assert registry.heartbeat(msg, now=1)
    metrics.workers.observe_heartbeat(msg)
    samples = scrape(metrics.render()[0].decode())

    def tier(name, medium):
        return value(samples, name, worker="d0", medium=medium)

    assert tier("pdserve:kv_tier_hit_tokens_total", "device") == 800 - 16 * 25
    assert tier("pdserve:kv_tier_hit_tokens_total", "host") == 16 * 20
    assert tier("pdserve:kv_tier_hit_tokens_total", "disk") == 16 * 5
    assert tier("pdserve:kv_tier_loaded_blocks_total", "host") == 20
    assert tier("pdserve:kv_tier_loaded_bytes_total", "disk") == 5 * 4096
    assert tier("pdserve:kv_tier_stored_blocks_total", "disk") == 10
    assert tier("pdserve:kv_tier_stored_bytes_total", "host") == 30 * 4096
    assert tier("pdserve:kv_tier_load_seconds_total", "disk") == 2.0
    assert tier("pdserve:kv_tier_store_seconds_total", "host") == 0.25
    assert tier("pdserve:kv_tier_recomputed_hits_total", "disk") == 3
    assert tier("pdserve:kv_tier_saved_seconds_total", "host") == 1.5
    # a worker that reports no tier figures (an older one) gets no tier series
    registry.register(RegisterWorker(worker_id="d1", role=WorkerRole.DECODE, input_addr="tcp://a:2",
                                     model_name="m", block_size=16), now=0)
    msg = heartbeat("d1", WorkerStats(prefix_cache_hits=5), role=WorkerRole.DECODE)
    registry.heartbeat(msg, now=1)
    metrics.workers.observe_heartbeat(msg)
    samples = scrape(metrics.render()[0].decode())
    assert not [lab for lab, _ in samples["pdserve:kv_tier_hit_tokens_total"] if lab["worker"] == "d1"]
