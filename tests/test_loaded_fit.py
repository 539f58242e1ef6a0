"""Under load a request's way in and out takes longer than at idle (``loaded_overhead_s``), and longer for each
stream in flight when it arrives (``overhead_per_stream_s``); the profiler fits both by replaying its loaded
pass in the simulator (``pdserve.sizing.loaded_fit``)."""

from __future__ import annotations

import random

import pytest

from pdserve.sizing.loaded_fit import fit_loaded_overhead, in_flight_at_sends, replay_ttfts
from pdserve.sizing.simulator import SimConfig, Simulator
from pdserve.sizing.workload import SimRequest
from tests.helpers.sizing import make_profile

DECODE_STEP = 0.004 + 0.0005  # make_profile's decode step at batch 1 (s)


def _request(index: int, at: float, prompt_len: int, output_len: int) -> SimRequest:
    return SimRequest(index, at, [100 + index * 1000 + j for j in range(prompt_len)], output_len)


def _ttfts(profile, requests) -> dict[float, float]:
    records = Simulator(profile, SimConfig(num_prefill=0, num_decode=1, step_jitter=False)).run(requests).records
    return dict(zip(records.arrival, records.ttft))


def test_each_stream_in_flight_at_arrival_adds_the_fitted_overhead_and_a_lone_request_only_the_constant():
    """Two long streams decoding when a third arrives: its time to first token grows by the constant and twice
    the per-stream term (its way in is delayed, so the decode step it joins may differ: within one step); the
    first request, which found nothing in flight, by the constant alone."""
    requests = [_request(0, 0.0, 64, 200), _request(1, 0.001, 64, 200), _request(2, 0.3, 64, 4)]
    profile = make_profile(request_overhead_s=0.01)
    before = _ttfts(profile, requests)
    base, per_stream = 0.003, 0.006
    colocated = profile.workers["colocated"]
    colocated.loaded_overhead_s, colocated.overhead_per_stream_s = base, per_stream
    after = _ttfts(profile, requests)
    assert after[0.0] - before[0.0] == pytest.approx(base)
    assert after[0.001] - before[0.001] == pytest.approx(base + per_stream, abs=DECODE_STEP)
    assert after[0.3] - before[0.3] == pytest.approx(base + 2 * per_stream, abs=DECODE_STEP)
    colocated.loaded_overhead_s = -1.0  # never less than no overhead at all
    assert _ttfts(profile, requests)[0.0] == pytest.approx(before[0.0] - 0.01)


def test_in_flight_counts_the_requests_sent_before_and_not_yet_done():
    sends = [0.0, 0.1, 0.2, 1.0]
    ends = [0.5, 0.15, 0.9, 1.2]
    assert in_flight_at_sends(sends, ends) == [0, 1, 1, 0]


def _loaded_pass(profile, base: float, per_stream: float, num: int = 40, rate: float = 12.0) -> dict:
    """A Poisson pass as the profiler records it, its "real" TTFTs those of a simulated cluster whose requests
    pay ``base`` more under load and ``per_stream`` seconds for each stream in flight."""
    rng = random.Random(3)
    arrivals, t = [], 0.0
    for _ in range(num):
        arrivals.append(t)
        t += rng.expovariate(rate)
    lengths = [128 + i % 8 for i in range(num)]
    requests = [_request(i, a, n, 48) for i, (a, n) in enumerate(zip(arrivals, lengths))]
    colocated = profile.workers["colocated"]
    colocated.loaded_overhead_s, colocated.overhead_per_stream_s = base, per_stream
    records = Simulator(profile, SimConfig(num_prefill=0, num_decode=1, step_jitter=False)).run(requests).records
    colocated.loaded_overhead_s = colocated.overhead_per_stream_s = 0.0
    by_arrival = {a: (ttft, e2el) for a, ttft, e2el in zip(records.arrival, records.ttft, records.e2el)}
    ttfts = [by_arrival[a][0] for a in arrivals]
    ends = [a + by_arrival[a][1] for a in arrivals]
    return {"arrival_s": arrivals, "prompt_tokens": lengths, "output_tokens": 48, "ttft_s": ttfts,
            "in_flight": in_flight_at_sends(arrivals, ends)}


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def test_the_fit_recovers_the_constant_and_what_each_stream_in_flight_adds():
    """A pass whose TTFTs came from a cluster adding 2 ms under load and 3 ms per stream in flight: the replay
    without the terms runs short, and the fit finds both again (the line through each request's shortfall
    against its streams in flight) and the replay then meets the real median."""
    profile = make_profile(request_overhead_s=0.004)
    loaded = _loaded_pass(profile, 0.002, 0.003)
    assert len(set(loaded["in_flight"])) > 3  # the pass sees several loads
    colocated = profile.workers["colocated"]
    colocated.loaded_pass = loaded
    real = _median(loaded["ttft_s"])
    assert _median(replay_ttfts(profile, "colocated", 0.0, 0.0)) < 0.8 * real
    base, per_stream = fit_loaded_overhead(profile, "colocated")
    assert base == pytest.approx(0.002, abs=0.001) and per_stream == pytest.approx(0.003, rel=0.2)
    assert _median(replay_ttfts(profile, "colocated", base, per_stream)) == pytest.approx(real, rel=0.03)


def test_a_pass_the_simulator_already_prices_fits_nothing_and_one_it_overprices_no_negative_slope():
    profile = make_profile(request_overhead_s=0.004)
    colocated = profile.workers["colocated"]
    colocated.loaded_pass = _loaded_pass(profile, 0.0, 0.0)
    assert fit_loaded_overhead(profile, "colocated") == (0.0, 0.0)  # the replay meets it at once
    colocated.loaded_pass["ttft_s"] = [0.5 * t for t in colocated.loaded_pass["ttft_s"]]
    base, per_stream = fit_loaded_overhead(profile, "colocated")
    assert per_stream == 0.0 and -0.004 <= base < 0  # never more than the idle overhead taken away
    colocated.loaded_pass = {}
    with pytest.raises(ValueError, match="no loaded pass"):
        fit_loaded_overhead(profile, "colocated")


def test_a_pass_slower_throughout_adds_at_most_the_idle_overhead_again():
    """A pass whose every TTFT came out 1.5x the simulator's (a shared machine in a slow phase: hundreds of ms
    on a prompt of ~0.1 s) fits a constant of the idle overhead at most, not the phase's 50 ms; a pass that
    pays 3 ms a stream in flight on top keeps that slope (``fit_loaded_overhead``'s bounds)."""
    profile = make_profile(request_overhead_s=0.004)
    colocated = profile.workers["colocated"]
    slow = _loaded_pass(profile, 0.0, 0.0)
    slow["ttft_s"] = [1.5 * t for t in slow["ttft_s"]]
    colocated.loaded_pass = slow
    base, _ = fit_loaded_overhead(profile, "colocated")
    assert base == pytest.approx(0.004)
    colocated.loaded_pass = _loaded_pass(profile, 0.02, 0.003)
    base, per_stream = fit_loaded_overhead(profile, "colocated")
    assert base == pytest.approx(0.004) and per_stream == pytest.approx(0.003, rel=0.3)
