"""Pure-Python paged KV block manager with prefix caching (no torch).

The KV cache is split into ``num_blocks`` fixed-size blocks of ``block_size``
token slots (PagedAttention, Kwon et al., SOSP 2023). A request owns a
``block_table: list[int]`` mapping its logical block i to a physical block id.
This module hands out physical blocks, counts references to them (a block may
be shared by several requests, e.g. the n samples of one prompt, or requests
with a common prefix), and remembers which full blocks hold which tokens.

Prefix caching (as in vLLM / SGLang's RadixAttention): a full block is named by
a SHA-256 hash chained through the previous block's hash and salted with what
else changes its KV (the model), so equal hashes mean equal prefixes (a
collision would need a SHA-256 collision). A hit is also checked against the
block's stored token ids.

Free block queue and eviction policy (LRU): a block whose last reference is
dropped goes to the tail of the free queue but keeps its hash, so it can still
be hit. Allocation takes from the head, the least recently freed block,
evicting its hash if it has one. A request frees its blocks last-to-first, so
the tail of a prompt, the part least likely to be shared, is evicted before
its head.

An offload tier (``pdserve.engine.scheduling.kv_offload``, ``--kv-offload-memory``): a cached block
about to be evicted is first queued to be copied into the tier (``take_tier_copies``), and
``find_offloaded`` continues a prefix hit there (and in a disk tier below it); ``adopt_offloaded``
gives such blocks KV cache blocks again and queues their copies back.

KV events (vLLM's ``BlockStored`` / ``BlockRemoved``): once ``enable_kv_events`` is called, every
block that enters or leaves the prefix cache or the offload tier is recorded, in order, until
``take_kv_events`` hands them over (the worker publishes them to the routers after each step:
``pdserve.cluster.kv_events``).
"""

from __future__ import annotations

import functools
import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from pdserve.common.protocol import TierOp, TierOpKind
from pdserve.engine.scheduling.kv_offload import OffloadTier, TierCosts

ROOT_HASH = b""  # the "previous block" of a sequence's first block


def split_key(key: bytes) -> tuple[bytes, int]:
    """(block hash, KV cache group) of a prefix cache key made by ``_key``."""
    return (key, 0) if len(key) <= 32 else (key[:32], int.from_bytes(key[32:], "little"))


def _key(block_hash: bytes, group: int) -> bytes:
    """The prefix cache's key of a block of KV cache group ``group`` with hash ``block_hash``: groups hold
    different layers, so the same tokens' blocks of two groups are different cache entries."""
    return block_hash if group == 0 else block_hash + group.to_bytes(2, "little")


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


def chain_hash(parent_hash: bytes, token_ids: Sequence[int], salt: int = 0) -> bytes:
    """SHA-256 of a full block given the previous block's hash (``ROOT_HASH`` for the first block).

    The same in every process; 32 bytes.
    """
    return hashlib.sha256(b"".join((parent_hash, _salt_bytes(salt), array("q", token_ids).tobytes()))).digest()


@functools.lru_cache(maxsize=64)
def _salt_bytes(salt: int) -> bytes:
    return salt.to_bytes(8, "little", signed=False)


def block_hashes(token_ids: Sequence[int], max_tokens: int, block_size: int, salt: int = 0,
                 root_hash: bytes = ROOT_HASH) -> list[bytes]:
    """The chained hashes of the full blocks of ``token_ids[:max_tokens]``, the first chained from
    ``root_hash``: what a prefix cache looks a prompt up by (``KVCacheManager.find_prefix``, and the
    router's ``kv_aware`` policy, which hashes as each worker does)."""
    hashes: list[bytes] = []
    parent = root_hash
    for start in range(0, max_tokens - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size], salt)
        hashes.append(parent)
    return hashes


class BlockManager:
    """Hands out KV cache block ids, reference-counts them, and caches full blocks by hash.

    Args:
        num_blocks: physical blocks in the KV cache (ids ``0 .. num_blocks-1``).
        block_size: token slots per block.
        enable_prefix_caching: keep full blocks findable by hash after they are freed.
        salt: mixed into every block hash (identify the model, so two models never share KV).
        offload: the tier evicted cached blocks are copied to (None: they are lost); needs prefix caching.
        disk: the tier the offload tier's evicted blocks are spilled to (None: they are lost); needs ``offload``.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, salt: int = 0,
                 offload: OffloadTier | None = None, disk: OffloadTier | None = None):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.salt = salt
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # head = LRU
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # block hash -> block id
        # Recorded KV events (None: not recorded): ("stored", key, parent_hash, token_ids, medium) /
        # ("removed", key, medium)
        self._kv_events: list[tuple] | None = None
        self.offload = offload if enable_prefix_caching else None
        self.disk = disk if self.offload is not None else None
        self._tier_ops: list[TierOp] = []  # copies queued for the next step, to run in this order
        self.num_offloaded = self.num_onloaded = 0  # blocks copied out to / back from the host tier, ever
        self.num_spilled = self.num_loaded = 0  # blocks written to / read from the disk tier, ever
        # Whether a hit in a tier is worth loading (the engine feeds it the measured speeds), and what
        # the tiers' hits did: hits recomputed because loading was dearer, seconds loading saved
        self.tier_costs = TierCosts(block_size)
        # Prefetches (tier hits read off the step loop): id -> what finish_prefetch needs; those not yet
        # handed to the runner, with their copies
        self._prefetches: dict[int, tuple] = {}
        self._prefetch_starts: list[tuple[int, list[TierOp]]] = []
        self._next_prefetch = 0
        self.num_declined = {"host": 0, "disk": 0}
        self.tier_saved_s = {"host": 0.0, "disk": 0.0}

    # ---- sizes ----------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests, in [0, 1] (vLLM's KV cache usage)."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    # ---- allocation -----------------------------------------------------------

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ref count 1.

        A cached block taken this way is evicted from the prefix cache.

        Raises:
            NoFreeBlocksError: fewer than ``num_blocks`` are free (nothing is taken).
        """
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"need {num_blocks} KV blocks, {len(self._free)} free of {self.num_blocks}")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            if self.offload is not None and self._block_hash[block_id] is not None:
                self._offload(block_id)
            self._evict(block_id)
            self._ref_counts[block_id] = 1
            block_ids.append(block_id)
        block_ids.sort()  # the same blocks; a request freed them last-to-first, so they come back adjacent
        return block_ids

    def share(self, block_ids: Sequence[int]) -> None:
        """Add one reference to each block, including cached blocks that no request holds."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                if self._block_hash[block_id] is None:
                    raise ValueError(f"block {block_id} is free and holds no cached KV")
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def is_writable(self, block_id: int) -> bool:
        """True if writing into the block in place cannot change KV that others rely on.

        A shared block, or one in the prefix cache, must be copied first (copy-on-write).
        """
        return self._ref_counts[block_id] == 1 and self._block_hash[block_id] is None

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching zero go to the free queue's tail.

        Blocks are released last-to-first, so a request's tail blocks are evicted
        before its head blocks.

        Raises:
            ValueError: a block that is already free (a double free is a bug).
        """
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"double free of KV block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    # ---- prefix cache ----------------------------------------------------------

    def find_cached_prefix(self, token_ids: Sequence[int], max_tokens: int,
                           root_hash: bytes = ROOT_HASH, group: int = 0,
                           known_hashes: Sequence[bytes] = ()) -> tuple[list[int], list[bytes]]:
        """Longest run of cached full blocks that prefixes ``token_ids[:max_tokens]``, the first
        block's hash chained from ``root_hash`` (a LoRA adapter's own root: ``Request.cache_root``),
        among KV cache group ``group``'s blocks (``pdserve.common.kv_cache_groups``).
        ``known_hashes``: the chained hashes of the first full blocks, already computed (the request's
        prompt hashes: ``KVCacheManager.prompt_hashes``); blocks past them are hashed here.

        Takes no references (call ``share`` on the result to keep the blocks).

        Returns:
            (block_ids, block_hashes) of the hit blocks, in order.
        """
        hits: list[int] = []
        hashes: list[bytes] = []
        if not self.enable_prefix_caching:
            return hits, hashes
        bs = self.block_size
        parent = root_hash
        num_known = len(known_hashes)
        for i, start in enumerate(range(0, max_tokens - bs + 1, bs)):
            block_tokens = tuple(token_ids[start:start + bs])
            block_hash = known_hashes[i] if i < num_known else chain_hash(parent, block_tokens, self.salt)
            block_id = self.cached_block(block_hash, block_tokens, group)
            if block_id is None:
                break
            hits.append(block_id)
            hashes.append(block_hash)
            parent = block_hash
        return hits, hashes

    def cached_block(self, block_hash: bytes, token_ids: tuple[int, ...], group: int = 0) -> int | None:
        """The block of group ``group`` cached under ``block_hash`` and holding ``token_ids``, or None."""
        block_id = self._cached.get(_key(block_hash, group))
        if block_id is None or self._block_tokens[block_id] != token_ids:
            return None
        return block_id

    def cache_block(self, block_id: int, parent_hash: bytes, token_ids: Sequence[int], group: int = 0) -> bytes:
        """Record that full block ``block_id`` (of KV cache group ``group``) holds ``token_ids`` after
        ``parent_hash``; return its hash.

        If an equal block is already cached, the existing one stays the cache's
        entry (this one is simply not findable).
        """
        block_hash = chain_hash(parent_hash, token_ids, self.salt)
        self.cache_hashed_block(block_id, block_hash, token_ids, group, parent_hash)
        return block_hash

    def cache_hashed_block(self, block_id: int, block_hash: bytes, token_ids: Sequence[int], group: int = 0,
                           parent_hash: bytes | None = None) -> None:
        """``cache_block`` with the hash already computed (one hash names a block of every group);
        ``parent_hash`` only goes into the KV event."""
        key = _key(block_hash, group)
        if self.enable_prefix_caching and key not in self._cached and self._block_hash[block_id] is None:
            self._cached[key] = block_id
            self._block_hash[block_id] = key
            self._block_tokens[block_id] = tuple(token_ids)
            if self._kv_events is not None:
                self._kv_events.append(("stored", key, parent_hash, self._block_tokens[block_id], "device"))

    def _evict(self, block_id: int) -> None:
        block_hash = self._block_hash[block_id]
        if block_hash is not None:
            del self._cached[block_hash]
            self._block_hash[block_id] = None
            self._block_tokens[block_id] = None
            if self._kv_events is not None:
                self._kv_events.append(("removed", block_hash, "device"))

    # ---- KV events -----------------------------------------------------------------

    def enable_kv_events(self) -> None:
        """Start recording KV events (a no-op without prefix caching: nothing is ever cached)."""
        if self.enable_prefix_caching and self._kv_events is None:
            self._kv_events = []

    def take_kv_events(self) -> list[tuple]:
        """The events recorded since the last call, oldest first; each ``("stored", key, parent_hash,
        token_ids, medium)`` or ``("removed", key, medium)``, ``key`` as ``split_key`` reads it."""
        events = self._kv_events or []
        if self._kv_events:
            self._kv_events = []
        return events

    def cached_blocks(self) -> list[tuple[bytes, tuple[int, ...], str]]:
        """(key, token_ids, medium) of every block in the prefix cache and the offload tier, in no
        particular order (a KV events snapshot)."""
        blocks = [(key, self._block_tokens[block_id], "device") for key, block_id in self._cached.items()]
        for tier in (self.offload, self.disk):
            if tier is not None:
                blocks += [(key, tokens, tier.medium) for key, tokens in tier.blocks()]
        return blocks

    def reset_prefix_cache(self) -> None:
        """Forget every cached block that no request holds, and the offload tier's."""
        for block_id in list(self._free):
            self._evict(block_id)
        if self.offload is not None:  # (the disk tier stays; queued copies still run, in order)
            for key in self.offload.clear():
                self._record("removed", key, self.offload.medium)

    # ---- offload tier ------------------------------------------------------------------

    def _record(self, kind: str, key: bytes, medium: str, parent: bytes | None = None,
                tokens: tuple[int, ...] = ()) -> None:
        if self._kv_events is not None:
            self._kv_events.append((kind, key, parent, tokens, medium) if kind == "stored" else (kind, key, medium))

    def _offload(self, block_id: int) -> None:
        """Queue the copy of cached block ``block_id`` into the offload tier (it is being reused)."""
        key, tokens = self._block_hash[block_id], self._block_tokens[block_id]
        slot = self._host_slot(key, tokens)
        if slot is None:  # already there (touched), or every slot is pinned
            return
        self._tier_ops.append(TierOp(kind=TierOpKind.OFFLOAD, src=block_id, dst=slot))
        self.num_offloaded += 1

    def _host_slot(self, key: bytes, tokens: tuple[int, ...]) -> int | None:
        """A host tier slot for block ``key``, its previous block spilled to the disk tier (queued), or
        None when the key is there already or every slot is pinned."""
        placed = self.offload.put(key, tokens)
        if placed is None:
            return None
        slot, evicted, evicted_tokens = placed
        if evicted is not None:
            self._record("removed", evicted, self.offload.medium)
            if self.disk is not None:
                self._spill(slot, evicted, evicted_tokens)
        self._record("stored", key, self.offload.medium, None, tokens)
        return slot

    def _spill(self, host_slot: int, key: bytes, tokens: tuple[int, ...]) -> None:
        placed = self.disk.put(key, tokens)
        if placed is None:
            return
        disk_slot, evicted, _ = placed
        if evicted is not None:
            self._record("removed", evicted, self.disk.medium)
        self._tier_ops.append(TierOp(kind=TierOpKind.SPILL, src=host_slot, dst=disk_slot, key=key, tokens=list(tokens)))
        self.num_spilled += 1
        self._record("stored", key, self.disk.medium, None, tokens)

    def find_offloaded(self, token_ids: Sequence[int], first_block: int, parent_hash: bytes,
                       max_tokens: int) -> tuple[list[int], list[bytes], str | None]:
        """The offload tiers' continuation of a prefix hit: the slots and hashes of the full blocks of
        ``token_ids[:max_tokens]`` from logical block ``first_block`` on (the first one chained from
        ``parent_hash``) that the tiers hold without a break, a host slot ``s`` as ``s``, a disk slot
        ``d`` as ``-(d + 1)``, and the tier whose hit stopped it because loading from there measures
        slower than recomputing (``tier_costs``; None: it stopped at a miss). Each slot is pinned until
        its step's copies are taken. Group 0 only."""
        slots: list[int] = []
        hashes: list[bytes] = []
        if self.offload is None or not (len(self.offload) or (self.disk is not None and len(self.disk))):
            return slots, hashes, None
        bs = self.block_size
        parent = parent_hash
        costs = self.tier_costs
        for start in range(first_block * bs, max_tokens - bs + 1, bs):
            block_tokens = tuple(token_ids[start:start + bs])
            block_hash = chain_hash(parent, block_tokens, self.salt)
            slot = self.offload.lookup(block_hash, block_tokens)
            if slot is not None:
                if not costs.worth_loading(self.offload.medium):
                    return slots, hashes, self.offload.medium
                self.offload.pin(slot)  # until its copy back is queued: no other block may take it
            elif self.disk is not None and (disk_slot := self.disk.lookup(block_hash, block_tokens)) is not None:
                if not costs.worth_loading(self.disk.medium):
                    return slots, hashes, self.disk.medium
                self.disk.pin(disk_slot)  # until its read is queued: no spill may take it
                slot = -(disk_slot + 1)
            else:
                break
            slots.append(slot)
            hashes.append(block_hash)
            parent = block_hash
        return slots, hashes, None

    def adopt_offloaded(self, slots: Sequence[int], block_ids: Sequence[int], block_hashes: Sequence[bytes],
                        parent_hash: bytes) -> None:
        """Blocks ``block_ids`` (just allocated) take the KV of tier slots ``slots`` (``find_offloaded``'s):
        queue the copies back (a disk slot is read straight into its block) and cache the blocks under
        ``block_hashes`` (chained from ``parent_hash``)."""
        parent = parent_hash
        for slot, block_id, block_hash in zip(slots, block_ids, block_hashes):
            if slot >= 0:
                self._tier_ops.append(TierOp(kind=TierOpKind.ONLOAD, src=slot, dst=block_id))
                self.num_onloaded += 1
                tokens, medium = self.offload.tokens(slot), self.offload.medium
            else:
                self._tier_ops.append(TierOp(kind=TierOpKind.LOAD, src=-slot - 1, dst=block_id, key=block_hash))
                self.num_loaded += 1
                tokens, medium = self.disk.tokens(-slot - 1), self.disk.medium
            self.tier_saved_s[medium] += self.tier_costs.saved_s(medium)
            self.cache_hashed_block(block_id, block_hash, tokens, 0, parent)
            parent = block_hash

    def take_tier_copies(self) -> list[TierOp]:
        """The copies queued since the last call, to run in order before anything writes the KV cache.
        Unpins every slot."""
        ops = self._tier_ops
        if ops:
            self._tier_ops = []
        for tier in (self.offload, self.disk):
            if tier is not None:
                tier.unpin_all()
        return ops

    # ---- prefetch: tier hits read off the step loop ----------------------------------------

    def start_prefetch(self, slots: Sequence[int], block_hashes: Sequence[bytes], parent_hash: bytes,
                       hit_blocks: Sequence[int]) -> int | None:
        """Read a hit's tier blocks (``find_offloaded``'s ``slots`` and hashes, chained from
        ``parent_hash``) into fresh KV cache blocks off the step loop, for a request that waits
        meanwhile (SGLang HiCache's prefetch; vLLM's offloading connector loads asynchronously too).
        ``hit_blocks``, the KV cache's own hit before them, are held so they stay cached. The copies
        wait in ``take_prefetch_starts`` until this step's tier copies have run (they may write the
        blocks and slots these read); ``finish_prefetch`` caches what was read. Returns the prefetch's
        id, or None when there are not enough free blocks (the request then loads in the step)."""
        self.share(hit_blocks)  # first: the allocation below must not take them
        if not self.can_allocate(len(slots)):
            self.free(hit_blocks)
            return None
        blocks = self.allocate(len(slots))
        ops, tokens = [], []
        for slot, block_id, block_hash in zip(slots, blocks, block_hashes):
            if slot >= 0:
                self.offload.hold(slot)
                ops.append(TierOp(kind=TierOpKind.ONLOAD, src=slot, dst=block_id))
                tokens.append(self.offload.tokens(slot))
            else:
                self.disk.hold(-slot - 1)
                ops.append(TierOp(kind=TierOpKind.LOAD, src=-slot - 1, dst=block_id, key=block_hash))
                tokens.append(self.disk.tokens(-slot - 1))
        prefetch_id = self._next_prefetch
        self._next_prefetch += 1
        self._prefetches[prefetch_id] = (list(slots), blocks, list(block_hashes), parent_hash, list(hit_blocks), tokens)
        self._prefetch_starts.append((prefetch_id, ops))
        return prefetch_id

    def take_prefetch_starts(self) -> list[tuple[int, list[TierOp]]]:
        """The prefetches started since the last call, with their copies, for the runner's reader."""
        starts, self._prefetch_starts = self._prefetch_starts, []
        return starts

    def finish_prefetch(self, prefetch_id: int, ok: Sequence[bool]) -> int:
        """The reader is done with prefetch ``prefetch_id`` (``ok``: per block, whether it was read): the
        blocks read, up to the first that was not (a corrupt file: recomputed), enter the prefix cache;
        every block and hold is let go. Returns how many were cached."""
        slots, blocks, hashes, parent, hit_blocks, tokens = self._prefetches.pop(prefetch_id)
        cached = 0
        for slot, block_id, block_hash, block_tokens, good in zip(slots, blocks, hashes, tokens, ok):
            if not good:
                break
            self.cache_hashed_block(block_id, block_hash, block_tokens, 0, parent)
            medium = self.offload.medium if slot >= 0 else self.disk.medium
            if slot >= 0:
                self.num_onloaded += 1
            else:
                self.num_loaded += 1
            self.tier_saved_s[medium] += self.tier_costs.saved_s(medium)
            parent = block_hash
            cached += 1
        for slot in slots:
            if slot >= 0:
                self.offload.release(slot)
            else:
                self.disk.release(-slot - 1)
        self.free(blocks)
        self.free(hit_blocks)
        return cached

    @property
    def num_prefetching(self) -> int:
        """Prefetches started and not finished."""
        return len(self._prefetches)

