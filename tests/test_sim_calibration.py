"""The simulator against the real cluster, on a small case: profile real workers, serve a workload on a real
``pdserve up --colocated`` cluster with ``pdserve bench serve``'s own client, simulate the same workload line
from the profile, and compare the TTFT median (TPOT is printed: too noisy here to bound, see below).

The bound is loose (a shared 2-core CI machine's two runs of one workload differ by tens of percent, and a
profile's serving grid by as much between two profiles: see docs/benchmarks.md's calibration table; here
TTFT came within 3% and TPOT 24% over when this test was written); what it catches is a simulator wrong in
kind: the request overhead left out halves TTFT for these short prompts, the wake-up of a cluster that sat
idle between arrivals left out put it 25-43% under (two runs, 2026-11-29), and the engine's
step alone (without the serving loop measured in the cluster) gives TPOT about half the real one.
"""

from __future__ import annotations

import statistics

import pytest

from pdserve.bench.datasets import DatasetConfig
from pdserve.bench.serve import ServeConfig, run_benchmark_sync
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.common.utils import free_port
from pdserve.sizing.profiler import run_profile
from pdserve.sizing.serving_profiler import LOADED_PASS_PROMPTS, WAKE_IDLE_S
from pdserve.sizing.simulator import SimConfig, Simulator
from pdserve.sizing.workload import synthetic

pytestmark = pytest.mark.cluster

FLAGS = ["--kv-cache-memory", "32MiB", "--max-num-seqs", "16"]
TOLERANCE = 0.45
ATTEMPTS = 3  # profile-and-serve pairs tried before the test fails (a shared machine's speed moves in minutes)


def _profile_and_serve(model_dir, tmp_path, attempt: int):
    """A colocated profile, then the real cluster serving the workload: (profile, real metrics, dataset, rate)."""
    profile = run_profile(model_dir, str(tmp_path / f"profile-{attempt}.json"), ["colocated"], FLAGS, repeats=2,
                          transfer=False, disable_tqdm=True)
    colocated = profile.workers["colocated"]
    assert colocated.serving_decode_seconds and colocated.request_overhead_s > 0
    # what a prompt pays after the cluster idled, by length (measured: noisy, either sign near 0)
    assert colocated.wake_tokens == [16, 512] and colocated.wake_idle_seconds == list(WAKE_IDLE_S)
    assert [len(row) for row in colocated.wake_overhead_seconds] == [2] * len(WAKE_IDLE_S)  # [gap][length]
    print(f"attempt {attempt}: wake-up {[[round(1000 * s, 1) for s in r] for r in colocated.wake_overhead_seconds]} ms")
    # the router's and the client's CPU per request and per token, read from their processes
    assert set(colocated.host_cpu_seconds) == {"router", "client"} and colocated.host_cpu_seconds["router"][1] > 0
    # the Poisson pass the overhead under load was fitted to, by replaying it (loaded_fit)
    assert len(colocated.loaded_pass["ttft_s"]) == LOADED_PASS_PROMPTS and max(colocated.loaded_pass["in_flight"]) > 0
    # the fit never takes more than the idle overhead at the pass's mean prompt away (fit_loaded_overhead's floor)
    floor = -colocated.request_overhead(statistics.fmean(colocated.loaded_pass["prompt_tokens"]))
    assert colocated.overhead_per_stream_s >= 0 and colocated.loaded_overhead_s >= floor - 1e-12
    print(f"attempt {attempt}: overhead under load {1000 * colocated.loaded_overhead_s:.2f} ms + "
          f"{1000 * colocated.overhead_per_stream_s:.2f} ms a stream in flight")
    dataset = DatasetConfig(num_prompts=60, input_len=96, range_ratio=0.5, output_len=24, prefix_len=32,
                            vocab_size=2048, seed=5 + attempt)
    rate = 6.0
    spec = ClusterSpec(model=model_dir, num_prefill=0, num_decode=1, port=free_port(), worker_args=FLAGS)
    with LocalCluster(spec, log_dir=str(tmp_path / f"logs-{attempt}")) as cluster:
        real = run_benchmark_sync(ServeConfig(url=cluster.url, dataset=dataset, request_rate=rate,
                                              num_warmups=4, disable_tqdm=True)).metrics
    assert real["completed"] == 60
    return profile, real, dataset, rate


def test_simulated_ttft_and_tpot_track_a_real_colocated_cluster(model_dir, tmp_path):
    """Simulated TTFT median within ``TOLERANCE`` of the real one. A shared machine's speed moves by 2-3x
    within minutes at times (the twenty-fourth session's Xeon: this test's real TTFT 29.8 ms in one run, 19.9
    in the next, the simulated 12.1 / 17.4 from profiles taken a minute before each; in a slow hour two
    pairs in a row missed): a miss is profiled and served again, on fresh prompts, up to ``ATTEMPTS`` pairs,
    and the test fails only if every pair misses, which a simulator wrong in kind (the request overhead
    left out) does."""
    errors = []
    for attempt in range(ATTEMPTS):
        profile, real, dataset, rate = _profile_and_serve(model_dir, tmp_path, attempt)
        sim = Simulator(profile, SimConfig(num_prefill=0, num_decode=1)).run(synthetic(dataset, rate)).metrics
        # TPOT is printed, not bounded: the profile's serving decode grid varies 1.2x-2x between two profiles
        # on a shared 2-core machine (the simulated TPOT came out +24% and +73% in two runs of this test)
        for key in ("median_ttft_ms", "median_tpot_ms"):
            error = (sim[key] - real[key]) / real[key]
            print(f"attempt {attempt}: {key}: simulated {sim[key]:.1f} ms, real {real[key]:.1f} ms "
                  f"({100 * error:+.1f}%)")
        error = (sim["median_ttft_ms"] - real["median_ttft_ms"]) / real["median_ttft_ms"]
        errors.append(f"simulated {sim['median_ttft_ms']:.1f} ms, real {real['median_ttft_ms']:.1f} ms")
        if abs(error) < TOLERANCE:
            return
    pytest.fail("median TTFT off by more than the tolerance in every attempt: " + "; ".join(errors))
