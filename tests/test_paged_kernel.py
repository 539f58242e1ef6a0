"""The native paged-attention backend against the plain-torch reference (gather + masked SDPA)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.attention import AttentionMetadata, paged_attention, select_backend
from pdserve.engine.kernels import load_paged_attention

pytestmark = pytest.mark.skipif(load_paged_attention() is None, reason="no C++ compiler: the native kernel is off")


def _batch(rng: random.Random, q_lens_ctx: list[tuple[int, int]], block_size: int, num_blocks: int):
    """Block tables (random, distinct blocks), computed and new token counts for (q_len, context) pairs."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, computed, new = [], [], []
    for q_len, ctx in q_lens_ctx:
        need = -(-ctx // block_size)
        tables.append([free.pop() for _ in range(need)])
        computed.append(ctx - q_len)
        new.append(q_len)
    return tables, computed, new


def _run(backend: str, cache: torch.Tensor, q, k, v, tables, computed, new, block_size, window, scale):
    md = AttentionMetadata.build(tables, computed, new, block_size, backend=backend)
    return paged_attention(q, k, v, cache, md, scale, window)


@pytest.mark.parametrize("heads", [(4, 4), (12, 4), (8, 1)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_matches_reference_on_a_mixed_batch(heads, window, block_size):
    """Decode rows, chunked prefill over a cached prefix, and fresh prefills, in one batch (blocks of
    16 take the kernel's eight-keys-at-a-time score path, blocks of 4 only its shorter ones)."""
    num_heads, num_kv_heads = heads
    head_dim, num_blocks = 16, 64
    rng = random.Random(0)
    torch.manual_seed(0)
    shapes = [(1, 1), (1, 9), (1, 30), (5, 13), (6, 6), (11, 11), (1, 4), (3, 25)]
    tables, computed, new = _batch(rng, shapes, block_size, num_blocks)
    n = sum(new)
    # NaN in every slot no sequence owns: a kernel that read past a sequence's end would show it.
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    for table, c, q_len in zip(tables, computed, new):  # the cached context is real data
        for pos in range(c):
            cache[:, table[pos // block_size], pos % block_size] = torch.randn(2, num_kv_heads, head_dim)
    q = torch.randn(n, num_heads, head_dim)
    k = torch.randn(n, num_kv_heads, head_dim)
    v = torch.randn(n, num_kv_heads, head_dim)
    ref_cache = cache.clone()
    ref = _run("reference", ref_cache, q, k, v, tables, computed, new, block_size, window, head_dim**-0.5)
    out = _run("paged", cache, q, k, v, tables, computed, new, block_size, window, head_dim**-0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cache, ref_cache, equal_nan=True)  # both wrote the same new K/V


def test_paged_decode_with_bfloat16_cache():
    rng = random.Random(1)
    torch.manual_seed(1)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 6, 2, 32, 16, 32
    shapes = [(1, 40), (1, 17), (1, 100)]
    tables, computed, new = _batch(rng, shapes, block_size, num_blocks)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim).to(torch.bfloat16)
    n = sum(new)
    q = torch.randn(n, num_heads, head_dim, dtype=torch.bfloat16)
    k = torch.randn(n, num_kv_heads, head_dim, dtype=torch.bfloat16)
    v = torch.randn(n, num_kv_heads, head_dim, dtype=torch.bfloat16)
    ref = _run("reference", cache.clone(), q.float(), k.float(), v.float(), tables, computed, new, block_size,
               None, 0.2)
    out = _run("paged", cache, q, k, v, tables, computed, new, block_size, None, 0.2)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_select_backend():
    assert select_backend("auto", torch.device("cpu"), torch.float32) == "paged"
    assert select_backend("auto", torch.device("cpu"), torch.float16) == "reference"
    assert select_backend("reference", torch.device("cpu"), torch.float32) == "reference"
    with pytest.raises(ValueError, match="cannot run here"):
        select_backend("paged", torch.device("cpu"), torch.float16)
    with pytest.raises(ValueError, match="unknown attention backend"):
        select_backend("flash", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("threads", [1, 2])
def test_paged_splits_heads_when_sequences_are_few(threads):
    """One long sequence on two threads: the kernel shares its KV heads out (and head_dim 128)."""
    rng = random.Random(2)
    torch.manual_seed(2)
    num_heads, num_kv_heads, head_dim, block_size, num_blocks = 8, 4, 128, 8, 40
    tables, computed, new = _batch(rng, [(1, 300)], block_size, num_blocks)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    q, k, v = torch.randn(1, num_heads, head_dim), torch.randn(1, num_kv_heads, head_dim), \
        torch.randn(1, num_kv_heads, head_dim)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = _run("paged", cache.clone(), q, k, v, tables, computed, new, block_size, None, 0.1)
    finally:
        torch.set_num_threads(before)
    ref = _run("reference", cache.clone(), q, k, v, tables, computed, new, block_size, None, 0.1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_head_dim_not_a_multiple_of_8_takes_the_reference_path():
    assert select_backend("auto", torch.device("cpu"), torch.float32, head_dim=12) == "reference"


def test_paged_softmax_over_a_wide_range_of_scores():
    """Large queries spread the scores over tens of units: the kernel's own exp must hold 1e-5."""
    rng = random.Random(3)
    torch.manual_seed(3)
    tables, computed, new = _batch(rng, [(1, 200), (1, 77), (4, 90)], 16, 40)
    cache = torch.randn(2, 40, 16, 2, 64)
    n = sum(new)
    q, k, v = 8 * torch.randn(n, 4, 64), torch.randn(n, 2, 64), torch.randn(n, 2, 64)
    ref = _run("reference", cache.clone(), q, k, v, tables, computed, new, 16, None, 0.125)
    out = _run("paged", cache.clone(), q, k, v, tables, computed, new, 16, None, 0.125)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_loading_the_kernel_leaves_float_state_alone():
    """The library must not switch the process to flush-to-zero (as -ffast-math's crtfastmath would)."""
    import sys

    tiny = sys.float_info.min / 2  # a subnormal double
    assert tiny > 0.0
    assert torch.tensor([1e-40], dtype=torch.float32).mul(1.0).item() > 0.0
