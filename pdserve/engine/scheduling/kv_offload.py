"""A KV cache tier below the worker's own KV cache: host memory (``--kv-offload-memory``). No torch.

When the block manager hands out a free block that still holds a cached prefix block, that block's
KV would be lost. With an offload tier it is copied out first (an *offload*), and a later request
whose prefix runs on past the blocks still in the KV cache finds the rest here and has it copied
back (an *onload*) into freshly allocated blocks instead of recomputing it: vLLM's CPU offloading
connector, SGLang's HiCache host tier and LMCache's local CPU backend work the same way.

This module is the tier's index: which block key (the prefix cache's chained hash, as in
``pdserve.engine.scheduling.block_manager``) is in which of ``capacity`` slots, least recently used
first, with the tokens it holds (a hit is checked against them, as a KV cache hit is). The bytes
live in the model runner (``pdserve.engine.execution.kv_cache.allocate_offload_cache``: the KV cache's
layout with ``capacity`` blocks), which does the copies the block manager queues, offloads before
onloads, before the step's forward.

The block manager queues the copies as the tiers' indexes change (``TierOp``s: spill, offload, load,
onload), and the model runner runs them in that order before the step's forward, so every copy reads
what the index said was there when it was queued. One hazard is left: a slot a hit will read (once
allocation has found blocks for it) must not be given to another block before its read is queued;
such slots, in either tier, are *pinned* until the step's copies are taken
(``BlockManager.take_tier_copies``).

A disk tier (``--kv-offload-disk``) is another ``OffloadTier`` (medium ``disk``) below the host tier,
whose slots are files (``pdserve.engine.execution.kv_disk``): a block the host tier evicts is
*spilled* to it, and a hit there is *loaded* straight into its new KV cache block.
"""

from __future__ import annotations

from collections import OrderedDict


class OffloadTier:
    """LRU index of KV blocks kept in ``capacity`` slots outside the KV cache.

    Args:
        capacity: slots (blocks) in the tier, >= 1.
        medium: the tier's name in KV events (``pdserve.common.protocol.KV_MEDIA``).

    Raises:
        ValueError: a capacity below 1.
    """

    def __init__(self, capacity: int, medium: str = "host"):
        if capacity < 1:
            raise ValueError(f"an offload tier needs at least one slot, got {capacity}")
        self.capacity = capacity
        self.medium = medium
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # key -> slot, least recently used first
        self._tokens: dict[int, tuple[int, ...]] = {}  # slot -> the tokens of the block it holds
        self._free = list(range(capacity - 1, -1, -1))
        self._pinned: set[int] = set()
        self._held: set[int] = set()  # slots a prefetch reads off the step loop: pinned until it ends

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def lookup(self, key: bytes, token_ids: tuple[int, ...]) -> int | None:
        """The slot holding block ``key`` with ``token_ids`` (now the most recently used), or None."""
        slot = self._slots.get(key)
        if slot is None or self._tokens[slot] != token_ids:
            return None
        self._slots.move_to_end(key)
        return slot

    def tokens(self, slot: int) -> tuple[int, ...]:
        return self._tokens[slot]

    def blocks(self) -> list[tuple[bytes, tuple[int, ...]]]:
        """(key, token_ids) of every block held, least recently used first."""
        return [(key, self._tokens[slot]) for key, slot in self._slots.items()]

    def put(self, key: bytes, token_ids: tuple[int, ...]) -> tuple[int, bytes | None, tuple[int, ...]] | None:
        """Give block ``key`` a slot, evicting the least recently used unpinned block if the tier is full.

        Returns (slot, the evicted key or None, its tokens); None when ``key`` is already here (it is
        touched) or every slot is pinned."""
        if key in self._slots:
            self._slots.move_to_end(key)
            return None
        evicted, evicted_tokens = None, ()
        if self._free:
            slot = self._free.pop()
        else:
            victim = next((k for k, s in self._slots.items() if s not in self._pinned and s not in self._held), None)
            if victim is None:
                return None
            slot = self._slots.pop(victim)
            evicted, evicted_tokens = victim, self._tokens[slot]
        self._slots[key] = slot
        self._tokens[slot] = tuple(token_ids)
        return slot, evicted, evicted_tokens

    def adopt(self, key: bytes, token_ids: tuple[int, ...], slot: int) -> None:
        """Enter a block already held in ``slot`` (a disk tier's file found at start-up).

        Raises:
            ValueError: the slot is out of range or taken, or the key is here already."""
        if not 0 <= slot < self.capacity or slot not in self._free or key in self._slots:
            raise ValueError(f"slot {slot} cannot take a block (capacity {self.capacity})")
        self._free.remove(slot)
        self._slots[key] = slot
        self._tokens[slot] = tuple(token_ids)

    def pin(self, slot: int) -> None:
        self._pinned.add(slot)

    def unpin_all(self) -> None:
        self._pinned.clear()

    def hold(self, slot: int) -> None:
        """Pin ``slot`` until ``release``: a prefetch reads it off the step loop."""
        self._held.add(slot)

    def release(self, slot: int) -> None:
        self._held.discard(slot)

    def clear(self) -> list[bytes]:
        """Forget every block but those a prefetch is reading (pinned or not); returns their keys."""
        keys = [key for key, slot in self._slots.items() if slot not in self._held]
        for key in keys:
            slot = self._slots.pop(key)
            del self._tokens[slot]
            self._free.append(slot)
        self._pinned.clear()
        return keys


# A cost needs this much behind it before it decides anything: blocks copied for a tier's load
# speed, prompt tokens computed for the recompute speed (as the router's registry counts them).
MIN_MEASURED_LOAD_BLOCKS = 8
MIN_MEASURED_PREFILL_TOKENS = 256


class TierCosts:
    """Whether a prefix hit in a lower tier is worth loading: the worker's own measured seconds to
    bring a block back from each tier against the seconds to recompute it.

    A hit can lose to recomputing it (an SGLang user measured an 8K-token file-tier hit at 2.45 s TTFT
    against 1.73 s recomputed; LMCache and SGLang HiCache load whatever they find). Both sides are
    measured on this worker, cumulatively: a tier's load speed from the copies its hits ran (seconds
    per block, ``observe_load``), the recompute speed from the steps that computed prompt tokens
    (seconds per token times the block size, ``observe_prefill``). Both are linear in blocks, so a
    tier is either worth loading for every hit or for none; until both are measured (a tier's first
    ``MIN_MEASURED_LOAD_BLOCKS`` blocks, the first ``MIN_MEASURED_PREFILL_TOKENS`` prompt tokens) its
    hits are loaded. Recomputing later blocks of a long prompt costs more than the mean (attention
    grows with the context), so this errs towards recomputing.

    Args:
        block_size: tokens per block.
    """

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._prefill = [0, 0.0]  # prompt tokens computed, seconds
        self._load: dict[str, list] = {}  # medium -> [blocks loaded, seconds]

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step computed ``num_tokens`` prompt tokens in ``seconds`` (its tier copies excluded)."""
        self._prefill[0] += num_tokens
        self._prefill[1] += seconds

    def observe_load(self, medium: str, num_blocks: int, seconds: float) -> None:
        """``num_blocks`` blocks came back from tier ``medium`` in ``seconds``."""
        entry = self._load.setdefault(medium, [0, 0.0])
        entry[0] += num_blocks
        entry[1] += seconds

    def recompute_s(self) -> float | None:
        """Measured seconds to recompute one block, or None before enough prompt tokens were computed."""
        tokens, seconds = self._prefill
        if tokens < MIN_MEASURED_PREFILL_TOKENS or seconds <= 0:
            return None
        return seconds / tokens * self.block_size

    def load_s(self, medium: str) -> float | None:
        """Measured seconds to load one block from tier ``medium``, or None before enough were."""
        blocks, seconds = self._load.get(medium, (0, 0.0))
        return seconds / blocks if blocks >= MIN_MEASURED_LOAD_BLOCKS else None

    def worth_loading(self, medium: str) -> bool:
        """True unless both speeds are measured and loading a block from ``medium`` is the slower."""
        load, recompute = self.load_s(medium), self.recompute_s()
        return load is None or recompute is None or load < recompute

    def saved_s(self, medium: str) -> float:
        """Seconds one block loaded from ``medium`` saves against recomputing it (0 until both are
        measured; negative would mean a bad decision, which ``worth_loading`` refuses)."""
        load, recompute = self.load_s(medium), self.recompute_s()
        return 0.0 if load is None or recompute is None else recompute - load
