"""The SLA autoscaler: its pieces, then real processes under a load that ramps up 3x and back.

The ramp test runs ``pdserve up``'s launcher (router + workers as processes) with the autoscaler reading
the router's real ``/metrics`` and writing targets through the real ``/admin/scale``; an open-loop client
sends streaming requests at 2 req/s, then 6, then 2 again. The profile is hand-made
(tests/helpers/sizing.py) so the sizing is known: one decode worker up to about 4.8 req/s, two above.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.cluster.autoscaler import Autoscaler, HoltForecaster, KubectlPools, parse_router_metrics, share_within
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.common.utils import free_port
from pdserve.sizing.sizer import ProfileSizer
from tests.helpers.cluster import API_KEY
from tests.helpers.sizing import make_profile


def test_holt_forecast_follows_a_ramp_ahead_of_it():
    f = HoltForecaster()
    forecasts = [f.update(x) for x in (2, 2, 4, 6, 8)]
    assert forecasts[1] == pytest.approx(2)
    assert forecasts[-1] > 8  # the trend carries it past the last value
    assert HoltForecaster().update(0) == 0


def test_share_within_reads_a_histograms_delta_at_its_bucket_bounds():
    reg = CollectorRegistry()
    h = Histogram("vllm:time_to_first_token_seconds", "ttft", buckets=(0.1, 0.5, 1.0), registry=reg)
    h.observe(0.05)
    before = parse_router_metrics(generate_latest(reg).decode()).ttft_buckets
    for v in (0.05, 0.3, 0.3, 2.0):
        h.observe(v)
    after = parse_router_metrics(generate_latest(reg).decode()).ttft_buckets
    assert share_within(before, after, 0.5) == 0.75
    assert share_within(before, after, 0.2) == 0.25  # read at the 0.1 bound: a lower bound
    assert share_within(after, after, 0.5) is None


def test_hysteresis_grows_at_once_and_shrinks_after_the_intervals_agree():
    a = Autoscaler("http://unused", lambda *_: (1, 1), {}, scale_down_intervals=3)
    assert a._hysteresis((1, 1), (1, 3), 0.0) == (1, 3)
    assert a._hysteresis((1, 3), (1, 1), 1.0) == (1, 3)
    assert a._hysteresis((1, 3), (1, 2), 2.0) == (1, 3)
    assert a._hysteresis((1, 3), (1, 1), 3.0) == (1, 2)  # the largest the three intervals wanted
    assert a._hysteresis((1, 2), (1, 1), 4.0) == (1, 2)  # counting starts again


def test_kubectl_pools_read_and_scale_the_two_deployments(tmp_path):
    # no Kubernetes cluster here: a kubectl that records its arguments and answers as the real one would
    log = tmp_path / "calls"
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n"
                       "case \"$*\" in *get*pdserve-prefill*) printf 2;; *get*pdserve-decode*) printf 3;; esac\n")
    kubectl.chmod(0o755)
    pools = KubectlPools("serving", kubectl=str(kubectl))
    assert pools.read() == (2, 3)
    pools.write(1, 4)
    calls = log.read_text().splitlines()
    assert calls[-2:] == ["--namespace serving scale deployment/pdserve-prefill --replicas=1",
                          "--namespace serving scale deployment/pdserve-decode --replicas=4"]
    failing = tmp_path / "failing"
    failing.write_text("#!/bin/sh\necho 'forbidden: no RBAC' >&2\nexit 1\n")
    failing.chmod(0o755)
    with pytest.raises(RuntimeError, match="forbidden: no RBAC"):
        KubectlPools(kubectl=str(failing)).write(1, 1)


class RateLoad:
    """Open-loop streaming requests at ``rate`` per second (changeable), each in its own thread."""

    def __init__(self, url: str, rate: float):
        self.url, self.rate = url, rate
        self.sent = self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._dispatcher = threading.Thread(target=self._dispatch, daemon=True)
        self._dispatcher.start()

    def _dispatch(self) -> None:
        while not self._stop.is_set():
            t = threading.Thread(target=self._one, args=(self.sent,), daemon=True)
            self.sent += 1
            t.start()
            self._threads.append(t)
            self._stop.wait(1.0 / self.rate)

    def _one(self, i: int) -> None:
        body = {"model": "tiny", "prompt": [10 + (i * 31 + j) % 200 for j in range(48)], "max_tokens": 16,
                "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=body, timeout=120,
                              headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
                if resp.status_code != 200:
                    self.errors.append(f"HTTP {resp.status_code}: {resp.read()[:200]!r}")
                    return
                lines = list(resp.iter_lines())
            if "data: [DONE]" not in lines:
                self.errors.append(f"request {i}: the stream ended early")
            else:
                self.ok += 1
        except httpx.HTTPError as e:
            self.errors.append(f"request {i}: {type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        self._dispatcher.join()
        for t in self._threads:
            t.join(timeout=120)


@pytest.mark.cluster
def test_pools_follow_a_load_ramping_up_3x_and_back_with_nothing_failed(model_dir, tmp_path):
    # decode step 0.01 + 0.01 B s; TPOT 100 ms: batches of 9; 16 tokens: 1 worker to ~4.8 req/s, 2 above
    profile = make_profile(decode_base_s=0.01, decode_per_seq_s=0.01)
    slos = {"ttft": 1000, "tpot": 100}
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB", "--drain-timeout", "60"], api_key=API_KEY)
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        url = cluster.url
        lines: list[str] = []
        autoscaler = Autoscaler(url, ProfileSizer(profile, slos), slos, interval_s=2.0, min_prefill=1, max_prefill=1,
                                max_decode=2, scale_down_intervals=2, api_key=API_KEY,
                                on_interval=lambda interval: lines.append(interval.line()))
        load = RateLoad(url, 2.0)
        _, stop = autoscaler.start()
        served = []  # decode workers serving, sampled through the run

        def watch(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pools = httpx.get(f"{url}/admin/pools", headers={"Authorization": f"Bearer {API_KEY}"}).json()
                served.append(pools["decode"]["num_serving"])
                time.sleep(0.5)

        try:
            watch(8)
            assert max(served) == 1
            load.rate = 6.0  # 3x
            deadline = time.monotonic() + 60
            while max(served) < 2 and time.monotonic() < deadline and not load.errors:
                watch(1)
            assert max(served) == 2, lines
            watch(6)  # serve at 3x with both
            load.rate = 2.0
            deadline = time.monotonic() + 60
            while served[-1] > 1 and time.monotonic() < deadline and not load.errors:
                watch(1)
            assert served[-1] == 1, lines
        finally:
            stop.set()
            load.stop()
    assert not load.errors, load.errors[:3]
    assert load.ok == load.sent > 50
    assert any("-> targets 1P+2D (scaled)" in line for line in lines), lines
    assert any("-> targets 1P+1D (scaled)" in line for line in lines), lines
    attainment = [line for line in lines if "TTFT n/a" not in line and "TPOT n/a" not in line]
    assert len(attainment) >= 5, lines  # SLO attainment logged for every interval that served
