"""KV events (issue 39): the block manager records what its prefix cache gains and loses, the worker's
publisher numbers it into batches and answers replays, and the router's KV index folds them into an
exact map of who caches what, which the ``kv_aware`` routing policy reads."""

from __future__ import annotations

import random

import pytest

from pdserve.cluster.kv_events import KVEventPublisher, to_kv_events
from pdserve.common.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Heartbeat,
    KVEventBatch,
    RegisterWorker,
    WorkerRole,
    WorkerStats,
)
from pdserve.common.transport import decode, encode
from pdserve.engine.scheduling.block_manager import ROOT_HASH, BlockManager, chain_hash
from pdserve.engine.scheduling.kv_cache_manager import KVCacheManager
from pdserve.router.kv_index import KVIndex, block_key
from pdserve.router.registry import WorkerRegistry
from pdserve.router.routing import (
    LOWER_TIER_COST,
    KVAwarePolicy,
    make_policy,
    prompt_block_hashes,
)
from tests.helpers.scheduling import compute_prompt, make_request

BS = 4


def test_block_manager_records_stored_and_removed_blocks_in_order():
    bm = BlockManager(8, BS, salt=7)
    kv = KVCacheManager(bm)
    r = make_request("a", list(range(10)))
    compute_prompt(kv, r)  # nothing recorded before events are enabled
    assert bm.take_kv_events() == []
    kv.free(r)
    bm.enable_kv_events()
    r = make_request("b", list(range(100, 110)))  # 10 tokens: 2 full blocks, 3 allocated
    compute_prompt(kv, r)
    events = bm.take_kv_events()
    h0 = chain_hash(ROOT_HASH, range(100, 104), 7)
    h1 = chain_hash(h0, range(104, 108), 7)
    assert [e[0] for e in events] == ["stored", "stored"]
    assert events[0][1:] == (h0, ROOT_HASH, (100, 101, 102, 103), "device")
    assert events[1][1:] == (h1, h0, (104, 105, 106, 107), "device")
    assert bm.take_kv_events() == []
    kv.free(r)
    # five blocks: the three never used, then "a"'s (freed before "b"'s): its two cached blocks are evicted
    r2 = make_request("c", list(range(200, 220)))
    compute_prompt(kv, r2)
    kinds = [e[0] for e in bm.take_kv_events()]
    assert kinds == ["removed", "removed"] + ["stored"] * 5
    assert sorted(k for k, _, _ in bm.cached_blocks()) == sorted(bm._cached)


def test_to_kv_events_merges_a_chain_and_a_run_of_removals():
    h = [bytes([i]) * 32 for i in range(4)]
    raw = [("stored", h[0], b"", (1, 2), "device"), ("stored", h[1], h[0], (3, 4), "device"),
           ("stored", h[3], h[2], (7, 8), "device"), ("stored", h[0], None, (1, 2), "host"),
           ("removed", h[0], "device"), ("removed", h[1], "device"), ("removed", h[2] + (1).to_bytes(2, "little"), "device")]
    events = to_kv_events(raw, 2)
    assert events == [
        BlockStored(block_hashes=[h[0], h[1]], parent_block_hash=None, token_ids=[1, 2, 3, 4], block_size=2),
        BlockStored(block_hashes=[h[3]], parent_block_hash=h[2], token_ids=[7, 8], block_size=2),
        BlockStored(block_hashes=[h[0]], token_ids=[1, 2], block_size=2, medium="host"),
        BlockRemoved(block_hashes=[h[0], h[1]]), BlockRemoved(block_hashes=[h[2]], group=1)]
    batch = KVEventBatch(worker_id="w", instance=1, seq=0, ts=0.0, events=events)
    assert decode(encode(batch)) == batch  # over the wire as it is


def test_publisher_numbers_batches_and_replays_them_or_a_snapshot():
    bm = BlockManager(64, BS, salt=1)
    kv = KVCacheManager(bm)
    pub = KVEventPublisher("w", bm, replay_batches=2)
    assert pub.poll() is None and pub.replay(0) == []
    for i in range(3):
        compute_prompt(kv, make_request(str(i), [i * 1000 + t for t in range(9)]))
        assert pub.poll().seq == i
    assert [b.seq for b in pub.replay(1)] == [1, 2]  # kept
    (snap,) = pub.replay(0)  # batch 0 is no longer kept
    assert snap.snapshot and snap.seq == 2 and isinstance(snap.events[0], AllBlocksCleared)
    assert sorted(snap.events[1].block_hashes) == sorted(bm._cached)
    assert pub.replay(3) == []
    with pytest.raises(ValueError):
        KVEventPublisher("w", bm, replay_batches=0)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def _batch(seq, events, instance=1, snapshot=False, worker="w"):
    return KVEventBatch(worker_id=worker, instance=instance, seq=seq, ts=0.0, events=events, snapshot=snapshot)


def _stored(*hashes, group=0, medium="device"):
    return BlockStored(block_hashes=list(hashes), block_size=BS, group=group, medium=medium)


def test_index_applies_in_order_asks_for_gaps_and_takes_snapshots():
    clock = Clock()
    index = KVIndex(replay_retry_s=1.0, now=clock)
    a, b, c = (bytes([i]) * 32 for i in (1, 2, 3))
    assert index.meet("w", 100) == 0  # a worker met for the first time: replay from 0
    assert index.apply(_batch(0, [_stored(a, b)])) is None
    assert index.matched_blocks("w", [a, b, c]) == 2
    assert index.apply(_batch(0, [_stored(c)])) is None  # a duplicate: ignored
    assert index.matched_blocks("w", [a, b, c]) == 2
    assert index.apply(_batch(2, [_stored(c)])) == 1  # batch 1 is missing: ask from 1
    assert index.apply(_batch(3, [])) is None  # asked already, within replay_retry_s
    clock.t = 2.0
    assert index.apply(_batch(3, [])) == 1  # asked again
    assert index.apply(_batch(1, [BlockRemoved(block_hashes=[b])])) is None
    assert index.matched_blocks("w", [a, b]) == 1
    assert index.apply(_batch(2, [_stored(c)])) is None and index.num_blocks("w") == 2
    # a snapshot replaces everything
    assert index.apply(_batch(7, [AllBlocksCleared(), _stored(b)], snapshot=True)) is None
    assert index.num_blocks("w") == 1 and index.matched_blocks("w", [b]) == 1
    assert index.apply(_batch(5, [AllBlocksCleared()], snapshot=True)) is None  # older: ignored
    assert index.num_blocks("w") == 1
    # a new process under the same id: what the old one held is gone
    assert index.apply(_batch(0, [_stored(a)], instance=2)) is None
    assert index.matched_blocks("w", [a]) == 1 and index.matched_blocks("w", [b]) == 0
    index.forget("w")
    assert index.num_entries == 0 and index.matched_blocks("w", [a]) == 0
    assert (index.num_gaps, index.num_snapshots) == (3, 1)


def test_index_tiers_groups_and_the_memory_cap():
    index = KVIndex(capacity_factor=1.0)
    a, b = bytes([1]) * 32, bytes([2]) * 32
    index.meet("w", 3)
    index.apply(_batch(0, [_stored(a, b), _stored(a, medium="disk"), _stored(a, group=1)]))
    assert index.tiers(block_key(a, 0), "w") == ("device", "disk")
    assert index.matched_blocks("w", [a, b], groups=(0, 1)) == 1  # b is cached in group 0 only
    index.apply(_batch(1, [BlockRemoved(block_hashes=[a], medium="device")]))
    assert index.tiers(block_key(a, 0), "w") == ("disk",)
    # past its cap (3 blocks) the worker's entries are out of step: dropped, a snapshot asked for
    assert index.apply(_batch(2, [_stored(*(bytes([i]) * 32 for i in range(10, 13)))])) == 0
    assert index.num_blocks("w") == 0 and index.num_overflows == 1


def test_index_matches_the_block_manager_exactly_under_random_traffic():
    """Whatever the cache does (hits, evictions, forks of shared prefixes), the index fed by the
    publisher knows exactly the blocks the block manager has cached; a router that missed batches
    catches up through a replay or a snapshot."""
    rng = random.Random(0)
    bm = BlockManager(48, BS, salt=3)
    kv = KVCacheManager(bm)
    pub = KVEventPublisher("w", bm, replay_batches=8)
    index, late = KVIndex(), KVIndex()
    late.meet("w", 48)
    live: list = []
    stems = [[rng.randrange(1000) for _ in range(12)] for _ in range(5)]
    for step in range(300):
        if live and (len(live) > 4 or rng.random() < 0.4):
            kv.free(live.pop(rng.randrange(len(live))))
        else:
            tokens = rng.choice(stems)[:rng.randrange(4, 13)] + [rng.randrange(1000) for _ in range(rng.randrange(1, 9))]
            r = make_request(str(step), tokens)
            hit = kv.find_prefix(r)
            if kv.allocate_slots(r, r.num_tokens, [], hit=hit):
                r.num_computed_tokens = r.num_tokens
                kv.cache_full_blocks(r)
                live.append(r)
        batch = pub.poll()
        if batch is not None:
            assert index.apply(decode(encode(batch))) is None
            if step % 3 == 0:  # the late router sees one batch in three; it asks, and is answered
                ask = late.apply(batch)
                if ask is not None:
                    for b in pub.replay(ask):
                        late.apply(b)
        cached = set(bm._cached)
        assert {k for k, h in index._holders.items() if "w" in h} == cached
    assert late.num_gaps > 0 and late.num_snapshots > 0
    ask = late.apply(pub.poll() or _batch(pub.seq + 1, [], instance=pub.instance))
    for b in pub.replay(ask if ask is not None else pub.seq + 1):
        late.apply(b)
    assert {k for k, h in late._holders.items() if "w" in h} == set(bm._cached)


def _registry(*workers) -> WorkerRegistry:
    registry = WorkerRegistry(worker_timeout_s=60)
    for wid, salt in workers:
        registry.register(RegisterWorker(worker_id=wid, role=WorkerRole.DECODE, input_addr=f"tcp://{wid}:1",
                                         model_name="m", num_blocks=64, block_size=BS, max_model_len=512,
                                         prefix_cache_salt=salt), now=0.0)
    return registry


def test_kv_aware_routes_to_the_worker_that_holds_the_prompt_under_bounded_loads():
    registry = _registry(("d0", 5), ("d1", 5), ("d2", None))
    index = KVIndex()
    policy = make_policy("kv_aware", kv_index=index)
    assert isinstance(policy, KVAwarePolicy)
    prompt = list(range(50, 70))  # 20 tokens: blocks of the first 19 can hit, 4 of them
    hashes = prompt_block_hashes(prompt, BS, 5)
    assert len(hashes) == 4 and hashes[1] == chain_hash(hashes[0], prompt[4:8], 5)
    index.apply(_batch(0, [_stored(*hashes[:3])], worker="d1"))
    index.apply(_batch(0, [_stored(*hashes)], worker="d2"))  # d2 has no prefix cache salt: never matched
    candidates = registry.live(WorkerRole.DECODE)
    assert policy.matched_tokens(candidates, prompt) == [0, 12, 0]
    worker, decision = policy.pick(WorkerRole.DECODE, candidates, prompt)
    assert (worker.worker_id, decision) == ("d1", "kv_hit")
    # the same tokens under a LoRA adapter are other blocks
    worker, decision = policy.pick(WorkerRole.DECODE, candidates, prompt, cache_salt=b"lora-root")
    assert decision == "kv_miss"
    # a worker holding more than balance_factor x the average loses its hit to the least loaded
    candidates[1].num_inflight = 3
    worker, decision = policy.pick(WorkerRole.DECODE, candidates, prompt)
    assert (worker.worker_id, decision) == ("d0", "kv_spill")
    # a prefix held in host memory counts nearly as much as one in the KV cache
    index.apply(_batch(1, [BlockRemoved(block_hashes=hashes[:3]), _stored(*hashes[:3], medium="host")], worker="d1"))
    assert policy.matched_tokens(candidates, prompt) == [0, 12 * (1 - LOWER_TIER_COST), 0]
    # once d1 has measured both speeds, its own figures price the copy back: 1 ms a token prefilled (4 ms
    # a block), 1 ms a block loaded from host memory, 8 ms a block read from disk
    stats = WorkerStats(prefill_compute_tokens=1000, prefill_compute_seconds=1.0, kv_onload_blocks=10,
                        kv_onload_seconds=0.01, kv_disk_read_blocks=10, kv_disk_read_seconds=0.08)
    registry.heartbeat(Heartbeat(worker_id="d1", role=WorkerRole.DECODE, stats=stats), now=1.0)
    assert candidates[1].tier_load_cost("host") == pytest.approx(0.25)
    assert policy.matched_tokens(candidates, prompt) == pytest.approx([0, 12 * 0.75, 0])
    # a disk dearer to read than recomputing: the worker recomputes from the first block only on disk
    index.apply(_batch(2, [BlockRemoved(block_hashes=hashes[1:3], medium="host"),
                           _stored(*hashes[1:3], medium="disk")], worker="d1"))
    assert candidates[1].tier_load_cost("disk") == pytest.approx(2.0)
    assert policy.matched_tokens(candidates, prompt) == pytest.approx([0, 4 * 0.75, 0])
    with pytest.raises(ValueError, match="KV index"):
        make_policy("kv_aware")
