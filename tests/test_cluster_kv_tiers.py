"""A worker's KV tiers in a real cluster (issue 39): router + 1 decode worker process with a host tier
and a disk tier. The worker is SIGKILLed after its cache spilled to disk; the supervisor restarts it,
its first KV events tell the router what the disk holds before any request, and the conversation's
next turn is served from the disk files, token-exact with transformers."""

from __future__ import annotations

import random
import signal

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM

from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.common.utils import free_port
from tests.helpers.cluster import wait_until

pytestmark = pytest.mark.cluster

BLOCK_SIZE = 16


def counters(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def decode_worker(url: str) -> dict | None:
    return next((w for w in httpx.get(f"{url}/workers", timeout=10).json() if w["role"] == "decode"), None)


def test_a_killed_worker_restarts_warm_from_its_disk_tier(model_dir, tmp_path):
    # the tiny preset's block is 8 KiB: 48 blocks in the KV cache, 8 in host memory, 1,024 on disk
    spec = ClusterSpec(model=model_dir, num_prefill=0, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "384KiB", "--kv-offload-memory", "64KiB",
                                    "--kv-offload-disk", f"{tmp_path / 'kv'}:8MiB", "--enforce-eager"])
    rng = random.Random(3)
    first = [rng.randrange(10, 2000) for _ in range(5 * BLOCK_SIZE + 3)]
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        url = cluster.url
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        api.completions.create(model="tiny", prompt=first, max_tokens=4, temperature=0)
        for _ in range(3):  # every block of the KV cache and the host tier is reused: the first turn reaches disk
            api.completions.create(model="tiny", prompt=[rng.randrange(10, 2000) for _ in range(40 * BLOCK_SIZE)],
                                   max_tokens=1)
        wait_until(lambda: counters(url, "pdserve:kv_disk_write_blocks_total") >= 5, 15, "the spills to disk")

        old = dict(cluster.procs)["decode-0"]
        old.send_signal(signal.SIGKILL)
        old.wait(timeout=10)
        # the supervisor starts it again; it finds its files and says so in its first KV event batch
        wait_until(lambda: (w := decode_worker(url)) and dict(cluster.procs)["decode-0"].pid != old.pid
                 and w["kv_index_blocks"] >= 5, 120, "the restarted worker's disk blocks in the router's index")

        turn = first + [rng.randrange(10, 2000) for _ in range(10)]
        text = api.completions.create(model="tiny", prompt=turn, max_tokens=8, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text
        wait_until(lambda: counters(url, "pdserve:kv_disk_read_blocks_total") >= 5, 15, "the reads from disk")
        hits = counters(url, "vllm:prefix_cache_hits_total")
        assert hits >= 5 * BLOCK_SIZE, hits

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref.generate(torch.tensor([turn]), attention_mask=torch.ones(1, len(turn), dtype=torch.long),
                           max_new_tokens=8, do_sample=False, pad_token_id=2, eos_token_id=None)[0, len(turn):]
    assert text == tok.decode(out, skip_special_tokens=True)
