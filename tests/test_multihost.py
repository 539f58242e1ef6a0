"""The ranks of one engine on two hosts: two Linux network namespaces joined by a veth pair.

Each namespace has its own network stack and address (10.213.7.1 and 10.213.7.2), so the
rendezvous, gloo's connections and the pipeline hand-offs cross a real (virtual) link and
nothing can fall back to 127.0.0.1. Needs root and iproute2; skipped where either is missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid

import pytest

H1, H2 = "10.213.7.1", "10.213.7.2"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@pytest.fixture
def two_hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 for network namespaces")
    tag = uuid.uuid4().hex[:6]
    ns = (f"pdsa{tag}", f"pdsb{tag}")
    links = (f"pva{tag}", f"pvb{tag}")
    try:
        _ip("netns", "add", ns[0])
        _ip("netns", "add", ns[1])
    except subprocess.CalledProcessError as e:
        subprocess.run(["ip", "netns", "del", ns[0]], capture_output=True)
        pytest.skip(f"cannot make network namespaces here: {e.stderr.decode().strip()}")
    try:
        _ip("link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for name, link, addr in zip(ns, links, (H1, H2)):
            _ip("link", "set", link, "netns", name)
            _ip("-n", name, "addr", "add", f"{addr}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
            _ip("-n", name, "link", "set", "lo", "up")
        yield ns
    finally:
        for name in ns:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)  # removes the veth pair too


def test_pipeline_stages_on_two_hosts_match_transformers(model_dir, two_hosts):
    port = "29651"
    rank1 = subprocess.Popen(["ip", "netns", "exec", two_hosts[1], sys.executable, "-m", "pdserve", "rank",
                              "--model", model_dir, "--pipeline-parallel-size", "2", "--rank", "1",
                              "--master-addr", H1, "--master-port", port, "--kv-cache-memory", "1MiB",
                              "--rank-timeout", "60"])
    driver = textwrap.dedent(f"""
        import torch
        from transformers import AutoModelForCausalLM
        from pdserve import LLM, SamplingParams
        prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [100, 200, 300]]
        with LLM({model_dir!r}, pipeline_parallel_size=2, master_addr={H1!r}, master_port={port},
                 kv_cache_memory="1MiB", rank_timeout_s=60) as llm:
            out = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
                               use_tqdm=False)
        ref = AutoModelForCausalLM.from_pretrained({model_dir!r}, dtype=torch.float32)
        for p, o in zip(prompts, out):
            expected = ref.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
            assert o.outputs[0].token_ids == expected, (o.outputs[0].token_ids, expected)
        print("EXACT")
    """)
    try:
        result = subprocess.run(["ip", "netns", "exec", two_hosts[0], sys.executable, "-c", driver],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 0 and "EXACT" in result.stdout, result.stderr[-3000:]
        assert rank1.wait(timeout=30) == 0
    finally:
        if rank1.poll() is None:
            rank1.kill()
            rank1.wait()
