"""Every supported family through every serving mode, against transformers' greedy tokens.

For each architecture a checkpoint written by transformers itself (``tests/checkpoints.py``) is served
the ways users run it (``LLM`` and 1P+1D for every family, ``--colocated`` for one family of each layer
kind: ``CLUSTER_CASES``):

- ``llm``: the offline ``LLM`` in this process, a 32-token step budget (longer prompts are chunked);
- ``colocated``: ``pdserve up --colocated`` (router + one decode worker that prefills, chunked and mixed
  into its decode steps);
- ``1p1d``: ``pdserve up --num-prefill 1 --num-decode 1``, every prompt prefilled by the prefill worker
  (32-token budget: the longer prompts in chunks) and its KV shipped to the decode worker.

The prompts' lengths straddle the edges where the KV layout changes: the sliding window (8 tokens
here: W - 1, W, W + 1, 2W), a block (16: B - 1, B, B + 1, 2B + 1) and the step budget. Each prompt
is drawn so that transformers' top token beats the runner-up by at least ``MARGIN`` at every step, so a
rounding difference between batch shapes can neither hide nor fake a wrong token. The token ids must
be transformers' exactly.

The layer kinds each family brings: full attention (Llama, Qwen3, Phi-3, OLMo 2), one sliding window
for every layer (Mistral), interleaved sliding and full layers in KV cache groups (Gemma 3, gpt-oss),
attention sinks (gpt-oss), MoE (Qwen3-MoE, Mixtral, DeepSeek-V3, gpt-oss) and MLA (DeepSeek-V3).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig

from pdserve import LLM, SamplingParams
from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.checkpoints import COMMON, FAMILIES, write_checkpoint

MODEL_FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=8, tie_word_embeddings=False),
    **FAMILIES,
}
# Around the window (8), a block (16) and the 32-token step budget (33 and longer are chunked).
PROMPT_LENS = [5, 7, 8, 9, 15, 16, 17, 24, 31, 32, 33, 48, 70]
MAX_TOKENS = 12
MARGIN = 2e-3  # least top-1 minus top-2 logit at every reference step (float32 differences are ~1e-5)
BUDGET = "32"  # --max-num-batched-tokens everywhere


def clear_prompts(hf, lengths: list[int], max_tokens: int, seed: int = 0) -> list[tuple[list[int], list[int]]]:
    """For each length, a random prompt whose greedy continuation by ``hf`` (transformers) has a clear
    winner at every step (``MARGIN``): ``(prompt ids, reference tokens)`` each. Raises AssertionError if
    20 draws of a length find none."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        for _ in range(20):
            ids = torch.randint(3, COMMON["vocab_size"], (1, n), generator=g)
            with torch.no_grad():
                gen = hf.generate(ids, max_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                  return_dict_in_generate=True)
            top2 = torch.stack([step[0].float().topk(2).values for step in gen.logits])  # [max_tokens, 2]
            if (top2[:, 0] - top2[:, 1]).min().item() >= MARGIN:
                out.append((ids[0].tolist(), gen.sequences[0, n:].tolist()))
                break
        else:
            raise AssertionError(f"no prompt of {n} tokens has a margin of {MARGIN} at every step")
    return out


@pytest.fixture(scope="module")
def family_cases(model_dir, tmp_path_factory) -> dict[str, tuple[str, list[tuple[list[int], list[int]]]]]:
    """Per family: its checkpoint's directory and its (prompt, transformers' tokens) pairs, made on first use."""
    class Cases(dict):
        def __missing__(self, family):
            path = write_checkpoint(MODEL_FAMILIES[family](), tmp_path_factory.mktemp(family), model_dir)
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            self[family] = (path, clear_prompts(hf, PROMPT_LENS, MAX_TOKENS))
            return self[family]

    return Cases()


def _serve(url: str, model: str, cases: list[tuple[list[int], list[int]]]) -> list[list[int]]:
    """Each prompt's greedy tokens from the router (4 at a time, so prompts share steps)."""
    def one(prompt: list[int]) -> list[int]:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json={
            "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        r.raise_for_status()
        return r.json()["choices"][0]["token_ids"]

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(one, [prompt for prompt, _ in cases]))


@pytest.mark.parametrize("family", list(MODEL_FAMILIES))
def test_llm_gives_transformers_tokens_at_every_edge(family, family_cases):
    path, cases = family_cases[family]
    with LLM(path, max_num_batched_tokens=int(BUDGET), kv_cache_memory="8MiB") as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p, _ in cases],
                            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True), use_tqdm=False)
    got = {len(p): o.outputs[0].token_ids for (p, _), o in zip(cases, outs)}
    assert got == {len(p): want for p, want in cases}


# 1P+1D for every family; colocated (the decode worker's own chunked prefill, the code a 1P+1D decode worker
# runs for a local prefill too) for one family of each layer kind, to keep the suite's time: full attention
# (Llama), one window for every layer (Mistral), KV cache groups with sinks and MoE (gpt-oss), MLA (DeepSeek-V3).
CLUSTER_CASES = [(family, "1p1d") for family in MODEL_FAMILIES] + \
    [(family, "colocated") for family in ("llama", "mistral", "gpt_oss", "deepseek_v3")]


@pytest.mark.cluster
@pytest.mark.parametrize("family,mode", CLUSTER_CASES)
def test_cluster_gives_transformers_tokens_at_every_edge(family, mode, family_cases, tmp_path, monkeypatch):
    """The router's token ids (``return_token_ids``) against transformers', per prompt length. gpt-oss, the
    family this matrix was written for (its KV reached the decode worker wrong for prompts whose window
    starts in the first block), runs disaggregated on the default weight layouts (timed at load)."""
    path, cases = family_cases[family]
    if family == "gpt_oss":
        monkeypatch.delenv("PDSERVE_LINEAR_WEIGHT_FORMAT", raising=False)  # the workers inherit it
    spec = ClusterSpec(model=path, num_prefill=1 if mode == "1p1d" else 0, num_decode=1, port=free_port(),
                       threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "8MiB", "--max-num-batched-tokens", BUDGET,
                                    "--remote-prefill-threshold", "1"])
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        got = _serve(cluster.url, Path(path).name, cases)
        workers = httpx.get(f"{cluster.url}/workers", timeout=10).json()
    assert {len(p): g for (p, _), g in zip(cases, got)} == {len(p): want for p, want in cases}
    if mode == "1p1d":  # every prompt was prefilled by the prefill worker and its KV shipped
        prefill = [w for w in workers if w["role"] == "prefill"]
        assert prefill and prefill[0]["num_routed"] >= len(cases)
