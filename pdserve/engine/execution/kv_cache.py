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

import logging
import math
import mmap
import os
import threading
import time
import weakref

import torch

from pdserve.common.kv_quant import kv_cache_format
from pdserve.common.utils import HUGE_PAGE_BYTES, advise_huge_pages, host_memory_limit, populate_pages
from pdserve.common.protocol import TierOp, TierOpKind

logger = logging.getLogger(__name__)


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


def auto_kv_cache_budget(memory_utilization: float, num_ranks: int, block_bytes: int,
                         blocks_wanted: int, device: torch.device | str = "cpu") -> tuple[int, str]:
    """``--kv-cache-memory auto``: this rank's KV budget in bytes from the host's memory, and why, in words.

    As vLLM's CPU worker sizes its cache (``--gpu-memory-utilization`` of the node's memory, less what the
    process already holds): the worker may hold ``memory_utilization`` of ``host_memory_limit()``, its
    ``num_ranks`` ranks an equal share each; the cache gets that share less this rank's resident memory
    (its weights, loaded by now), no more than 90% of the memory available now, and no more than
    ``blocks_wanted`` blocks of ``block_bytes`` (what ``max_num_seqs`` sequences of ``max_model_len``
    tokens fill: more could only hold cached prefixes, which ``--kv-offload-memory`` is for). On a GPU
    the memory is the device's: ``memory_utilization`` of it less what is in use there, as vLLM's GPU
    worker (one rank a device).

    Raises:
        ValueError: the share, less what the rank holds, leaves less than one block.
    """
    import psutil

    if torch.device(device).type == "cuda":
        free, limit = torch.cuda.mem_get_info(torch.device(device))
        resident, share, available = limit - free, int(memory_utilization * limit), int(0.9 * free)
    else:
        limit = host_memory_limit()
        resident = psutil.Process().memory_info().rss
        share = int(memory_utilization * limit / num_ranks)
        available = int(0.9 * psutil.virtual_memory().available)
    budget = min(share - resident, available, blocks_wanted * block_bytes)
    if budget < block_bytes:
        raise ValueError(
            f"--kv-cache-memory auto leaves no KV block: {memory_utilization:g} of {limit / 2**30:.1f} GiB over "
            f"{num_ranks} rank(s) is {share / 2**20:.0f} MiB, this rank holds {resident / 2**20:.0f} MiB and "
            f"{available / 2**20:.0f} MiB is free; raise --memory-utilization or give --kv-cache-memory")
    bound = ("max_num_seqs x max_model_len" if budget == blocks_wanted * block_bytes else
             "90% of free memory" if budget == available else
             f"--memory-utilization {memory_utilization:g} of {limit / 2**30:.1f} GiB"
             + (f" over {num_ranks} ranks" if num_ranks > 1 else "") + f", less {resident / 2**20:.0f} MiB held")
    return budget, f"--kv-cache-memory auto: {bound}"


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
    return zero_pages_on_touch(shape, fmt.storage_dtype)


def zero_pages_on_touch(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in an anonymous private mapping, on transparent huge pages where Linux has them.

    The kernel zero-fills each page when it is first touched, so a cache of gigabytes costs nothing at
    start (writing its zeros took ~0.6 s a GiB on a 2-core VM) and its memory becomes resident as blocks
    are first written. A ``torch.empty`` + ``zero_`` would touch it all at once: its fresh pages are zero
    only where the allocator maps new memory, which an allocator such as tcmalloc need not do."""
    numel = math.prod(shape)
    nbytes = max(1, numel * torch.empty((), dtype=dtype).element_size())
    buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    tensor = torch.frombuffer(buffer, dtype=dtype, count=numel).view(shape)  # keeps ``buffer`` alive
    advise_huge_pages(tensor)
    return tensor


def populate_when_idle(tensor: torch.Tensor, what: str) -> threading.Thread | None:
    """Make a ``zero_pages_on_touch`` tensor resident in the background, when the CPU has nothing else to
    do; the thread doing it (daemon), or None where it cannot (not a CPU tensor, not Linux).

    A page's first touch costs its zero-fill, and in a VM whose memory the host backs lazily (Firecracker,
    KVM without preallocation) the host's fault as well: a never-touched GiB took 2.4 s of system time to
    write on a 2-core Firecracker VM, a reused one 0.06 s. Left to the step loop, a prefill worker paid it on
    the blocks each prompt wrote: 23-29 ms of a 512-token prompt's ~380 ms, until the whole cache had been
    written once (``benchmarks/bench_first_touch.py``, docs/benchmarks.md). Here a thread at ``SCHED_IDLE`` (it runs
    only while every other thread of the core waits) asks for the pages one huge page at a time with
    ``MADV_POPULATE_WRITE``, which leaves the contents of pages already written as they are, so it may run
    while the cache is in use. vLLM and SGLang pay the same cost before serving, by writing zeros at start."""
    if tensor.device.type != "cpu" or not hasattr(os, "SCHED_IDLE"):
        return None
    owner, nbytes = weakref.ref(tensor), tensor.nbytes  # a cache dropped meanwhile is not kept alive

    def run() -> None:
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # this thread only
        except OSError:  # never compete with the step loop: the pages come as they are written
            return
        start, done = time.perf_counter(), 0
        while done < nbytes and (cache := owner()) is not None:
            # a kernel before 5.14 refuses: the pages are then made resident as they are first written
            if not populate_pages(cache.view(-1).view(torch.uint8)[done:done + HUGE_PAGE_BYTES]):
                break
            del cache
            done = min(nbytes, done + HUGE_PAGE_BYTES)
        logger.debug("%s: %.1f of %.1f MiB made resident at idle priority in %.1f s", what, done / 2**20,
                     nbytes / 2**20, time.perf_counter() - start)

    thread = threading.Thread(target=run, name=f"populate-{what}", daemon=True)
    thread.start()
    return thread


def allocate_offload_cache(kv_cache: torch.Tensor, num_slots: int) -> torch.Tensor:
    """The offload tier's bytes (``pdserve.engine.scheduling.kv_offload``): ``kv_cache``'s layout with
    ``num_slots`` blocks, in host memory (pinned where the cache is on a GPU, so copies overlap compute)."""
    shape = (*kv_cache.shape[:2], num_slots, *kv_cache.shape[3:])
    if kv_cache.device.type != "cpu":
        return torch.zeros(shape, dtype=kv_cache.dtype, pin_memory=True)
    return zero_pages_on_touch(shape, kv_cache.dtype)


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
