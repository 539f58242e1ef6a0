"""The paged KV cache tensor and its sizing from a memory budget.

Layout (one tensor per worker rank)::

    kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]
               index 1 of dim 1: 0 = K, 1 = V

Token slot ``s = block_id * block_size + offset`` addresses
``kv_cache[layer, :, block_id, offset]``; see ``pdserve.engine.attention``.
"""

from __future__ import annotations

import torch


def kv_cache_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem


def num_blocks_for_budget(budget_bytes: int, block_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes``.

    Raises:
        ValueError: the budget holds less than one block.
    """
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ValueError(
            f"KV cache budget of {budget_bytes} bytes holds no block ({block_bytes} bytes each); "
            "raise --kv-cache-memory"
        )
    return int(num_blocks)


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """Preallocate the zeroed cache ``[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]``."""
    return torch.zeros((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), dtype=dtype, device=device)


def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks (all layers, K and V): ``kv_cache[:, :, dst] = kv_cache[:, :, src]``.

    Used for copy-on-write before a request writes into a block it shares.
    """
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=kv_cache.device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=kv_cache.device)
    kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))
