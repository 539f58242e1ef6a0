"""The router's index of which worker caches which KV block in which tier, fed by KV events.

Pure Python, no sockets. Each worker publishes numbered ``KVEventBatch``es
(``pdserve.cluster.kv_events``); ``KVIndex.apply`` folds them into one map from a block's key (its
chained hash, and the KV cache group for groups past 0: the block manager's own prefix-cache key)
to the workers holding it and in which tiers (a bit per ``KV_MEDIA`` entry). Every router of a tier
gets every batch and keeps its own index, so they agree without talking to each other.

Sequence numbers make it exact rather than a guess. A batch applies only right after the last one
applied from the same worker process (``instance``); a gap (a batch lost while this router was
down, or a router that met the worker late) drops the batch and ``apply`` answers the seq to ask
for (``KVEventsReplay``), once per ``replay_retry_s``; a snapshot batch replaces what the index
held for the worker. A worker that restarted (new ``instance``) starts from nothing.

Memory is bounded: a worker's entries are capped at ``capacity_factor`` times the blocks it
advertised (every tier counted); a worker past its cap is treated as out of step (its entries are
dropped and a snapshot asked for). A worker that leaves the pool is ``forget``-ten.

``matched_blocks`` answers the routing question (vLLM's and Dynamo's KV-aware routers): how many
of a prompt's first blocks a worker holds, and in which tiers.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

from pdserve.common.protocol import (
    KV_MEDIA,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

_MEDIUM_BIT = {m: 1 << i for i, m in enumerate(KV_MEDIA)}
DEVICE_BIT = _MEDIUM_BIT["device"]
HOST_BIT = _MEDIUM_BIT["host"]
DISK_BIT = _MEDIUM_BIT["disk"]


def block_key(block_hash: bytes, group: int) -> bytes:
    """The index's key of a block (the block manager's prefix-cache key)."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


@dataclasses.dataclass
class _WorkerState:
    instance: int | None = None
    seq: int | None = None  # last batch applied (None: none since the index met this instance)
    replay_asked_at: float | None = None
    keys: set[bytes] = dataclasses.field(default_factory=set)
    capacity: int = 0


class KVIndex:
    """Block key -> {worker id: tier bits}, kept exact by KV event sequence numbers.

    Args:
        capacity_factor: a worker's entries are capped at this times its advertised blocks.
        replay_retry_s: a replay asked for and not answered is asked again after this long.
        now: the clock (``time.monotonic``; tests pass their own).

    Counters: ``num_batches`` applied, ``num_gaps`` (batches dropped out of order),
    ``num_replays_asked``, ``num_snapshots`` applied, ``num_overflows`` (workers past their cap).
    """

    def __init__(self, capacity_factor: float = 2.0, replay_retry_s: float = 2.0,
                 now: Callable[[], float] = time.monotonic):
        self.capacity_factor = capacity_factor
        self.replay_retry_s = replay_retry_s
        self._now = now
        self._holders: dict[bytes, dict[str, int]] = {}
        self._workers: dict[str, _WorkerState] = {}
        self.num_batches = self.num_gaps = self.num_replays_asked = self.num_snapshots = self.num_overflows = 0

    # ---- feeding ----------------------------------------------------------------------

    @property
    def num_entries(self) -> int:
        """(block, worker) pairs held."""
        return sum(len(w.keys) for w in self._workers.values())

    def num_blocks(self, worker_id: str) -> int:
        """Blocks (of any group) the index says ``worker_id`` caches."""
        state = self._workers.get(worker_id)
        return len(state.keys) if state else 0

    def meet(self, worker_id: str, num_blocks: int) -> int | None:
        """A worker registered, advertising ``num_blocks`` blocks over its tiers: the seq to ask a replay
        from when the index has nothing from it yet (its cache may predate this router), else None."""
        state = self._workers.setdefault(worker_id, _WorkerState())
        state.capacity = max(1, int(num_blocks * self.capacity_factor))
        return self._ask(state, 0) if state.seq is None else None

    def forget(self, worker_id: str) -> None:
        """Drop everything about a worker (it left the pool, or a new process took its id)."""
        state = self._workers.pop(worker_id, None)
        if state is not None:
            self._clear(worker_id, state)

    def apply(self, batch: KVEventBatch) -> int | None:
        """Fold one batch in. Returns the seq to ask the worker to replay from when the batch left a
        gap (and no replay was asked within ``replay_retry_s``), else None."""
        state = self._workers.setdefault(batch.worker_id, _WorkerState(capacity=1 << 62))
        if batch.instance != state.instance:  # a new worker process: what the old one cached is gone
            self._clear(batch.worker_id, state)
            state.instance, state.seq, state.replay_asked_at = batch.instance, None, None
        if batch.snapshot:
            if state.seq is not None and batch.seq < state.seq:
                return None  # older than what is applied (a late answer to an earlier replay)
            self._clear(batch.worker_id, state)
            self.num_snapshots += 1
        elif state.seq is not None and batch.seq <= state.seq:
            return None  # a duplicate (a replay overlapping what arrived)
        elif batch.seq != (0 if state.seq is None else state.seq + 1):
            self.num_gaps += 1
            return self._ask(state, 0 if state.seq is None else state.seq + 1)
        for event in batch.events:
            self._apply_event(batch.worker_id, state, event)
        state.seq, state.replay_asked_at = batch.seq, None
        self.num_batches += 1
        if len(state.keys) > state.capacity:  # out of step with the worker: start over from a snapshot
            self.num_overflows += 1
            self._clear(batch.worker_id, state)
            state.seq = None
            return self._ask(state, 0)
        return None

    def _ask(self, state: _WorkerState, from_seq: int) -> int | None:
        now = self._now()
        if state.replay_asked_at is not None and now - state.replay_asked_at < self.replay_retry_s:
            return None
        state.replay_asked_at = now
        self.num_replays_asked += 1
        return from_seq

    def _apply_event(self, worker_id: str, state: _WorkerState, event) -> None:
        if isinstance(event, BlockStored):
            bit = _MEDIUM_BIT.get(event.medium, 1)
            for block_hash in event.block_hashes:
                key = block_key(block_hash, event.group)
                holders = self._holders.setdefault(key, {})
                holders[worker_id] = holders.get(worker_id, 0) | bit
                state.keys.add(key)
        elif isinstance(event, BlockRemoved):
            bit = _MEDIUM_BIT.get(event.medium, 1)
            for block_hash in event.block_hashes:
                key = block_key(block_hash, event.group)
                holders = self._holders.get(key)
                if holders is None or worker_id not in holders:
                    continue
                bits = holders[worker_id] & ~bit
                if bits:
                    holders[worker_id] = bits
                else:
                    del holders[worker_id]
                    state.keys.discard(key)
                    if not holders:
                        del self._holders[key]
        elif isinstance(event, AllBlocksCleared):
            self._clear(worker_id, state)

    def _clear(self, worker_id: str, state: _WorkerState) -> None:
        for key in state.keys:
            holders = self._holders.get(key)
            if holders is not None:
                holders.pop(worker_id, None)
                if not holders:
                    del self._holders[key]
        state.keys = set()

    # ---- reading ----------------------------------------------------------------------

    def tiers(self, key: bytes, worker_id: str) -> tuple[str, ...]:
        """The tiers (``KV_MEDIA`` names) in which ``worker_id`` holds the block ``key``."""
        bits = self._holders.get(key, {}).get(worker_id, 0)
        return tuple(m for m, b in _MEDIUM_BIT.items() if bits & b)

    def matched_blocks(self, worker_id: str, block_hashes: Sequence[bytes], groups: Sequence[int] = (0,)) -> int:
        """How many of ``block_hashes`` (a prompt's chained block hashes, in order) ``worker_id`` holds
        from the first one on without a break, in every one of ``groups`` (the KV cache groups a hit
        needs whole), in any tier."""
        return len(self.prefix_tiers(worker_id, block_hashes, groups))

    def prefix_tiers(self, worker_id: str, block_hashes: Sequence[bytes], groups: Sequence[int] = (0,)) -> list[int]:
        """``matched_blocks``' blocks, each as the tiers that hold it (a bit per ``KV_MEDIA`` entry, the
        tiers every group has it in)."""
        tiers: list[int] = []
        for block_hash in block_hashes:
            bits = -1
            for group in groups:
                holders = self._holders.get(block_key(block_hash, group))
                bits &= holders.get(worker_id, 0) if holders is not None else 0
            if bits <= 0:
                break
            tiers.append(bits)
        return tiers
