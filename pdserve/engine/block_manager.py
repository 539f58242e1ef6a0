"""Pure-Python paged KV block manager (no torch).

The KV cache is split into ``num_blocks`` fixed-size blocks of ``block_size``
token slots (PagedAttention, Kwon et al., SOSP 2023). A request owns a
``block_table: list[int]`` mapping its logical block i to a physical block id.
This module hands out physical blocks and counts references to them so that a
block may be shared (e.g. by parallel samples of one prompt) and is returned to
the free block queue only when its last user lets go.

Free block queue policy: FIFO. Freed blocks go to the tail and allocation takes
from the head, so the block freed longest ago is reused first (this is the order
an LRU prefix cache will later want to evict in).
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockManager:
    """Hands out KV cache block ids and reference-counts them.

    Args:
        num_blocks: physical blocks in the KV cache (ids ``0 .. num_blocks-1``).
        block_size: token slots per block.

    Raises:
        ValueError: non-positive sizes.
    """

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1] (vLLM's KV cache usage)."""
        return 1.0 - len(self._free) / self.num_blocks

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` token slots."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the free queue, each with ref count 1.

        Raises:
            NoFreeBlocksError: fewer than ``num_blocks`` are free (nothing is taken).
        """
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"need {num_blocks} KV blocks, {len(self._free)} free of {self.num_blocks}")
        block_ids = [self._free.popleft() for _ in range(num_blocks)]
        for block_id in block_ids:
            self._ref_counts[block_id] = 1
        return block_ids

    def share(self, block_ids: list[int]) -> None:
        """Add one reference to each block (a second owner of the same KV)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} is free and cannot be shared")
            self._ref_counts[block_id] += 1

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks reaching zero return to the queue.

        Blocks are released last-to-first so a request's tail blocks (least
        likely to be shared) are reused before its head blocks.

        Raises:
            ValueError: a block that is already free (a double free is a bug).
        """
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"double free of KV block {block_id}")
            self._ref_counts[block_id] = count - 1
            if count == 1:
                self._free.append(block_id)
