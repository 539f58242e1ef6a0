"""The host-memory offload tier (issue 39, ``--kv-offload-memory``): evicted prefix blocks are copied out
and a later prefix hit there is copied back instead of recomputed, token-exact with transformers."""

from __future__ import annotations

import pytest

from pdserve import LLM
from pdserve.common import faults
from pdserve.common.protocol import SamplingParams, TierOpKind, WorkerStats
from pdserve.engine.scheduling.block_manager import ROOT_HASH, BlockManager, chain_hash
from pdserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pdserve.engine.scheduling.kv_offload import OffloadTier
from tests.helpers.reference import (  # noqa: F401
    GREEDY,
    assert_all_blocks_free,
    hf_greedy,
    prompts,
    token_ids,
)
from tests.helpers.scheduling import compute_prompt, make_request

BS = 4


def test_offload_tier_lru_and_pins():
    tier = OffloadTier(2)
    a, b, c = b"a" * 32, b"b" * 32, b"c" * 32
    assert tier.put(a, (1,)) == (0, None, ()) and tier.put(b, (2,)) == (1, None, ())
    assert tier.put(a, (1,)) is None  # already there: touched, b is now the least recently used
    assert tier.lookup(b, (9,)) is None  # other tokens under the same key: no hit
    tier.pin(1)
    assert tier.put(c, (3,)) == (0, a, (1,))  # b is pinned: a goes
    tier.pin(0)
    assert tier.put(a, (1,)) is None  # every slot pinned
    tier.unpin_all()
    assert tier.lookup(b, (2,)) == 1 and len(tier) == 2
    with pytest.raises(ValueError):
        tier.adopt(b"d" * 32, (4,), 1)  # taken
    with pytest.raises(ValueError):
        OffloadTier(0)


def test_evicted_blocks_go_to_the_tier_and_come_back_in_order():
    bm = BlockManager(6, BS, salt=2, offload=OffloadTier(8))
    kv = KVCacheManager(bm)
    bm.enable_kv_events()
    first = make_request("a", list(range(17)))  # 4 full blocks + 1
    assert compute_prompt(kv, first) == 0
    kv.free(first)
    assert not bm.take_tier_copies()
    other = make_request("b", list(range(100, 123)))  # 6 blocks: evicts all of a's cached blocks
    compute_prompt(kv, other)
    ops = bm.take_tier_copies()
    assert [op.kind for op in ops] == [TierOpKind.OFFLOAD] * 4 and len(bm.offload) == 4
    kv.free(other)
    bm.take_kv_events()
    again = make_request("c", list(range(17)) + [5, 6])
    assert compute_prompt(kv, again) == 16  # the four blocks, from the tier
    ops = bm.take_tier_copies()
    offloads = [(op.src, op.dst) for op in ops if op.kind == TierOpKind.OFFLOAD]
    onloads = [(op.src, op.dst) for op in ops if op.kind == TierOpKind.ONLOAD]
    # b's evicted blocks were offloaded to make room (queued first: they were evicted by the allocation),
    # never into a slot being read back; the copies back come after
    assert len(onloads) == 4 and offloads and ops[-4:] == [op for op in ops if op.kind == TierOpKind.ONLOAD]
    assert not {slot for slot, _ in onloads} & {slot for _, slot in offloads}
    assert [block for _, block in onloads] == again.block_tables[0][:4]
    # the blocks are in the prefix cache again, under the same chain
    h0 = chain_hash(ROOT_HASH, range(4), 2)
    assert again.block_hashes[0] == h0 and bm.cached_block(h0, (0, 1, 2, 3)) == again.block_tables[0][0]
    events = bm.take_kv_events()
    assert {e[-1] for e in events} == {"device", "host"}
    assert bm.num_onloaded == 4 and bm.num_offloaded == 8


def test_a_tier_measured_slower_than_recomputing_is_recomputed():
    """A hit is loaded only while the worker's measured load speed beats its measured prefill speed."""
    bm = BlockManager(6, BS, salt=2, offload=OffloadTier(8))
    kv = KVCacheManager(bm)
    costs = bm.tier_costs
    assert costs.worth_loading("host") and costs.recompute_s() is None  # nothing measured: a hit loads

    def run(name: str, tokens: list[int]) -> int:
        request = make_request(name, tokens)
        cached = compute_prompt(kv, request)
        kv.free(request)
        return cached

    def evict_then_ask(name: str, base: int) -> int:
        run(f"evict-{name}", list(range(base, base + 23)))  # 6 fresh blocks: the first prompt's go to the tier
        bm.take_tier_copies()
        return run(name, list(range(17)) + [5, 6])

    run("a", list(range(17)))
    costs.observe_prefill(1000, 1.0)  # 1 ms a token: 4 ms a block
    costs.observe_load("host", 10, 0.1)  # 10 ms a block
    assert costs.recompute_s() == pytest.approx(0.004) and not costs.worth_loading("host")
    assert evict_then_ask("b", 100) == 0  # in the tier, recomputed
    assert not [op for op in bm.take_tier_copies() if op.kind == TierOpKind.ONLOAD]
    assert bm.num_declined == {"host": 1, "disk": 0} and bm.num_onloaded == 0
    costs.observe_load("host", 990, 0.0)  # now 0.1 ms a block
    assert costs.worth_loading("host")
    assert evict_then_ask("c", 200) == 16  # loaded
    assert bm.num_onloaded == 4 and bm.tier_saved_s["host"] == pytest.approx(4 * (0.004 - 0.0001))


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


def test_a_disk_hit_is_read_off_the_step_loop_while_other_requests_compute(model_dir, prompts, hf_greedy, tmp_path,
                                                                          monkeypatch):
    """A prompt whose prefix is on disk waits while its blocks are read (slowed to 0.3 s a block by the
    ``disk_read_delay_s`` fault); a request behind it computes 24 tokens meanwhile and finishes first,
    though the slow one wants a single token. Its token still matches transformers."""
    from pdserve.common.protocol import SamplingParams as Params

    llm = _disk_llm(model_dir, tmp_path)
    bm = llm.block_manager
    long_ids = llm.generate([prompts[-1]], GREEDY, use_tqdm=False)[0].prompt_token_ids
    for _ in range(2):
        _flush(llm)
    assert len(bm.disk) >= 4  # its blocks: most on disk, the last few in the host tier's 2 slots
    loaded = bm.num_loaded
    monkeypatch.setitem(faults.FAULTS, "disk_read_delay_s", 0.3)
    core = llm.core
    core.add_request("slow", long_ids, Params(max_tokens=1, temperature=0.0))
    core.add_request("other", list(range(600, 630)), Params(max_tokens=24, temperature=0.0, ignore_eos=True))
    finished, first_token = [], None
    while core.has_unfinished():
        _, outputs = core.step()
        for out in outputs:
            if out.request.request_id == "slow" and out.new_token_ids:
                first_token = out.new_token_ids[0]
            if out.finished is not None:
                finished.append(out.request.request_id)
    assert finished == ["other", "slow"]
    assert first_token == hf_greedy[-1][0]
    assert core.scheduler.requests == {} and bm.num_prefetching == 0
    assert bm.num_loaded - loaded >= 4
    assert_all_blocks_free(llm)
    llm.close()


def test_disk_writes_run_behind_the_step_and_reads_see_them_at_once(tmp_path):
    """``DiskKVStore.write`` only takes the bytes; the writer thread puts the file in place. A read before
    then gets the bytes it was given, a slot written twice ends with the second, close drains the queue."""
    import torch

    from pdserve.engine.execution.kv_disk import CorruptKVFile, DiskKVStore

    shape = (2, 2, BS, 1, 8)
    store = DiskKVStore(str(tmp_path), b"f" * 8, shape, torch.float32, capacity=4)
    blocks = [torch.randn(shape) for _ in range(3)]
    store.write(0, b"k0", (1, 2, 3, 4), blocks[0])
    store.write(1, b"k1", (5, 6, 7, 8), blocks[1])
    out = torch.empty(shape)
    store.read(1, b"k1", out)
    assert torch.equal(out, blocks[1])
    store.write(1, b"k2", (9, 9, 9, 9), blocks[2])  # the slot's block was evicted and the slot reused
    store.flush()
    assert store.num_written == 3 and store.write_seconds > 0 and not store._pending
    store.read(1, b"k2", out)  # from the file now
    assert torch.equal(out, blocks[2])
    with pytest.raises(CorruptKVFile, match="another block"):
        store.read(1, b"k1", out)
    store.write(2, b"k3", (1, 1, 1, 1), blocks[0])
    store.close()
    assert sorted(p.name for p in store.dir.glob("*.kv")) == ["0.kv", "1.kv", "2.kv"]
    again = DiskKVStore(str(tmp_path), b"f" * 8, shape, torch.float32, capacity=4)
    assert sorted((slot, key) for slot, key, _ in again.scan()) == [(0, b"k0"), (1, b"k2"), (2, b"k3")]
    again.close()


def test_every_rank_keeps_its_share_on_disk_and_a_block_comes_back_only_whole(model_dir, prompts, hf_greedy,
                                                                                 tmp_path):
    """Tensor parallel: each rank writes its KV heads' share of a block to its own directory; a restart
    finds the blocks every rank holds (a file corrupt on one rank drops that block on both) and serves
    them token-exact."""
    rank_block_bytes = 8192 // 2

    def engine():
        return LLM(model_dir, tensor_parallel_size=2, max_num_batched_tokens=32, kv_cache_memory=12 * rank_block_bytes,
                   kv_offload_memory=2 * rank_block_bytes, kv_offload_disk=f"{tmp_path}:{512 * rank_block_bytes}")

    with engine() as llm:
        for _ in range(2):
            outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
            assert token_ids(outputs) == hf_greedy
            _flush(llm)
        assert llm.block_manager.num_loaded > 0
        on_disk = len(llm.block_manager.disk)
    dirs = sorted({p.parent for p in tmp_path.rglob("*.kv")})
    assert len(dirs) == 2  # one per rank (the fingerprint names the rank)
    assert len(list(dirs[0].glob("*.kv"))) == len(list(dirs[1].glob("*.kv"))) == on_disk
    victim = sorted(dirs[1].glob("*.kv"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0xFF
    victim.write_bytes(bytes(data))
    with engine() as warm:
        assert len(warm.block_manager.disk) == on_disk - 1  # that block is on neither rank now
        assert len(list(dirs[0].glob("*.kv"))) == len(list(dirs[1].glob("*.kv"))) == on_disk - 1
        outputs = [warm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        assert token_ids(outputs) == hf_greedy
        assert warm.block_manager.num_loaded > 0


def _disk_llm(model_dir, path, **kw):
    return LLM(model_dir, max_num_batched_tokens=32, kv_cache_memory="96KiB", kv_offload_memory="16KiB",
               kv_offload_disk=f"{path}:4MiB", **kw)


def _flush(llm: LLM) -> None:
    """A prompt that takes every KV cache block: what the cache and the host tier held moves down a tier."""
    llm.generate([{"prompt_token_ids": list(range(300, 300 + 12 * 16 - 8))}], SamplingParams(max_tokens=1),
                 use_tqdm=False)


def test_the_disk_tier_serves_prefixes_across_a_restart_and_never_a_bad_file(model_dir, prompts, hf_greedy, tmp_path):
    """A KV cache and a host tier too small to keep the prompts: the host tier's evictions are written to
    disk and read back on the second pass; a new engine on the same directory (a restart) finds them, a
    corrupt file is skipped and its block recomputed, and every token matches transformers."""
    llm = _disk_llm(model_dir, tmp_path)
    bm = llm.block_manager
    assert bm.num_blocks == 12 and bm.offload.capacity == 2 and bm.disk.capacity == 512
    for _ in range(2):
        outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        assert token_ids(outputs) == hf_greedy
        _flush(llm)
    assert bm.num_spilled > 0 and bm.num_loaded > 0 and outputs[-1].num_cached_tokens >= 32
    assert_all_blocks_free(llm)
    on_disk = len(bm.disk)
    llm.core.runner.disk_store.flush()  # the writer thread's files are all in place
    files = sorted(p for p in tmp_path.rglob("*.kv"))
    assert len(files) == on_disk
    llm.close()

    # warm restart: the index is rebuilt from the files; the long prompt is served from disk at once
    warm = _disk_llm(model_dir, tmp_path)
    assert len(warm.block_manager.disk) == on_disk
    out = warm.generate([prompts[-1]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy[-1] and out.num_cached_tokens >= 32
    assert warm.block_manager.num_loaded > 0
    warm.close()

    # a truncated file and a flipped byte: both skipped (removed) at start, their blocks recomputed
    files = sorted(p for p in tmp_path.rglob("*.kv"))
    files[0].write_bytes(files[0].read_bytes()[:-100])
    data = bytearray(files[1].read_bytes())
    data[-1] ^= 0xFF
    files[1].write_bytes(bytes(data))
    checked = _disk_llm(model_dir, tmp_path)
    assert len(checked.block_manager.disk) == len(files) - 2 and not files[0].exists() and not files[1].exists()
    outputs = [checked.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert token_ids(outputs) == hf_greedy
    checked.close()

    # two engines at once on one path (pdserve up gives every worker the same flags): one directory each
    first, second = _disk_llm(model_dir, tmp_path), _disk_llm(model_dir, tmp_path)
    assert first.core.runner.disk_store.dir != second.core.runner.disk_store.dir
    assert len(first.block_manager.disk) > 0 and len(second.block_manager.disk) == 0
    first.close()
    second.close()

    # a checkpoint replaced in place (its weight file's modification time moves) never reads them either
    import os
    import pathlib

    weights = next(pathlib.Path(model_dir).glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    try:
        replaced = _disk_llm(model_dir, tmp_path)
        assert len(replaced.block_manager.disk) == 0
        replaced.close()
    finally:
        os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))

    # another model (here: the same weights in bfloat16) never reads these files
    other = _disk_llm(model_dir, tmp_path, dtype="bfloat16")
    assert len(other.block_manager.disk) == 0
    other.close()
    with pytest.raises(ValueError, match="needs --kv-offload-memory"):
        LLM(model_dir, kv_offload_disk=f"{tmp_path}:1MiB")


def test_a_slow_disk_is_measured_and_its_hits_recomputed_token_exact(model_dir, prompts, hf_greedy, tmp_path,
                                                                      monkeypatch):
    """A disk that takes 50 ms a block (an injected delay in the real read path): the first hits there
    are read and timed, then recomputed, every token still matching transformers; the worker's
    figures say so."""
    monkeypatch.setitem(faults.FAULTS, "disk_read_delay_s", 0.05)
    llm = _disk_llm(model_dir, tmp_path)
    bm = llm.block_manager
    passes = 0
    while bm.num_declined["disk"] == 0 and passes < 4:
        outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
        assert token_ids(outputs) == hf_greedy
        _flush(llm)
        passes += 1
    assert bm.num_loaded >= 8 and not bm.tier_costs.worth_loading("disk")
    assert bm.tier_costs.load_s("disk") > 0.05 > bm.tier_costs.recompute_s()
    loaded = bm.num_loaded
    outputs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    assert token_ids(outputs) == hf_greedy and bm.num_loaded == loaded  # recomputed, not read
    stats = llm.core.stats(WorkerStats())
    assert stats.kv_disk_recomputed_hits == bm.num_declined["disk"] > 0
    assert stats.kv_disk_read_seconds >= 0.05 * loaded and stats.kv_disk_saved_seconds == 0.0
    assert stats.kv_block_bytes == llm.core.runner.block_bytes > 0
    assert_all_blocks_free(llm)
    llm.close()


_KILLED_WORKER = """
import random, sys
from pdserve import LLM, SamplingParams
llm = LLM(sys.argv[1], max_num_batched_tokens=32, kv_cache_memory="96KiB", kv_offload_memory="16KiB",
          kv_offload_disk=sys.argv[2] + ":4MiB")
llm.generate([sys.argv[3]], SamplingParams(max_tokens=24, temperature=0.0), use_tqdm=False)
llm.generate([{"prompt_token_ids": list(range(300, 484))}], SamplingParams(max_tokens=1), use_tqdm=False)
rng = random.Random(0)
for i in range(3):  # fresh prompts: every tier cycles, the first prompt's blocks reach the disk
    llm.generate([{"prompt_token_ids": [rng.randrange(300, 2000) for _ in range(184)]}], SamplingParams(max_tokens=1),
                 use_tqdm=False)
print("ready", flush=True)
while True:  # still writing the disk tier when the signal comes
    llm.generate([{"prompt_token_ids": [rng.randrange(300, 2000) for _ in range(184)]}], SamplingParams(max_tokens=8),
                 use_tqdm=False)
"""


def test_a_worker_killed_with_sigkill_leaves_a_disk_tier_the_next_one_serves(model_dir, prompts, hf_greedy, tmp_path):
    """SIGKILL while the engine keeps writing its disk tier: the next engine on the directory finds whole
    files only (written beside, renamed into place) and serves the prompt from them, token-exact."""
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WORKER, model_dir, str(tmp_path), prompts[-1]],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    warm = _disk_llm(model_dir, tmp_path)
    assert len(warm.block_manager.disk) > 0 and not list(tmp_path.rglob("*.tmp"))
    out = warm.generate([prompts[-1]], GREEDY, use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy[-1] and out.num_cached_tokens >= 32
    warm.close()
