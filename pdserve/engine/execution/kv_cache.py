"""The paged KV cache tensor and its sizing from a memory budget.

Layout (one tensor per worker rank)::

    kv_cache: [num_layers, kv_slots, num_blocks, block_size, num_kv_heads, head_dim]

``kv_slots`` is what the model's attention caches per token and KV head (its ``kv_slots``):

* 2 for per-head K/V attention (Llama, Qwen3, Gemma3, gpt-oss, ...): index 0 = K, 1 = V;
* 1 for a latent cache (DeepSeek's MLA): one row per token, the attention's key, whose first
  ``v_dim`` values are also its value (``v_dim = kv_lora_rank``; vLLM's and SGLang's MLA cache).

A quantized cache (``--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2``) is ``torch.uint8`` with
rows of ``head_dim + 4`` bytes: the quantized values, then the row's float32 scale
(``pdserve.common.kv_quant``). Token slot ``s = block_id * block_size + offset`` addresses
``kv_cache[layer, :, block_id, offset]``; see ``pdserve.engine.layers.attention``.
Every function here takes ``kv_slots`` (default 2) and counts real bytes: a latent cache's
block is half a K/V cache's of the same row width.
"""

from __future__ import annotations

import time

import torch

from pdserve.common.kv_quant import kv_cache_format
from pdserve.common.utils import advise_huge_pages
from pdserve.common.protocol import TierOp, TierOpKind


def kv_cache_block_bytes(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                         dtype: torch.dtype | str, kv_slots: int = 2) -> int:
    """Bytes one block takes across all layers (each of its ``kv_slots`` rows), scales included.

    dtype: a torch dtype or a KV cache dtype name (``int8``, ``fp8_e4m3``, ...);
    kv_slots: 2 (K and V) or 1 (a latent cache).
    Raises ValueError for an unknown name.
    """
    return num_layers * kv_slots * block_size * num_kv_heads * kv_cache_format(dtype).bytes_per_row(head_dim)


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
    dtype: torch.dtype | str,
    device: torch.device | str,
    kv_slots: int = 2,
) -> torch.Tensor:
    """Preallocate the zeroed cache ``[num_layers, kv_slots, num_blocks, block_size, num_kv_heads, head_dim]``.

    dtype: a torch dtype or a KV cache dtype name; a quantized one gives
    ``[num_layers, kv_slots, num_blocks, block_size, num_kv_heads, head_dim + 4]`` uint8 (zero rows, scale 0).
    kv_slots: 2 (K and V) or 1 (a latent cache).
    """
    if kv_slots not in (1, 2):
        raise ValueError(f"kv_slots must be 1 (a latent cache) or 2 (K and V), got {kv_slots}")
    fmt = kv_cache_format(dtype)
    shape = (num_layers, kv_slots, num_blocks, block_size, num_kv_heads, fmt.row_len(head_dim))
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=fmt.storage_dtype, device=device)
    cache = torch.empty(shape, dtype=fmt.storage_dtype)  # pages not touched yet
    advise_huge_pages(cache)
    return cache.zero_()


def allocate_offload_cache(kv_cache: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The offload tier's bytes (``pdserve.engine.scheduling.kv_offload``): ``kv_cache``'s layout with
    ``num_slots`` blocks, in host memory (pinned where the cache is on a GPU, so copies overlap compute)."""
    shape = (*kv_cache.shape[:2], num_slots, *kv_cache.shape[3:])
    if kv_cache.device.type != "cpu":
        return torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=True)
    tier = torch.empty(shape, dtype=kv_cache.dtype)
    advise_huge_pages(tier)
    return tier.zero_()


def copy_tier_blocks(kv_cache: torch.Tensor, tier: torch.Tensor, ops: list[TierOp], disk=None,
                     timings: dict[TierOpKind, list] | None = None) -> None:
    """Run the offload tiers' copies of one step in order (``TierOp``: spill host -> disk, offload KV
    cache -> host, load disk -> KV cache, onload host -> KV cache; ``disk`` a ``kv_disk.DiskKVStore``).
    A run of offloads or onloads with no destination twice is one indexed copy. ``timings`` (kind ->
    [blocks, seconds]) is added each kind's blocks and wall time.

    Raises:
        kv_disk.CorruptKVFile: a disk file failed its check (the step's requests fail; nothing is served)."""
    i = 0
    while i < len(ops):
        op = ops[i]
        start = time.perf_counter()
        j = i + 1
        if op.kind == TierOpKind.SPILL:
            disk.write(op.dst, op.key, tuple(op.tokens), tier[:, :, op.src])
        elif op.kind == TierOpKind.LOAD:
            disk.read(op.src, op.key, kv_cache[:, :, op.dst])
        else:
            j, seen = i, set()
            while j < len(ops) and ops[j].kind == op.kind and ops[j].dst not in seen:
                seen.add(ops[j].dst)
                j += 1
            src = torch.tensor([o.src for o in ops[i:j]], dtype=torch.int64)
            dst = torch.tensor([o.dst for o in ops[i:j]], dtype=torch.int64)
            if op.kind == TierOpKind.OFFLOAD:
                tier.index_copy_(2, dst, kv_cache.index_select(2, src.to(kv_cache.device)).to("cpu"))
            else:
                kv_cache.index_copy_(2, dst.to(kv_cache.device),
                                     tier.index_select(2, src).to(kv_cache.device, non_blocking=True))
        if timings is not None:
            if kv_cache.device.type == "cuda":
                torch.cuda.synchronize(kv_cache.device)  # the copy's time, not its launch's
            entry = timings.setdefault(op.kind, [0, 0.0])
            entry[0] += j - i
            entry[1] += time.perf_counter() - start
        i = j


def copy_blocks(kv_cache: torch.Tensor, copies: list[tuple[int, int]]) -> None:
    """Copy whole blocks (all layers, every slot): ``kv_cache[:, :, dst] = kv_cache[:, :, src]``.

    Used for copy-on-write before a request writes into a block it shares. Quantized rows
    carry their scales, so a copy moves both.
    """
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=kv_cache.device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=kv_cache.device)
    kv_cache.index_copy_(2, dst, kv_cache.index_select(2, src))
