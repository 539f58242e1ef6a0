"""The goodput sweep (DistServe's measure): SLO sets, attainment, the saturation stop, goodput, the report."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.metrics import RequestOutput
from pdserve.bench.sweep import (SweepPoint, attainment_of, describe_warmup, goodput, num_prompts_for, parse_slo_set,
                                 parse_warmup, past_saturation, run_sweep, slo_label)
from pdserve.bench.systems import SystemResult

LOOSE, TIGHT = {"ttft": 2500.0, "tpot": 150.0}, {"ttft": 1000.0, "tpot": 50.0}
L_LOOSE, L_TIGHT = slo_label(LOOSE), slo_label(TIGHT)


def _out(ttft_s: float, tpot_s: float, ok: bool = True) -> RequestOutput:
    if not ok:
        return RequestOutput(False, error="HTTP 503")
    return RequestOutput(True, prompt_len=100, output_tokens=11, ttft_s=ttft_s, e2el_s=ttft_s + 10 * tpot_s,
                         itl_s=[tpot_s] * 10)


def test_slo_sets_parse_and_label():
    assert parse_slo_set("ttft:2500,tpot:150") == LOOSE
    assert parse_slo_set(" TTFT:1000 , tpot:50 ") == TIGHT
    assert slo_label(LOOSE) == "TTFT<=2500ms & TPOT<=150ms"
    for bad in ("", "ttft", "ttft:-1", "speed:3"):
        with pytest.raises(ValueError):
            parse_slo_set(bad)


def test_attainment_counts_failures_as_misses():
    outs = [_out(0.5, 0.04), _out(2.0, 0.1), _out(3.0, 0.04), _out(0, 0, ok=False)]
    att = attainment_of(outs, [LOOSE, TIGHT])
    assert att == {L_LOOSE: pytest.approx(0.5), L_TIGHT: pytest.approx(0.25)}


def _point(rate: float, loose: float, tight: float, throughput: float | None = None) -> SweepPoint:
    return SweepPoint(rate, 10, {"request_throughput": rate if throughput is None else throughput},
                      {L_LOOSE: loose, L_TIGHT: tight})


def test_goodput_is_the_highest_rate_whose_attainment_and_every_lower_ones_pass():
    points = [_point(0.5, 1.0, 0.95), _point(1, 0.97, 0.6), _point(2, 0.85, 0.1), _point(4, 0.92, 0.0)]
    assert goodput(points, L_LOOSE) == 1  # the pass at 4 after a miss at 2 is noise, not goodput
    assert goodput(points, L_TIGHT) == 0.5
    assert goodput([_point(1, 0.5, 0.1)], L_LOOSE) is None
    assert goodput(list(reversed(points)), L_LOOSE) == 1  # order of the points does not matter


def test_saturation_is_low_attainment_for_every_slo_set():
    assert not past_saturation(_point(2, 0.6, 0.1))
    assert past_saturation(_point(2, 0.4, 0.1))
    assert not past_saturation(_point(2, 0.95, 0.9, throughput=1.2))  # a short run's drain lowers completed req/s


def test_run_sweep_warms_up_uses_fresh_seeds_and_stops_past_saturation():
    calls = []

    class Result:
        def __init__(self, rate, n):
            good = rate < 3  # a server that saturates at 3 req/s
            self.outputs = [_out(0.5 if good else 9.0, 0.04) for _ in range(n)]
            self.metrics = {"request_throughput": rate, "p50_ttft_ms": 1.0, "p50_tpot_ms": 1.0}

    def run_at(rate, n, seed):
        calls.append((rate, n, seed))
        return Result(rate, n)

    points = run_sweep(run_at, [4, 1, 2, 3, 8], [LOOSE, TIGHT], duration_s=10, seed=7, log=lambda _: None)
    assert calls[0] == (1, 10, 7 + 999)  # warm-up: a full pass at the lowest rate, its own prompts, discarded
    assert [(r, n) for r, n, _ in calls[1:]] == [(1, 10), (2, 20), (3, 30)]  # ascending; stops after 3
    seeds = [s for _, _, s in calls]
    assert len(set(seeds)) == len(seeds)  # every rate (and the warm-up) draws fresh prompts
    assert [p.request_rate for p in points] == [1, 2, 3]
    assert goodput(points, L_LOOSE) == 2 and goodput(points, L_TIGHT) == 2
    assert num_prompts_for(0.1, 10) == 8 and num_prompts_for(1.5, 45) == 68

    calls.clear()  # a short warm-up run instead, or none
    run_sweep(run_at, [1, 2], [LOOSE], duration_s=10, seed=7, warmup="8", log=lambda _: None)
    assert calls[0] == (4, 8, 7 + 999) and len(calls) == 3
    calls.clear()
    run_sweep(run_at, [1, 2], [LOOSE], duration_s=10, seed=7, warmup="0", log=lambda _: None)
    assert [r for r, _, _ in calls] == [1, 2]
    with pytest.raises(ValueError, match="full"):
        parse_warmup("lots")
    full = describe_warmup("full", [2, 0.5], 30)
    assert "full pass" in full and "15 requests" in full
    assert "not a full pass" in describe_warmup("8", [1], 30)


def test_sweep_report_and_figure(tmp_path):
    from pdserve.bench.compare import CompareConfig
    from pdserve.bench.datasets import DatasetConfig, build_requests
    from pdserve.bench.report import write_report

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    cfg = CompareConfig(model=str(model), out_dir=str(tmp_path), systems=["pdserve-disagg", "vllm-cpu", "hf-generate"],
                        dataset=DatasetConfig(min_input=64, max_input=512, min_output=16, max_output=256),
                        request_rates=[0.5, 1, 2], slo_sets=[LOOSE, TIGHT])
    assert cfg.goodput_slos == LOOSE  # the first set is the runs' own goodput
    import dataclasses

    def row(name, points):
        return SystemResult(name, "ok", "setup", points[-1].metrics, sweep=[dataclasses.asdict(p) for p in points])

    rows = [row("pdserve-disagg", [_point(0.5, 1, 0.95), _point(1, 0.95, 0.92), _point(2, 0.91, 0.5)]),
            row("vllm-cpu", [_point(0.5, 0.95, 0.5), _point(1, 0.6, 0.1)]),
            SystemResult("hf-generate", "not swept: static batches have no request rate")]
    write_report(cfg, rows, build_requests(cfg.dataset))
    text = (tmp_path / "results.md").read_text()
    assert "| pdserve-disagg | 2 | 1 | 4.00x | n/a |" in text  # tight: vllm-cpu has no goodput to divide by
    assert "| vllm-cpu | 0.5 | < 0.5 | 1.00x | n/a |" in text
    assert "not swept" in text and "goodput.png" in text
    assert (tmp_path / "goodput.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["systems"][0]["sweep"][2]["attainment"][L_LOOSE] == 0.91
    assert saved["settings"]["slo_sets_ms"] == [LOOSE, TIGHT]
    assert "a discarded full pass of the workload per system first (23 requests" in text  # 45 s at 0.5 req/s


def test_compare_flags_for_a_sweep():
    import argparse

    from pdserve.bench.commands import add_compare_args
    from pdserve.bench.compare import CompareConfig

    p = argparse.ArgumentParser()
    add_compare_args(p)
    args = p.parse_args(["--request-rates", "0.5", "1", "--slo-set", "ttft:2500,tpot:150", "--slo-set",
                         "ttft:1000,tpot:50", "--sweep-duration-s", "30", "--dtype", "bfloat16"])
    assert args.request_rates == [0.5, 1] and args.slo_set == ["ttft:2500,tpot:150", "ttft:1000,tpot:50"]
    assert (args.sweep_duration_s, args.dtype, args.sweep_warmup) == (30, "bfloat16", "full")
    with pytest.raises(ValueError, match="needs SLOs"):
        CompareConfig(model="/nonexistent", out_dir="x", request_rates=[1.0])
    with pytest.raises(ValueError, match="request rates"):
        CompareConfig(model="/nonexistent", out_dir="x", request_rates=[0.0], slo_sets=[LOOSE])
