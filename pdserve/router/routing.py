"""Routing policies: which decode worker (and which prefill worker) gets a request.

Pure Python, no sockets, no torch. The router's engine hands a policy the live
workers of one role that accept the request (``candidates``, in registration
order: not stalled, not draining, able to hold the request) and the prompt's
token ids; the policy returns one of them and a short label of why
(``decision``, counted in ``pdserve:routing_decisions``). Requests that lost
their decode worker (migration) are routed by the same policy with their
original prompt, so they land where the policy would have sent them had the
lost worker never existed.

``--routing-policy``:

* ``round_robin``: the next worker in registration order, a counter per role.
  Blind to load and to prompts; pdserve's only policy before issue 12.
* ``least_loaded``: the worker with the fewest requests, by ``load_key``: the
  larger of the router's own count of requests in flight there (current, but
  blind to what the worker holds that the router does not count) and the
  latest heartbeat's ``num_running + num_waiting`` (the worker's view, up to one
  heartbeat interval old); then the heartbeat's KV cache usage
  (``1 - num_free_blocks / num_blocks``); then the fewest requests ever routed
  there; then registration order. So ties go deterministically to the worker
  that has had the least.
* ``prefix_aware``: the worker most likely to hold the prompt's prefix in its
  prefix cache. The prompt's key is ``prefix_key``: a hash of its first
  ``min(prefix_blocks, num_full_blocks)`` full KV blocks (``block_size`` tokens
  each, the smallest ``block_size`` the candidates advertised). Keys map onto
  workers by consistent hashing (Karger et al., "Consistent Hashing and Random
  Trees", STOC 1997) on a ring with ``HashRing.num_vnodes`` virtual nodes per
  worker, with bounded loads (Mirrokni, Thorup, Zadimoghaddam, "Consistent
  Hashing with Bounded Loads", SODA 2018): walking clockwise from the key, the
  first worker whose in-flight count is below ``ceil(balance_factor *
  (total in flight + 1) / num_candidates)`` gets the request. So requests with
  the same first blocks go to the same worker while it is not overloaded; a
  worker joining or leaving moves only about 1/N of the keys (the others keep
  their cache hits); no worker holds more than ``balance_factor`` times the
  average (plus one). A prompt shorter than one block has nothing a prefix
  cache could reuse: it falls back to ``least_loaded``. Prefill workers are
  picked the same way on their own ring (their prefix cache saves prefill
  compute for blocks the decode worker lacks), with their pending prefills as
  the load.
* ``kv_aware``: the worker that really holds most of the prompt, by the workers'
  KV events (``pdserve.router.kv_index``; vLLM's, Dynamo's and llm-d's KV-aware
  routing). The prompt's blocks are hashed as each worker hashes them (its
  ``prefix_cache_salt``, the LoRA adapter's root), and each candidate is priced by
  the prefill it would still have to do: ``(its pending prefill tokens + the
  prompt tokens it does not hold) / its measured prefill speed``, where pending
  tokens count only what each queued prompt did not find cached (tokens alone
  until every candidate has measured one; a block held only in a lower tier, host
  memory or disk, counts what loading it measured on that worker against recomputing
  it, ``LOWER_TIER_COST`` until measured, and not at all where loading is dearer). The cheapest worker below the bounded
  load capacity above gets the request, so a conversation follows its cache until
  that worker is ``balance_factor`` times busier than the average. A decode worker's
  pending prefills are its local ones: in disaggregated serving its price is the
  KV it lacks, which the prefill worker must send.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from pdserve.common.protocol import WorkerRole
from pdserve.engine.scheduling.block_manager import ROOT_HASH, block_hashes

from pdserve.router.kv_index import DEVICE_BIT, DISK_BIT, HOST_BIT

if TYPE_CHECKING:
    from pdserve.router.kv_index import KVIndex
    from pdserve.router.registry import WorkerInfo

ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix_aware", "kv_aware")
# kv_aware: what bringing back a block held only in a lower tier costs, as a fraction of recomputing it,
# until the worker has measured both (a copy of its bytes against a forward over its tokens: a few
# percent on the CPU from host memory, as bench_kv_offload.py measures)
LOWER_TIER_COST = 0.1
DEFAULT_BLOCK_SIZE = 16  # when no candidate advertised a block_size


def _hash64(data: bytes) -> int:
    """A 64-bit hash that is the same in every process (Python's ``hash`` of str is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


def prefix_key(prompt_token_ids: Sequence[int], block_size: int, max_blocks: int, salt: bytes = b"") -> int | None:
    """The routing key of a prompt: a 64-bit hash of its first ``min(max_blocks, num_full_blocks)`` blocks,
    after ``salt`` (a LoRA adapter's cache root: its KV is cached apart, so its prompts key apart too).

    ``num_full_blocks = len(prompt_token_ids) // block_size``. Two prompts get the same key
    exactly when they have the same number of keyed blocks and equal tokens in them (up to
    hash collisions, 2**-64). None when the prompt is shorter than one block.

    Raises:
        ValueError: ``block_size`` or ``max_blocks`` below 1.
    """
    if block_size < 1 or max_blocks < 1:
        raise ValueError(f"block_size and max_blocks must be >= 1, got {block_size} and {max_blocks}")
    num_blocks = min(max_blocks, len(prompt_token_ids) // block_size)
    if num_blocks == 0:
        return None
    return _hash64(salt + array("q", prompt_token_ids[:num_blocks * block_size]).tobytes())


class HashRing:
    """A consistent-hashing ring (Karger et al., STOC 1997) of node ids, ``num_vnodes`` points per node.

    A node's points are the 64-bit hashes of ``"{node_id}#{i}"``, so they depend on its id only:
    adding or removing a node moves only the keys between its points and their predecessors
    (about 1/N of all keys), and every router builds the same ring from the same ids.
    """

    def __init__(self, node_ids: Iterable[str], num_vnodes: int = 128):
        if num_vnodes < 1:
            raise ValueError(f"num_vnodes must be >= 1, got {num_vnodes}")
        self.node_ids = tuple(node_ids)
        self.num_vnodes = num_vnodes
        points = sorted((_hash64(f"{node}#{i}".encode()), node) for node in self.node_ids for i in range(num_vnodes))
        self._positions = [p for p, _ in points]
        self._nodes = [n for _, n in points]

    def walk(self, key: int) -> Iterator[str]:
        """Each node once, clockwise from ``key``: the first is the key's owner, then its successors."""
        if not self._nodes:
            return
        start = bisect.bisect_right(self._positions, key)
        seen: set[str] = set()
        for i in range(len(self._nodes)):
            node = self._nodes[(start + i) % len(self._nodes)]
            if node not in seen:
                seen.add(node)
                yield node
                if len(seen) == len(self.node_ids):
                    return

    def owner(self, key: int) -> str | None:
        """The node a key maps to without load bounds (None on an empty ring)."""
        return next(self.walk(key), None)


def bounded_load_capacity(total_load: int, num_nodes: int, balance_factor: float) -> int:
    """The most requests a node may hold after taking one more: ``ceil(balance_factor * (total_load + 1) / num_nodes)``.

    Mirrokni, Thorup, Zadimoghaddam (SODA 2018), with ``balance_factor`` = their ``1 + eps``;
    ``total_load`` counts requests already placed, the ``+ 1`` the one being placed. Always
    above the average, so some node is below it.
    """
    return math.ceil(balance_factor * (total_load + 1) / num_nodes - 1e-9)


def kv_usage(worker: WorkerInfo) -> float:
    """The worker's KV cache usage from its latest heartbeat, in [0, 1] (0 before any heartbeat)."""
    hb = worker.heartbeat
    num_blocks = (hb.num_blocks if hb else 0) or worker.num_blocks
    if hb is None or num_blocks <= 0:
        return 0.0
    return min(1.0, max(0.0, 1.0 - hb.num_free_blocks / num_blocks))


def num_requests(worker: WorkerInfo) -> int:
    """Requests on the worker: the router's in-flight count or the latest heartbeat's, whichever is larger.

    The router's count (decode: routed and unfinished; prefill: waiting for its KV) is
    current; the heartbeat's (``num_running + num_waiting``) lags by up to one heartbeat but
    includes what the router does not count (``n`` sequences of one request, aborted
    requests not yet freed).
    """
    hb = worker.heartbeat
    return max(worker.num_outstanding, hb.num_running + hb.num_waiting if hb else 0)


def load_key(worker: WorkerInfo, order: int) -> tuple:
    """``least_loaded``'s sort key: requests, KV cache usage, requests ever routed, registration order."""
    return num_requests(worker), kv_usage(worker), worker.num_routed, order


class RoutingPolicy:
    """Picks one of ``candidates`` for a request; subclasses implement ``pick``. ``name`` is the CLI name."""

    name = ""

    def pick(self, role: WorkerRole, candidates: Sequence[WorkerInfo],
             prompt_token_ids: Sequence[int], cache_salt: bytes = b"") -> tuple[WorkerInfo, str]:
        """(The chosen worker, the decision's label). ``candidates`` is non-empty, in registration order.
        ``cache_salt``: what keys the request's prefix cache besides its tokens (a LoRA adapter)."""
        raise NotImplementedError

    def cached_tokens(self, worker: WorkerInfo, prompt_token_ids: Sequence[int], cache_salt: bytes = b"") -> int:
        """The prompt tokens ``worker`` is known to hold in its prefix cache (0: the policy does not know).
        The router counts the rest in the worker's ``prefill_pending_tokens``, its queue of work."""
        return 0


class RoundRobinPolicy(RoutingPolicy):
    """The next candidate in registration order, one counter per role (the prompt is not read)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next = {role: 0 for role in WorkerRole}

    def pick(self, role, candidates, prompt_token_ids=(), cache_salt=b""):
        i = self._next[role] % len(candidates)
        self._next[role] = i + 1
        return candidates[i], "round_robin"


class LeastLoadedPolicy(RoutingPolicy):
    """The candidate with the smallest ``load_key`` (the prompt is not read)."""

    name = "least_loaded"

    def pick(self, role, candidates, prompt_token_ids=(), cache_salt=b""):
        i = min(range(len(candidates)), key=lambda j: load_key(candidates[j], j))
        return candidates[i], "least_loaded"


class PrefixAwarePolicy(RoutingPolicy):
    """Consistent hashing with bounded loads on the prompt's ``prefix_key``; ``least_loaded`` below one block.

    Args:
        prefix_blocks: full blocks of the prompt the key covers, at most (``--routing-prefix-blocks``).
        balance_factor: ``1 + eps`` of the bounded loads, >= 1 (``--routing-balance-factor``);
            1 balances perfectly and moves many keys under load, larger keeps more locality.
        num_vnodes: ring points per worker.

    Decisions: ``prefix_home`` (the key's first worker on the ring), ``prefix_spill`` (it was
    full, a successor took it), ``short_prompt`` (under one block: least loaded).
    """

    name = "prefix_aware"

    def __init__(self, prefix_blocks: int = 4, balance_factor: float = 1.5, num_vnodes: int = 128):
        if prefix_blocks < 1:
            raise ValueError(f"prefix_blocks must be >= 1, got {prefix_blocks}")
        if not balance_factor >= 1.0:
            raise ValueError(f"balance_factor must be >= 1, got {balance_factor}")
        self.prefix_blocks = prefix_blocks
        self.balance_factor = balance_factor
        self.num_vnodes = num_vnodes
        self._rings: dict[WorkerRole, HashRing] = {}
        self._least_loaded = LeastLoadedPolicy()

    def ring(self, role: WorkerRole, node_ids: Iterable[str]) -> HashRing:
        """The ring over ``node_ids`` (rebuilt only when the set of ids changes)."""
        ids = tuple(sorted(node_ids))
        ring = self._rings.get(role)
        if ring is None or ring.node_ids != ids:
            ring = self._rings[role] = HashRing(ids, self.num_vnodes)
        return ring

    def pick(self, role, candidates, prompt_token_ids=(), cache_salt=b""):
        block_size = min((w.block_size for w in candidates if w.block_size > 0), default=DEFAULT_BLOCK_SIZE)
        key = prefix_key(prompt_token_ids, block_size, self.prefix_blocks, cache_salt)
        if key is None:
            return self._least_loaded.pick(role, candidates)[0], "short_prompt"
        by_id = {w.worker_id: w for w in candidates}
        worker, spilled = pick_bounded(self.ring(role, by_id), key, by_id, lambda w: w.num_outstanding,
                                       self.balance_factor)
        return worker, "prefix_spill" if spilled else "prefix_home"


def prompt_block_hashes(prompt_token_ids: Sequence[int], block_size: int, salt: int,
                        root: bytes = ROOT_HASH) -> list[bytes]:
    """The chained hashes of the prompt's full blocks a worker's prefix cache could hit (never the
    block of the last token, which is always computed), as the worker with ``salt`` hashes them
    (``block_manager.block_hashes``), from ``root`` (a LoRA adapter's cache root, else ``ROOT_HASH``)."""
    return block_hashes(prompt_token_ids, len(prompt_token_ids) - 1, block_size, salt, root)


def full_groups(worker: WorkerInfo) -> tuple[int, ...]:
    """The KV cache groups a prefix hit on ``worker`` needs whole (full attention; group 0 alone when
    every group slides: a hit there needs its window's blocks, which the router does not check)."""
    caps = worker.kv_group_caps or [None]
    return tuple(g for g, cap in enumerate(caps) if cap is None) or (0,)


def _held_blocks(worker: WorkerInfo, tiers: Sequence[int]) -> float:
    """How many blocks of a prefix ``worker`` holds, as it will reuse them: ``tiers`` is each leading
    block's tier bits (``KVIndex.prefix_tiers``). A block only in host memory (else on disk, as the worker
    looks) counts 1 minus its measured load cost against recomputing (``WorkerInfo.tier_load_cost``;
    ``LOWER_TIER_COST`` until measured); at a block dearer to load than to recompute the worker stops
    loading, and so does the count."""
    held = 0.0
    costs: dict[int, float] = {}
    for bits in tiers:
        if bits & DEVICE_BIT:
            held += 1.0
            continue
        bit = HOST_BIT if bits & HOST_BIT else DISK_BIT
        if bit not in costs:
            measured = worker.tier_load_cost("host" if bit == HOST_BIT else "disk")
            costs[bit] = LOWER_TIER_COST if measured is None else measured
        if costs[bit] >= 1.0:
            break
        held += 1.0 - costs[bit]
    return held


class KVAwarePolicy(RoutingPolicy):
    """The cheapest prefill, by what each worker really caches (``KVIndex``), under bounded loads.

    Args:
        index: the router's KV index, fed by the workers' KV events.
        balance_factor: the bounded loads' ``1 + eps`` (as ``PrefixAwarePolicy``'s), >= 1.

    Decisions: ``kv_hit`` (the chosen worker holds some of the prompt), ``kv_miss`` (none of the
    prompt is cached where it goes, or it is under one block), ``kv_spill`` (a worker holding more
    of it was over the bounded-load capacity).
    """

    name = "kv_aware"

    def __init__(self, index: KVIndex, balance_factor: float = 1.5):
        if not balance_factor >= 1.0:
            raise ValueError(f"balance_factor must be >= 1, got {balance_factor}")
        self.index = index
        self.balance_factor = balance_factor
        self._last: tuple | None = None  # (prompt, salt, {worker id: matched tokens}) of the last pick
        self._hashes: tuple | None = None  # (prompt, salt, {(block size, salt): its block hashes})

    def matched_tokens(self, candidates: Sequence[WorkerInfo], prompt_token_ids: Sequence[int],
                       cache_salt: bytes = b"") -> list[float]:
        """Per candidate, the prompt tokens it holds (whole blocks from the first), a token held only in a
        lower tier counting 1 minus what loading it costs that worker (``_held_blocks``)."""
        memo = self._hashes  # the decode pick and the prefill pick of one request hash it once
        if memo is None or memo[0] is not prompt_token_ids or memo[1] != cache_salt:
            memo = self._hashes = (prompt_token_ids, cache_salt, {})
        hashes: dict[tuple[int, int], list[bytes]] = memo[2]
        matched = []
        for w in candidates:
            if w.prefix_cache_salt is None or w.block_size <= 0:
                matched.append(0)
                continue
            key = (w.block_size, w.prefix_cache_salt)
            if key not in hashes:
                hashes[key] = prompt_block_hashes(prompt_token_ids, w.block_size, w.prefix_cache_salt,
                                                  cache_salt or ROOT_HASH)
            tiers = self.index.prefix_tiers(w.worker_id, hashes[key], full_groups(w))
            matched.append(w.block_size * _held_blocks(w, tiers))
        return matched

    def cached_tokens(self, worker, prompt_token_ids, cache_salt=b""):
        last = self._last
        if last is not None and last[0] is prompt_token_ids and last[1] == cache_salt and worker.worker_id in last[2]:
            return int(last[2][worker.worker_id])  # priced by the pick just made
        return int(self.matched_tokens([worker], prompt_token_ids, cache_salt)[0])

    def pick(self, role, candidates, prompt_token_ids=(), cache_salt=b""):
        matched = self.matched_tokens(candidates, prompt_token_ids, cache_salt)
        self._last = (prompt_token_ids, cache_salt, {w.worker_id: m for w, m in zip(candidates, matched)})
        speeds = [w.prefill_tokens_per_s for w in candidates]
        timed = all(s is not None for s in speeds)
        capacity = bounded_load_capacity(sum(w.num_outstanding for w in candidates), len(candidates),
                                         self.balance_factor)

        def price(i: int) -> tuple:
            w = candidates[i]
            tokens = w.prefill_pending_tokens + len(prompt_token_ids) - matched[i]
            return (w.num_outstanding >= capacity, tokens / speeds[i] if timed else tokens, load_key(w, i))

        best = min(range(len(candidates)), key=price)
        cheapest = min(range(len(candidates)), key=lambda i: price(i)[1:])
        if cheapest != best and matched[cheapest] > matched[best]:
            return candidates[best], "kv_spill"  # the worker holding more of the prompt was too busy
        return candidates[best], "kv_hit" if matched[best] > 0 else "kv_miss"


def pick_bounded(ring: HashRing, key: int, nodes: dict[str, WorkerInfo], load: Callable[[WorkerInfo], int],
                 balance_factor: float) -> tuple[WorkerInfo, bool]:
    """Consistent hashing with bounded loads: the first node clockwise from ``key`` below capacity.

    Returns (the node, whether it is not the key's owner). ``nodes`` are the ring's nodes
    with their loads (``load``, requests in flight); see ``bounded_load_capacity``.
    """
    capacity = bounded_load_capacity(sum(load(w) for w in nodes.values()), len(nodes), balance_factor)
    for i, node_id in enumerate(ring.walk(key)):
        if load(nodes[node_id]) < capacity:
            return nodes[node_id], i > 0
    raise AssertionError("bounded loads: no node below capacity")  # capacity > average: unreachable


def make_policy(name: str, prefix_blocks: int = 4, balance_factor: float = 1.5,
                kv_index: KVIndex | None = None) -> RoutingPolicy:
    """The policy ``--routing-policy`` names (``kv_aware`` reads ``kv_index``).

    Raises:
        ValueError: an unknown name (one of ``ROUTING_POLICIES`` is needed), bad prefix_aware settings,
            or kv_aware without an index.
    """
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_loaded":
        return LeastLoadedPolicy()
    if name == "prefix_aware":
        return PrefixAwarePolicy(prefix_blocks, balance_factor)
    if name == "kv_aware":
        if kv_index is None:
            raise ValueError("the kv_aware routing policy needs the router's KV index")
        return KVAwarePolicy(kv_index, balance_factor)
    raise ValueError(f"routing policy must be one of {', '.join(ROUTING_POLICIES)}, got {name!r}")


def prefers_local_prefill(decode_worker: WorkerInfo, prefill_worker: WorkerInfo, num_prompt_tokens: int,
                          margin_s: float, margin_per_request_s: float = 0.0, decode_cached_tokens: int = 0,
                          prefill_cached_tokens: int = 0) -> bool:
    """Load-aware prefill placement: should ``decode_worker`` prefill this prompt itself rather than
    ``prefill_worker``?

    A prefill pool sized for the average load falls behind in bursts, and then every prompt waits
    in its queue while the decode worker, memory-bound at small batches, has compute to spare
    (vLLM calls a local prefill on the decode side conditional disaggregation; Splitwise and
    DynaServe move prefills between pools by load). Each worker's queue is the router's count of
    prompt tokens routed to it to prefill whose first token has not come back
    (``prefill_pending_tokens``); its speed is what its heartbeats measured
    (``prefill_tokens_per_s``; a decode worker that never prefilled is taken to be as fast as the
    prefill worker, the same model on the same kind of machine). The prompt goes local when

        (decode queue + prompt - decode cached) / decode speed + margin
            < (prefill queue + prompt - prefill cached) / prefill speed
        margin = margin_s + margin_per_request_s * (the decode worker's requests in flight)

    where each side's cached tokens are the prompt's leading tokens that worker holds
    (``RoutingPolicy.cached_tokens``: kv_aware reads them from the KV index, other policies know
    none): a prefill worker computes all it does not hold itself (the decode worker's hits only save
    sending), so a conversation whose history the decode worker holds and the prefill worker has
    evicted is prefilled where its KV is.

    The margin (seconds) is the price of a local prefill: the decode worker's running requests
    wait for its step, so the more of them, the dearer (a batch of 2 at light load pays little, a
    batch of 20 near saturation pays ten times that in TPOT). Never local before the prefill
    worker has measured its speed (no evidence of a queue), or when ``margin_s`` is infinite (off).
    """
    prefill_speed = prefill_worker.prefill_tokens_per_s
    if prefill_speed is None or math.isinf(margin_s):
        return False
    decode_speed = decode_worker.prefill_tokens_per_s or prefill_speed
    remote_s = (prefill_worker.prefill_pending_tokens + num_prompt_tokens - prefill_cached_tokens) / prefill_speed
    local_s = (decode_worker.prefill_pending_tokens + num_prompt_tokens - decode_cached_tokens) / decode_speed
    return local_s + margin_s + margin_per_request_s * decode_worker.num_inflight < remote_s



def pull_source(decode_worker: WorkerInfo, prefill_worker: WorkerInfo | None, peers: Sequence[WorkerInfo],
                num_prompt_tokens: int, held: Callable[[WorkerInfo], float], margin_s: float,
                margin_per_request_s: float = 0.0) -> WorkerInfo | None:
    """The decode worker among ``peers`` the prompt's KV should be pulled from, or None.

    ``decode_worker`` will decode the request and ``prefill_worker`` (None: ``decode_worker`` itself)
    was to prefill it. A peer that holds more of the prompt (``held``: the tokens the KV index says a
    worker holds, as ``KVAwarePolicy.matched_tokens`` prices them) can instead serve the request as
    its prefill worker: it computes only what its cache lacks and sends the whole prompt's KV over the
    transfer path, as a prefill worker does (``pdserve.cluster.kv_source``). Mooncake and LMCache move
    cached KV between instances the same way, instead of recomputing it. A site's price is its
    measured prefill time, ``(its pending prefill tokens + the prompt - what it holds) / its speed``,
    plus, for a decode worker that computes (the one that will decode, or the peer), the margin its
    running requests pay (``margin_s + margin_per_request_s`` x its requests in flight, as
    ``prefers_local_prefill``). The cheapest peer that holds at least a block more than the site
    wins if it is cheaper than the site. The transfer is not priced: it overlaps the peer's layers,
    as any remote prefill's does, and its bytes are those a prefill worker would send.
    """
    site = prefill_worker or decode_worker
    site_held = held(site)
    candidates = [(p, held(p)) for p in peers if p.worker_id != decode_worker.worker_id]
    candidates = [(p, h) for p, h in candidates if h >= site_held + max(1, p.block_size)]
    if not candidates or math.isinf(margin_s):
        return None
    measured = [w.prefill_tokens_per_s for w in (site, *(p for p, _ in candidates)) if w.prefill_tokens_per_s]
    fallback = measured[0] if measured else 1.0  # the same model on the same kind of machine

    def seconds(worker: WorkerInfo, worker_held: float, computes_beside_decoding: bool) -> float:
        work = max(0.0, worker.prefill_pending_tokens + num_prompt_tokens - worker_held)
        margin = margin_s + margin_per_request_s * worker.num_inflight if computes_beside_decoding else 0.0
        return work / (worker.prefill_tokens_per_s or fallback) + margin

    site_s = seconds(site, site_held, prefill_worker is None)
    best, best_s = None, site_s
    for peer, peer_held in candidates:
        peer_s = seconds(peer, peer_held, True)
        if peer_s < best_s:
            best, best_s = peer, peer_s
    return best
