"""Prompt logprobs and completions ``echo`` against transformers' log-softmax on the same checkpoint:
through ``LLM`` (chunked prefill, prefix cache warm) and through a disaggregated cluster over HTTP
(prefill worker computes them; a decode worker prefilling locally too), and an lm-evaluation-harness
style loglikelihood (echo, max_tokens 0, logprobs 1, temperature 0)."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.common.utils import free_port
from pdserve.launcher import ClusterSpec, LocalCluster

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree".split()
PROMPTS = [" ".join(WORDS[i % len(WORDS)] for i in range(k)) for k in (2, 9, 40)]  # the last: 3+ chunks of 16
ATOL = 1e-4


@pytest.fixture(scope="module")
def hf(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab]: row p is log p(. | ids[:p+1])."""
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return tok, logprobs


def check_against_hf(ids: list[int], prompt_logprobs: list, ref: torch.Tensor, k: int) -> None:
    """``prompt_logprobs`` in vLLM's shape (None, then {token_id: {logprob, rank, ...}}) against HF."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        step = {int(t): v for t, v in prompt_logprobs[p].items()}
        row = ref[p - 1]
        want = row[ids[p]].item()
        got = step[ids[p]]
        logprob = got["logprob"] if isinstance(got, dict) else got.logprob
        rank = got["rank"] if isinstance(got, dict) else got.rank
        assert logprob == pytest.approx(want, abs=ATOL)
        assert rank == int((row > want + 1e-6).sum()) + 1
        top = row.topk(k)
        for value, token_id in zip(top.values.tolist(), top.indices.tolist()):
            entry = step[token_id]
            assert (entry["logprob"] if isinstance(entry, dict) else entry.logprob) == pytest.approx(value, abs=ATOL)
        assert len(step) in (k, k + 1)


def test_llm_prompt_logprobs_match_hf_with_chunked_prefill(model_dir, hf):
    tok, ref = hf
    llm = LLM(model_dir, max_num_batched_tokens=16, kv_cache_memory="1MiB")
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)  # warm the prefix cache
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids and out.num_cached_tokens == 0  # no prefix hits for these
        check_against_hf(ids, out.prompt_logprobs, ref(ids), 3)
        assert out.prompt_logprobs[1][ids[1]].decoded_token == tok.decode([ids[1]])
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert all(o.prompt_logprobs is None for o in plain)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outputs]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
