"""KV cache groups: models that mix sliding-window and full-attention layers free the sliding
layers' blocks (pdserve.common.kv_cache_groups, vLLM's hybrid KV cache manager).

Gemma 3 and gpt-oss checkpoints written here by transformers, with 4-token blocks and a
10-token window: the full-attention layers' table holds every block, each sliding group's only
the blocks its next query reads; the tokens stay transformers' own through chunked prefill,
the compiled decode step, prefix hits, forks and preemption; every block comes back; and a
disaggregated prefill ships each layer only the blocks its group keeps.
"""

from __future__ import annotations

import pytest
import torch._dynamo.utils
from transformers import Gemma3TextConfig, GptOssConfig

from pdserve import LLM, SamplingParams
from pdserve.common.kv_cache_groups import KVCacheGroups
from pdserve.engine.scheduling.kv_cache_manager import NULL_BLOCK
from tests.checkpoints import write_checkpoint
from tests.helpers.sliding_window import BLOCK, PROMPT_LENGTHS, WINDOW, live_blocks_needed, reference_tokens, serve_disaggregated, step_to_the_end, window_prompts

COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              vocab_size=2048, max_position_embeddings=512, initializer_range=0.1, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, sliding_window=WINDOW, tie_word_embeddings=False)
S, F = "sliding_attention", "full_attention"
GEMMA_LAYERS = [S, S, F, S, S, F]  # 4 sliding, 2 full: groups of 2 layers, 1 full group and 2 sliding ones
LAYER_BLOCK_BYTES = 2 * BLOCK * 2 * 16 * 4  # K/V x slots x KV heads x head dim x float32: one layer's block


@pytest.fixture(scope="module")
def gemma3_model(model_dir, tmp_path_factory) -> str:
    config = Gemma3TextConfig(**COMMON, num_hidden_layers=len(GEMMA_LAYERS), query_pre_attn_scalar=16,
                              layer_types=GEMMA_LAYERS)
    return write_checkpoint(config, tmp_path_factory.mktemp("gemma3_groups"), model_dir)


@pytest.fixture(scope="module")
def gpt_oss_model(model_dir, tmp_path_factory) -> str:
    config = GptOssConfig(**{**COMMON, "intermediate_size": 32}, num_hidden_layers=4, num_local_experts=4,
                          num_experts_per_tok=2)  # layers alternate sliding, full: two groups of 2
    return write_checkpoint(config, tmp_path_factory.mktemp("gpt_oss_groups"), model_dir)


def test_layers_are_cut_into_equal_groups_of_one_kind():
    """Gemma 3 1B's 26 layers (every sixth one full) make groups of its 4 full layers: 1 full group and 6
    sliding ones, the last with 2 padding positions; gpt-oss's alternation makes two groups of half the
    layers; a model of one kind keeps one group, each layer its own position."""
    gemma = [None if (i + 1) % 6 == 0 else 512 for i in range(26)]
    groups = KVCacheGroups.hybrid(gemma)
    assert groups.num_cache_layers == 4
    assert groups.windows == (None,) + (512,) * 6
    assert [groups.layer_groups[i] for i in (5, 11, 17, 23)] == [0, 0, 0, 0]
    assert [groups.layer_slots[i] for i in (5, 11, 17, 23)] == [0, 1, 2, 3]
    sliding = [i for i in range(26) if gemma[i] is not None]
    assert [(groups.layer_groups[i], groups.layer_slots[i]) for i in sliding[:5]] == \
        [(1, 0), (1, 1), (1, 2), (1, 3), (2, 0)]
    assert groups.group_layers(6) == sliding[20:]  # the last group: 2 layers, positions 2 and 3 unused
    positions = {(groups.layer_groups[i], groups.layer_slots[i]) for i in range(26)}
    assert len(positions) == 26  # no two layers share a group's position
    oss = KVCacheGroups.hybrid([128, None] * 12)
    assert (oss.windows, oss.num_cache_layers) == ((None, 128), 12)
    assert oss.group_layers(0) == list(range(1, 24, 2))
    one = KVCacheGroups.single(4, 128)
    assert (one.windows, one.layer_slots, one.is_single) == ((128,), (0, 1, 2, 3), True)


def _check_tables(core, request) -> None:
    """The full group (0) holds every block of the request; each sliding group exactly its window's."""
    tables = request.block_tables
    assert len(tables) == core.scheduler.kv.num_groups
    for g, (table, window) in enumerate(zip(tables, core.scheduler.kv.windows)):
        assert len(table) == len(tables[0])
        live = [b for b in table if b != NULL_BLOCK]
        if window is None:
            assert len(live) == len(table)
        else:
            assert len(live) == live_blocks_needed(request.num_computed_tokens, len(table) * BLOCK)
            assert all(b == NULL_BLOCK for b in table[:len(table) - len(live)])


@pytest.mark.parametrize("family,enforce_eager", [("gemma3", True), ("gemma3", False), ("gpt_oss", False)])
def test_each_group_holds_its_blocks_and_tokens_stay_exact(family, enforce_eager, gemma3_model, gpt_oss_model):
    """Chunked prefill (16-token steps) and decoding: after every step the full-attention group holds every
    block and each sliding group only its window's (checked per group), the tokens are transformers', and
    every block is free at the end. The compiled decode step reads the same per-group tables."""
    path = gemma3_model if family == "gemma3" else gpt_oss_model
    prompts = window_prompts()
    want = reference_tokens(path, prompts, 30)
    llm = LLM(path, block_size=BLOCK, max_num_batched_tokens=16, enable_prefix_caching=False,
              enforce_eager=enforce_eager)
    peak = 0

    def check(r) -> None:
        nonlocal peak
        _check_tables(llm.core, r)
        peak = max(peak, sum(b != NULL_BLOCK for b in r.block_tables[1]))

    try:
        core = llm.core
        assert core.scheduler.kv.windows == ((None, WINDOW, WINDOW) if family == "gemma3" else (None, WINDOW))
        assert (core.runner._compiled_decode is None) == enforce_eager
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        tokens = step_to_the_end(core, prompts, 30, check)
        # no step recompiled (the warm-up's tables once had a width equal to the number of groups, which
        # dynamo tied into one size: every wider real step compiled a graph of its own, seconds each)
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs
    finally:
        llm.close()
    assert tokens == want
    # the longest request reached 100 tokens (25 blocks); its sliding groups never held more than a window
    # and a chunk
    assert peak <= -(-(WINDOW + 16) // BLOCK) + 1


def test_prefix_hits_forks_and_preemption_across_groups(gemma3_model):
    """A repeated prompt hits the prefix cache in every group (the full group's blocks from the start, the
    sliding groups' inside the window, though the sliding blocks before it were freed long ago); n=2
    samples fork every group's table; a cache too small for three requests preempts. Transformers' tokens
    throughout, and every block back."""
    prompts = window_prompts()
    want = reference_tokens(gemma3_model, prompts, 20)
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    with LLM(gemma3_model, block_size=BLOCK, max_num_batched_tokens=16, enable_prefix_caching=True) as llm:
        first = llm.generate([{"prompt_token_ids": prompts[2]}], params, use_tqdm=False)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert again[2].num_cached_tokens >= 64, "the repeated prompt was meant to hit the prefix cache"
        two = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=20, n=2, temperature=0.0,
                                                                               ignore_eos=True), use_tqdm=False)
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks
    assert first[0].outputs[0].token_ids == want[2]
    assert [o.outputs[0].token_ids for o in again] == want
    assert [c.token_ids for c in two[0].outputs] == [want[0], want[0]]
    # 40 blocks of one group (2 layers each): the 90-token request alone needs 23 full + 2 x 7 sliding ones
    with LLM(gemma3_model, block_size=BLOCK, max_num_batched_tokens=16, enable_prefix_caching=True,
             kv_cache_memory=40 * 2 * LAYER_BLOCK_BYTES) as llm:
        assert llm.core.block_manager.num_blocks == 40
        small = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.core.scheduler.num_preemptions > 0, "40 blocks were meant to force preemption"
        assert llm.core.block_manager.num_free_blocks == llm.core.block_manager.num_blocks
    assert [o.outputs[0].token_ids for o in small] == want


@pytest.mark.cluster
def test_disaggregated_prefill_ships_each_layer_its_groups_blocks(gemma3_model, tmp_path):
    """1P+1D, the prefill worker TP 2 and the decode worker TP 1: the decode worker reserves, and the
    prefill ranks send, every block for the full-attention layers and only the window's for the sliding
    ones; the tokens are transformers'. Checked through both workers' KV transfer bytes."""
    full_layers, sliding_layers = GEMMA_LAYERS.count(F), GEMMA_LAYERS.count(S)
    layer_blocks = sum(full_layers * -(-n // BLOCK) + sliding_layers * live_blocks_needed(n, n)
                       for n in PROMPT_LENGTHS)
    moved = serve_disaggregated(gemma3_model, tmp_path, layer_blocks * LAYER_BLOCK_BYTES, prefill_tp=2)
    assert layer_blocks < len(GEMMA_LAYERS) * sum(-(-n // BLOCK) for n in PROMPT_LENGTHS)
    assert moved == {"prefill": layer_blocks * LAYER_BLOCK_BYTES, "decode": layer_blocks * LAYER_BLOCK_BYTES}


def _one_table_every_block(request) -> None:
    assert NULL_BLOCK not in request.block_table and len(request.block_tables) == 1


def test_disabling_the_hybrid_manager_keeps_every_block_in_one_table(gemma3_model):
    """``--disable-hybrid-kv-cache-manager`` (vLLM's flag): one block table for every layer, every block kept
    (the windows only mask), the same tokens."""
    prompts = window_prompts()
    want = reference_tokens(gemma3_model, prompts, 12)
    with LLM(gemma3_model, block_size=BLOCK, max_num_batched_tokens=16, disable_hybrid_kv_cache_manager=True) as llm:
        core = llm.core
        assert (core.scheduler.kv.num_groups, core.scheduler.kv.frees_blocks) == (1, False)
        assert core.runner.kv_cache.shape[0] == len(GEMMA_LAYERS)  # one position per layer
        tokens = step_to_the_end(core, prompts, 12, _one_table_every_block)
    assert tokens == want
