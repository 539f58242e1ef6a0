"""The native paged-attention backend against the plain-torch reference (gather + masked SDPA)."""

from __future__ import annotations

import random

import pytest
import torch

from pdserve.engine.layers.attention import AttentionMetadata, paged_attention, select_backend
from pdserve.engine.layers.paged_backend import native_plan
from pdserve.kernels import load_paged_attention, load_prefill_attention
from pdserve.engine.layers.prefill_attention import causal_attention
from tests.threads import torch_threads
from tests.helpers.kernels import _batch  # noqa: F401

pytestmark = pytest.mark.skipif(load_paged_attention() is None, reason="no C++ compiler: the native kernel is off")


def _run(backend: str, cache: torch.Tensor, q, k, v, tables, computed, new, block_size, window, scale):
    md = AttentionMetadata.build(tables, computed, new, block_size, backend=backend)
    return paged_attention(q, k, v, cache, md, scale, window)


@pytest.mark.parametrize("heads,head_dim", [((4, 4), 16), ((12, 4), 16), ((8, 1), 16), ((20, 4), 48),
                                             ((16, 4), 24)])
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_matches_reference_on_a_mixed_batch(heads, head_dim, window, block_size):
    """Decode rows, chunked prefill over a cached prefix, and fresh prefills, in one batch (blocks of
    16 take the kernel's eight-keys-at-a-time score path, blocks of 4 only its shorter ones). Chunks of
    ``CHUNK_DENSE_MIN_ROWS`` rows or more after cached ones attend densely over the gathered cache
    (without a window), shorter ones in the kernel: both against the reference. With AVX-512, head_dim
    16 and 48 take the 16-lane path (five query heads per KV head: scores in groups of 3 + 2, values
    4 + 1; 48 columns: a three-vector value chunk), 24 the 8-lane one."""
    num_heads, num_kv_heads = heads
    num_blocks = 96
    rng = random.Random(0)
    torch.manual_seed(0)
    shapes = [(1, 1), (1, 9), (1, 30), (5, 13), (6, 6), (11, 11), (1, 4), (3, 25), (20, 45), (16, 37)]
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
    plan = native_plan(AttentionMetadata.build(tables, computed, new, block_size, backend="paged"), window)
    assert [c[2] for c in plan.chunks] == ([] if window else [8, 9])  # the two long chunks; (5, 13) stays
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
    with torch_threads(threads):
        out = _run("paged", cache.clone(), q, k, v, tables, computed, new, block_size, None, 0.1)
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


def _dense_latent(q, rows, v_dim, scale):
    """Causal attention of q [q_len, H, D] (the last q_len positions) over one latent row per position,
    rows [ctx, 1, D]: key = the row, value = its first v_dim values. Returns [q_len, H, v_dim]."""
    q_len, ctx = q.shape[0], rows.shape[0]
    k = rows[:, 0]  # (ctx, D)
    scores = torch.einsum("qhd,kd->hqk", q, k) * scale  # (H, q_len, ctx)
    pos = torch.arange(ctx - q_len, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,kv->qhv", scores.softmax(-1), k[:, :v_dim])


@pytest.mark.parametrize("kv_dtype", [None, "bfloat16", "int8", "fp8_e4m3"])
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_latent_cache_values_are_the_key_rows_head(kv_dtype, batch_invariant):
    """A latent cache (one slot per token, as DeepSeek's MLA): the kernel reads V from the K rows, only
    their first v_dim < head_dim columns (a quantized row's one scale for both), and matches the
    reference path and, in float32, dense attention; only one row per token is written."""
    from pdserve.common.kv_quant import kv_cache_format, quantize_rows

    head_dim, v_dim, num_heads, block_size, num_blocks = 40, 32, 8, 16, 64
    rng = random.Random(4)
    torch.manual_seed(4)
    shapes = [(1, 1), (1, 9), (1, 30), (5, 13), (6, 6), (11, 11), (1, 4), (3, 25), (18, 40)]
    tables, computed, new = _batch(rng, shapes, block_size, num_blocks)
    fmt = kv_cache_format(kv_dtype or "float32")
    rows = [torch.randn(c + n, 1, head_dim) for c, n in zip(computed, new)]  # each sequence's latent rows
    if fmt.quantized:
        cache = torch.full((1, num_blocks, block_size, 1, head_dim + 4), 255, dtype=torch.uint8)  # NaN scales
    else:
        cache = torch.full((1, num_blocks, block_size, 1, head_dim), float("nan"), dtype=fmt.storage_dtype)
    for table, c, r in zip(tables, computed, rows):
        for pos in range(c):
            row = quantize_rows(r[pos], fmt) if fmt.quantized else r[pos].to(fmt.storage_dtype)
            cache[0, table[pos // block_size], pos % block_size] = row
    key = torch.cat([r[c:] for r, c in zip(rows, computed)])  # (N, 1, D)
    q = torch.randn(key.shape[0], num_heads, head_dim)
    scale = head_dim**-0.5
    outs, caches = {}, {}
    for backend in ("reference", "paged"):
        caches[backend] = cache.clone()
        md = AttentionMetadata.build(tables, computed, new, block_size, backend=backend, kv_cache_dtype=kv_dtype)
        md.batch_invariant = batch_invariant
        outs[backend] = paged_attention(q, key, key[..., :v_dim], caches[backend], md, scale)
    assert outs["paged"].shape == (key.shape[0], num_heads, v_dim)
    assert not outs["paged"].isnan().any()
    # bfloat16: a fresh prefill's SDPA takes the float32 new rows, the reference their bfloat16 copies
    tol = {None: 1e-5, "bfloat16": 2e-2, "int8": 2e-6, "fp8_e4m3": 2e-6}[kv_dtype]
    torch.testing.assert_close(outs["paged"], outs["reference"], atol=tol, rtol=tol)
    assert torch.equal(caches["paged"].view(torch.uint8), caches["reference"].view(torch.uint8))
    if kv_dtype is None:  # against dense attention, sequence by sequence
        starts = [0]
        for n in new:
            starts.append(starts[-1] + n)
        for i, (r, n) in enumerate(zip(rows, new)):
            want = _dense_latent(q[starts[i]:starts[i + 1]], r, v_dim, scale)
            torch.testing.assert_close(outs["paged"][starts[i]:starts[i + 1]], want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [None, 5])
def test_decode_op_writes_and_attends_in_one_call(window):
    """The decode op on a float32 K/V cache makes one native call (the new rows' write, then attention):
    against the reference backend on a copy of the cache, the same outputs and the same cache (only the
    layer asked for written), with K/V rows strided as the fused QKV projection leaves them. A slot outside
    the cache raises and writes nothing."""
    num_layers, num_blocks, block_size, num_heads, num_kv_heads, head_dim = 3, 12, 4, 6, 2, 16
    tables, computed, new = _batch(random.Random(1), [(1, 1), (1, 7), (1, 13)], block_size, num_blocks)
    torch.manual_seed(1)
    cache = torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(3, q_size + 2 * kv_size + 4)  # rows longer than q, k and v: strided views
    q = qkv[:, :q_size].view(3, num_heads, head_dim)
    k = qkv[:, q_size:q_size + kv_size].view(3, num_kv_heads, head_dim)
    v = qkv[:, q_size + kv_size:q_size + 2 * kv_size].view(3, num_kv_heads, head_dim)
    expected_cache = cache.clone()
    want = _run("reference", expected_cache[1], q, k, v, tables, computed, new, block_size, window, 0.25)
    md = AttentionMetadata.build(tables, computed, new, block_size, backend="paged")
    got = paged_attention(q, k, v, cache, md, 0.25, window, layer=1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache, expected_cache)
    bad_slots = md.slot_mapping.clone()
    bad_slots[2] = num_blocks * block_size
    with pytest.raises(ValueError, match="code 6"):
        torch.ops.pdserve.paged_decode_attention(q, k, v, cache, 1, bad_slots, md.block_tables, md.seq_lens,
                                                 md.query_start_loc, 0.25, 0)
    assert torch.equal(cache, expected_cache)


def test_the_float32_decode_op_runs_in_cpp_with_its_python_implementations_bits():
    """Where ``kernels.load_torch_ops`` builds, ``paged_decode_attention_f32`` has a C++ CPU kernel
    (torch_ops.cpp) calling the same native kernel as its Python implementation: the same output bits and
    the same cache after the write, for strided K/V and a sliding window; what the kernel rejects (a slot
    outside the cache, int32 metadata, a cache that is not float32) raises ValueError and writes nothing."""
    from pdserve.engine.layers.paged_backend import _decode_float32
    from pdserve.kernels import load_torch_ops

    if load_torch_ops() is None:
        pytest.skip("the C++ operators cannot be built here")
    assert torch._C._dispatch_has_kernel_for_dispatch_key("pdserve::paged_decode_attention_f32", "CPU")
    num_layers, num_blocks, block_size, num_heads, num_kv_heads, head_dim = 2, 16, 4, 8, 2, 32
    tables, computed, new = _batch(random.Random(5), [(1, 3), (1, 9), (1, 20), (1, 1)], block_size, num_blocks)
    md = AttentionMetadata.build(tables, computed, new, block_size, backend="paged")
    torch.manual_seed(5)
    cache = torch.randn(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    q = torch.randn(4, num_heads, head_dim)
    kv = torch.randn(4, 2, num_kv_heads, head_dim + 8)[..., :head_dim]  # strided rows
    k, v = kv[:, 0], kv[:, 1]
    args = (md.slot_mapping, md.block_tables, md.seq_lens, md.query_start_loc, 0.2)
    for window in (0, 6):
        py_cache, cpp_cache = cache.clone(), cache.clone()
        want = _decode_float32(q, k, v, py_cache, 1, *args, window)
        got = torch.ops.pdserve.paged_decode_attention_f32(q, k, v, cpp_cache, 1, *args, window)
        assert torch.equal(got, want) and torch.equal(cpp_cache, py_cache)
        assert not torch.equal(cpp_cache[1], cache[1]) and torch.equal(cpp_cache[0], cache[0])
    bad_slots = md.slot_mapping.clone()
    bad_slots[1] = num_blocks * block_size
    rejected = [(cache, bad_slots, md.seq_lens, "code 6"), (cache, md.slot_mapping, md.seq_lens.int(), "int64"),
                (cache.double(), md.slot_mapping, md.seq_lens, "float32")]
    for c, slots, seq_lens, message in rejected:
        before = c.clone()
        with pytest.raises(ValueError, match=message):
            torch.ops.pdserve.paged_decode_attention_f32(q, k, v, c, 1, slots, md.block_tables, seq_lens,
                                                         md.query_start_loc, 0.2, 0)
        assert torch.equal(c, before)


def test_latent_decode_op_writes_one_row_and_reads_values_from_it():
    """The compiled decode op (``paged_decode_attention``) over a latent cache: one new row per token is
    written into the single slot, and a decode over one cached token returns that row's head."""
    cache = torch.zeros(2, 1, 4, 4, 1, 24)  # [num_layers, kv_slots=1, num_blocks, block_size, 1, head_dim]
    row = torch.randn(1, 1, 24)
    md = AttentionMetadata.build([[2]], [0], [1], 4, backend="paged")
    out = paged_attention(torch.randn(1, 3, 24), row, row[..., :16], cache, md, 0.5, layer=1)
    assert out.shape == (1, 3, 16)
    torch.testing.assert_close(out, row[..., :16].expand(1, 3, 16))  # one key: softmax weight 1
    assert torch.equal(cache[1, 0, 2, 0], row[0]) and cache[0].abs().sum() == 0


def _dense_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain float64 attention: row j of Q sees keys 0 .. L - Q + j (GQA by repeating KV heads)."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), kk) * scale
    num_q, num_k = q.shape[0], k.shape[0]
    scores.masked_fill_(~torch.ones(num_q, num_k, dtype=torch.bool).tril(num_k - num_q), float("-inf"))
    return torch.einsum("hqk,khv->qhv", scores.softmax(-1), vv).float()


@pytest.mark.skipif(load_prefill_attention() is None, reason="no C++ compiler: the prefill kernel is off")
@pytest.mark.parametrize("num_q,num_k,heads,head_dim,v_dim", [
    (1, 1, (4, 4), 16, 16), (15, 15, (12, 4), 64, 64), (17, 17, (8, 1), 32, 32), (200, 200, (12, 4), 64, 64),
    (64, 300, (6, 2), 128, 128), (33, 97, (4, 2), 80, 48)])
def test_prefill_kernel_matches_dense_attention(num_q, num_k, heads, head_dim, v_dim):
    """``prefill_attention.cpp`` (fresh prompts and chunks after cached rows, GQA, a strided query as the
    fused QKV projection leaves it, values narrower than keys as a latent cache's) against float64
    attention; one thread and two give the same bits (a row's result depends on its keys alone)."""
    torch.manual_seed(num_q + num_k)
    num_heads, num_kv_heads = heads
    qkv = torch.randn(num_q, num_heads * head_dim + 8)  # rows longer than the query: a strided view
    q = 4 * qkv[:, :num_heads * head_dim].view(num_q, num_heads, head_dim)  # spread scores over tens of units
    key = torch.randn(num_k, num_kv_heads, head_dim)
    value = key[..., :v_dim] if v_dim < head_dim else torch.randn(num_k, num_kv_heads, v_dim)
    outs = []
    for threads in (1, 2):
        out = torch.full((num_q, num_heads, v_dim), float("nan"))
        with torch_threads(threads):
            causal_attention(out, q, key, value, num_heads // num_kv_heads, head_dim**-0.5, [None])
        outs.append(out)
    torch.testing.assert_close(outs[0], _dense_causal(q, key, value, head_dim**-0.5), atol=2e-5, rtol=2e-5)
    assert torch.equal(outs[0], outs[1])


def test_prefill_attention_falls_back_to_sdpa():
    """Head dims the kernel does not take (not a multiple of 16) and bfloat16 rows go through SDPA,
    which builds a chunk's shifted mask once and keeps it for the next layer."""
    torch.manual_seed(5)
    for dtype, head_dim in ((torch.float32, 24), (torch.bfloat16, 64)):
        q, key, value = (torch.randn(9, 4, head_dim), torch.randn(20, 2, head_dim), torch.randn(20, 2, head_dim))
        masks: list[torch.Tensor | None] = [None]
        out = torch.empty(9, 4, head_dim)
        causal_attention(out, q.to(dtype), key.to(dtype), value.to(dtype), 2, 0.3, masks)
        want = _dense_causal(q.to(dtype).float(), key.to(dtype).float(), value.to(dtype).float(), 0.3)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(out, want, atol=tol, rtol=tol)
        assert masks[0] is not None and masks[0].shape == (9, 20)


@pytest.mark.parametrize("num_q,num_k,heads", [(32, 96, (4, 4)), (40, 200, (12, 4)), (64, 1000, (6, 1)),
                                                (256, 768, (12, 4)), (512, 768, (4, 2))])
def test_a_chunk_after_many_cached_rows_splits_its_sdpa_without_a_mask(num_q, num_k, heads):
    """A chunk after enough cached rows (twice its own, or half of its own for a long chunk), on torch's path
    (the native kernel off), is two flash-attention calls merged by log-sum-exp (``chunk_sdpa``): the same
    values as float64 attention (GQA, a strided query) and no [Q, L] mask built; a chunk after one cached
    row fewer keeps the masked call."""
    from pdserve.engine.layers.native_switch import native, set_native
    from pdserve.engine.layers.prefill_attention import chunk_sdpa, splits

    torch.manual_seed(num_q + num_k)
    num_heads, num_kv_heads = heads
    qkv = torch.randn(num_q, num_heads * 64 + 8)
    q = 4 * qkv[:, :num_heads * 64].view(num_q, num_heads, 64)  # a strided view, scores over tens of units
    key, value = torch.randn(num_k, num_kv_heads, 64), torch.randn(num_k, num_kv_heads, 64)
    was = native("prefill_attention")
    set_native("prefill_attention", False)
    try:
        masks: list[torch.Tensor | None] = [None]
        out = torch.full((num_q, num_heads, 64), float("nan"))
        causal_attention(out, q, key, value, num_heads // num_kv_heads, 0.125, masks)
        assert masks[0] is None  # split: no mask
        torch.testing.assert_close(out, _dense_causal(q, key, value, 0.125), atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(chunk_sdpa(q, key, value, num_heads // num_kv_heads, 0.125), out, atol=0, rtol=0)
        few = num_q + next(c for c in range(num_k) if splits(num_q, c)) - 1  # one cached row short of the split
        causal_attention(out, q, key[:few], value[:few], num_heads // num_kv_heads, 0.125, masks)
        assert masks[0] is not None and masks[0].shape == (num_q, few)
        torch.testing.assert_close(out, _dense_causal(q, key[:few], value[:few], 0.125), atol=2e-5, rtol=2e-5)
    finally:
        set_native("prefill_attention", was)


def test_make_install_builds_every_kernel_for_this_cpu():
    """``python -m pdserve.kernels`` (run by ``make install``) builds each library into the cache, so a first
    ``pdserve up`` does not: a kernel that cannot build is named, and the command still exits 0."""
    import os
    import subprocess
    import sys

    from pdserve.kernels import cache_dir

    env = dict(os.environ, PDSERVE_KERNEL_CACHE=str(cache_dir()))  # the suite's own cache: built already, fast
    out = subprocess.run([sys.executable, "-m", "pdserve.kernels"], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "paged_attention built" in out and "elementwise built" in out, out
    env["PDSERVE_DISABLE_KERNELS"] = "1"
    out = subprocess.run([sys.executable, "-m", "pdserve.kernels"], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert "paged_attention NOT built" in out, out
