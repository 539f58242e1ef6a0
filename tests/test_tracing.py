"""Where a request's time goes: hop histograms and OpenTelemetry traces from a real cluster.

A router, one prefill worker and one decode worker run as processes on the tiny model. The router
exports its traces to an OTLP/HTTP receiver this test runs on loopback, which decodes each POST with
opentelemetry-proto's ``ExportTraceServiceRequest`` (no SDK code on the receiving side).
"""

from __future__ import annotations

import http.server
import json
import os
import random
import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.router.tracing import DISAGGREGATED_PHASES, LOCAL_PHASES, PHASES, request_phases
from pdserve.common.protocol import RequestTiming

pytestmark = pytest.mark.cluster

REMOTE_PREFILL_THRESHOLD = 16  # the workers' default: shorter prompts are prefilled by the decode worker


class OTLPReceiver:
    """A tiny OTLP/HTTP traces endpoint: keeps every span POSTed to ``/v1/traces``, decoded."""

    def __init__(self):
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                              ExportTraceServiceResponse)

        self.spans: list[dict] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path != "/v1/traces" or self.headers.get("Content-Type") != "application/x-protobuf":
                    self.send_response(400)
                    self.end_headers()
                    return
                receiver.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def add(self, request) -> None:
        for resource_spans in request.resource_spans:
            resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    with self.lock:
                        self.spans.append({
                            "name": span.name, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex(), "start": span.start_time_unix_nano,
                            "end": span.end_time_unix_nano, "resource": resource,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "events": [(e.name, e.time_unix_nano) for e in span.events],
                            "status": span.status.code})

    def spans_of(self, request_id: str, num: int, timeout_s: float = 20.0) -> list[dict]:
        """The spans naming ``request_id``, once there are at least ``num``."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                found = [s for s in self.spans if s["attributes"].get("gen_ai.request.id") == request_id]
            if len(found) >= num or time.monotonic() > deadline:
                return found
            time.sleep(0.1)

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def _value(v):
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@pytest.fixture(scope="module")
def otlp():
    receiver = OTLPReceiver()
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def cluster(model_dir, otlp, tmp_path_factory):
    """1 prefill + 1 decode worker; no load-aware local prefill, so the prompt length alone picks the path."""
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(),
                       worker_args=["--kv-cache-memory", "16MiB"], threads_per_worker=1,
                       router_args=["--local-prefill-margin-s", "inf", "--otlp-traces-endpoint", otlp.url])
    old = os.environ.get("OTEL_BSP_SCHEDULE_DELAY")
    os.environ["OTEL_BSP_SCHEDULE_DELAY"] = "100"  # the router exports its batch every 100 ms, not 5 s
    try:
        with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("logs"))) as c:
            _complete(c, _prompt(random.Random(99), 40), stream=False)  # warm up: KV pair, kernels
            yield c
    finally:
        if old is None:
            os.environ.pop("OTEL_BSP_SCHEDULE_DELAY", None)
        else:
            os.environ["OTEL_BSP_SCHEDULE_DELAY"] = old


def _prompt(rng: random.Random, num_tokens: int) -> list[int]:
    """Random token ids: no two prompts share a prefix, so no prefix-cache hit turns one local."""
    return [rng.randrange(5, 2000) for _ in range(num_tokens)]


def _complete(cluster, prompt: list[int], stream: bool, headers: dict | None = None) -> tuple[str, float]:
    """One completion; returns (its response id, seconds until the client had the first token)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "stream": stream}
    start = time.monotonic()
    if not stream:
        resp = httpx.post(f"{cluster.url}/v1/completions", json=body, headers=headers, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["id"], time.monotonic() - start
    first, response_id = None, None
    with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, headers=headers, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: {"):  # a chunk: the first one carries the first token
                first = time.monotonic() - start if first is None else first
                response_id = json.loads(line[len("data: "):])["id"]
    return response_id, first


def scrape(cluster) -> dict:
    """Sample name -> [(labels, value)] of the router's /metrics."""
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(httpx.get(f"{cluster.url}/metrics", timeout=10).text):
        for s in family.samples:
            samples.setdefault(s.name, []).append((s.labels, s.value))
    return samples


def phase_totals(samples) -> dict[str, tuple[float, float]]:
    """phase -> (count, sum seconds) of pdserve:request_phase_seconds; "ttft" -> the TTFT histogram's."""
    out = {lab["phase"]: (0.0, 0.0) for lab, _ in samples.get("pdserve:request_phase_seconds_count", [])}
    for lab, v in samples.get("pdserve:request_phase_seconds_count", []):
        out[lab["phase"]] = (v, out[lab["phase"]][1])
    for lab, v in samples.get("pdserve:request_phase_seconds_sum", []):
        out[lab["phase"]] = (out[lab["phase"]][0], v)
    out["ttft"] = tuple(sum(v for _, v in samples.get(f"vllm:time_to_first_token_seconds_{kind}", []))
                        for kind in ("count", "sum"))
    return out


def diff(after: dict, before: dict) -> dict[str, tuple[float, float]]:
    return {k: (c - before.get(k, (0, 0))[0], s - before.get(k, (0, 0))[1]) for k, (c, s) in after.items()}


def test_request_phases_are_contiguous_clamped_and_sum_to_ttft():
    t = RequestTiming(decode_received=1.01, remote_prefill_sent=1.02, prefill_received=1.03, prefill_started=1.05,
                      prefill_done=1.25, kv_installed=1.26)
    phases = request_phases(1.0, 1.005, t, 1.3)
    assert [p.name for p in phases] == list(DISAGGREGATED_PHASES)
    assert [round(p.seconds, 6) for p in phases] == [0.005, 0.015, 0.03, 0.2, 0.01, 0.04]
    local = request_phases(1.0, 1.005, RequestTiming(decode_received=1.01, prefill_started=1.1, prefill_done=1.2),
                           1.3)
    assert [p.name for p in local] == list(LOCAL_PHASES)
    # A worker clock 0.5 s ahead of the router's: hops stay >= 0 and still sum to TTFT.
    skewed = request_phases(1.0, 1.005, RequestTiming(prefill_started=1.6, prefill_done=1.7), 1.3)
    assert all(p.seconds >= 0 for p in skewed) and sum(p.seconds for p in skewed) == pytest.approx(0.3)
    assert request_phases(1.0, 1.005, None, 1.3) == []
    assert request_phases(1.0, 1.005, RequestTiming(remote_prefill_sent=1.02, kv_installed=1.2), 1.3) == []


def test_every_hop_is_counted_once_per_request_and_the_hops_sum_to_ttft(cluster):
    rng = random.Random(0)
    jobs = [(_prompt(rng, n), stream) for n, stream in ((40, True), (120, False), (300, True), (64, True))]
    jobs += [(_prompt(rng, n), True) for n in (5, REMOTE_PREFILL_THRESHOLD - 1)]  # prefilled by the decode worker
    num_remote, num_local = 4, 2
    start = phase_totals(scrape(cluster))
    for prompt, stream in jobs:  # one at a time: each scrape difference is one request's hops
        before = phase_totals(scrape(cluster))
        _, client_ttft = _complete(cluster, prompt, stream)
        hops = diff(phase_totals(scrape(cluster)), before)
        path = DISAGGREGATED_PHASES if len(prompt) >= REMOTE_PREFILL_THRESHOLD else LOCAL_PHASES
        assert {k for k, (c, _) in hops.items() if c} == {*path, "ttft"}, (len(prompt), hops)
        assert all(c == 1 and s >= 0 for k, (c, s) in hops.items() if c), hops
        total = sum(s for k, (_, s) in hops.items() if k != "ttft")
        assert total == pytest.approx(hops["ttft"][1], abs=2e-3), hops  # wall vs monotonic clock, rounding
        if stream:
            assert total <= client_ttft, (total, client_ttft)  # the client sees the HTTP legs on top
        compute = hops["prefill_compute" if path == DISAGGREGATED_PHASES else "local_prefill_compute"][1]
        assert compute > 0
    totals = diff(phase_totals(scrape(cluster)), start)
    for phase in PHASES:
        expected = (num_remote if phase in DISAGGREGATED_PHASES else 0) + (num_local if phase in LOCAL_PHASES else 0)
        assert totals[phase][0] == expected, (phase, totals)


def test_decode_step_counters_come_with_heartbeats(cluster):
    def steps() -> tuple[float, float]:
        samples = scrape(cluster)
        return tuple(sum(v for lab, v in samples.get(name, []) if lab["role"] == "decode")
                     for name in ("pdserve:decode_steps_total", "pdserve:decode_step_seconds_total"))

    def prefill_steps() -> float:
        return sum(v for lab, v in scrape(cluster).get("pdserve:decode_steps_total", []) if lab["role"] == "prefill")

    def settled_steps() -> tuple[float, float]:
        """The figures once two reads further apart than a heartbeat interval (1 s) agree: the workers
        are idle and a heartbeat sent after their last step has arrived."""
        deadline = time.monotonic() + 20
        while True:
            first = steps()
            time.sleep(1.5)
            second = steps()
            if first == second:
                return second
            assert time.monotonic() < deadline, (first, second)

    before = settled_steps()
    _complete(cluster, _prompt(random.Random(5), 30), stream=False)  # first token from P, then 5 decode steps
    after = settled_steps()
    num_steps, seconds = after[0] - before[0], after[1] - before[1]
    assert num_steps == 5
    assert 0 < seconds / num_steps < 5.0  # a mean decode step of the tiny model, in seconds
    assert prefill_steps() == 0


def test_one_trace_per_request_with_a_span_per_hop(cluster, otlp):
    rng = random.Random(7)
    response_id, _ = _complete(cluster, _prompt(rng, 80), stream=True)
    request_id = response_id.split("-", 1)[1]
    expected = ["llm_request", *DISAGGREGATED_PHASES, "decode"]
    spans = otlp.spans_of(request_id, len(expected))
    assert sorted(s["name"] for s in spans) == sorted(expected), spans
    parent = next(s for s in spans if s["name"] == "llm_request")
    assert parent["parent_span_id"] == "" and parent["resource"]["service.name"] == "pdserve-router"
    assert parent["attributes"]["gen_ai.usage.prompt_tokens"] == 80
    assert parent["attributes"]["gen_ai.usage.completion_tokens"] == 6
    assert parent["attributes"]["pdserve.prefill_worker"] == "prefill-0"
    children = sorted((s for s in spans if s is not parent), key=lambda s: s["start"])
    assert [s["name"] for s in children] == expected[1:]
    assert all(s["trace_id"] == parent["trace_id"] and s["parent_span_id"] == parent["span_id"] for s in children)
    # Back to back from the HTTP arrival to the end; the hops end at the first token.
    assert children[0]["start"] == parent["start"] and children[-1]["end"] == parent["end"]
    assert all(a["end"] == b["start"] and a["start"] <= a["end"] for a, b in zip(children, children[1:]))
    ttft_ns = parent["attributes"]["gen_ai.latency.time_to_first_token"] * 1e9
    assert children[-1]["start"] - parent["start"] == pytest.approx(ttft_ns, abs=1e4)
    # The workers' own stamps (unclamped), in the order a disaggregated request passes them (one host: one clock).
    events = parent["events"]
    assert [name for name, _ in events] == ["decode_received", "remote_prefill_sent", "prefill_received",
                                            "prefill_started", "prefill_done", "kv_installed"]
    times = [parent["start"], *(t for _, t in events), children[-1]["start"]]
    assert times == sorted(times), events


def test_a_client_traceparent_makes_the_request_span_its_child(cluster, otlp):
    trace_id, span_id = "%032x" % random.getrandbits(128), "%016x" % random.getrandbits(64)
    response_id, _ = _complete(cluster, _prompt(random.Random(8), 8), stream=False,
                               headers={"traceparent": f"00-{trace_id}-{span_id}-01"})
    spans = otlp.spans_of(response_id.split("-", 1)[1], 1 + len(LOCAL_PHASES) + 1)
    parent = next(s for s in spans if s["name"] == "llm_request")
    assert (parent["trace_id"], parent["parent_span_id"]) == (trace_id, span_id)
    assert sorted(s["name"] for s in spans if s is not parent) == sorted([*LOCAL_PHASES, "decode"])
    assert all(s["trace_id"] == trace_id for s in spans)


def test_the_flag_needs_an_http_url_and_the_sdk(model_dir, monkeypatch):
    from pdserve.cli import build_parser
    from pdserve.router.config import RouterConfig, tracing_args

    url = "http://127.0.0.1:4318/v1/traces"
    assert RouterConfig(model=model_dir, otlp_traces_endpoint=url).otlp_traces_endpoint == url
    with pytest.raises(ValueError, match="http"):
        RouterConfig(model=model_dir, otlp_traces_endpoint="127.0.0.1:4317")
    args, _ = build_parser().parse_known_args(["up", "--otlp-traces-endpoint", url])
    assert tracing_args(args) == ["--otlp-traces-endpoint", url]  # what pdserve up hands the router
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith("opentelemetry") else real_find_spec(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'pdserve\[otel\]'"):
        RouterConfig(model=model_dir, otlp_traces_endpoint=url)
    assert RouterConfig(model=model_dir).otlp_traces_endpoint is None  # no flag, no SDK needed


# ---- bench serve's summary ----------------------------------------------------------------------------


def test_bench_summary_from_two_scrapes():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

    from pdserve.bench import phases

    reg = CollectorRegistry()
    hist = Histogram("pdserve:request_phase_seconds", "hops", ["model_name", "phase"], buckets=(0.01, 0.1, 1.0),
                     registry=reg)
    steps = Counter("pdserve:decode_steps", "steps", ["model_name", "worker", "role"], registry=reg)
    step_s = Counter("pdserve:decode_step_seconds", "seconds", ["model_name", "worker", "role"], registry=reg)
    hist.labels("m", "router_queue").observe(0.5)  # before the run: must not count
    steps.labels("m", "d0", "decode").inc(10)
    before = phases.parse_figures(generate_latest(reg).decode())
    for queue, compute, back in ((0.005, 0.05, 0.005), (0.005, 0.07, 0.005), (0.02, 0.5, 0.03)):
        for name, seconds in (("router_queue", queue), ("local_prefill_compute", compute),
                              ("first_token_back", back)):
            hist.labels("m", name).observe(seconds)
    steps.labels("m", "d0", "decode").inc(4)
    step_s.labels("m", "d0", "decode").inc(0.2)
    summary = phases.summarize(before, phases.parse_figures(generate_latest(reg).decode()))
    assert summary["num_requests"] == 3
    assert list(summary["phases"]) == ["router_queue", "first_token_back", "local_prefill_compute"]  # PHASES order
    assert summary["phases"]["router_queue"]["mean_s"] == pytest.approx(0.01)
    # rank 1.5 of 3 falls in (0.01, 0.1], which holds 2: interpolated as Prometheus' histogram_quantile does
    assert summary["phases"]["local_prefill_compute"]["p50_s"] == pytest.approx(0.01 + 0.09 * 1.5 / 2)
    assert summary["mean_ttft_s"] == pytest.approx(0.69 / 3)
    assert summary["non_prefill_compute_share"] == pytest.approx(0.07 / 0.69)
    assert summary["mean_decode_step_s"] == pytest.approx(0.05)
    table = phases.format_summary(summary)
    assert "local_prefill_compute" in table and "10.1%" in table
    assert phases.parse_figures("# TYPE vllm:e2e_request_latency_seconds histogram\n") is None  # not pdserve


def test_bench_serve_prints_where_ttft_went(cluster):
    from pdserve.bench import DatasetConfig, ServeConfig
    from pdserve.bench.serve import run_benchmark_sync

    result = run_benchmark_sync(ServeConfig(url=cluster.url, disable_tqdm=True, dataset=DatasetConfig(
        num_prompts=4, input_len=48, output_len=4, vocab_size=2000, seed=3)))
    assert not result.errors
    summary = result.phases
    assert summary["num_requests"] == 4
    assert {name for name, h in summary["phases"].items() if h["count"] == 4} == set(DISAGGREGATED_PHASES)
    assert 0 < summary["non_prefill_compute_share"] < 1
    assert 0 < summary["mean_ttft_s"] <= result.metrics["mean_ttft_ms"] / 1e3  # the client sees the HTTP legs too
    assert "Where TTFT went" in result.table() and result.to_dict()["ttft_phases"] == summary
