"""Scheduler behaviour with a fake model runner (no torch): budget, chunking, preemption, remote KV."""

import pytest

from pdserve.common.protocol import SamplingParams
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.outputs import ModelRunnerOutput
from pdserve.engine.scheduling.request import Request, RequestStatus
from pdserve.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from tests.helpers.scheduling import fake_step, run_to_completion  # noqa: F401


def make(num_blocks=64, block_size=4, max_num_seqs=8, budget=32, max_model_len=256):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len), bm), bm


def req(rid, prompt_len, max_tokens=4, **kw):
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_ids=frozenset({0}))


def test_decodes_batch_together_and_finish_frees_blocks():
    sched, bm = make()
    for i in range(3):
        sched.add_request(req(f"r{i}", 5, max_tokens=3))
    out, _ = fake_step(sched)
    assert [n for _, n in out.scheduled] == [5, 5, 5]  # three prefills in one step
    out, _ = fake_step(sched)
    assert [n for _, n in out.scheduled] == [1, 1, 1]  # then one batch of decodes
    done = run_to_completion(sched)
    assert all(r.num_output_tokens == 3 and r.status == RequestStatus.FINISHED_LENGTH for r in done.values())
    assert bm.num_free_blocks == bm.num_blocks


def test_token_budget_chunks_long_prompt_and_running_go_first():
    sched, _ = make(budget=8)
    sched.add_request(req("short", 3, max_tokens=10))
    fake_step(sched)  # short prefilled
    sched.add_request(req("long", 20))
    out, _ = fake_step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 1), ("long", 7)]
    out, _ = fake_step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 1), ("long", 7)]
    out, results = fake_step(sched)
    assert [(r.request_id, n) for r, n in out.scheduled] == [("short", 1), ("long", 6)]
    assert {o.request.request_id for o in results} == {"short", "long"}  # long sampled only after its last chunk


def test_long_prefill_token_threshold_lets_short_prompts_share_a_long_prompts_steps():
    """Without the cap a 60-token prompt takes each 32-token step whole and the short prompts queued
    behind it wait for its last chunk; with ``long_prefill_token_threshold=16`` (vLLM's flag) each of
    its chunks is 16 tokens and the short prompts are prefilled in its second step."""
    def first_token_steps(threshold: int) -> dict[str, int]:
        bm = BlockManager(64, 4)
        sched = Scheduler(SchedulerConfig(8, 32, 256, long_prefill_token_threshold=threshold), bm)
        sched.add_request(req("long", 60))
        out, _ = fake_step(sched)
        assert [n for _, n in out.scheduled] == [min(threshold or 32, 32)]
        chunks = [out.scheduled[0][1]]
        for rid, n in (("a", 6), ("b", 8)):  # their own tokens: no prefix hit on the long prompt's blocks
            sched.add_request(Request(rid, list(range(100, 100 + n)), SamplingParams(max_tokens=4),
                                      eos_token_ids=frozenset({0})))
        first = {}
        for step in range(2, 20):
            out, results = fake_step(sched)
            assert out.num_scheduled_tokens <= 32
            chunks += [n for r, n in out.scheduled if r.request_id == "long" and n > 1]  # its prompt's chunks
            for o in results:
                if o.new_token_ids:
                    first.setdefault(o.request.request_id, step)
            if len(first) == 3:
                break
        run_to_completion(sched)
        assert bm.num_free_blocks == bm.num_blocks
        assert chunks == ([32, 28] if not threshold else [16, 16, 28])
        return first

    assert first_token_steps(0) == {"long": 2, "a": 3, "b": 3}  # 32 + 28: the short ones wait for it
    # 16 (60 left > the budget), then 16 again beside a and b (44 left), then 28 whole (fits one step)
    assert first_token_steps(16) == {"a": 2, "b": 2, "long": 3}
    bm = BlockManager(64, 4)  # a prompt that fits one step is never split: FCFS, not processor sharing
    sched = Scheduler(SchedulerConfig(8, 32, 256, long_prefill_token_threshold=16), bm)
    sched.add_request(req("fits", 30))
    out, results = fake_step(sched)
    assert [n for _, n in out.scheduled] == [30] and results[0].new_token_ids
    sched, _ = make(budget=32)
    sched.config.long_prefill_token_threshold = 1  # a decode's one token is never cut to nothing
    sched.add_request(req("r", 3, max_tokens=3))
    assert run_to_completion(sched)["r"].num_output_tokens == 3


def test_prefill_workers_cap_a_prompts_chunk_at_half_their_budget_by_default():
    import argparse

    from pdserve.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)

    def threshold(role, *argv):
        return EngineConfig.from_cli_args(parser.parse_args(["--model", "m", *argv]), role).long_prefill_token_threshold

    assert threshold("prefill") == 256 and threshold("prefill", "--max-num-batched-tokens", "2048") == 1024
    assert threshold("decode") == 0 and threshold(None) == 0
    assert EngineConfig(model="m").long_prefill_token_threshold == 0
    assert threshold("prefill", "--long-prefill-token-threshold", "0") == 0
    with pytest.raises(ValueError, match="long_prefill_token_threshold"):
        EngineConfig(model="m", long_prefill_token_threshold=-1)


def test_whole_admission_finishes_each_prompt_in_one_step():
    """``prefill_admission="whole"`` (a prefill worker's default): two 20-token prompts under a 32-token
    budget. ``fill`` starts the second as a 12-token chunk, so both first tokens wait for step 2 (and
    the first's step grew for nothing); ``whole`` runs the first alone and the second whole in step 2.
    A short prompt that fits what is left still joins, and a long prompt's capped chunk leaves its
    remainder to the queue as before."""
    def steps(admission: str, prompts, threshold=0) -> tuple[list, dict[str, int]]:
        bm = BlockManager(64, 4)
        sched = Scheduler(SchedulerConfig(8, 32, 256, long_prefill_token_threshold=threshold,
                                          prefill_admission=admission), bm)
        for i, (rid, n) in enumerate(prompts):  # distinct tokens: no prefix hits between prompts
            sched.add_request(Request(rid, list(range(100 * (i + 1), 100 * (i + 1) + n)),
                                      SamplingParams(max_tokens=1), eos_token_ids=frozenset({0})))
        batches, first = [], {}
        for step in range(1, 20):
            if not sched.has_unfinished():
                break
            out, results = fake_step(sched)
            batches.append([(r.request_id, n) for r, n in out.scheduled])
            for o in results:
                first.setdefault(o.request.request_id, step)
        assert bm.num_free_blocks == bm.num_blocks
        return batches, first

    assert steps("fill", [("a", 20), ("b", 20)]) == ([[("a", 20), ("b", 12)], [("b", 8)]], {"a": 1, "b": 2})
    assert steps("whole", [("a", 20), ("b", 20)]) == ([[("a", 20)], [("b", 20)]], {"a": 1, "b": 2})
    # a prompt that fits what the step leaves is admitted; strict arrival order otherwise
    assert steps("whole", [("a", 20), ("s", 8), ("b", 20)])[0] == [[("a", 20), ("s", 8)], [("b", 20)]]
    # a prompt longer than a step is chunked (capped at 16): the rest of each of its steps goes to b
    batches, first = steps("whole", [("long", 60), ("b", 20)], threshold=16)
    assert batches[0] == [("long", 16), ("b", 16)] and first["b"] == 2
    with pytest.raises(ValueError, match="prefill_admission"):
        SchedulerConfig(prefill_admission="greedy")


def test_prefill_workers_admit_whole_prompts_by_default():
    import argparse

    from pdserve.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)

    def admission(role, *argv):
        return EngineConfig.from_cli_args(parser.parse_args(["--model", "m", *argv]), role).prefill_admission

    assert admission("prefill") == "whole" and admission("decode") == "fill" and admission(None) == "fill"
    assert admission("prefill", "--prefill-admission", "fill") == "fill"
    assert EngineConfig(model="m").prefill_admission == "fill"


def test_max_num_seqs_limits_admission():
    sched, _ = make(max_num_seqs=2)
    for i in range(3):
        sched.add_request(req(f"r{i}", 2))
    out, _ = fake_step(sched)
    assert len(out.scheduled) == 2 and sched.num_waiting == 1


def test_preemption_frees_newest_and_recomputes_it():
    sched, bm = make(num_blocks=6, block_size=4, budget=64)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    fake_step(sched)  # 2 blocks each
    preempted = []
    for _ in range(8):
        out, _ = fake_step(sched)
        preempted += [r.request_id for r in out.preempted]
    assert preempted and preempted[0] == "b"  # most recently admitted goes first
    run_to_completion(sched)
    assert a.num_output_tokens == 8 and b.num_output_tokens == 8
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert b.num_preemptions >= 1 and sched.num_preemptions >= 1
    assert bm.num_free_blocks == bm.num_blocks


def test_oversized_requests_are_refused_up_front():
    sched, _ = make(num_blocks=4, block_size=4, max_model_len=100)
    for bad in (req("too-long", 101), req("too-big-for-cache", 20)):
        try:
            sched.add_request(bad)
        except ValueError as e:
            assert bad.request_id in str(e)
        else:
            raise AssertionError("accepted a request that cannot fit")
    assert not sched.has_unfinished()


def test_remote_prefill_parks_request_then_decodes():
    sched, bm = make()
    r = req("r", 9, max_tokens=3)
    sched.add_request(r, remote_prefill=True)
    out = sched.schedule()
    assert out.remote_prefills == [r] and not out.scheduled
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS and len(r.block_table) == 3
    assert sched.schedule().is_empty()  # nothing to compute while the KV is in flight
    first = sched.remote_kv_arrived("r", 42)
    assert first.request is r and first.new_token_ids == [42] and first.finished is None and r.output_token_ids == [42] and r.num_computed_tokens == 9
    out, _ = fake_step(sched)
    assert out.scheduled == [(r, 1)]
    run_to_completion(sched)
    assert r.output_token_ids == [42, 7, 7] and bm.num_free_blocks == bm.num_blocks


def test_remote_failure_recomputes_locally_with_reserved_blocks():
    sched, bm = make()
    r = req("r", 6, max_tokens=2)
    sched.add_request(r, remote_prefill=True)
    sched.schedule()
    blocks = list(r.block_table)
    assert sched.recompute_locally("r")
    out, _ = fake_step(sched)
    assert out.scheduled == [(r, 6)] and r.block_table[:len(blocks)] == blocks
    run_to_completion(sched)
    assert bm.num_free_blocks == bm.num_blocks
    assert sched.remote_kv_arrived("r", 1) is None  # a late transfer is ignored


def test_abort_in_every_state_frees_blocks():
    sched, bm = make()
    sched.add_request(req("waiting", 4))
    sched.add_request(req("remote", 4), remote_prefill=True)
    sched.add_request(req("running", 4))
    sched.schedule()
    sched.add_request(req("queued", 4))
    for rid in ("waiting", "remote", "running", "queued", "unknown"):
        sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_delayed_free_keeps_a_finished_requests_blocks_until_its_sends_are_done():
    """A prefill worker's request whose KV is sent from its blocks (``delay_free_blocks``) finishes but keeps
    them, so no later request is handed them, until ``free_delayed``; freed before it finished, it frees on
    finishing as any other."""
    sched, bm = make(num_blocks=4)  # 16 slots: one 8-token prompt's blocks, then the other's
    first = req("sent", 8, max_tokens=1)
    sched.add_request(first)
    out = sched.schedule()
    first.delay_free_blocks = True  # as the prefill worker marks it once its sends are planned
    sched.update_from_output(out, ModelRunnerOutput({"sent": 7}))
    held = list(first.block_tables[0])
    assert first.status == RequestStatus.FINISHED_LENGTH and bm.num_free_blocks == 2
    second = Request("next", list(range(100, 112)), SamplingParams(max_tokens=1), eos_token_ids=frozenset({0}))
    # another prompt of three blocks: it waits while two are held
    sched.add_request(second)
    out, _ = fake_step(sched)
    assert not out.scheduled and second.status == RequestStatus.WAITING
    sched.free_delayed("sent")
    sched.free_delayed("sent")  # idempotent
    assert bm.num_free_blocks == 4
    out = sched.schedule()
    assert out.scheduled == [(second, 12)] and set(held) & set(second.block_tables[0])
    second.delay_free_blocks = True
    sched.update_from_output(out, ModelRunnerOutput({"next": 7}))
    assert bm.num_free_blocks == 1
    sched.free_delayed("next")
    assert bm.num_free_blocks == 4
    early = req("early", 4, max_tokens=2)  # released while it still runs: its finish frees
    sched.add_request(early)
    early.delay_free_blocks = True
    sched.free_delayed("early")
    run_to_completion(sched)
    assert early.status == RequestStatus.FINISHED_LENGTH and bm.num_free_blocks == 4 and not sched.delayed_frees


def test_eos_and_stop_token_and_min_tokens():
    sched, _ = make()
    sched.add_request(req("eos", 3, max_tokens=10))
    sched.add_request(req("stop-id", 3, max_tokens=10, stop_token_ids=[7]))
    sched.add_request(req("min", 3, max_tokens=10, min_tokens=2, stop_token_ids=[7]))
    out = sched.schedule()
    results = sched.update_from_output(out, ModelRunnerOutput({"eos": 0, "stop-id": 7, "min": 7}))
    status = {o.request.request_id: o.finished for o in results}
    assert status == {"eos": RequestStatus.FINISHED_STOPPED, "stop-id": RequestStatus.FINISHED_STOPPED, "min": None}


def test_shared_prefix_skips_computation_and_outputs_unchanged():
    sched, bm = make(block_size=4, budget=64)
    prefix = list(range(1, 13))  # 3 full blocks
    first = Request("first", prefix + [50, 51], SamplingParams(max_tokens=2), eos_token_ids=frozenset({0}))
    sched.add_request(first)
    run_to_completion(sched)
    second = Request("second", prefix + [60], SamplingParams(max_tokens=2), eos_token_ids=frozenset({0}))
    sched.add_request(second)
    out, _ = fake_step(sched)
    assert out.scheduled == [(second, 1)]  # 12 of 13 prompt tokens were cache hits
    assert second.num_cached_tokens == 12 and second.block_table[:3] == first_blocks(first, bm, prefix)
    assert sched.stats.prefix_cache_hits == 12 and sched.stats.prefix_cache_queries == 14 + 13
    run_to_completion(sched)
    assert bm.num_free_blocks == bm.num_blocks


def first_blocks(request, bm, prefix):
    return bm.find_cached_prefix(prefix + [0], len(prefix))[0]


def test_identical_prompt_recomputes_at_least_its_last_token():
    sched, _ = make(block_size=4, budget=64)
    for rid in ("a", "b"):
        sched.add_request(Request(rid, list(range(1, 9)), SamplingParams(max_tokens=1)))
        out, _ = fake_step(sched)
    assert out.scheduled[0][1] == 4  # 8 tokens = 2 full blocks; only the first is reused (7 token limit)


def test_parallel_samples_share_prompt_blocks_and_copy_on_write():
    sched, bm = make(block_size=4, budget=64)
    parent = Request("g", list(range(1, 7)), SamplingParams(max_tokens=3, n=3), eos_token_ids=frozenset({0}))
    sched.add_request(parent)
    fake_step(sched)  # prompt computed, sample 0's first token; samples 1, 2 fork
    children = [sched.requests["g#1"], sched.requests["g#2"]]
    assert [c.sample_index for c in children] == [1, 2] and all(c.group_id == "g" for c in children)
    assert all(c.block_table == parent.block_table[:2] for c in children)
    assert bm.ref_count(parent.block_table[1]) == 3  # the partial last prompt block is shared three ways
    out = sched.schedule()
    # every sample writes into the shared last block (position 6 or 5): each gets its own copy
    srcs = {src for src, _ in out.block_copies}
    assert len(out.block_copies) >= 2 and srcs <= {parent.block_table[1], *[c.block_table[1] for c in children]}
    tables = [parent.block_table[1]] + [c.block_table[1] for c in children]
    assert len(set(tables)) == 3  # nobody writes a block another sample reads
    assert {(r.request_id, n) for r, n in out.scheduled} == {("g", 1), ("g#1", 1), ("g#2", 1)}
    sched.update_from_output(out, ModelRunnerOutput({"g": 7, "g#1": 8, "g#2": 9}))
    run_to_completion(sched)
    assert [len(r.output_token_ids) for r in [parent, *children]] == [3, 3, 3]
    assert children[0].output_token_ids[0] == 8 and bm.num_free_blocks == bm.num_blocks


def test_abort_group_finishes_every_sample():
    sched, bm = make(block_size=4)
    sched.add_request(Request("g", list(range(1, 7)), SamplingParams(max_tokens=9, n=4)))
    fake_step(sched)
    assert len(sched.groups["g"]) == 4
    assert len(sched.finish_group("g", RequestStatus.FINISHED_ABORTED)) == 4
    assert not sched.has_unfinished() and bm.num_free_blocks == bm.num_blocks


def test_conditional_disaggregation_short_or_cached_prompts_stay_local():
    bm = BlockManager(64, 4)
    sched = Scheduler(SchedulerConfig(8, 64, 256, remote_prefill_threshold=8), bm)
    short = req("short", 7)
    sched.add_request(short, remote_prefill=True)
    long = req("long", 20)
    sched.add_request(long, remote_prefill=True)
    out = sched.schedule()
    assert out.remote_prefills == [long] and [r for r, _ in out.scheduled] == [short]
    assert sched.stats.num_local_prefills == 1
    sched.remote_kv_arrived("long", 5)
    sched.kv.cache_full_blocks(long)
    again = Request("again", long.prompt_token_ids, SamplingParams(max_tokens=2))
    sched.add_request(again, remote_prefill=True)
    out = sched.schedule()
    assert again not in out.remote_prefills and again.num_cached_tokens == 16  # fully cached: local


def test_a_prompt_is_hashed_once_for_lookup_and_caching_and_a_handed_over_hash_list_is_reused(monkeypatch):
    """``KVCacheManager.prompt_hashes``: the prefix lookup and the caching of the computed blocks read one
    list of the prompt's chained hashes; a second worker given that list (the simulator's prefill worker,
    the same prompt) hashes nothing, unless its salt differs, when it hashes with its own. The digests
    are ``block_hashes``' in every case, and a hit still finds the cached blocks."""
    from pdserve.engine.scheduling import block_manager as bm_mod
    from pdserve.engine.scheduling import kv_cache_manager as kv_mod
    calls = []
    real = bm_mod.chain_hash

    def counting(parent, tokens, salt=0):
        calls.append(tuple(tokens))
        return real(parent, tokens, salt)

    monkeypatch.setattr(bm_mod, "chain_hash", counting)
    monkeypatch.setattr(kv_mod, "chain_hash", counting)
    sched, bm = make()
    first = req("a", 22, max_tokens=3)  # five full blocks of 4, a sixth once two outputs are computed
    sched.add_request(first)
    run_to_completion(sched)
    assert len(calls) == 5 + 1  # the prompt once (lookup and caching), then the block its outputs filled
    assert first.prompt_hashes[1] == bm_mod.block_hashes(first.prompt_token_ids, 22, 4)
    calls.clear()
    second = req("b", 22, max_tokens=2)
    second.prompt_hashes = first.prompt_hashes  # handed over: the same prompt, block size, salt and root
    sched.add_request(second)
    out, _ = fake_step(sched)
    assert second.num_cached_tokens == 20 and calls == []  # its hits found by the handed-over hashes
    other = Scheduler(SchedulerConfig(8, 32, 256), BlockManager(64, 4, salt=9))
    third = req("c", 22, max_tokens=3)
    third.prompt_hashes = first.prompt_hashes  # another model's salt: not used
    other.add_request(third)
    run_to_completion(other)
    assert len(calls) == 5 + 1
    assert third.prompt_hashes[1] == bm_mod.block_hashes(third.prompt_token_ids, 22, 4, salt=9)
