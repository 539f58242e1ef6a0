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
from pdserve.launcher import ClusterSpec, LocalCluster

pytestmark = pytest.mark.cluster


def test_tp2_decode_worker_serves_exactly_and_a_killed_rank_removes_it(model_dir, tmp_path):
    spec = ClusterSpec(model=model_dir, num_prefill=0, num_decode=1, port=free_port(), threads_per_worker=1,
                       decode_tensor_parallel_size=2,
                       worker_args=["--kv-cache-memory", "2MiB", "--max-num-batched-tokens", "32",
                                    "--rank-timeout", "10"],
                       router_args=["--worker-timeout-s", "3"])
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
        for prompt, text in zip(prompts, texts):
            ids = torch.tensor([tok.encode(prompt)])
            with torch.no_grad():
                out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                   pad_token_id=2)
            assert text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)

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
