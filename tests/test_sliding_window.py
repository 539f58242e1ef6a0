"""Sliding-window attention frees the KV blocks that leave the window (KVCacheManager).

A Mistral checkpoint written here by transformers, every layer attending to the last 10
positions, with 4-token blocks: a request holds only the blocks its next query can read, its
tokens stay transformers' own, prefix hits and forked samples stay exact, every block comes
back, and a disaggregated prefill ships only the live blocks.
"""

from __future__ import annotations


import pytest
from transformers import MistralConfig

from pdserve import LLM, SamplingParams
from pdserve.engine.scheduling.kv_cache_manager import NULL_BLOCK
from tests.checkpoints import write_checkpoint
from tests.helpers.sliding_window import BLOCK, PROMPT_LENGTHS, WINDOW, live_blocks_needed, reference_tokens, serve_disaggregated, kv_transfer_bytes, step_to_the_end, window_prompts  # noqa: F401


@pytest.fixture(scope="module")
def window_model(model_dir, tmp_path_factory) -> str:
    config = MistralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=2, vocab_size=2048, max_position_embeddings=512, sliding_window=WINDOW,
                           initializer_range=0.1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return write_checkpoint(config, tmp_path_factory.mktemp("mistral_window"), model_dir)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_blocks_outside_the_window_are_freed_and_tokens_stay_exact(window_model, enforce_eager):
    """Chunked prefill (16-token steps) and decoding: after every step each request holds exactly the blocks
    from its window's first one on (the rest are NULL_BLOCK), the tokens are transformers', and every block
    is free at the end. The compiled decode step reads the same tables."""
    prompts = window_prompts()
    want = reference_tokens(window_model, prompts, 30)
    llm = LLM(window_model, block_size=BLOCK, max_num_batched_tokens=16, enable_prefix_caching=False,
              enforce_eager=enforce_eager)
    peak = 0

    def check(r) -> None:
        nonlocal peak
        live = [b for b in r.block_table if b != NULL_BLOCK]
        assert len(live) == live_blocks_needed(r.num_computed_tokens, len(r.block_table) * BLOCK)
        assert all(b == NULL_BLOCK for b in r.block_table[:len(r.block_table) - len(live)])
        peak = max(peak, len(live))

    try:
        assert llm.core.scheduler.kv.sliding_window == WINDOW
        tokens = step_to_the_end(llm.core, prompts, 30, check)
    finally:
        llm.close()
    assert tokens == want
    # the longest request reached 100 tokens (25 blocks); it never held more than a window and a chunk
    assert peak <= -(-(WINDOW + 16) // BLOCK) + 1


def test_prefix_hits_forks_and_preemption_with_a_window(window_model):
    """Prefix caching across requests (the first prompt's blocks, freed as the window moved, stay findable),
    n=2 samples forking from a prompt whose head already left the window, and then a budget of 12 blocks
    that preempts: transformers' tokens throughout, and every block back."""
    prompts = window_prompts()
    want = reference_tokens(window_model, prompts, 20)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    llm = LLM(window_model, block_size=BLOCK, max_num_batched_tokens=16, enable_prefix_caching=True)
    try:
        first = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert again[2].num_cached_tokens >= 64, "the repeated prompt was meant to hit the prefix cache"
        two = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=20, n=2, temperature=0.0,
                                                                               ignore_eos=True), use_tqdm=False)
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks
    finally:
        llm.close()
    assert first[0].outputs[0].token_ids == want[2]
    assert [o.outputs[0].token_ids for o in again] == want
    assert [c.token_ids for c in two[0].outputs] == [want[0], want[0]]
    llm = LLM(window_model, block_size=BLOCK, max_num_batched_tokens=16, enable_prefix_caching=True,
              kv_cache_memory=12 * 2 * 2 * BLOCK * 2 * 16 * 4)  # 12 blocks: layers x K/V x slots x heads x dim x 4 B
    try:
        assert llm.core.block_manager.num_blocks == 12
        small = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.core.scheduler.num_preemptions > 0, "12 blocks were meant to force preemption"
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in small] == want


def test_tensor_parallel_ranks_share_the_freed_tables(window_model):
    """TP 2: the driver's tables, NULL_BLOCK entries included, reach the other rank; transformers' tokens."""
    prompts = window_prompts()
    want = reference_tokens(window_model, prompts, 12)
    with LLM(window_model, block_size=BLOCK, max_num_batched_tokens=16, tensor_parallel_size=2,
             kv_cache_memory="2MiB") as llm:
        assert llm.core.scheduler.kv.sliding_window == WINDOW
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False)
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks
    assert [o.outputs[0].token_ids for o in outs] == want


@pytest.mark.cluster
def test_disaggregated_prefill_ships_only_the_window(window_model, tmp_path):
    """1P+1D: the decode worker reserves, and the prefill worker sends, only the blocks the first decode
    query reads; the tokens are transformers'. Checked through the decode worker's received KV bytes."""
    block_bytes = 2 * 2 * BLOCK * 2 * 16 * 4  # layers x K/V x slots x KV heads x head dim x float32
    live = sum(live_blocks_needed(n, n) for n in PROMPT_LENGTHS)
    moved = serve_disaggregated(window_model, tmp_path, live * block_bytes)
    # both sides moved exactly the live blocks (the whole prompts would be 12 + 4 + 18 = 34 blocks)
    assert moved == {"prefill": live * block_bytes, "decode": live * block_bytes}


def test_speculative_decoding_with_a_window(window_model):
    """n-gram drafts over a repetitive prompt: rejected drafts roll ``num_computed_tokens`` back, and the
    window then frees from the verified position only; transformers' tokens. A draft model (it reads the
    whole context through the same block tables) turns the freeing off."""
    prompt = [11, 12, 13, 14, 15] * 12
    [want] = reference_tokens(window_model, [prompt], 24)
    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}'
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(window_model, block_size=BLOCK, speculative_config=ngram) as llm:
        assert llm.core.scheduler.kv.sliding_window == WINDOW
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert llm.core.scheduler.stats.spec_decode_num_draft_tokens > 0
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks
    assert out.outputs[0].token_ids == want
    draft = f'{{"method": "draft_model", "model": "{window_model}", "num_speculative_tokens": 2}}'
    with LLM(window_model, block_size=BLOCK, speculative_config=draft) as llm:
        assert llm.core.scheduler.kv.sliding_window is None
        [out] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert out.outputs[0].token_ids == want
