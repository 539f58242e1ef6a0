import pytest
import torch

from pdserve.engine.execution.kv_cache import (allocate_kv_cache, copy_blocks, kv_cache_block_bytes,
                                               num_blocks_for_budget, populate_when_idle)


def test_block_bytes_and_budget():
    # 2 layers * (K, V) * 16 slots * 2 kv heads * 16 head_dim * 4 bytes
    assert kv_cache_block_bytes(2, 16, 2, 16, torch.float32) == 8192
    assert kv_cache_block_bytes(2, 16, 2, 16, torch.bfloat16) == 4096
    assert num_blocks_for_budget(16 * 2**20, 8192) == 2048
    assert num_blocks_for_budget(8192 * 3 + 100, 8192) == 3
    with pytest.raises(ValueError, match="kv-cache-memory"):
        num_blocks_for_budget(8000, 8192)


def test_allocate_and_copy_blocks():
    cache = allocate_kv_cache(2, 5, 4, 2, 8, torch.float32, "cpu")
    assert cache.shape == (2, 2, 5, 4, 2, 8) and not cache.any()
    cache[:, :, 1] = 1.0
    cache[:, :, 3] = 3.0
    copy_blocks(cache, [(1, 0), (3, 4)])
    assert (cache[:, :, 0] == 1).all() and (cache[:, :, 4] == 3).all() and (cache[:, :, 2] == 0).all()


def _mapping_kib(tensor: torch.Tensor) -> dict[str, int]:
    """The /proc/self/smaps fields (KiB) of the mapping that holds ``tensor``'s memory (the kernel may have
    merged it with a neighbour, so compare before and after, never alone)."""
    address, fields, inside = tensor.data_ptr(), {}, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line: start-end perms ...
                lo, hi = (int(x, 16) for x in head[0].split("-"))
                if inside:
                    break
                inside = lo <= address < hi
            elif inside and len(head) == 3 and head[2] == "kB":
                fields[head[0].rstrip(":")] = int(head[1])
    return fields


def _resident_bytes(tensor: torch.Tensor) -> int:
    """Bytes of ``tensor``'s pages that are mapped (``mincore``), exactly over its own range."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    start = tensor.data_ptr() // page * page
    pages = -(-(tensor.data_ptr() + tensor.nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0, ctypes.get_errno()
    return sum(b & 1 for b in vec) * page


def test_a_large_cpu_cache_is_zero_takes_memory_as_written_and_sits_on_huge_pages():
    """The cache is an anonymous mapping: no resident memory until a block is written (a cache of
    gigabytes costs nothing at start), zeros where unwritten, transparent huge pages once written."""
    import pathlib
    thp = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not thp.exists() or "[never]" in thp.read_text() or not pathlib.Path("/proc/self/smaps").exists():
        pytest.skip("no transparent huge pages on this machine")
    cache = allocate_kv_cache(4, 512, 16, 4, 64, torch.float32, "cpu")  # 64 MiB
    assert _resident_bytes(cache) == 0
    cache[:, :, :256] = 1.0  # half the blocks: 8 runs of 4 MiB
    written = cache.numel() * 4 // 2
    assert written <= _resident_bytes(cache) <= written + 8 * 2 * 2**20  # a huge page at each end of a run
    assert not cache[:, :, 256:].any()  # never written: zeros
    huge = _mapping_kib(cache)["AnonHugePages"]
    cache[:, :, 256:] = 2.0
    # madvise covers the 2 MiB-aligned interior: the other half, less at most a huge page per run
    assert _mapping_kib(cache)["AnonHugePages"] - huge >= (written - 8 * 2 * 2**20) // 1024
    assert (cache[:, :, 0] == 1).all() and (cache[:, :, -1] == 2).all()


def test_an_idle_thread_makes_the_cache_resident_and_keeps_what_was_written():
    """populate_when_idle: every page of the cache resident once its thread ends (the step loop no longer
    pays a first-touch fault), blocks written before or while it runs unchanged, the rest still zero."""
    import os
    import re
    import sys
    release = re.match(r"(\d+)\.(\d+)", os.uname().release)
    if not sys.platform.startswith("linux") or not release or tuple(map(int, release.groups())) < (5, 14):
        pytest.skip("MADV_POPULATE_WRITE needs Linux 5.14")
    cache = allocate_kv_cache(4, 512, 16, 4, 64, torch.float32, "cpu")  # 64 MiB, nothing resident yet
    cache[:, :, 7] = 7.0
    thread = populate_when_idle(cache, "test")
    cache[:, :, 300] = 3.0  # written while it runs
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert _resident_bytes(cache) == cache.nbytes
    assert (cache[:, :, 7] == 7).all() and (cache[:, :, 300] == 3).all()
    cache[:, :, 7] = 0
    cache[:, :, 300] = 0
    assert not cache.any()


def test_a_latent_cache_has_one_slot_per_token_and_half_the_block_bytes():
    """kv_slots=1 (MLA's latent): one row per token and layer, so a block costs half a K/V block of the
    same row width and a budget holds twice the blocks."""
    # 2 layers * 1 slot * 16 slots * 1 head * (32 + 8) values * 4 bytes
    assert kv_cache_block_bytes(2, 16, 1, 40, torch.float32, kv_slots=1) == 5120
    assert kv_cache_block_bytes(2, 16, 1, 40, torch.float32) == 2 * 5120
    assert kv_cache_block_bytes(2, 16, 1, 40, "int8", kv_slots=1) == 2 * 16 * 44  # one scale per latent row
    budget = 10 * 2 * 5120
    assert num_blocks_for_budget(budget, 5120) == 2 * num_blocks_for_budget(budget, 2 * 5120) == 20
    cache = allocate_kv_cache(2, 5, 4, 1, 40, torch.float32, "cpu", kv_slots=1)
    assert cache.shape == (2, 1, 5, 4, 1, 40) and cache.nbytes == 5 * kv_cache_block_bytes(2, 4, 1, 40, "float32", 1)
    cache[:, :, 1] = 1.0
    copy_blocks(cache, [(1, 3)])
    assert (cache[:, :, 3] == 1).all() and (cache[:, :, 2] == 0).all()
    with pytest.raises(ValueError, match="kv_slots"):
        allocate_kv_cache(2, 5, 4, 1, 40, torch.float32, "cpu", kv_slots=3)


def test_auto_budget_is_the_least_of_the_share_the_free_memory_and_what_the_sequences_fill():
    """--kv-cache-memory auto (vLLM's CPU sizing): the share of the host's memory less what this process
    holds, split over the ranks, bounded by 90% of free memory and by max_num_seqs x max_model_len."""
    import psutil

    from pdserve.common.utils import host_memory_limit
    from pdserve.engine.execution.kv_cache import auto_kv_cache_budget

    mib = 2**20
    budget, why = auto_kv_cache_budget(0.5, 1, mib, 10)  # ten blocks wanted: far below any share
    assert budget == 10 * mib and why == "--kv-cache-memory auto: max_num_seqs x max_model_len"
    limit, held = host_memory_limit(), psutil.Process().memory_info().rss
    share = 0.25 * limit - held  # a quarter of the host, less what this process holds
    assert share > 64 * mib, "this machine has too little memory for the test"
    budget, why = auto_kv_cache_budget(0.25, 1, mib, 2**40 // mib)  # wants a TiB
    assert abs(budget - share) < 64 * mib and "--memory-utilization 0.25" in why, (budget, why)
    halves, why = auto_kv_cache_budget(0.5, 2, mib, 2**40 // mib)  # two ranks: a quarter each
    assert abs(halves - share) < 64 * mib and "over 2 ranks" in why
    assert budget <= 0.9 * psutil.virtual_memory().available + 64 * mib
    with pytest.raises(ValueError, match="raise --memory-utilization or give --kv-cache-memory"):
        auto_kv_cache_budget(held / limit / 2, 1, mib, 10)  # a share smaller than what the process holds
