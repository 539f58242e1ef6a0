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
the prefix cache until evicted, so hits remain exact. Models whose layers mix windows and full
attention (Gemma 3, gpt-oss) keep every block: freeing their sliding layers' blocks needs a
block table per layer kind (vLLM's hybrid KV cache manager), not built.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pdserve.engine.block_manager import BlockManager, chain_hash
from pdserve.engine.request import Request

NULL_BLOCK = -1  # a block_table entry whose block slid out of the attention window and was freed

logger = logging.getLogger(__name__)


def uniform_sliding_window(model, config) -> int | None:
    """The attention window every layer of ``model`` (an ``nn.Module`` whose attention modules carry
    ``sliding_window``) shares, in tokens, or None: the scheduler then frees blocks that slide out of
    it (``KVCacheManager``). None for full attention, mixed layers (Gemma 3, gpt-oss: logged),
    pipeline stages (``config``, an ``EngineConfig``: a stage sees only its own layers) and a draft
    model (its own layers attend over the whole context through the same block tables)."""
    windows = {m.sliding_window for m in model.modules() if hasattr(m, "sliding_window")}
    if not windows or None in windows:
        if len(windows) > 1:
            logger.info("sliding-window layers keep every KV block: the model mixes windows %s with full "
                        "attention (freeing them needs a block table per layer kind, not built)",
                        sorted(w for w in windows if w is not None))
        return None
    if len(windows) > 1:
        logger.info("KV blocks kept: the model's layers have different windows %s", sorted(windows))
        return None
    window = windows.pop()
    if config.parallel.pipeline_parallel_size > 1:
        logger.info("KV blocks outside the %d-token window are kept: pipeline stages", window)
        return None
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        logger.info("KV blocks outside the %d-token window are kept: a draft model reads the whole context", window)
        return None
    logger.info("sliding window of %d tokens: KV blocks that leave it are freed", window)
    return window


@dataclass
class PrefixHit:
    """Cached full blocks that prefix a request's tokens."""

    block_ids: list[int]
    block_hashes: list[bytes]

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


class KVCacheManager:
    """Owns every request's ``block_table`` and ``block_hashes``.

    Args:
        block_manager: the pool the blocks come from.
        sliding_window: the attention window every layer shares, in tokens, to free blocks
            that fall out of it (module docstring); None keeps every block.

    Raises:
        ValueError: a window below one token.
    """

    def __init__(self, block_manager: BlockManager, sliding_window: int | None = None):
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.sliding_window = sliding_window

    def first_live_block(self, next_position: int) -> int:
        """Index of the first logical block a query at ``next_position`` or later can read (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, next_position - self.sliding_window + 1) // self.block_size

    def max_seq_blocks(self, max_step_tokens: int) -> int | None:
        """The most blocks one sequence holds when a step computes at most ``max_step_tokens`` of its tokens:
        its window before the step's first query and the step's own tokens, over one more block where they
        straddle a boundary. None without a window (a sequence holds its whole length)."""
        if self.sliding_window is None:
            return None
        return -(-(self.sliding_window - 1 + max_step_tokens) // self.block_size) + 1

    def free_out_of_window(self, request: Request, next_position: int | None = None) -> int:
        """Free the blocks no query from ``next_position`` on (default: the request's next
        uncomputed token) can read, leaving ``NULL_BLOCK`` in their table entries.

        Returns the number of blocks freed (0 without a window)."""
        if self.sliding_window is None:
            return 0
        table = request.block_table
        end = min(self.first_live_block(request.num_computed_tokens if next_position is None else next_position),
                  len(table))
        if request.keep_blocks_from is not None:
            end = min(end, request.keep_blocks_from)
        dead = [table[i] for i in range(end) if table[i] != NULL_BLOCK]
        if dead:
            self.block_manager.free(dead)
            table[:end] = [NULL_BLOCK] * end
        return len(dead)

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
                       hit: PrefixHit | None = None, next_position: int | None = None) -> bool:
        """Make ``request.block_table`` hold ``num_tokens`` slots, ready to write
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
        table = list(hit.block_ids) if hit else list(request.block_table)
        first_written = hit.num_blocks if hit else request.num_computed_tokens // bs  # hits are never written
        to_copy = [i for i in range(first_written, min(len(table), -(-num_tokens // bs)))
                   if not bm.is_writable(table[i])]
        num_new = bm.num_blocks_for_tokens(num_tokens) - len(table)
        # blocks no query of this request will read (a remote prefill's KV that lands only in live blocks)
        num_dead = max(0, min(num_new, self.first_live_block(next_position) - len(table))) \
            if next_position is not None else 0
        revived = sum(1 for b in hit.block_ids if bm.ref_count(b) == 0) if hit else 0  # leave the free queue
        if not bm.can_allocate(max(num_new - num_dead, 0) + len(to_copy) + revived):
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
            table.extend([NULL_BLOCK] * num_dead)
            table.extend(bm.allocate(num_new - num_dead))
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
            block = request.block_table[i]
            if block == NULL_BLOCK:  # out of the window, never filled here: chain its hash, cache nothing
                request.block_hashes.append(chain_hash(parent, tokens[i * bs:(i + 1) * bs], self.block_manager.salt))
            else:
                request.block_hashes.append(self.block_manager.cache_block(block, parent, tokens[i * bs:(i + 1) * bs]))

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Let ``child`` share the parent's blocks that hold its first ``num_tokens`` tokens."""
        num_blocks = self.block_manager.num_blocks_for_tokens(num_tokens)
        child.block_table = list(parent.block_table[:num_blocks])
        self.block_manager.share([b for b in child.block_table if b != NULL_BLOCK])
        child.block_hashes = list(parent.block_hashes[:num_tokens // self.block_size])

    def free(self, request: Request) -> None:
        if request.block_table:
            self.block_manager.free([b for b in request.block_table if b != NULL_BLOCK])
        request.block_table = []
        request.block_hashes = []
