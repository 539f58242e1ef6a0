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


def test_pdserve_up_default_model_serves_and_stops_all_children(tmp_path):
    port = free_port()
    env = dict(os.environ, PDSERVE_CACHE=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--port", str(port), "--kv-cache-memory", "8MiB"],
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
        assert len(children) == 3  # router, prefill, decode
        assert (tmp_path / "cache" / "tiny-llama-v1" / "config.json").exists()
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                          json={"model": "tiny-llama-v1", "prompt": "hello", "max_tokens": 5, "temperature": 0})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"children still running after SIGTERM: {alive}"
    finally:
        for p in [*children, psutil.Process(proc.pid) if proc.poll() is None else None]:
            if p is not None and p.is_running():
                p.kill()
