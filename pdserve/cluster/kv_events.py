"""A worker's KV events: what its prefix cache gained and lost, numbered, for every router.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` in ``KVEventBatch``es over
ZeroMQ with sequence numbers and a replay buffer (its ``kv_events`` publisher), and Dynamo's and
llm-d's routers build their index of who caches what from them. pdserve does the same over the
worker's own mailbox: after each step the worker hands the block manager's recorded events to
``KVEventPublisher.poll``, which numbers them as one batch (``seq`` 0, 1, 2, ... per process, named
by a random ``instance``) and keeps the last ``replay_batches`` for a router that missed some. Every
router of the tier gets every batch (``WorkerBase.publish_kv_events``).

A router that sees a gap (a batch lost in a router restart, or a router that joined late) sends
``KVEventsReplay(from_seq)``; ``replay`` answers with the kept batches from there, or, when they
are gone, with a snapshot: one batch of ``AllBlocksCleared`` and every block cached now, numbered
as the last batch sent, so what follows it continues the sequence.

What an event names is exactly what a request can reuse: a full block of one KV cache group,
findable by its chained hash (``pdserve.engine.scheduling.block_manager``), in the tier ``medium``.
"""

from __future__ import annotations

import collections
import random
import time

from pdserve.common.protocol import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from pdserve.engine.scheduling.block_manager import BlockManager, split_key


def to_kv_events(raw: list[tuple], block_size: int) -> list[KVEvent]:
    """The block manager's recorded events (``BlockManager.take_kv_events``) as protocol events, in
    order: consecutive stores of one group and tier that chain (each block's parent is the previous
    block) become one ``BlockStored``, consecutive removals of one group and tier one ``BlockRemoved``."""
    events: list[KVEvent] = []
    last_hash = None
    for item in raw:
        block_hash, group = split_key(item[1])
        prev = events[-1] if events else None
        medium = item[-1]
        if item[0] == "stored":
            parent = item[2] or None
            if isinstance(prev, BlockStored) and prev.group == group and prev.medium == medium \
                    and parent is not None and parent == last_hash:
                prev.block_hashes.append(block_hash)
                prev.token_ids.extend(item[3])
            else:
                events.append(BlockStored(block_hashes=[block_hash], parent_block_hash=parent,
                                          token_ids=list(item[3]), block_size=block_size, medium=medium,
                                          group=group))
            last_hash = block_hash
        else:
            if isinstance(prev, BlockRemoved) and prev.group == group and prev.medium == medium:
                prev.block_hashes.append(block_hash)
            else:
                events.append(BlockRemoved(block_hashes=[block_hash], medium=medium, group=group))
            last_hash = None
    return events


class KVEventPublisher:
    """Numbers a worker's KV events into batches and answers replays.

    Args:
        worker_id: the worker's id, named in every batch.
        block_manager: whose recorded events are published (recording is switched on here).
        replay_batches: how many of the last batches are kept for ``replay``.

    Attributes:
        instance: a random 63-bit id of this process (a restarted worker numbers from 0 again).
        seq: the last batch's number (-1 before the first).
    """

    def __init__(self, worker_id: str, block_manager: BlockManager, replay_batches: int = 1024):
        if replay_batches < 1:
            raise ValueError(f"replay_batches must be >= 1, got {replay_batches}")
        self.worker_id = worker_id
        self.block_manager = block_manager
        block_manager.enable_kv_events()
        self.instance = random.getrandbits(63)
        self.seq = -1
        self._kept: collections.deque[KVEventBatch] = collections.deque(maxlen=replay_batches)
        if block_manager.cached_blocks():  # a disk tier found at start (warm restart): batch 0 says so, to
            # every router, which asks each worker it meets for a replay from 0
            self.seq = 0
            self._kept.append(self.snapshot())

    def _batch(self, events: list[KVEvent], snapshot: bool = False) -> KVEventBatch:
        return KVEventBatch(worker_id=self.worker_id, instance=self.instance, seq=self.seq, ts=time.time(),
                            events=events, snapshot=snapshot)

    def poll(self) -> KVEventBatch | None:
        """The events recorded since the last poll as the next batch (kept for replay); None if none."""
        raw = self.block_manager.take_kv_events()
        if not raw:
            return None
        self.seq += 1
        batch = self._batch(to_kv_events(raw, self.block_manager.block_size))
        self._kept.append(batch)
        return batch

    def replay(self, from_seq: int) -> list[KVEventBatch]:
        """The batches from ``from_seq`` to the last one, or ``[snapshot()]`` when some are no longer
        kept. Poll first: a snapshot shows the cache as it is now, which must be the state after
        batch ``seq``. Empty when ``from_seq`` is past the last batch."""
        if from_seq > self.seq:
            return []
        if self._kept and self._kept[0].seq <= max(from_seq, 0):
            return [b for b in self._kept if b.seq >= from_seq]
        return [self.snapshot()]

    def snapshot(self) -> KVEventBatch:
        """``AllBlocksCleared`` and one ``BlockStored`` per KV cache group and tier holding every cached
        block, numbered ``seq`` (the state after the last batch; not kept for replay)."""
        bs = self.block_manager.block_size
        by_group: dict[tuple[int, str], BlockStored] = {}
        for key, tokens, medium in self.block_manager.cached_blocks():
            block_hash, group = split_key(key)
            stored = by_group.get((group, medium))
            if stored is None:
                stored = by_group[group, medium] = BlockStored(block_hashes=[], token_ids=[], block_size=bs,
                                                               group=group, medium=medium)
            stored.block_hashes.append(block_hash)
            stored.token_ids.extend(tokens)
        return self._batch([AllBlocksCleared(), *by_group.values()], snapshot=True)
