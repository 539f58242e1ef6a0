"""The host-memory offload tier (issue 39, ``--kv-offload-memory``): evicted prefix blocks are copied out
and a later prefix hit there is copied back instead of recomputed, token-exact with transformers."""

from __future__ import annotations

import pytest

from pdserve import LLM
from pdserve.common.protocol import SamplingParams
from pdserve.engine.scheduling.block_manager import ROOT_HASH, BlockManager, chain_hash
from pdserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pdserve.engine.scheduling.kv_offload import OffloadTier
from pdserve.engine.scheduling.request import Request
from tests.helpers.reference import GREEDY, assert_all_blocks_free, hf_greedy, prompts, token_ids  # noqa: F401

BS = 4


def _request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4))


def _compute(kv: KVCacheManager, request: Request) -> int:
    """Admit with its prefix hit, 'compute' the rest, cache its full blocks; the tokens the hit covered."""
    hit = kv.find_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens, [], hit=hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return hit.num_blocks * BS


def test_offload_tier_lru_and_pins():
    tier = OffloadTier(2)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    assert tier.put(a, (1,)) == (0, None) and tier.put(b, (2,)) == (1, None)
    assert tier.put(a, (1,)) is None  # already there: touched, b is now the least recently used
    assert tier.lookup(b, (9,)) is None  # other tokens under the same key: no hit
    tier.pin(1)
    assert tier.put(c, (3,)) == (0, a)  # b is pinned: a goes
    tier.pin(0)
    assert tier.put(a, (1,)) is None  # every slot pinned
    tier.unpin_all()
    assert tier.lookup(b, (2,)) == 1 and len(tier) == 2
    with pytest.raises(ValueError):
        OffloadTier(0)


def test_evicted_blocks_go_to_the_tier_and_come_back_in_order():
    bm = BlockManager(6, BS, salt=2, offload=OffloadTier(8))
    kv = KVCacheManager(bm)
    bm.enable_kv_events()
    first = _request("a", list(range(17)))  # 4 full blocks + 1
    assert _compute(kv, first) == 0
    kv.free(first)
    assert bm.take_tier_copies() == ([], [])
    other = _request("b", list(range(100, 123)))  # 6 blocks: evicts all of a's cached blocks
    _compute(kv, other)
    offloads, onloads = bm.take_tier_copies()
    assert len(offloads) == 4 and onloads == [] and len(bm.offload) == 4
    kv.free(other)
    bm.take_kv_events()
    again = _request("c", list(range(17)) + [5, 6])
    assert _compute(kv, again) == 16  # the four blocks, from the tier
    offloads, onloads = bm.take_tier_copies()
    # b's evicted blocks were offloaded to make room, never into a slot being read back
    assert len(onloads) == 4 and offloads
    assert not {slot for slot, _ in onloads} & {slot for _, slot in offloads}
    assert [block for _, block in onloads] == again.block_tables[0][:4]
    # the blocks are in the prefix cache again, under the same chain
    h0 = chain_hash(ROOT_HASH, range(4), 2)
    assert again.block_hashes[0] == h0 and bm.cached_block(h0, (0, 1, 2, 3)) == again.block_tables[0][0]
    events = bm.take_kv_events()
    assert {e[-1] for e in events} == {"device", "host"}
    assert bm.num_onloaded == 4 and bm.num_offloaded == 8


def test_greedy_is_token_exact_with_prefixes_served_from_the_tier(model_dir, prompts, hf_greedy):
    """A KV cache too small to keep any earlier prompt: the second pass over the prompts finds them in
    host memory and copies them back, and every token still matches transformers."""
    llm = LLM(model_dir, max_num_batched_tokens=32, kv_cache_memory="96KiB", kv_offload_memory="1MiB")
    assert llm.block_manager.num_blocks == 12 and llm.block_manager.offload.capacity == 128
    for _ in range(2):
        outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        assert token_ids(outputs) == hf_greedy
    long_ones = [o for o, p in zip(outputs, prompts) if len(o.prompt_token_ids) > 2 * 16]
    assert long_ones and all(o.num_cached_tokens >= 32 for o in long_ones)
    assert llm.block_manager.num_onloaded > 0
    assert_all_blocks_free(llm)
    plain = LLM(model_dir, max_num_batched_tokens=32, kv_cache_memory="96KiB")
    for _ in range(2):
        outputs = [plain.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert sum(o.num_cached_tokens for o in outputs) < sum(o.num_cached_tokens for o in long_ones)


def test_every_rank_copies_its_share_of_the_tier(model_dir, prompts, hf_greedy):
    """Tensor parallel: each rank holds half the KV heads in its own tier; the copies are broadcast with
    the step, so a prefix served from the tier is still token-exact."""
    rank_block_bytes = 8192 // 2  # the tiny preset's block over its two KV heads, one per rank
    with LLM(model_dir, tensor_parallel_size=2, max_num_batched_tokens=32, kv_cache_memory=12 * rank_block_bytes,
             kv_offload_memory=128 * rank_block_bytes) as llm:
        assert llm.block_manager.num_blocks == 12 and llm.block_manager.offload.capacity == 128
        for _ in range(2):
            outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
            assert token_ids(outputs) == hf_greedy
        assert llm.block_manager.num_onloaded > 0 and outputs[-1].num_cached_tokens >= 32
        assert_all_blocks_free(llm)
