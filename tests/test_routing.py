"""Routing policies without processes: ring stability, bounded loads, least loaded, the router's use of them."""

from __future__ import annotations

import argparse
import random

import pytest

from pdserve.common.protocol import Heartbeat, RegisterWorker, WorkerRole
from pdserve.router.config import RouterConfig, routing_args
from pdserve.router.engine import RouterEngine
from pdserve.router.registry import WorkerRegistry
from pdserve.router.routing import (HashRing, LeastLoadedPolicy, PrefixAwarePolicy, RoundRobinPolicy,
                                    bounded_load_capacity, make_policy, pick_bounded, prefix_key)

DECODE = WorkerRole.DECODE


def registry_with(*worker_ids: str, role=DECODE, block_size=16, num_blocks=100) -> WorkerRegistry:
    reg = WorkerRegistry(worker_timeout_s=5)
    for i, w in enumerate(worker_ids):
        reg.register(RegisterWorker(worker_id=w, role=role, input_addr=f"tcp://127.0.0.1:{10000 + i}",
                                    model_name="tiny", num_blocks=num_blocks, block_size=block_size), now=0)
    return reg


def heartbeat(reg: WorkerRegistry, worker_id: str, running=0, waiting=0, free=100, blocks=100) -> None:
    reg.heartbeat(Heartbeat(worker_id=worker_id, role=DECODE, num_running=running, num_waiting=waiting,
                            num_free_blocks=free, num_blocks=blocks), now=0)


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10, 1000) for _ in range(n)]


# --- prefix keys and the ring ---------------------------------------------------------------

def test_prefix_key_covers_the_first_full_blocks_only():
    rng = random.Random(0)
    prompt = random_prompt(rng, 100)  # 6 full blocks of 16
    assert prefix_key(prompt, 16, 4) == prefix_key(prompt[:64] + [1, 2, 3], 16, 4)  # past 4 blocks: ignored
    assert prefix_key(prompt, 16, 4) != prefix_key(prompt[:63] + [prompt[63] + 1] + prompt[64:], 16, 4)
    assert prefix_key(prompt, 16, 4) != prefix_key(prompt, 16, 3)
    assert prefix_key(prompt[:40], 16, 4) == prefix_key(prompt[:32], 16, 4)  # 2 full blocks; the rest ignored
    assert prefix_key(prompt[:15], 16, 4) is None  # no full block
    assert prefix_key(prompt[:16], 16, 4) is not None
    with pytest.raises(ValueError):
        prefix_key(prompt, 0, 4)


def owners(ring: HashRing, keys: list[int]) -> list[str]:
    return [ring.owner(k) for k in keys]


def test_ring_moves_about_one_nth_of_the_keys_when_a_worker_joins_or_leaves():
    rng = random.Random(1)
    keys = [rng.getrandbits(64) for _ in range(20000)]
    four = owners(HashRing(["d0", "d1", "d2", "d3"]), keys)
    shares = [four.count(w) / len(keys) for w in ("d0", "d1", "d2", "d3")]
    assert all(0.17 < s < 0.33 for s in shares), shares  # 128 points each: roughly even

    five = owners(HashRing(["d0", "d1", "d2", "d3", "d4"]), keys)
    moved = [(a, b) for a, b in zip(four, five) if a != b]
    assert 0.14 < len(moved) / len(keys) < 0.26  # ~1/5 (a modulo hash would move ~4/5)
    assert {b for _, b in moved} == {"d4"}  # keys move only to the new worker

    three = owners(HashRing(["d0", "d2", "d3"]), keys)
    moved = [(a, b) for a, b in zip(four, three) if a != b]
    assert {a for a, _ in moved} == {"d1"}  # only the leaving worker's keys move
    assert len(moved) == four.count("d1")
    assert 0.17 < len(moved) / len(keys) < 0.33  # ~1/4


def test_ring_walk_visits_each_worker_once_and_is_order_independent():
    ring = HashRing(["a", "b", "c"], num_vnodes=16)
    for key in (0, 2**63, 2**64 - 1, 12345):
        walk = list(ring.walk(key))
        assert sorted(walk) == ["a", "b", "c"] and walk[0] == ring.owner(key)
    assert owners(HashRing(["c", "a", "b"], num_vnodes=16), [1, 2**40, 2**62]) == owners(ring, [1, 2**40, 2**62])
    assert list(HashRing([]).walk(5)) == []


# --- bounded loads --------------------------------------------------------------------------

def test_capacity_is_ceil_of_factor_times_average_with_the_new_request():
    assert bounded_load_capacity(0, 4, 1.25) == 1
    assert bounded_load_capacity(3, 4, 1.25) == 2  # ceil(1.25 * 4 / 4 = 1.25)
    assert bounded_load_capacity(7, 4, 1.0) == 2  # exactly the average: no float round-up to 3
    assert bounded_load_capacity(15, 4, 1.5) == 6


@pytest.mark.parametrize("factor", [1.0, 1.25, 2.0])
def test_bounded_loads_hold_under_a_hot_prefix_and_random_finishes(factor):
    reg = registry_with("d0", "d1", "d2", "d3")
    policy = PrefixAwarePolicy(prefix_blocks=2, balance_factor=factor)
    rng = random.Random(2)
    hot = random_prompt(rng, 48)
    inflight: list = []
    home = None
    for step in range(400):
        prompt = hot if rng.random() < 0.7 else random_prompt(rng, 40)
        workers = reg.candidates(DECODE)
        total = sum(w.num_inflight for w in workers)
        capacity = bounded_load_capacity(total, len(workers), factor)
        worker, decision = policy.pick(DECODE, workers, prompt)
        assert worker.num_inflight < capacity, (step, worker.num_inflight, capacity)
        if prompt is hot and decision == "prefix_home":
            assert home in (None, worker.worker_id)  # the hot prefix's home never changes
            home = worker.worker_id
        worker.num_inflight += 1
        inflight.append(worker)
        assert max(w.num_inflight for w in workers) <= capacity
        if rng.random() < 0.45 and inflight:  # some requests finish
            inflight.pop(rng.randrange(len(inflight))).num_inflight -= 1
    assert home is not None


def test_same_prefix_goes_to_the_same_worker_while_it_is_not_overloaded():
    reg = registry_with("d0", "d1", "d2", "d3")
    policy = PrefixAwarePolicy(prefix_blocks=4)
    rng = random.Random(3)
    system_prompts = [random_prompt(rng, 64) for _ in range(8)]
    chosen: dict[int, set[str]] = {}
    for _ in range(80):  # one at a time: every request finishes before the next
        g = rng.randrange(len(system_prompts))
        worker, decision = policy.pick(DECODE, reg.candidates(DECODE), system_prompts[g] + random_prompt(rng, 30))
        assert decision == "prefix_home"
        chosen.setdefault(g, set()).add(worker.worker_id)
    assert all(len(ws) == 1 for ws in chosen.values()), chosen
    assert len({next(iter(ws)) for ws in chosen.values()}) > 1  # different prefixes spread


def test_prefix_aware_spills_a_busy_home_and_short_prompts_go_least_loaded():
    reg = registry_with("d0", "d1")
    policy = PrefixAwarePolicy(prefix_blocks=1, balance_factor=1.0)
    prompt = list(range(10, 42))
    home, decision = policy.pick(DECODE, reg.candidates(DECODE), prompt)
    assert decision == "prefix_home"
    home.num_inflight = 1  # capacity for the next: ceil(1.0 * 2 / 2) = 1, so home is full
    other, decision = policy.pick(DECODE, reg.candidates(DECODE), prompt)
    assert decision == "prefix_spill" and other is not home
    worker, decision = policy.pick(DECODE, reg.candidates(DECODE), [11, 12, 13])
    assert decision == "short_prompt" and worker is other  # the least loaded


def test_pick_bounded_returns_the_owner_when_all_are_idle():
    reg = registry_with("a", "b", "c")
    nodes = {w.worker_id: w for w in reg.candidates(DECODE)}
    ring = HashRing(nodes)
    for key in (1, 2**50, 2**63 + 7):
        worker, spilled = pick_bounded(ring, key, nodes, lambda w: w.num_inflight, 1.25)
        assert worker.worker_id == ring.owner(key) and not spilled


# --- least loaded, round robin --------------------------------------------------------------

def test_least_loaded_counts_in_flight_and_heartbeats_then_kv_usage_then_history():
    reg = registry_with("d0", "d1", "d2")
    d0, d1, d2 = reg.candidates(DECODE)
    policy = LeastLoadedPolicy()
    d0.num_inflight, d1.num_inflight, d2.num_inflight = 3, 1, 2
    assert policy.pick(DECODE, [d0, d1, d2])[0] is d1
    heartbeat(reg, "d1", running=4)  # the worker holds more than the router counts (e.g. n=4 sequences)
    assert policy.pick(DECODE, [d0, d1, d2])[0] is d2
    heartbeat(reg, "d1", running=0)
    d0.num_inflight = d1.num_inflight = d2.num_inflight = 0
    heartbeat(reg, "d0", free=90)
    heartbeat(reg, "d1", free=40)  # 60% KV cache usage
    heartbeat(reg, "d2", free=95)
    assert policy.pick(DECODE, [d0, d1, d2])[0] is d2
    heartbeat(reg, "d2", free=90)
    d0.num_routed = 5
    assert policy.pick(DECODE, [d0, d1, d2])[0] is d2  # equal load and usage: fewer routed so far
    d2.num_routed = 5
    assert policy.pick(DECODE, [d0, d1, d2])[0] is d0  # all equal: registration order


def test_round_robin_cycles_in_registration_order_per_role():
    reg = registry_with("d0", "d1", "d2")
    policy = RoundRobinPolicy()
    ids = [policy.pick(DECODE, reg.candidates(DECODE), [])[0].worker_id for _ in range(5)]
    assert ids == ["d0", "d1", "d2", "d0", "d1"]


# --- the router's engine and config ---------------------------------------------------------

class FakeSockets:
    """Stands in for the router's PUSH sockets: records what would be sent."""

    def __init__(self):
        self.sent: list[tuple[str, object]] = []

    def send(self, addr, msg):
        self.sent.append((addr, msg))

    def close(self, addr):
        pass


def test_engine_routes_by_policy_and_drain_moves_only_the_drained_workers_keys():
    reg = registry_with("d0", "d1", "d2")
    decisions = []
    engine = RouterEngine("127.0.0.1", 0, reg, policy=make_policy("prefix_aware", prefix_blocks=2),
                          on_route=lambda *d: decisions.append(d))
    engine._sockets = FakeSockets()
    rng = random.Random(4)
    prompts = [random_prompt(rng, 40) for _ in range(300)]
    before = [engine.route(DECODE, p).worker_id for p in prompts]
    assert set(before) == {"d0", "d1", "d2"}
    assert decisions[0] == ("prefix_aware", DECODE, "prefix_home")
    engine.drain("d1", "test")
    after = [engine.route(DECODE, p).worker_id for p in prompts]
    assert all(a == b for a, b in zip(after, before) if b != "d1")
    assert "d1" not in after
    assert engine.route(DECODE, prompts[0], accepts=lambda w: False) is None


def test_a_lost_workers_requests_migrate_to_the_rings_next_worker():
    reg = registry_with("d0", "d1", "d2")
    engine = RouterEngine("127.0.0.1", 0, reg, policy=make_policy("prefix_aware", prefix_blocks=2))
    engine._sockets = sockets = FakeSockets()
    rng = random.Random(5)
    from pdserve.common.protocol import SamplingParams

    prompts = [random_prompt(rng, 40) for _ in range(30)]
    for i, p in enumerate(prompts):
        engine.submit(f"r{i}", p, SamplingParams(max_tokens=4), engine.route(DECODE, p), None)
    on_d1 = {f"r{i}" for i, p in enumerate(prompts) if engine._requests[f"r{i}"].decode_worker_id == "d1"}
    assert on_d1
    sockets.sent.clear()
    engine._connection_lost(reg.get("d1").input_addr)  # d1 died
    resent = {m.request_id: addr for addr, m in sockets.sent}
    assert set(resent) == on_d1 and all(m.resume is not None for _, m in sockets.sent)
    survivors = HashRing(["d0", "d2"])
    for rid in on_d1:  # each lands on its key's owner among the survivors (their loads stay below capacity here)
        key = prefix_key(prompts[int(rid[1:])], 16, 2)
        assert resent[rid] == reg.get(survivors.owner(key)).input_addr


def test_config_and_cli_flags():
    parser = RouterConfig.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", "x", "--routing-policy", "least_loaded", "--routing-prefix-blocks", "8"])
    assert (args.routing_policy, args.routing_prefix_blocks, args.routing_balance_factor) == ("least_loaded", 8, 1.5)
    assert routing_args(args)[:2] == ["--routing-policy", "least_loaded"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "x", "--routing-policy", "random"])
    from pdserve.cli import build_parser

    up, extra = build_parser().parse_known_args(["up", "--routing-policy", "round_robin", "--kv-cache-memory", "1MiB"])
    assert up.routing_policy == "round_robin" and extra == ["--kv-cache-memory", "1MiB"]


def test_config_validates_routing(model_dir):
    assert RouterConfig(model=model_dir).routing_policy == "kv_aware"
    with pytest.raises(ValueError, match="routing_policy"):
        RouterConfig(model=model_dir, routing_policy="random")
    with pytest.raises(ValueError, match="routing_balance_factor"):
        RouterConfig(model=model_dir, routing_balance_factor=0.9)
    with pytest.raises(ValueError, match="routing_prefix_blocks"):
        RouterConfig(model=model_dir, routing_prefix_blocks=0)
    with pytest.raises(ValueError):
        make_policy("nearest")


# --- load-aware prefill placement -------------------------------------------------------------

def _measured(reg: WorkerRegistry, worker_id: str, role: WorkerRole, tokens: int, seconds: float) -> None:
    from pdserve.common.protocol import WorkerStats

    reg.heartbeat(Heartbeat(worker_id=worker_id, role=role, num_blocks=100, num_free_blocks=100,
                            stats=WorkerStats(prefill_compute_tokens=tokens, prefill_compute_seconds=seconds)), now=0)


def _decode_and_prefill_workers():
    """A registry with decode worker d0 and prefill worker p0, and a router engine over it (no sockets)."""
    reg = registry_with("d0")
    reg.register(RegisterWorker(worker_id="p0", role=WorkerRole.PREFILL, input_addr="tcp://127.0.0.1:11000",
                                model_name="tiny", num_blocks=100, block_size=16), now=0)
    engine = RouterEngine("127.0.0.1", 0, reg)
    engine._sockets = FakeSockets()
    return reg, engine, reg.get("d0"), reg.get("p0")


def test_prompts_go_to_the_decode_worker_only_when_the_prefill_queue_is_slower_by_the_margin():
    from pdserve.common.protocol import SamplingParams
    from pdserve.router.routing import prefers_local_prefill

    reg, engine, d0, p0 = _decode_and_prefill_workers()
    prompt = list(range(10, 310))  # 300 tokens
    assert not prefers_local_prefill(d0, p0, 300, 0.5)  # no measured speed yet: no evidence of a queue
    _measured(reg, "p0", WorkerRole.PREFILL, 6000, 10.0)  # 600 tokens/s
    assert p0.prefill_tokens_per_s == pytest.approx(600.0)
    assert not prefers_local_prefill(d0, p0, 300, 0.5)  # both idle: the prefill pool
    # three prompts queued at p0 (1.5 s of work before ours): the decode worker, idle, is 1.5 s sooner
    for i in range(3):
        engine.submit(f"r{i}", prompt, SamplingParams(max_tokens=4), d0, p0)
    assert (p0.prefill_pending_tokens, d0.prefill_pending_tokens) == (900, 0)
    assert prefers_local_prefill(d0, p0, 300, 0.5)
    assert not prefers_local_prefill(d0, p0, 300, 2.0)  # a dearer local prefill: not worth it
    assert not prefers_local_prefill(d0, p0, 300, float("inf"))  # off
    engine.submit("r3", prompt, SamplingParams(max_tokens=4), d0, None)  # a local prefill queues at d0
    assert d0.prefill_pending_tokens == 300
    _measured(reg, "d0", DECODE, 3000, 10.0)  # the decode worker prefills at 300 tokens/s
    assert not prefers_local_prefill(d0, p0, 300, 0.5)  # (300 + 300) / 300 + 0.5 > (900 + 300) / 600
    # the decode worker holds the prompt (a conversation it served before) and the prefill worker does
    # not: it computes only the last turn's tokens, so the prompt is prefilled where its KV is
    assert prefers_local_prefill(d0, p0, 300, 0.5, decode_cached_tokens=288)  # 312 / 300 + 0.5 < 1200 / 600
    assert not prefers_local_prefill(d0, p0, 300, 0.5, decode_cached_tokens=288, prefill_cached_tokens=288)
    # a first token back takes the prompt out of its worker's queue; so does an abort
    from pdserve.common.protocol import RequestDelta

    engine._deliver(RequestDelta(request_id="r0", new_token_ids=[5]), "d0")
    engine._deliver(RequestDelta(request_id="r3", new_token_ids=[5]), "d0")
    engine.abort("r1")
    assert (p0.prefill_pending_tokens, d0.prefill_pending_tokens) == (300, 0)
    engine.abort("r2")
    assert p0.prefill_pending_tokens == 0


def test_the_margin_grows_with_the_decode_workers_requests_in_flight():
    """``margin_per_request_s``: a local prefill delays every request decoding there, so the same prefill
    queue sends a prompt to an idle decode worker and not to a busy one."""
    from pdserve.common.protocol import SamplingParams
    from pdserve.router.routing import prefers_local_prefill

    reg, engine, d0, p0 = _decode_and_prefill_workers()
    _measured(reg, "p0", WorkerRole.PREFILL, 6000, 10.0)  # 600 tokens/s
    engine.submit("r0", list(range(10, 310)), SamplingParams(max_tokens=4), d0, p0)  # 0.5 s queued at p0
    # remote 1.0 s, local 0.5 s: 0.5 s sooner, against 0.1 + 0.05 per request in flight on d0 (one: r0)
    assert d0.num_inflight == 1
    assert prefers_local_prefill(d0, p0, 300, 0.1, 0.05)
    for i in range(1, 8):  # seven more decoding there: 0.1 + 8 * 0.05 = 0.5 s, no longer sooner by more
        engine.submit(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=4), d0, None)
    assert d0.num_inflight == 8
    assert not prefers_local_prefill(d0, p0, 300, 0.1, 0.05)
    assert prefers_local_prefill(d0, p0, 300, 0.1)  # the fixed margin alone ignores the batch


def test_local_prefill_margin_flag(model_dir):
    parser = RouterConfig.add_cli_args(argparse.ArgumentParser())
    defaults = parser.parse_args(["--model", "x"])
    assert defaults.local_prefill_margin_s == 0.1  # the benchmarked price, on by default
    assert defaults.local_prefill_margin_per_request_s == 0.03
    args = parser.parse_args(["--model", "x", "--local-prefill-margin-s", "1.5",
                              "--local-prefill-margin-per-request-s", "0.03"])
    assert routing_args(args)[-4:] == ["--local-prefill-margin-s", "1.5", "--local-prefill-margin-per-request-s",
                                       "0.03"]
    assert RouterConfig.from_cli_args(
        parser.parse_args(["--model", model_dir, "--local-prefill-margin-per-request-s", "0.03"])
    ).local_prefill_margin_per_request_s == 0.03
    with pytest.raises(ValueError, match="local_prefill_margin_s"):
        RouterConfig(model=model_dir, local_prefill_margin_s=-1)
    with pytest.raises(ValueError, match="local_prefill_margin_per_request_s"):
        RouterConfig(model=model_dir, local_prefill_margin_per_request_s=float("inf"))


def test_a_prompt_is_pulled_from_the_peer_that_holds_more_of_it_when_that_is_cheaper():
    """``pull_source``: a decode worker holding the prompt serves its prefill for the one that will decode
    it, when computing only what it lacks (plus the margin its own requests pay) beats the site's work."""
    from pdserve.router.routing import pull_source

    reg, _, d0, p0 = _decode_and_prefill_workers()
    reg.register(RegisterWorker(worker_id="d1", role=DECODE, input_addr="tcp://127.0.0.1:10001", model_name="tiny",
                                num_blocks=100, block_size=16), now=0)
    d1 = reg.get("d1")
    holds = {"d0": 0, "d1": 288, "p0": 0}

    def held(w):
        return holds[w.worker_id]

    # d0 decodes and would prefill 300 tokens itself; d1 holds 288 of them: 12 tokens + the margin
    assert pull_source(d0, None, [d0, d1], 300, held, 0.1) is d1
    # the same against a prefill worker that holds none of it (no speed measured: tokens as seconds)
    assert pull_source(d0, p0, [d0, d1], 300, held, 0.1) is d1
    # a peer busy enough that its margin outweighs the tokens saved is left alone
    d1.num_inflight = 20
    assert pull_source(d0, None, [d0, d1], 300, held, 0.1, margin_per_request_s=20.0) is None
    d1.num_inflight = 0
    # a peer that holds no more than the site (less than a block more) is not asked
    holds["d0"] = 280
    assert pull_source(d0, None, [d0, d1], 300, held, 0.1) is None
    holds["d0"] = 0
    assert pull_source(d0, None, [d0, d1], 300, held, float("inf")) is None  # placement off: no pulls
    # measured speeds price the work: a peer 100x slower at prefill loses even holding most of it
    _measured(reg, "d0", DECODE, 100_000, 1.0)
    _measured(reg, "d1", DECODE, 1_000, 1.0)
    assert pull_source(d0, None, [d0, d1], 300, held, 0.01) is None
