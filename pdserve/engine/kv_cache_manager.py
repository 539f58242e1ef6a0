"""Per-request KV block bookkeeping on top of the block manager (no torch).

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
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.request import Request


@dataclass
class PrefixHit:
    """Cached full blocks that prefix a request's tokens."""

    block_ids: list[int]
    block_hashes: list[bytes]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class KVCacheManager:
    """Owns every request's ``block_table`` and ``block_hashes``."""

    def __init__(self, block_manager: BlockManager):
        self.block_manager = block_manager
        self.block_size = block_manager.block_size

    def find_prefix(self, request: Request) -> PrefixHit:
        """Cached blocks for the start of ``request`` (never all of it: the last token is always computed).

        No hit for a request that asked for prompt logprobs: every prompt position needs its logits (vLLM
        does not reuse cached prefixes for them either; their blocks still enter the cache).
        """
        if request.sampling_params.prompt_logprobs is not None:
            return PrefixHit([], [])
        blocks, hashes = self.block_manager.find_cached_prefix(request.all_token_ids, request.num_tokens - 1,
                                                               request.cache_root)
        return PrefixHit(blocks, hashes)

    def allocate_slots(self, request: Request, num_tokens: int, copies: list[tuple[int, int]],
                       hit: PrefixHit | None = None) -> bool:
        """Make ``request.block_table`` hold ``num_tokens`` slots, ready to write
        positions ``[request.num_computed_tokens, num_tokens)``.

        Args:
            hit: prefix hit to adopt first (only for a request with no blocks yet);
                its blocks are shared, and ``num_computed_tokens`` is NOT changed here.
            copies: receives ``(src_block, dst_block)`` for each copy-on-write;
                the model runner must copy those blocks before the forward.

        Returns:
            False, changing nothing, if there are not enough free blocks.
        """
        bm = self.block_manager
        bs = self.block_size
        table = list(hit.block_ids) if hit else list(request.block_table)
        first_written = hit.num_blocks if hit else request.num_computed_tokens // bs  # hits are never written
        to_copy = [i for i in range(first_written, min(len(table), -(-num_tokens // bs)))
                   if not bm.is_writable(table[i])]
        num_new = bm.num_blocks_for_tokens(num_tokens) - len(table)
        revived = sum(1 for b in hit.block_ids if bm.ref_count(b) == 0) if hit else 0  # leave the free queue
        if not bm.can_allocate(max(num_new, 0) + len(to_copy) + revived):
            return False
        if hit:
            bm.share(hit.block_ids)
            request.block_hashes = list(hit.block_hashes)
        for i in to_copy:
            src = table[i]
            table[i] = bm.allocate(1)[0]
            copies.append((src, table[i]))
            bm.free([src])
        if num_new > 0:
            table.extend(bm.allocate(num_new))
        request.block_table = table
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Name every block whose tokens are all computed, extending the hash chain."""
        bs = self.block_size
        num_full = min(request.num_computed_tokens, request.num_tokens) // bs
        tokens = None
        for i in range(len(request.block_hashes), num_full):
            tokens = tokens or request.all_token_ids
            parent = request.block_hashes[-1] if request.block_hashes else request.cache_root
            request.block_hashes.append(
                self.block_manager.cache_block(request.block_table[i], parent, tokens[i * bs:(i + 1) * bs]))

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Let ``child`` share the parent's blocks that hold its first ``num_tokens`` tokens."""
        num_blocks = self.block_manager.num_blocks_for_tokens(num_tokens)
        child.block_table = list(parent.block_table[:num_blocks])
        self.block_manager.share(child.block_table)
        child.block_hashes = list(parent.block_hashes[:num_tokens // self.block_size])

    def free(self, request: Request) -> None:
        if request.block_table:
            self.block_manager.free(request.block_table)
        request.block_table = []
        request.block_hashes = []
