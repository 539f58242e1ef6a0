"""The offline LLM's shared fixtures: prompts and transformers' greedy tokens for them."""

from __future__ import annotations

import pytest
import torch

from pdserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree".split()


@pytest.fixture(scope="module")
def prompts():
    """Six prompts of 1 to ~115 tokens (the longest takes four 32-token prefill chunks)."""
    return [" ".join(WORDS[i % len(WORDS)] for i in range(k)) for k in (1, 3, 7, 15, 30, 45)]


@pytest.fixture(scope="module")
def hf_greedy(model_dir, prompts):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = []
    for prompt in prompts:
        ids = torch.tensor([tokenizer.encode(prompt)])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY.max_tokens,
                              do_sample=False, pad_token_id=2)
        expected.append(out[0, ids.shape[1]:].tolist())
    return expected


def assert_all_blocks_free(llm: LLM) -> None:
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert not llm.scheduler.has_unfinished()


def token_ids(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]
