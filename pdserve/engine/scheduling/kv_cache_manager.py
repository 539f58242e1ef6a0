"""Per-request KV block bookkeeping on top of the block manager (no torch import).

The scheduler decides *who* runs; this module decides *which blocks* they use:

* prefix hits on admission (``find_prefix``);
* growing a request's ``block_table`` for the tokens it computes next, with
  copy-on-write of any block those tokens land in that is shared or cached
  (``allocate_slots``), all or nothing;
* naming newly full blocks in the prefix cache (``cache_full_blocks``);
* sharing a parent's blocks with its parallel samples (``fork``).

Layout of one request's blocks (block_size 4, prompt of 10 tokens, 2 cached)::

    block_table: [ 7 | 3 | 9 ]      7, 3: prefix-cache hits (shared, read-only)
    tokens:      [abcd|efgh|ij..]   9: allocated; slots of i, j, then outputs
    block_hashes:[h0 | h1]          h1 = hash(h0, "efgh"); h2 follows once block 9 is full

Sliding windows (Mistral, Phi-3: every layer attends to the last ``W`` positions only): a query
at position p reads keys from p - W + 1 on, so once a request's next query position q is known,
every block whose slots all lie before q - W + 1 is dead. ``free_out_of_window`` returns such
blocks to the free queue and leaves ``NULL_BLOCK`` in their place (vLLM's sliding-window
manager does the same with its null block), so a long request holds about ``W / block_size``
blocks plus the tokens of one step instead of its whole length. Hashes of freed blocks stay in
the prefix cache until evicted, so hits remain exact.

Models whose layers mix windows and full attention (Gemma 3, gpt-oss) get one block table per
KV cache group (``pdserve.common.kv_cache_groups``; vLLM's hybrid KV cache manager): every
operation here runs on each group's table, all drawing from one pool. A sliding group frees
what leaves its window, a full group keeps everything. A prefix hit must hold in every group:
a full group needs all of the hit's blocks cached, a sliding group only those inside the
window of the first uncached token.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from pdserve.engine.scheduling.block_manager import BlockManager, block_hashes, chain_hash
from pdserve.common.kv_cache_groups import KVCacheGroups
from pdserve.engine.scheduling.request import Request

NULL_BLOCK = -1  # a block_table entry whose block slid out of the attention window and was freed

logger = logging.getLogger(__name__)


@dataclass
class PrefixHit:
    """Cached full blocks that prefix a request's tokens: the first ``num_blocks`` logical blocks.

    ``group_block_ids[g]``: group g's blocks for them (``NULL_BLOCK`` where a sliding group needs
    none); ``block_hashes``: their hash chain."""

    group_block_ids: list[list[int]]
    block_hashes: list[bytes]
    num_blocks: int
    # The offload tier's slots of the hit's last blocks (one KV cache group only): the blocks after
    # group_block_ids[0], which get KV cache blocks and copies back at allocate_slots
    offload_slots: list[int] = dataclasses.field(default_factory=list)
    # The tier whose hit was left to recompute, loading from it measuring slower (None: none was)
    declined_tier: str | None = None

    @property
    def block_ids(self) -> list[int]:
        """Group 0's blocks."""
        return self.group_block_ids[0]


class KVCacheManager:
    """Owns every request's ``block_tables`` (one per KV cache group) and ``block_hashes``.

    Args:
        block_manager: the pool the blocks come from.
        groups: which layers share which table, and each group's window (None: one group of
            full attention, every block kept). A group with a window frees the blocks that
            fall out of it (module docstring).

    Raises:
        ValueError: a window below one token.
    """

    def __init__(self, block_manager: BlockManager, groups: KVCacheGroups | None = None):
        groups = groups or KVCacheGroups.single(1)
        if any(w is not None and w < 1 for w in groups.windows):
            raise ValueError(f"sliding windows must be at least 1 token, got {groups.windows}")
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.groups = groups
        self.windows = groups.windows
        self.num_groups = groups.num_groups
        self.frees_blocks = any(w is not None for w in self.windows)  # some group slides: free_out_of_window

    @property
    def sliding_window(self) -> int | None:
        """The widest window of the model's sliding layers, in tokens; None when no layer slides."""
        return max((w for w in self.windows if w is not None), default=None)

    def _first_live(self, window: int | None, next_position: int) -> int:
        return 0 if window is None else max(0, next_position - window + 1) // self.block_size

    def first_live_blocks(self, next_position: int) -> list[int]:
        """Per group, the index of the first logical block a query at ``next_position`` or later
        can read (0 for full attention)."""
        return [self._first_live(w, next_position) for w in self.windows]

    def group_caps(self, max_step_tokens: int) -> tuple[int | None, ...]:
        """Per group, the most blocks one sequence holds there when a step computes at most
        ``max_step_tokens`` of its tokens: its window before the step's first query and the step's
        own tokens, over one more block where they straddle a boundary. None: the whole length
        (full attention)."""
        return tuple(None if w is None else -(-(w - 1 + max_step_tokens) // self.block_size) + 1
                     for w in self.windows)

    def free_out_of_window(self, request: Request, next_position: int | None = None) -> int:
        """Free the blocks no query from ``next_position`` on (default: the request's next
        uncomputed token) can read, leaving ``NULL_BLOCK`` in their table entries, in every
        sliding group. Blocks from ``request.keep_blocks_from[g]`` on stay (a prefill worker
        still sends them).

        Returns the number of blocks freed (0 without a window)."""
        if not self.frees_blocks:
            return 0
        position = request.num_computed_tokens if next_position is None else next_position
        freed = 0
        for g, window in enumerate(self.windows):
            if window is None or g >= len(request.block_tables):
                continue
            table = request.block_tables[g]
            end = min(self._first_live(window, position), len(table))
            if request.keep_blocks_from is not None:
                end = min(end, request.keep_blocks_from[g])
            dead = [table[i] for i in range(end) if table[i] != NULL_BLOCK]
            if dead:
                self.block_manager.free(dead)
                table[:end] = [NULL_BLOCK] * end
                freed += len(dead)
        return freed

    def find_prefix(self, request: Request) -> PrefixHit:
        """Cached blocks for the start of ``request`` (never all of it: the last token is always computed).

        No hit for a request that asked for prompt logprobs: every prompt position needs its logits (vLLM
        does not reuse cached prefixes for them either; their blocks still enter the cache).
        """
        if request.sampling_params.prompt_logprobs is not None:
            return PrefixHit([[] for _ in self.windows], [], 0)
        if self.num_groups == 1:
            bm = self.block_manager
            blocks, hashes = bm.find_cached_prefix(request.all_token_ids, request.num_tokens - 1, request.cache_root,
                                                   known_hashes=self.prompt_hashes(request)
                                                   if bm.enable_prefix_caching else ())
            if self.windows[0] is not None:  # a window frees what it leaves: no tier behind it
                return PrefixHit([blocks], hashes, len(blocks))
            slots, more, declined = bm.find_offloaded(request.all_token_ids, len(blocks),
                                                      hashes[-1] if hashes else request.cache_root,
                                                      request.num_tokens - 1)
            return PrefixHit([blocks], hashes + more, len(blocks) + len(slots), slots, declined)
        return self._find_group_prefix(request)

    def prompt_hashes(self, request: Request) -> list[bytes]:
        """The chained hashes of ``request``'s full prompt blocks (``block_hashes`` from its cache root),
        computed once per request and read by both the prefix lookup and ``cache_full_blocks``, so a
        prompt is hashed once, not once to look up and again to cache (vLLM v1 keeps
        ``Request.block_hashes`` for the same reason). Kept with the (block size, salt, root) they were
        computed for: another worker's (``Request.prompt_hashes`` handed over) is used only if they match."""
        key = (self.block_size, self.block_manager.salt, request.cache_root)
        kept = request.prompt_hashes
        if kept is None or kept[0] != key:
            tokens = request.prompt_token_ids
            kept = request.prompt_hashes = (key, block_hashes(tokens, len(tokens), self.block_size,
                                                              self.block_manager.salt, request.cache_root))
        return kept[1]

    def _find_group_prefix(self, request: Request) -> PrefixHit:
        """``find_prefix`` over several groups: the longest prefix every full group holds whole and
        every sliding group holds over the window of the first token after it."""
        bm, bs = self.block_manager, self.block_size
        tokens = request.all_token_ids
        hashes = []
        if bm.enable_prefix_caching:  # the prompt's kept hashes, then the outputs' blocks (after a preemption)
            num_full = (request.num_tokens - 1) // bs
            hashes = self.prompt_hashes(request)[:num_full]
            done = len(hashes) * bs
            hashes += block_hashes(tokens[done:], (num_full * bs) - done, bs, bm.salt,
                                   hashes[-1] if hashes else request.cache_root)
        blocks = [tuple(tokens[i * bs:(i + 1) * bs]) for i in range(len(hashes))]

        def cached(i: int, g: int) -> int | None:
            return bm.cached_block(hashes[i], blocks[i], g)

        full = [g for g, w in enumerate(self.windows) if w is None]
        n = 0
        while n < len(hashes) and all(cached(n, g) is not None for g in full):
            n += 1
        sliding = [g for g, w in enumerate(self.windows) if w is not None]
        while n > 0 and not all(cached(i, g) is not None for g in sliding
                                for i in range(self._first_live(self.windows[g], n * bs), n)):
            n -= 1
        group_blocks = []
        for g, window in enumerate(self.windows):
            first = self._first_live(window, n * bs)
            group_blocks.append([NULL_BLOCK] * first + [cached(i, g) for i in range(first, n)])
        return PrefixHit(group_blocks, hashes[:n], n)

    def allocate_slots(self, request: Request, num_tokens: int, copies: list[tuple[int, int]],
                       hit: PrefixHit | None = None, next_position: int | None = None) -> bool:
        """Make every group's table of ``request`` hold ``num_tokens`` slots, ready to write
        positions ``[request.num_computed_tokens, num_tokens)``.

        Args:
            hit: prefix hit to adopt first (only for a request with no blocks yet);
                its blocks are shared, and ``num_computed_tokens`` is NOT changed here.
            copies: receives ``(src_block, dst_block)`` for each copy-on-write;
                the model runner must copy those blocks before the forward.
            next_position: with a sliding window, the first position this request will query
                (a remote prefill: the prompt length); new blocks before the window it opens
                are left ``NULL_BLOCK``. None: every new block is allocated.

        Returns:
            False, changing nothing, if there are not enough free blocks.
        """
        bm = self.block_manager
        bs = self.block_size
        if hit is None and next_position is None and self.num_groups == 1 and request.block_tables:
            grown = self._grow_writable(request, num_tokens)  # a decode step's case: nothing to copy
            if grown is not None:
                return grown
        first_written = hit.num_blocks if hit else request.num_computed_tokens // bs  # hits are never written
        end_block = -(-num_tokens // bs)
        plans = []
        needed = 0
        for g, window in enumerate(self.windows):
            if hit:
                table = list(hit.group_block_ids[g])
            else:
                table = list(request.block_tables[g]) if g < len(request.block_tables) else []
            to_copy = [i for i in range(first_written, min(len(table), end_block))
                       if table[i] != NULL_BLOCK and not bm.is_writable(table[i])]
            num_new = end_block - len(table)
            # blocks no query of this request will read (a remote prefill's KV that lands only in live blocks)
            num_dead = max(0, min(num_new, self._first_live(window, next_position) - len(table))) \
                if next_position is not None else 0
            revived = sum(1 for b in hit.group_block_ids[g] if b != NULL_BLOCK and bm.ref_count(b) == 0) \
                if hit else 0  # leave the free queue
            needed += max(num_new - num_dead, 0) + len(to_copy) + revived
            plans.append((table, to_copy, num_new, num_dead))
        if not bm.can_allocate(needed):
            return False
        if hit:
            for ids in hit.group_block_ids:
                bm.share([b for b in ids if b != NULL_BLOCK])
            request.block_hashes = list(hit.block_hashes)
        tables = []
        for table, to_copy, num_new, num_dead in plans:
            for i in to_copy:
                src = table[i]
                table[i] = bm.allocate(1)[0]
                copies.append((src, table[i]))
                bm.free([src])
            if num_new > 0:
                table.extend([NULL_BLOCK] * num_dead)
                table.extend(bm.allocate(num_new - num_dead))
            tables.append(table)
        request.block_tables = tables
        if hit and hit.declined_tier is not None:
            bm.num_declined[hit.declined_tier] += 1
        if hit and hit.offload_slots:  # the blocks after the KV cache's hits take the tier's copies
            first = len(hit.group_block_ids[0])
            parent = hit.block_hashes[first - 1] if first else request.cache_root
            bm.adopt_offloaded(hit.offload_slots, tables[0][first:hit.num_blocks],
                               hit.block_hashes[first:hit.num_blocks], parent)
        return True

    def _grow_writable(self, request: Request, num_tokens: int) -> bool | None:
        """``allocate_slots`` for one group, no hit, when every block written from ``num_computed_tokens``
        on is the request's own (nothing to copy on write): extend the table to ``num_tokens`` slots.
        True/False as ``allocate_slots``; None when a block would need a copy (the general path's case)."""
        bm = self.block_manager
        table = request.block_tables[0]
        have = len(table)
        end_block = -(-num_tokens // self.block_size)
        for i in range(request.num_computed_tokens // self.block_size, min(have, end_block)):
            block = table[i]
            if block != NULL_BLOCK and not bm.is_writable(block):
                return None
        if end_block > have:
            if not bm.can_allocate(end_block - have):
                return False
            request.block_tables = [table + bm.allocate(end_block - have)]
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Name every block whose tokens are all computed, extending the hash chain (one hash per
        logical block; each group's block is cached under it, ``NULL_BLOCK``s nowhere)."""
        bs = self.block_size
        bm = self.block_manager
        num_full = min(request.num_computed_tokens, request.num_tokens) // bs
        hashes = request.block_hashes
        if len(hashes) >= num_full:
            return
        tables = request.block_tables
        prompt = request.prompt_token_ids
        salt = bm.salt
        known = self.prompt_hashes(request) if bm.enable_prefix_caching else ()
        parent = hashes[-1] if hashes else request.cache_root
        for i in range(len(hashes), num_full):
            start, end = i * bs, (i + 1) * bs
            block_tokens = prompt[start:end] if end <= len(prompt) else request.token_ids_between(start, end)
            block_hash = known[i] if i < len(known) else chain_hash(parent, block_tokens, salt)
            hashes.append(block_hash)
            for g, table in enumerate(tables):
                if table[i] != NULL_BLOCK:  # out of the window, never filled here: cached nowhere
                    bm.cache_hashed_block(table[i], block_hash, block_tokens, g, parent)
            parent = block_hash

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Let ``child`` share the parent's blocks that hold its first ``num_tokens`` tokens (every group)."""
        num_blocks = self.block_manager.num_blocks_for_tokens(num_tokens)
        child.block_tables = [list(table[:num_blocks]) for table in parent.block_tables]
        for table in child.block_tables:
            self.block_manager.share([b for b in table if b != NULL_BLOCK])
        child.block_hashes = list(parent.block_hashes[:num_tokens // self.block_size])

    def free(self, request: Request) -> None:
        for table in request.block_tables:
            if table:
                self.block_manager.free([b for b in table if b != NULL_BLOCK])
        request.block_tables = [[] for _ in self.windows]
        request.block_hashes = []

    def blocks_needed(self, num_tokens: int, max_step_tokens: int) -> int:
        """Blocks one sequence of ``num_tokens`` tokens holds at most, summed over the groups."""
        num_blocks = -(-num_tokens // self.block_size)
        return sum(num_blocks if cap is None else min(num_blocks, cap) for cap in self.group_caps(max_step_tokens))
