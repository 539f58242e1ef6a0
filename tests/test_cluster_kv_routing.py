"""KV-aware routing in a real cluster (issue 39): 2 routers + 2 decode workers as processes.

The workers publish KV events to both routers; each router's index must show what each worker
caches, a conversation's next turn must go where its earlier turns are cached and hit that cache,
and a router killed and restarted must rebuild its index from the workers (replay or snapshot)
before any new request. Requests go to router-0's own port; router-1 only watches.
"""

from __future__ import annotations

import os
import random
import signal

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.common.utils import free_port
from tests.helpers.cluster import wait_until

pytestmark = pytest.mark.cluster

BLOCK_SIZE = 16  # the workers' default


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    spec = ClusterSpec(model=model_dir, num_prefill=0, num_decode=2, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB", "--enforce-eager"],
                       router_args=["--routing-policy", "kv_aware"], num_routers=2)
    with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("logs"))) as c:  # supervised: restarts the router
        yield c


def workers(cluster, router: int = 0) -> dict[str, dict]:
    url = cluster.router_urls()[router]
    return {w["id"]: w for w in httpx.get(f"{url}/workers", timeout=10).json() if w["role"] == "decode"}


def prefix_hits(cluster) -> dict[str, float]:
    text = httpx.get(f"{cluster.router_urls()[0]}/metrics", timeout=10).text
    return {s.labels["worker"]: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name == "vllm:prefix_cache_hits_total" and s.labels.get("role") == "decode"}


def complete(cluster, prompt: list[int]) -> str:
    """Send ``prompt``; the decode worker that served it."""
    before = {w: info["num_routed"] for w, info in workers(cluster).items()}
    api = openai.OpenAI(base_url=f"{cluster.router_urls()[0]}/v1", api_key="unused", timeout=120, max_retries=0)
    resp = api.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == 4
    after = {w: info["num_routed"] for w, info in workers(cluster).items()}
    (went,) = [w for w in after if after[w] != before.get(w, 0)]
    return went


def test_turns_follow_their_cache_and_a_restarted_router_rebuilds_its_index(cluster):
    rng = random.Random(1)
    # two conversations, each started on the worker the policy picks (the idle one)
    first = [rng.randrange(10, 500) for _ in range(5 * BLOCK_SIZE + 3)]
    home = complete(cluster, first)
    other = next(w for w in workers(cluster) if w != home)
    wait_until(lambda: workers(cluster)[home]["kv_index_blocks"] >= 5, what="the index to show the first turn")
    assert workers(cluster)[other]["kv_index_blocks"] == 0

    hits_before = prefix_hits(cluster)
    turn = first
    for _ in range(3):  # each turn extends the conversation: it goes home and hits the cache there
        turn = turn + [rng.randrange(10, 500) for _ in range(rng.randint(8, 24))]
        went = complete(cluster, turn)
        assert went == home
    hits = wait_until(lambda: (h := prefix_hits(cluster)).get(home, 0) - hits_before.get(home, 0) >= 3 * 5 * BLOCK_SIZE
                    and h, what="the prefix cache hits")
    assert hits.get(other, 0) == hits_before.get(other, 0)
    decisions = {s.labels["decision"]: s.value for family in text_string_to_metric_families(
        httpx.get(f"{cluster.router_urls()[0]}/metrics", timeout=10).text) for s in family.samples
        if s.name == "pdserve:routing_decisions_total" and s.labels["policy"] == "kv_aware"}
    assert decisions.get("kv_hit", 0) >= 3, decisions
    # the other router of the tier, which routed none of it, knows the same
    blocks = workers(cluster)[home]["kv_index_blocks"]
    wait_until(lambda: {w: i["kv_index_blocks"] for w, i in workers(cluster, 1).items()} == {home: blocks, other: 0},
             what="router-1's index")

    # router-0 dies; its restart knows nothing until the workers replay (or snapshot) their events
    os.kill(cluster.router_proc.pid, signal.SIGKILL)
    wait_until(lambda: len(workers(cluster)) == 2 and workers(cluster)[home]["kv_index_blocks"] == blocks,
             timeout_s=60, what="the restarted router's index")
    info = httpx.get(f"{cluster.router_urls()[0]}/info", timeout=10).json()["kv_index"]
    assert info["replays_asked"] >= 2 and info["entries"] >= blocks, info
    went = complete(cluster, turn + [rng.randrange(10, 500) for _ in range(10)])
    assert went == home
