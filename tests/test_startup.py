"""Supervision from the first second: a worker dying while the cluster starts is restarted, not
fatal; a worker that cannot start fails start-up at once, with its own last log lines."""

from __future__ import annotations

import signal
import threading
import time

import httpx
import openai
import pytest

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import stream_until_cut  # noqa: F401

pytestmark = pytest.mark.cluster


def test_a_worker_killed_during_start_up_is_restarted_and_the_cluster_serves(model_dir, tmp_path):
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=2, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "8MiB"])
    cluster = LocalCluster(spec, log_dir=str(tmp_path / "logs"))
    cluster.start()
    try:
        deadline = time.monotonic() + 120
        while True:  # wait until a decode worker registered: traffic could start now (/ready says so)
            try:
                if httpx.get(f"{cluster.url}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "no worker came up"
            time.sleep(0.1)
        health = httpx.get(f"{cluster.url}/health", timeout=2).json()
        # SIGKILL a decode worker now, while start-up is still waiting for the whole cluster (or just done)
        victim = cluster.workers["decode-1"] if health["num_decode"] < 2 else cluster.workers["decode-0"]
        victim.handle.send_signal(signal.SIGKILL)
        victim.handle.wait(timeout=10)
        assert cluster.wait_healthy(), "start-up gave up instead of restarting the worker"
        assert victim.num_restarts == 1 and victim.handle.poll() is None
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=60, max_retries=0)
        for _ in range(3):
            assert api.completions.create(model="tiny", prompt="the quick brown fox", max_tokens=4,
                                          extra_body={"ignore_eos": True}).usage.completion_tokens == 4
    finally:
        cluster.stop()


def test_a_worker_that_cannot_start_fails_start_up_at_once_with_its_log_lines(model_dir, tmp_path):
    spec = ClusterSpec(model=model_dir, num_prefill=0, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--no-such-flag"])
    cluster = LocalCluster(spec, log_dir=str(tmp_path / "logs"))
    started = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        with cluster:
            pass
    message = str(info.value)
    assert "decode-0 (exit 2 before it ever registered" in message and "--no-such-flag" in message, message
    assert "Traceback" not in message
    assert time.monotonic() - started < 60  # no restart loop: a bad flag fails the same way every time
    assert all(proc.poll() is not None for _, proc in cluster.procs)  # everything it started is stopped


def test_transfer_pairs_are_set_up_before_the_first_request(model_dir, tmp_path):
    """Warm pairs: once both workers registered, the router has the decode worker connect its KV pair
    with the prefill worker; the first request finds it ready (it no longer waits seconds for it)."""
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "8MiB", "--remote-prefill-threshold", "4"])
    log = tmp_path / "logs" / "prefill-0.log"
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        deadline = time.monotonic() + 60
        while "KV transfer pairs with decode worker decode-0 (generation 0) are ready" not in log.read_text():
            assert time.monotonic() < deadline, "the pair was not set up ahead of a request"
            time.sleep(0.1)
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=60, max_retries=0)
        choice = api.completions.create(model="tiny", prompt="the quick brown fox jumps over", max_tokens=4,
                                        extra_body={"ignore_eos": True})
        assert choice.usage.completion_tokens == 4
        workers = httpx.get(f"{cluster.url}/workers", timeout=5).json()
        assert [w["num_routed"] for w in workers if w["role"] == "prefill"] == [1]  # prefilled over that pair
        assert log.read_text().count("are ready") == 1  # the request reused it


def test_workers_outlive_a_dead_router_and_join_the_next_one(model_dir, tmp_path):
    """SIGKILL the router mid-stream: after --router-timeout-s the worker drops the orphaned requests
    (their KV blocks free), keeps registering, and serves the router started in its place."""
    import re

    spec = ClusterSpec(model=model_dir, num_prefill=0, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "8MiB", "--router-timeout-s", "1"])
    cluster = LocalCluster(spec, log_dir=str(tmp_path / "logs"))
    cluster.start()
    try:
        assert cluster.wait_healthy()
        streaming = threading.Barrier(9)
        clients = [threading.Thread(target=stream_until_cut, daemon=True,
                                    args=(cluster.url, f"the quick brown fox {i}", streaming)) for i in range(8)]
        for c in clients:
            c.start()
        streaming.wait(timeout=60)  # all 8 are streaming: each has ~1,500 tokens to go
        cluster.router_proc.send_signal(signal.SIGKILL)
        cluster.router_proc.wait(timeout=10)
        log = tmp_path / "logs" / "decode-0.log"
        deadline = time.monotonic() + 30
        while not re.search(r"dropped [1-9]\d* requests", log.read_text()):
            assert time.monotonic() < deadline, "the worker kept the dead router's requests"
            time.sleep(0.1)
        assert cluster.workers["decode-0"].handle.poll() is None  # the worker lives on
        cluster._start_router()  # a new router on the same addresses
        deadline = time.monotonic() + 30
        while True:
            try:
                workers = httpx.get(f"{cluster.url}/workers", timeout=2).json()
                if workers and workers[0].get("heartbeat_received"):
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the worker did not register with the new router"
            time.sleep(0.2)
        assert workers[0]["num_free_blocks"] == workers[0]["num_blocks"]  # the dropped requests' KV is free
        resp = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": "hello", "max_tokens": 4, "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4
    finally:
        cluster.stop()
