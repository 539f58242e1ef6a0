"""paged_attention against a dense causal reference on contiguous K/V."""

import random

import pytest
import torch
import torch.nn.functional as F

from pdserve.engine.layers.attention import AttentionMetadata, paged_attention

BLOCK_SIZE = 4
NUM_BLOCKS = 64
HEAD_DIM = 8


def dense_reference(q, k, v, scale, sliding_window=None):
    """q [q_len, H, D] are the last q_len positions of a context k, v [ctx_len, H_kv, D]."""
    q_len, num_heads, _ = q.shape
    ctx_len, num_kv_heads, _ = k.shape
    rep = num_heads // num_kv_heads
    k = k.repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, ctx, D)
    v = v.repeat_interleave(rep, dim=1).transpose(0, 1)  # (H, ctx, D)
    q_pos = torch.arange(ctx_len - q_len, ctx_len)[:, None]
    k_pos = torch.arange(ctx_len)[None, :]
    mask = k_pos <= q_pos
    if sliding_window is not None:
        mask &= k_pos > q_pos - sliding_window
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k, v, attn_mask=mask, scale=scale)
    return out.transpose(0, 1)  # (q_len, H, D)


def run_case(num_cached, num_new, num_heads, num_kv_heads, seed=0, sliding_window=None, dtype=torch.float32,
             device="cpu"):
    """Cache num_cached[i] tokens of seq i, then run paged_attention on num_new[i] new ones."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    # A NaN-filled cache proves unused slots never leak into the result.
    kv_cache = torch.full((2, NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, HEAD_DIM), float("nan"), dtype=dtype)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)  # non-contiguous, shuffled block ids
    tables, full_k, full_v = [], [], []
    for c, n in zip(num_cached, num_new):
        num_blocks = -(-(c + n) // BLOCK_SIZE)
        tables.append([free.pop() for _ in range(num_blocks)])
        full_k.append(torch.randn(c + n, num_kv_heads, HEAD_DIM, generator=gen).to(dtype))
        full_v.append(torch.randn(c + n, num_kv_heads, HEAD_DIM, generator=gen).to(dtype))
    # Put the cached context in place by hand.
    for table, c, k, v in zip(tables, num_cached, full_k, full_v):
        for pos in range(c):
            b, off = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            kv_cache[0, b, off], kv_cache[1, b, off] = k[pos], v[pos]

    meta = AttentionMetadata.build(tables, num_cached, num_new, BLOCK_SIZE, device=device)
    qs = [torch.randn(n, num_heads, HEAD_DIM, generator=gen).to(dtype) for n in num_new]
    query = torch.cat(qs)
    key = torch.cat([k[c:] for k, c in zip(full_k, num_cached)])
    value = torch.cat([v[c:] for v, c in zip(full_v, num_cached)])
    scale = HEAD_DIM**-0.5
    kv_dev = kv_cache.to(device)
    out = paged_attention(query.to(device), key.to(device), value.to(device), kv_dev, meta, scale, sliding_window)
    out, kv_cache, meta.slot_mapping = out.cpu(), kv_dev.cpu(), meta.slot_mapping.cpu()

    assert out.shape == query.shape
    ref = torch.cat([dense_reference(q, k, v, scale, sliding_window) for q, k, v in zip(qs, full_k, full_v)])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)

    # The new K/V landed in the slots slot_mapping names, and those slots are the right ones.
    flat = kv_cache.view(2, -1, num_kv_heads, HEAD_DIM)
    torch.testing.assert_close(flat[0, meta.slot_mapping], key)
    torch.testing.assert_close(flat[1, meta.slot_mapping], value)
    for table, k, v in zip(tables, full_k, full_v):
        for pos in range(k.shape[0]):
            b, off = table[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            assert torch.equal(kv_cache[0, b, off], k[pos]) and torch.equal(kv_cache[1, b, off], v[pos])
    return meta


def test_prefill_batch():
    run_case(num_cached=[0, 0, 0], num_new=[5, 12, 1], num_heads=4, num_kv_heads=4)


def test_decode_batch():
    meta = run_case(num_cached=[7, 3, 16, 0], num_new=[1, 1, 1, 1], num_heads=4, num_kv_heads=4)
    assert meta.max_query_len == 1


def test_mixed_batch_with_cached_context():
    # seq 0 decodes; seq 1 has 6 cached tokens + 7 new (chunked prefill / prefix hit); seq 2 is a fresh prefill.
    run_case(num_cached=[9, 6, 0], num_new=[1, 7, 10], num_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 2), (4, 1), (6, 3)])
def test_gqa(num_heads, num_kv_heads):
    run_case(num_cached=[5, 0, 13], num_new=[3, 9, 1], num_heads=num_heads, num_kv_heads=num_kv_heads, seed=3)


def test_sliding_window():
    run_case(num_cached=[10, 0], num_new=[4, 11], num_heads=4, num_kv_heads=2, sliding_window=5, seed=5)


def test_bfloat16():
    run_case(num_cached=[4, 0], num_new=[3, 6], num_heads=4, num_kv_heads=2, dtype=torch.bfloat16, seed=7)


def test_block_tables_padding_and_slots():
    meta = AttentionMetadata.build([[5, 2], [9]], [3, 0], [2, 1], block_size=4)
    assert meta.block_tables.tolist() == [[5, 2], [9, 0]]
    assert meta.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 9 * 4 + 0]
    assert meta.seq_lens.tolist() == [5, 1]
    assert meta.query_start_loc.tolist() == [0, 2, 3]
    assert (meta.max_query_len, meta.max_seq_len) == (2, 5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_mixed_gqa(dtype):
    run_case(num_cached=[9, 6, 0, 20], num_new=[1, 7, 10, 1], num_heads=8, num_kv_heads=2, dtype=dtype, device="cuda")
