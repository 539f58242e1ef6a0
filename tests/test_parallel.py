"""Tensor and pipeline parallelism with real rank processes (gloo on CPU), against transformers."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from pdserve import LLM
from pdserve.common.utils import free_port
from pdserve.common.sharding import (KVLayoutSpec, KVSlice, kv_head_layout, rank_slice, stage_layer_range,
                                     transfer_pieces)
from pdserve.engine.config import ParallelConfig
from tests.helpers.reference import GREEDY, assert_all_blocks_free, hf_greedy, prompts, token_ids  # noqa: F401 (fixtures)

# Tiny preset: 2 layers, 2 KV heads of 16 dims, float32: 8 KiB per 16-token block on one rank.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4


def test_stage_layer_range_is_contiguous_and_covers_every_layer():
    assert [stage_layer_range(7, 3, s) for s in range(3)] == [(0, 2), (2, 4), (4, 7)]
    assert [stage_layer_range(2, 2, s) for s in range(2)] == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="cannot be split"):
        stage_layer_range(2, 3, 0)


def test_kv_head_layout_splits_or_replicates():
    assert kv_head_layout(8, 2) == (4, 1)
    assert kv_head_layout(2, 2) == (1, 1)
    assert kv_head_layout(2, 4) == (1, 2)  # each head held by two ranks
    with pytest.raises(ValueError):
        kv_head_layout(3, 2)
    with pytest.raises(ValueError):
        kv_head_layout(2, 3)


@pytest.mark.parametrize("prefill,decode", [((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (1, 1)), ((2, 2), (4, 1)),
                                            ((4, 1), (1, 2)), ((1, 3), (2, 2)), ((4, 2), (2, 3))])
@pytest.mark.parametrize("num_layers,num_kv_heads", [(12, 4), (6, 2)])
def test_transfer_pieces_give_each_decode_rank_exactly_its_slice_once(prefill, decode, num_layers, num_kv_heads):
    p = KVLayoutSpec(*prefill, num_layers, num_kv_heads)
    d = KVLayoutSpec(*decode, num_layers, num_kv_heads)
    pieces = transfer_pieces(p, d)
    for rank in range(d.world_size):
        want = rank_slice(d, rank)
        got = [(layer, head) for piece in pieces if piece.decode_rank == rank
               for layer in range(piece.slice.layer_start, piece.slice.layer_end)
               for head in range(piece.slice.head_start, piece.slice.head_end)]
        assert sorted(got) == [(layer, head) for layer in range(want.layer_start, want.layer_end)
                               for head in range(want.head_start, want.head_end)]  # all of it, once
    for piece in pieces:  # a sender only sends what it holds
        assert piece.slice.intersect(rank_slice(p, piece.prefill_rank)) == piece.slice


def test_copied_kv_heads_are_sent_by_one_rank_only():
    p = KVLayoutSpec(tensor_parallel_size=4, pipeline_parallel_size=1, num_layers=2, num_kv_heads=2)
    assert [rank_slice(p, r) for r in range(4)] == [KVSlice(0, 2, 0, 1), KVSlice(0, 2, 0, 1),
                                                     KVSlice(0, 2, 1, 2), KVSlice(0, 2, 1, 2)]
    single = KVLayoutSpec(1, 1, 2, 2)
    assert [(x.prefill_rank, x.slice) for x in transfer_pieces(p, single)] == [
        (0, KVSlice(0, 2, 0, 1)), (2, KVSlice(0, 2, 1, 2))]
    with pytest.raises(ValueError, match="disagree on the model"):
        transfer_pieces(p, KVLayoutSpec(1, 1, 3, 2))


def test_rank_coordinates():
    p = ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3)
    assert p.world_size == 6 and p.coords(0) == (0, 0) and p.coords(5) == (2, 1) and p.rank_of(1, 1) == 3
    with pytest.raises(ValueError):
        ParallelConfig(tensor_parallel_size=0)


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2), (4, 1)])
def test_greedy_matches_hf_under_chunking_prefix_caching_and_preemption(model_dir, prompts, hf_greedy, tp, pp):
    # Each rank holds 1/tp of the KV heads (at least one) and 1/pp of the layers: size the per-rank
    # budget to 10 blocks, too few for the six prompts at once, so requests get preempted.
    kv_heads_per_rank, _ = kv_head_layout(2, tp)
    rank_block_bytes = BLOCK_BYTES // 2 * kv_heads_per_rank // pp
    with LLM(model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_batched_tokens=32,
             kv_cache_memory=10 * rank_block_bytes) as llm:
        assert llm.block_manager.num_blocks == 10
        assert llm.core.runner.num_layers == 2 // pp
        first = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert token_ids(first) == hf_greedy
        assert llm.scheduler.stats.num_preemptions > 0
        again = llm.generate(prompts[-1:], GREEDY, use_tqdm=False)  # its prefix is cached by now
        assert token_ids(again) == hf_greedy[-1:] and again[0].num_cached_tokens > 0
        assert_all_blocks_free(llm)
        procs = list(llm.core._rank_procs)
        assert len(procs) == tp * pp - 1 and all(p.poll() is None for p in procs)
    assert all(p.wait(timeout=10) == 0 for p in procs)  # close() ended every rank cleanly


def test_a_killed_rank_fails_the_engine_instead_of_hanging(model_dir, prompts):
    llm = LLM(model_dir, tensor_parallel_size=2, rank_timeout_s=10)
    try:
        assert llm.generate(prompts[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        (rank1,) = llm.core._rank_procs
        os.kill(rank1.pid, signal.SIGKILL)
        rank1.wait(timeout=10)
        start = time.monotonic()
        with pytest.raises(Exception):  # gloo: the peer closed the connection
            llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        assert time.monotonic() - start < 15
    finally:
        llm.close()


def test_ranks_started_by_hand_join_a_driver_given_a_rendezvous(model_dir, prompts, hf_greedy):
    """The multi-host path: no local spawning; rank 1 is its own `pdserve rank` command."""
    port = free_port()
    rank1 = subprocess.Popen([sys.executable, "-m", "pdserve", "rank", "--model", model_dir,
                              "--tensor-parallel-size", "2", "--rank", "1", "--master-addr", "127.0.0.1",
                              "--master-port", str(port), "--kv-cache-memory", "1MiB"])
    try:
        with LLM(model_dir, tensor_parallel_size=2, master_addr="127.0.0.1", master_port=port,
                 kv_cache_memory="1MiB", max_num_batched_tokens=32) as llm:
            assert llm.core._rank_procs == []  # the driver started nobody
            assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
        assert rank1.wait(timeout=20) == 0  # told to stop by the driver
    finally:
        if rank1.poll() is None:
            rank1.kill()
