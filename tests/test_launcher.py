"""`pdserve up` (the README's main command): default model, serves, stops every child on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from pdserve.common.utils import free_port

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_pdserve_up_default_model_serves_and_stops_all_children(tmp_path, mode):
    port = free_port()
    env = dict(os.environ, PDSERVE_CACHE=str(tmp_path / "cache"))
    extra = ["--colocated"] if mode == "colocated" else []
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--port", str(port), "--kv-cache-memory", "8MiB",
                             *extra],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        line = ""
        while "pdserve is up" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, "pdserve up did not come up"
            line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in line
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == (2 if extra else 3)  # router, [prefill,] decode
        assert (tmp_path / "cache" / "tiny-llama-v1" / "config.json").exists()
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                          json={"model": "tiny-llama-v1", "prompt": "hello", "max_tokens": 5, "temperature": 0})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert health["num_prefill"] == (0 if extra else 1) and health["num_decode"] == 1
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"children still running after SIGTERM: {alive}"
    finally:
        for p in [*children, psutil.Process(proc.pid) if proc.poll() is None else None]:
            if p is not None and p.is_running():
                p.kill()


def test_up_parallel_flags_size_each_pool():
    from pdserve.cli import build_parser, pool_parallel_sizes
    from pdserve.launcher import ClusterSpec

    args, extra = build_parser().parse_known_args(["up", "--tensor-parallel-size", "2",
                                                   "--decode-tensor-parallel-size", "1",
                                                   "--prefill-pipeline-parallel-size", "2", "--kv-cache-memory", "1GiB"])
    sizes = pool_parallel_sizes(args)
    assert sizes == {"prefill_tensor_parallel_size": 2, "prefill_pipeline_parallel_size": 2,
                     "decode_tensor_parallel_size": 1, "decode_pipeline_parallel_size": 1}
    assert extra == ["--kv-cache-memory", "1GiB"]  # unknown flags still go to every worker
    spec = ClusterSpec(model="m", num_prefill=1, num_decode=2, **sizes)
    assert spec.num_ranks == 4 + 2 and spec.parallel_args("prefill") == [
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
