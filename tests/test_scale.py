"""Pools that change while serving: scale up, drain, scale down, SIGTERM, all under load, nothing failed.

Real processes (``pdserve up``'s launcher), the real ``openai`` client streaming
greedy requests the whole time; every completion is compared with Hugging Face
``generate`` on the same checkpoint.
"""

from __future__ import annotations

import random
import signal
import time

import httpx
import pytest

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.cluster.scale import scale_pools
from tests.helpers.cluster import hf_greedy_texts, prompt_text, wait_all_blocks_free
from tests.helpers.cluster import API_KEY, MAX_TOKENS, Load  # noqa: F401

pytestmark = pytest.mark.cluster


def pools(url: str) -> dict:
    return httpx.get(f"{url}/admin/pools", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10).json()


def test_pools_grow_drain_and_shrink_under_load_with_nothing_failed(model_dir, tmp_path):
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB", "--drain-timeout", "60"], api_key=API_KEY)
    rng = random.Random(7)
    prompts = [prompt_text(rng, rng.randint(3, 24)) for _ in range(6)]
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        url = cluster.url
        assert httpx.get(f"{url}/admin/pools", timeout=10).status_code == 401  # admin needs the key
        load = Load(url, prompts)
        try:
            load.wait_for(4)

            # grow both pools mid-load: the launcher starts the workers, the router routes to them
            grown = scale_pools(url, prefill=2, decode=2, api_key=API_KEY, wait=True, timeout_s=120)
            assert {w["id"] for w in grown["decode"]["workers"]} == {"decode-0", "decode-1"}
            assert {w["id"] for w in grown["prefill"]["workers"]} == {"prefill-0", "prefill-1"}
            done = len(load.results)
            load.wait_for(done + 12)
            routed = {w["id"]: w["num_routed"] for role in ("prefill", "decode") for w in pools(url)[role]["workers"]}
            assert routed["decode-1"] > 0 and routed["prefill-1"] > 0, routed

            assert not load.errors, load.errors[:3]

            # drain the decode worker holding the most requests, while they stream (a snapshot can fall
            # between one client's requests, so look again until one holds some)
            deadline = time.monotonic() + 30
            while True:
                busiest = max(pools(url)["decode"]["workers"], key=lambda w: w["num_outstanding"])
                if busiest["num_outstanding"] > 0:
                    break
                assert time.monotonic() < deadline and not load.errors, \
                    ("the load should keep the decode workers busy", load.errors[:3])
                time.sleep(0.05)
            resp = httpx.post(f"{url}/admin/workers/{busiest['id']}/drain",
                              headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
            assert resp.status_code == 200 and resp.json()["state"] == "draining"
            assert httpx.post(f"{url}/admin/workers/nobody/drain", headers={"Authorization": f"Bearer {API_KEY}"},
                              timeout=10).status_code == 404
            deadline = time.monotonic() + 60
            while busiest["id"] in {w["id"] for w in pools(url)["decode"]["workers"]}:
                assert time.monotonic() < deadline, "the drained worker never left"
                time.sleep(0.2)

            # shrink to one prefill and one decode worker mid-load (the launcher starts nothing more)
            scale_pools(url, prefill=1, decode=1, api_key=API_KEY, wait=True, timeout_s=120)
            # SIGTERM drains a worker too; the launcher replaces it (the pool's target is 1)
            survivor = pools(url)["decode"]["workers"][0]["id"]
            proc = cluster.workers[survivor].handle
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
            deadline = time.monotonic() + 120
            while not [w for w in pools(url)["decode"]["workers"] if w["id"] != survivor]:
                assert time.monotonic() < deadline, "no decode worker replaced the one that drained"
                time.sleep(0.2)
            done = len(load.results)
            load.wait_for(done + 8)
        finally:
            load.stop()
        assert not load.errors, load.errors[:3]
        assert cluster.check() == []  # drained workers left cleanly (exit 0) and were forgotten
        final = pools(url)
        assert (final["prefill"]["num_serving"], final["decode"]["num_serving"]) == (1, 1)
        assert sorted(cluster.workers) == sorted(w["id"] for role in ("prefill", "decode")
                                                 for w in final[role]["workers"])
        wait_all_blocks_free(cluster)

    expected = hf_greedy_texts(model_dir, prompts, MAX_TOKENS)
    assert len(load.results) >= 24
    mismatched = [(p, t) for p, t in load.results if t != expected[p]]
    assert not mismatched, mismatched[:2]
