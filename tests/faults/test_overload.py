"""A burst far past what the cluster can hold: bounded admission answers 503 + Retry-After at once, loses nothing."""

from __future__ import annotations

import collections
import concurrent.futures as cf
import time

import httpx
import pytest

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import wait_all_blocks_free

pytestmark = pytest.mark.cluster


def test_burst_gets_200_or_an_immediate_503_with_retry_after(model_dir, tmp_path):
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB"],
                       router_args=["--max-num-waiting-requests", "4", "--request-timeout", "60"])
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        url = cluster.url
        body = {"model": "tiny", "prompt": "the quick brown fox jumps over the lazy dog " * 6, "max_tokens": 32,
                "ignore_eos": True}

        def one(_):
            started = time.monotonic()
            resp = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
            return resp.status_code, time.monotonic() - started, resp.headers.get("retry-after"), resp.json()

        with cf.ThreadPoolExecutor(64) as pool:
            results = list(pool.map(one, range(128)))
        statuses = collections.Counter(status for status, *_ in results)
        assert set(statuses) == {200, 503} and statuses[503] > 0 and statuses[200] >= 4, statuses
        for status, seconds, retry_after, payload in results:
            if status == 503:  # refused at once, told when to come back, in OpenAI's shape
                assert retry_after == "1" and "overloaded" in payload["error"]["message"] and seconds < 5
            else:
                assert payload["usage"]["completion_tokens"] == 32
        wait_all_blocks_free(cluster)
        resp = httpx.post(f"{url}/v1/completions", json=body, timeout=60)  # normal service right after
        assert resp.status_code == 200
        rejected = [line for line in httpx.get(f"{url}/metrics").text.splitlines()
                    if line.startswith("pdserve:requests_rejected_total")]
        assert rejected and float(rejected[0].rsplit(" ", 1)[1]) == statuses[503]
