"""A tensor-parallel decode worker in the real cluster: token-exact, and a killed rank takes it out cleanly."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import httpx
import openai
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster

pytestmark = pytest.mark.cluster


def assert_greedy_matches_hf(tok, ref, prompts: list[str], texts: list[str], max_new_tokens: int) -> None:
    """Each served text equals transformers' greedy continuation of its prompt."""
    for prompt, text in zip(prompts, texts, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.no_grad():
            out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=2)
        assert text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True), prompt


def test_tp2_decode_worker_serves_exactly_and_a_killed_rank_removes_it(model_dir, tmp_path):
    spec = ClusterSpec(model=model_dir, num_prefill=0, num_decode=1, port=free_port(), threads_per_worker=1,
                       decode_tensor_parallel_size=2,
                       worker_args=["--kv-cache-memory", "2MiB", "--max-num-batched-tokens", "32",
                                    "--rank-timeout", "10"],
                       router_args=["--worker-timeout-s", "3", "--worker-wait-s", "0"],
                       max_restarts=0)  # the launcher would otherwise restart the failed worker
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = ["the quick brown fox jumps over the lazy dog " * 3, "seven wizards quietly pack boxes",
               "a river bank in autumn light near the old mill and the bridge"]
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)

        def run(prompt):
            return api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text

        with cf.ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(run, prompts))
        assert_greedy_matches_hf(tok, ref, prompts, texts, 12)

        decode = dict(cluster.procs)["decode-0"]
        (rank1,) = psutil.Process(decode.pid).children()
        assert "rank" in rank1.cmdline() and "--rank" in rank1.cmdline()
        rank1.send_signal(signal.SIGKILL)
        decode.wait(timeout=30)  # the driver's next ping fails: the worker exits instead of hanging
        assert decode.returncode != 0
        deadline = time.monotonic() + 15
        while httpx.get(f"{cluster.url}/health").json()["num_decode"] != 0:
            assert time.monotonic() < deadline, "the router kept the dead worker"
            time.sleep(0.2)
        resp = httpx.post(f"{cluster.url}/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert resp.status_code == 503


# Tiny preset: 8 KiB per 16-token block on a single rank (2 layers x K,V x 16 x 2 KV heads x 16 x fp32).
BLOCK_BYTES = 8192


@pytest.mark.parametrize("prefill,decode,secret", [((2, 1), (1, 1), "s3cret"), ((1, 1), (2, 1), "s3cret"),
                                                   ((1, 2), (1, 1), None), ((2, 2), (1, 2), None)],
                         ids=["P-TP2-to-D-TP1-curve", "P-TP1-to-D-TP2-curve", "P-PP2-to-D-PP1", "P-TP2xPP2-to-D-PP2"])
def test_mixed_layouts_transfer_exactly_under_preemption_and_partial_prefix_hits(model_dir, tmp_path, prefill,
                                                                                  decode, secret):
    """Each decode rank receives exactly its slice from the prefill ranks that hold it (several senders to one
    receiver, or one sender to several), while the decode cache is too small for the load (preemption) and
    a shared prefix is already cached on the decode side (only the missing blocks travel). With a cluster
    ``secret`` every ZMQ socket is CURVE, the non-driver ranks' reports to their driver included (a report
    lost would fail the transfers)."""
    from tests.helpers.cluster import metric_totals, wait_metric_increase

    decode_ranks = decode[0] * decode[1]
    secret_args = ["--cluster-secret", secret] if secret else []
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       prefill_tensor_parallel_size=prefill[0], prefill_pipeline_parallel_size=prefill[1],
                       decode_tensor_parallel_size=decode[0], decode_pipeline_parallel_size=decode[1],
                       worker_args=["--max-num-batched-tokens", "64", "--transfer-timeout", "20", *secret_args],
                       router_args=secret_args,
                       decode_args=["--kv-cache-memory", str(16 * BLOCK_BYTES // decode_ranks)])
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prefix = "the quick brown fox jumps over the lazy dog while seven small birds sing " * 3
    suffixes = ["in the old oak tree", "near a river bank", "under the autumn light", "beside the mill"]
    prompts = [f"{prefix}{suffixes[i % 4]} number {i} and then some more words" for i in range(16)]
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)

        def run(prompt):
            return api.completions.create(model="tiny", prompt=prompt, max_tokens=64, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text

        run(prefix + "warm")  # the shared prefix is now cached on the decode worker
        before = metric_totals(cluster)
        with cf.ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(run, prompts))
        assert_greedy_matches_hf(tok, ref, prompts, texts, 64)
        assert wait_metric_increase(cluster, "pdserve:kv_transfers_total", before, 2) >= 2
        after = metric_totals(cluster)
        assert after.get("pdserve:kv_transfer_failures_total", 0) == before.get("pdserve:kv_transfer_failures_total", 0)
        assert after["vllm:num_preemptions_total"] > before.get("vllm:num_preemptions_total", 0)
        assert after["vllm:prefix_cache_hits_total"] > before.get("vllm:prefix_cache_hits_total", 0)
        deadline = time.monotonic() + 15
        while True:  # nothing leaked: every block back in the free queue (or the prefix cache)
            (worker,) = [w for w in httpx.get(f"{cluster.url}/workers").json() if w["role"] == "decode"]
            if worker["num_free_blocks"] == worker["num_blocks"] and worker["num_running"] == 0:
                break
            assert time.monotonic() < deadline, worker
            time.sleep(0.3)
