"""SIGTERM on the router process: /health turns 503, new requests are refused, in-flight streams finish."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import httpx
from transformers import AutoTokenizer

from pdserve.common.utils import free_port
from tests.helpers.fake_peers import FakeDecodeWorker, wait_for


def test_sigterm_drains_the_router_then_it_exits(model_dir):
    port, zmq_port = free_port(), free_port()
    router = subprocess.Popen([sys.executable, "-m", "pdserve", "router", "--model", model_dir, "--port", str(port),
                               "--zmq-port", str(zmq_port), "--shutdown-timeout", "30"])
    url = f"http://127.0.0.1:{port}"
    worker = None
    try:
        wait_for(lambda: router.poll() is None and _health(url) is not None, timeout_s=60)
        worker = FakeDecodeWorker(f"tcp://127.0.0.1:{zmq_port}")
        wait_for(lambda: (_health(url) or {}).get("num_decode") == 1, timeout_s=10)
        worker.script = AutoTokenizer.from_pretrained(model_dir).encode(" one two three four five six seven eight")
        worker.delay_s = 0.25  # a two-second stream
        chunks: list[dict] = []

        def stream():
            body = {"model": "tiny", "prompt": "hello", "max_tokens": 8, "stream": True}
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as resp:
                for line in resp.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(json.loads(line[6:]) if line != "data: [DONE]" else {"done": True})

        thread = threading.Thread(target=stream)
        thread.start()
        wait_for(lambda: len(chunks) >= 1, timeout_s=10)
        router.send_signal(signal.SIGTERM)
        wait_for(lambda: httpx.get(f"{url}/health", timeout=2).status_code == 503, timeout_s=5)
        assert httpx.get(f"{url}/health", timeout=2).json()["status"] == "draining"
        refused = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2},
                             timeout=10)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        thread.join(timeout=30)
        assert chunks[-1] == {"done": True} and not any("error" in c for c in chunks)
        assert sum(len(c["choices"]) and c["choices"][0]["text"] != "" for c in chunks[:-1]) == 8
        assert router.wait(timeout=15) == 0  # exits once nothing is in flight
    finally:
        if worker is not None:
            worker.close()
        if router.poll() is None:
            router.kill()
            router.wait()


def _health(url: str) -> dict | None:
    try:
        return httpx.get(f"{url}/health", timeout=2).json()
    except httpx.HTTPError:
        return None
