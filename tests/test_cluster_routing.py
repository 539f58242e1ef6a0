"""Prefix-aware routing in a real cluster: router + 1 prefill + 2 decode workers as processes.

Requests that share their first KV blocks must reach the decode worker the ring names for
that prefix (computed here independently of the router), every time, and hit its prefix cache.
"""

from __future__ import annotations

import random
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.router.routing import HashRing, prefix_key

pytestmark = pytest.mark.cluster

BLOCK_SIZE = 16  # the workers' default
PREFIX_BLOCKS = 2


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=2, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB"],
                       router_args=["--routing-policy", "prefix_aware", "--routing-prefix-blocks", str(PREFIX_BLOCKS)])
    with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("logs"))) as c:
        yield c


def samples(cluster, name: str) -> dict[tuple, float]:
    """Every sample of metric ``name`` from /metrics, keyed by its sorted labels."""
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return {tuple(sorted(s.labels.items())): s.value for family in text_string_to_metric_families(text)
            for s in family.samples if s.name == name}


def per_worker(cluster, name: str) -> dict[str, float]:
    return {dict(labels)["worker"]: v for labels, v in samples(cluster, name).items()
            if dict(labels).get("role") == "decode"}


def num_routed(cluster) -> dict[str, int]:
    return {w["id"]: w["num_routed"] for w in httpx.get(f"{cluster.url}/workers", timeout=10).json()
            if w["role"] == "decode"}


def test_same_prefix_requests_go_to_the_same_decode_worker_and_hit_its_cache(cluster):
    decode_ids = sorted(num_routed(cluster))
    assert len(decode_ids) == 2
    ring = HashRing(decode_ids)
    rng = random.Random(0)
    prefixes: dict[str, list[int]] = {}  # the ring's owner -> a prefix it owns: one prefix per worker
    while len(prefixes) < 2:
        prefix = [rng.randrange(10, 500) for _ in range(PREFIX_BLOCKS * BLOCK_SIZE)]
        prefixes.setdefault(ring.owner(prefix_key(prefix, BLOCK_SIZE, PREFIX_BLOCKS)), prefix)
    hits_before = per_worker(cluster, "vllm:prefix_cache_hits_total")
    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
    a, b = prefixes
    for owner in (a, a, b, a, b, b):  # an order round robin or least loaded would split between the workers
        prefix = prefixes[owner]
        before = num_routed(cluster)
        suffix = [rng.randrange(10, 500) for _ in range(rng.randint(5, 20))]
        resp = api.completions.create(model="tiny", prompt=prefix + suffix, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 4
        after = num_routed(cluster)
        went = [w for w in after if after[w] != before.get(w, 0)]
        assert went == [owner], (owner, before, after)

    # the two later requests of each prefix found its blocks cached on that worker
    deadline = time.monotonic() + 10  # worker counters come with heartbeats
    while True:
        hits = per_worker(cluster, "vllm:prefix_cache_hits_total")
        gained = {w: hits.get(w, 0) - hits_before.get(w, 0) for w in decode_ids}
        if all(g >= 2 * PREFIX_BLOCKS * BLOCK_SIZE for g in gained.values()) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert all(g >= 2 * PREFIX_BLOCKS * BLOCK_SIZE for g in gained.values()), gained

    api.completions.create(model="tiny", prompt=[11, 12, 13], max_tokens=2)  # under one block: least loaded
    decisions = {dict(labels)["decision"]: v for labels, v in samples(cluster, "pdserve:routing_decisions_total").items()
                 if dict(labels)["policy"] == "prefix_aware" and dict(labels)["role"] == "decode"}
    assert decisions.get("prefix_home", 0) >= 6 and decisions.get("short_prompt", 0) >= 1, decisions
    assert httpx.get(f"{cluster.url}/info", timeout=10).json()["routing_policy"] == "prefix_aware"
