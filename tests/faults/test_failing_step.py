"""A forward pass that raises fails only its requests; both workers keep serving (fault injected in-process)."""

from __future__ import annotations

import json

import httpx
import pytest

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import wait_all_blocks_free

pytestmark = pytest.mark.cluster

POISON = 251  # a token id no test prompt below contains


def test_failing_forward_fails_its_request_and_the_workers_keep_serving(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_FAULTS", json.dumps({"forward_fails_on_token": POISON}))
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB"])
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        url = cluster.url
        pids = {name: w.handle.pid for name, w in cluster.workers.items()}
        ok = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8], "max_tokens": 4,
                                                       "temperature": 0}, timeout=60)
        assert ok.status_code == 200
        # the prefill worker's forward fails: it hands the request back; the decode worker's recompute fails too
        resp = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, POISON, 7], "max_tokens": 4},
                          timeout=60)
        assert resp.status_code == 500, resp.text
        error = resp.json()["error"]
        assert "forward pass failed" in error["message"] and "injected fault" in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        for _ in range(3):  # both workers still serve, the same processes
            again = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7, 8],
                                                              "max_tokens": 4, "temperature": 0}, timeout=60)
            assert again.status_code == 200 and again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]
        assert {name: w.handle.pid for name, w in cluster.workers.items()} == pids
        assert all(w.handle.poll() is None and w.num_restarts == 0 for w in cluster.workers.values())
        wait_all_blocks_free(cluster)  # the failed request's blocks came back on both workers
