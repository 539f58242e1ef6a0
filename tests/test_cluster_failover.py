"""A prefill worker dies: the decode worker recomputes prompts itself and nothing is lost."""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import wait_all_blocks_free, workers

pytestmark = pytest.mark.cluster


def test_prefill_worker_killed_requests_recomputed_locally(model_dir, tmp_path):
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB", "--remote-prefill-timeout", "3",
                                    "--transfer-timeout", "3"],
                       router_args=["--worker-timeout-s", "30"])  # far off: the socket monitor must see the death
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = ["the quick brown fox", "seven wizards quietly pack boxes", "a river bank in autumn light near"]
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=60, max_retries=0)
        assert api.completions.create(model="tiny", prompt="warm up", max_tokens=4).usage.completion_tokens == 4
        prefill = dict(cluster.procs)["prefill-0"]
        prefill.send_signal(signal.SIGKILL)
        prefill.wait(timeout=10)
        deadline = time.monotonic() + 2  # its connection drops: it leaves the pool at once, not after 30 s
        while [w for w in workers(cluster) if w["role"] == "prefill"]:
            assert time.monotonic() < deadline, "the router kept routing to the dead prefill worker"
            time.sleep(0.05)

        def run(prompt):
            return api.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0).choices[0].text

        with cf.ThreadPoolExecutor(3) as pool:
            texts = list(pool.map(run, prompts))
        for prompt, text in zip(prompts, texts):
            ids = tok(prompt).input_ids
            out = ref.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):]
            assert text == tok.decode(out, skip_special_tokens=True)
        deadline = time.monotonic() + 5  # the decode worker prefilled them itself (its next heartbeat says)
        while not [w for w in workers(cluster) if w["role"] == "decode" and w["num_steps"] > 0]:
            assert time.monotonic() < deadline, "the decode worker ran no step"
            time.sleep(0.2)
        wait_all_blocks_free(cluster)
