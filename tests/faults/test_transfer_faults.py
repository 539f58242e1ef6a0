"""Faults in the KV transfer path, injected into the real prefill worker's sender (``PDSERVE_FAULTS``).

For each fault (nothing sent, a send past the deadline, corrupted bytes, a truncated
tensor) the decode worker must detect it (deadline, checksum, size), recompute the
prompt itself so the client gets transformers' greedy output, leave the next request on
that pair of workers unaffected (its KV crosses the wire again), and leak no block.
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import hf_greedy_texts, wait_all_blocks_free

pytestmark = pytest.mark.cluster

POISON = 251  # only the faulty prompts contain it


def counter(url: str, name: str, role: str) -> float:
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith(f"{name}{{") and f'role="{role}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def reference(model_dir):
    def greedy(prompt: list[int], max_tokens: int) -> str:
        return hf_greedy_texts(model_dir, [prompt], max_tokens)[tuple(prompt)]

    return greedy


@pytest.mark.parametrize("mode", ["never", "delay", "corrupt", "truncate"])
def test_transfer_fault_is_detected_recomputed_and_the_pair_recovers(model_dir, tmp_path, monkeypatch, reference,
                                                                     mode):
    monkeypatch.setenv("PDSERVE_FAULTS", json.dumps({"kv_send": {"token": POISON, "mode": mode, "delay_s": 4}}))
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB", "--remote-prefill-timeout", "2",
                                    "--transfer-timeout", "2"])
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        url = cluster.url

        def complete(prompt: list[int]) -> str:
            resp = httpx.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True},
                timeout=60)
            assert resp.status_code == 200, resp.text
            return resp.json()["choices"][0]["text"]

        good = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
        assert complete(good) == reference(good, 6)

        bad = [5, POISON, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
        assert complete(bad) == reference(bad, 6)  # recomputed on the decode worker
        deadline = time.monotonic() + 10
        while counter(url, "pdserve:kv_transfer_failures_total", "decode") < 1:
            assert time.monotonic() < deadline, "the decode worker did not count the failed transfer"
            time.sleep(0.3)
        if mode == "delay":
            time.sleep(2.5)  # the late send lands now: it must be dropped, not written into any block

        done = counter(url, "pdserve:kv_transfers_total", "decode")
        other = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47]
        assert complete(other) == reference(other, 6)  # the next request on this pair: unaffected
        deadline = time.monotonic() + 10
        while counter(url, "pdserve:kv_transfers_total", "decode") < done + 1:
            assert time.monotonic() < deadline, "the next request's KV did not cross the wire"
            time.sleep(0.3)
        wait_all_blocks_free(cluster)
        assert all(w.num_restarts == 0 and w.handle.poll() is None for w in cluster.workers.values())


def test_abort_mid_transfer_then_a_new_request_on_the_same_pair(model_dir, tmp_path, monkeypatch, reference):
    """The client leaves while its KV is still being sent; the next request on that pair must not be hurt."""
    monkeypatch.setenv("PDSERVE_FAULTS", json.dumps({"kv_send": {"token": POISON, "mode": "delay", "delay_s": 2}}))
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB", "--remote-prefill-timeout", "10",
                                    "--transfer-timeout", "10"])
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        url = cluster.url
        body = {"model": "tiny", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while the KV is on its way
            httpx.post(f"{url}/v1/completions", json={**body, "prompt": [5, POISON, *range(7, 23)]}, timeout=0.5)
        other = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43, 44, 45, 46, 47]
        resp = httpx.post(f"{url}/v1/completions", json={**body, "prompt": other}, timeout=60)  # at once
        assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == reference(other, 6)
        wait_all_blocks_free(cluster)
