"""Sliding-window models: prompts around the window, references and serving them disaggregated."""

from __future__ import annotations

import re
import time

import httpx
import openai
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve import SamplingParams
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.common.utils import free_port

WINDOW, BLOCK = 10, 4


PROMPT_LENGTHS = (45, 13, 70)


def window_prompts() -> list[list[int]]:
    return [[(i * 37 + j * 11) % 2000 + 10 for j in range(n)] for i, n in enumerate(PROMPT_LENGTHS)]


def reference_tokens(path: str, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # as ignore_eos
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_tokens, do_sample=False)[0, len(p):].tolist()
                for p in prompts]


def serve_disaggregated(model_path: str, tmp_path, expected_bytes: int, prefill_tp: int = 1) -> dict[str, float]:
    """1P+1D on ``model_path`` (4-token blocks, 16-token steps, no prefix caching, the prefill worker ``prefill_tp``
    ranks): each of ``window_prompts`` gets transformers' 12 greedy tokens back as text; returns both workers'
    KV transfer bytes (``kv_transfer_bytes``, waiting for ``expected_bytes``)."""
    prompts = window_prompts()
    want = reference_tokens(model_path, prompts, 12)
    spec = ClusterSpec(model=model_path, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       prefill_tensor_parallel_size=prefill_tp,
                       worker_args=["--remote-prefill-threshold", "8", "--block-size", str(BLOCK),
                                    "--no-prefix-caching", "--max-num-batched-tokens", "16"])
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
        model = api.models.list().data[0].id
        tok = AutoTokenizer.from_pretrained(model_path)
        for p, tokens in zip(prompts, want):
            choice = api.completions.create(model=model, prompt=p, max_tokens=12, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0]
            assert choice.text == tok.decode(tokens, skip_special_tokens=True)
        return kv_transfer_bytes(cluster, expected_bytes)


def kv_transfer_bytes(cluster, expected: float, timeout_s: float = 15.0) -> dict[str, float]:
    """``pdserve:kv_transfer_bytes_total`` of the prefill and of the decode workers as the router's /metrics
    shows them: polled until both equal ``expected`` (the workers' figures come with their heartbeats, each
    on its own clock) or ``timeout_s`` passes, then the last reading."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        moved = {role: sum(float(v) for labels, v in re.findall(
            r'^pdserve:kv_transfer_bytes_total\{([^}]*)\} (\S+)', metrics, re.M) if role in labels)
            for role in ("prefill", "decode")}
        if moved["decode"] == moved["prefill"] == expected or time.monotonic() > deadline:
            return moved
        time.sleep(0.2)


def step_to_the_end(core, prompts: list[list[int]], max_tokens: int, after_step) -> list[list[int]]:
    """Greedy requests for ``prompts`` stepped through ``core`` until all finish; ``after_step(request)`` runs for
    each running request after every step. Returns each prompt's tokens, and checks every block came back."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(f"r{i}", p, params)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    while core.has_unfinished():
        for out in core.step()[1]:
            tokens[out.request.request_id].extend(out.new_token_ids)
        for r in core.scheduler.running:
            after_step(r)
    assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def live_blocks_needed(next_position: int, num_tokens: int) -> int:
    """Blocks from the first one a query at ``next_position`` reads up to the one holding token ``num_tokens - 1``."""
    return -(-num_tokens // BLOCK) - max(0, next_position - WINDOW + 1) // BLOCK
