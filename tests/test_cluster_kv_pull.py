"""Pulling a cached prefix from a peer (issue 39): 2 colocated decode workers as processes, round robin.

A conversation's first turn is prefilled on one worker; round robin sends its second turn to the
other, which holds none of it. The router's KV index says the first holds the prompt's leading
blocks, so it names that peer as the request's prefill worker: the peer computes only the new tokens
(a prefix-cache hit) and sends the whole prompt's KV over the transfer path, and the second worker
decodes from it. Greedy tokens must match transformers', also when the peer stops answering mid-pull.
"""

from __future__ import annotations

import random
import signal

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.common.utils import free_port
from tests.helpers.cluster import wait_until

pytestmark = pytest.mark.cluster

BLOCK_SIZE = 16  # the workers' default
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    spec = ClusterSpec(model=model_dir, num_prefill=0, num_decode=2, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB", "--enforce-eager", "--remote-prefill-timeout", "8"],
                       router_args=["--routing-policy", "round_robin"])
    with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("logs"))) as c:
        yield c


def metric(cluster, name: str, **labels) -> dict[str, float]:
    """Per worker, ``name``'s value among the samples with ``labels``."""
    text = httpx.get(f"{cluster.router_urls()[0]}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                key = s.labels.get("worker", s.labels.get("decision", ""))
                out[key] = out.get(key, 0.0) + s.value
    return out


def complete(cluster, prompt: list[int]) -> str:
    api = openai.OpenAI(base_url=f"{cluster.router_urls()[0]}/v1", api_key="unused", timeout=120, max_retries=0)
    resp = api.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert resp.usage.completion_tokens == MAX_TOKENS
    return resp.choices[0].text


def hf_text(model_dir: str, prompt: list[int]) -> str:
    """Transformers' greedy continuation of ``prompt``, as the router's detokenizer writes it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                          do_sample=False, pad_token_id=2)
    return AutoTokenizer.from_pretrained(model_dir).decode(out[0, len(prompt):].tolist(), skip_special_tokens=True)


def test_a_worker_that_lacks_a_prefix_pulls_it_from_the_peer_that_holds_it(cluster, model_dir):
    rng = random.Random(3)
    first = [rng.randrange(10, 500) for _ in range(6 * BLOCK_SIZE + 3)]
    complete(cluster, first)
    (home,) = metric(cluster, "vllm:request_success_total")
    url = cluster.router_urls()[0]
    wait_until(lambda: {w["id"]: w for w in httpx.get(f"{url}/workers", timeout=10).json()}[home]["kv_index_blocks"]
               >= 6, what="the index to show the first turn")
    hits_before = metric(cluster, "vllm:prefix_cache_hits_total")

    second = first + [rng.randrange(10, 500) for _ in range(20)]
    assert complete(cluster, second) == hf_text(model_dir, second)
    served = metric(cluster, "vllm:request_success_total")
    (puller,) = [w for w in served if w != home]  # round robin: the turn went to the other worker
    assert metric(cluster, "pdserve:routing_decisions_total", role="prefill").get("kv_pull") == 1
    wait_until(lambda: metric(cluster, "pdserve:kv_transfers_total").get(home, 0) >= 1
               and metric(cluster, "pdserve:kv_transfers_total").get(puller, 0) >= 1,
               what="both sides to count the transfer")
    # the peer found the first turn's blocks in its prefix cache and computed only the rest
    hits = wait_until(lambda: (h := metric(cluster, "vllm:prefix_cache_hits_total")).get(home, 0)
                      - hits_before.get(home, 0) >= 6 * BLOCK_SIZE and h, what="the peer's prefix hit")
    assert hits.get(puller, 0) == hits_before.get(puller, 0)
    # both now hold the second turn: the third, sent back to the first worker, is a hit there, no pull
    third = second + [rng.randrange(10, 500) for _ in range(12)]
    assert complete(cluster, third) == hf_text(model_dir, third)
    assert metric(cluster, "pdserve:routing_decisions_total", role="prefill").get("kv_pull") == 1


def test_a_peer_that_stops_answering_mid_pull_is_recomputed_around(cluster, model_dir):
    """The peer is frozen (SIGSTOP) as the pull goes out: the puller's deadline passes and it prefills the
    prompt itself, token-exact; the peer, woken, drops the stale pull and leaks no block."""
    rng = random.Random(4)
    first = [rng.randrange(10, 500) for _ in range(5 * BLOCK_SIZE + 7)]
    before = metric(cluster, "vllm:request_success_total")
    complete(cluster, first)
    after = metric(cluster, "vllm:request_success_total")
    (home,) = [w for w in after if after[w] != before.get(w, 0)]
    url = cluster.router_urls()[0]
    wait_until(lambda: {w["id"]: w for w in httpx.get(f"{url}/workers", timeout=10).json()}[home]["kv_index_blocks"]
               >= 5 + 7, what="the index to show the turn")  # (the first test's 7 blocks are there too)
    pulls = metric(cluster, "pdserve:routing_decisions_total", role="prefill").get("kv_pull", 0)
    peer = dict(cluster.procs)[home]
    peer.send_signal(signal.SIGSTOP)
    try:
        second = first + [rng.randrange(10, 500) for _ in range(9)]
        assert complete(cluster, second) == hf_text(model_dir, second)
        assert metric(cluster, "pdserve:routing_decisions_total", role="prefill").get("kv_pull") == pulls + 1
    finally:
        peer.send_signal(signal.SIGCONT)

    def blocks_free() -> bool:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        usage = [s.value for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "vllm:kv_cache_usage_perc"]
        return len(usage) == 2 and all(u == 0 for u in usage)

    wait_until(blocks_free, 60, "every block back in both workers (the stale pull dropped)")
    assert complete(cluster, second + [7, 8, 9]) == hf_text(model_dir, second + [7, 8, 9])
