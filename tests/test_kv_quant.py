"""Quantized KV cache (``--kv-cache-dtype int8|fp8_e4m3|fp8_e5m2``): the packed rows, both attention
backends over them, block copies, the offline ``LLM`` against a float32 cache, and the KV transfer
between a real prefill and decode worker (bytes, dtype in the header, mismatched pairs refused).
The whole cluster as processes: tests/test_cluster_kv_quant.py."""

from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch
import zmq

from pdserve import LLM, SamplingParams
from pdserve.common.config import WorkerConfig
from pdserve.common.protocol import GenerateRequest, KVLayout, RegisterWorker, RemotePrefillRequest, WorkerRole
from pdserve.common.transport import encode
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.layers.attention import AttentionMetadata, paged_attention, select_backend
from pdserve.engine.layers.paged_backend import attend_native
from pdserve.engine.config import EngineConfig
from pdserve.kernels import load_paged_attention
from pdserve.engine.execution.kv_cache import allocate_kv_cache, copy_blocks, kv_cache_block_bytes, num_blocks_for_budget
from pdserve.common.kv_quant import QUANTIZED_KV_DTYPES, dequantize_rows, kv_cache_format, quantize_rows
from pdserve.kvtransfer import wire
from pdserve.kvtransfer.agent import check_kv_dtype
from pdserve.prefill_worker.worker import PrefillWorker
from pdserve.router.registry import WorkerRegistry
from tests.helpers.kernels import _batch
from tests.helpers.fake_peers import GREEDY, FakeRouter, Peer, drive
from tests.helpers.kernels import kv_dtype_runs  # noqa: F401

needs_kernel = pytest.mark.skipif(load_paged_attention() is None, reason="no C++ compiler: the native kernel is off")
# Worst error of one element relative to its row's amax: int8 rounds to 1/254 of amax; an fp8 value is
# within half an ulp of it (2^-4 relative for e4m3's 3 mantissa bits, 2^-3 for e5m2's 2).
ROW_TOL = {"int8": 0.5 / 127 + 1e-6, "fp8_e4m3": 2.0**-4, "fp8_e5m2": 2.0**-3}


# ---- the packed rows -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", QUANTIZED_KV_DTYPES)
def test_round_trip_error_is_within_the_format_bound(name):
    fmt = kv_cache_format(name)
    torch.manual_seed(0)
    x = torch.randn(50, 3, 64) * torch.logspace(-3, 3, 50)[:, None, None]  # rows of very different scales
    x[0, 0] = 0.0  # an all-zero row: scale 1, exact zeros back
    packed = quantize_rows(x, fmt)
    assert packed.dtype == torch.uint8 and packed.shape == (50, 3, 68)
    y = dequantize_rows(packed, fmt)
    assert torch.equal(y[0, 0], torch.zeros(64))
    amax = x.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    rel = ((y - x).abs() / amax).max().item()
    assert rel <= ROW_TOL[name], rel
    assert rel > ROW_TOL[name] / 8  # it does quantize (a float copy would pass the bound above)
    scale = packed[..., 64:].contiguous().view(torch.float32)[..., 0]  # the row's float32 scale, beside it
    torch.testing.assert_close(scale[1:], x.abs().amax(-1)[1:] / fmt.qmax)
    # the largest element of each row is the format's largest value: nothing clips
    assert torch.allclose(y.abs().amax(-1), x.abs().amax(-1), rtol=ROW_TOL[name])


def test_unknown_kv_cache_dtype_is_a_clear_error(model_dir):
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'.*int8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(model=model_dir, kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="unknown KV cache dtype 'int4'"):
        kv_cache_format("int4")


def test_block_bytes_count_the_scales_and_an_int8_cache_holds_more_blocks():
    f32 = kv_cache_block_bytes(4, 16, 2, 64, torch.float32)
    assert kv_cache_block_bytes(4, 16, 2, 64, "bfloat16") * 2 == f32
    for name in QUANTIZED_KV_DTYPES:
        assert kv_cache_block_bytes(4, 16, 2, 64, name) == 4 * 2 * 16 * 2 * (64 + 4)
    budget = 64 * 2**20
    ratio = num_blocks_for_budget(budget, kv_cache_block_bytes(4, 16, 2, 64, "int8")) / \
        num_blocks_for_budget(budget, f32)
    assert 3.7 < ratio < 3.8  # 256 / 68 bytes per row


def test_block_copy_moves_the_scales_with_the_values():
    fmt = kv_cache_format("int8")
    cache = allocate_kv_cache(2, 6, 4, 2, 16, "int8", "cpu")
    assert cache.shape == (2, 2, 6, 4, 2, 20) and cache.dtype == torch.uint8
    x = torch.randn(2, 2, 4, 2, 16) * torch.tensor([0.01, 100.0])[:, None, None, None, None]
    cache[:, :, 1] = quantize_rows(x, fmt)
    copy_blocks(cache, [(1, 4)])
    assert torch.equal(cache[:, :, 4], cache[:, :, 1])
    err = (dequantize_rows(cache[:, :, 4], fmt) - x).abs() / x.abs().amax(-1, keepdim=True)
    assert err.max() <= ROW_TOL["int8"]  # each row's own scale came along: the 0.01 rows stay exact-ish


# ---- attention over a quantized cache ----------------------------------------------------------------


def _quantized_batch(name, num_heads, num_kv_heads, head_dim=16, block_size=4, num_blocks=64, seed=0):
    """A mixed batch (decode rows, chunked prefill over a cached prefix, fresh prefills) whose cached
    context is quantized rows; every slot no sequence owns is 0xff bytes (a NaN scale)."""
    fmt = kv_cache_format(name)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    shapes = [(1, 1), (1, 9), (1, 30), (5, 13), (6, 6), (11, 11), (1, 4), (3, 25)]
    tables, computed, new = _batch(rng, shapes, block_size, num_blocks)
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim + 4), 255, dtype=torch.uint8)
    for table, c in zip(tables, computed):
        for pos in range(c):
            cache[:, table[pos // block_size], pos % block_size] = quantize_rows(
                torch.randn(2, num_kv_heads, head_dim), fmt)
    n = sum(new)
    qkv = (torch.randn(n, num_heads, head_dim), torch.randn(n, num_kv_heads, head_dim),
           torch.randn(n, num_kv_heads, head_dim))
    return cache, qkv, (tables, computed, new, block_size)


def _attend(backend, name, cache, qkv, batch, window):
    tables, computed, new, block_size = batch
    md = AttentionMetadata.build(tables, computed, new, block_size, backend=backend, kv_cache_dtype=name)
    q, k, v = qkv
    return paged_attention(q, k, v, cache, md, q.shape[-1] ** -0.5, window)


@needs_kernel
@pytest.mark.parametrize("name", QUANTIZED_KV_DTYPES)
@pytest.mark.parametrize("heads,window", [((4, 4), None), ((12, 4), 7), ((8, 1), None)])
def test_kernel_matches_reference_on_a_quantized_cache(name, heads, window):
    cache, qkv, batch = _quantized_batch(name, *heads)
    ref_cache = cache.clone()
    ref = _attend("reference", name, ref_cache, qkv, batch, window)
    out = _attend("paged", name, cache, qkv, batch, window)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=2e-6)
    assert torch.equal(cache, ref_cache)  # both wrote the same quantized rows


@pytest.mark.parametrize("name", QUANTIZED_KV_DTYPES)
def test_attention_over_a_quantized_cache_is_close_to_float(name):
    """Reference backend: quantized cache against a float32 cache holding the same K/V."""
    cache, qkv, batch = _quantized_batch(name, 12, 4)
    fmt = kv_cache_format(name)
    float_cache = dequantize_rows(cache, fmt)  # the same context, unquantized (unowned slots: NaN)
    out = _attend("reference", name, cache, qkv, batch, None)
    exact = _attend("reference", None, float_cache, qkv, batch, None)
    err = (out - exact).abs().max().item()
    assert err < {"int8": 0.02, "fp8_e4m3": 0.15, "fp8_e5m2": 0.3}[name], err
    assert err > 0  # the new tokens' K/V were quantized too


@needs_kernel
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_kernel_decodes_every_fp8_code_as_torch_does(name):
    """One key, so the output is exactly that V row: every finite fp8 byte, dequantized by the kernel."""
    fmt = kv_cache_format(name)
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(fmt.quant_dtype).to(torch.float32)
    codes[~values.isfinite()] = 0
    values = codes.view(fmt.quant_dtype).to(torch.float32)  # (256,)
    scale = torch.tensor([0.375])
    row = torch.cat([codes, scale.view(torch.uint8)])  # (260,) one packed row
    cache = torch.zeros(2, 2, 4, 1, 260, dtype=torch.uint8)
    cache[:, 1, 0, 0] = row
    md = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_tables=torch.tensor([[1]]),
                           seq_lens=torch.tensor([1]), query_start_loc=torch.tensor([0, 1]), max_query_len=1,
                           max_seq_len=1, backend="paged", kv_cache_dtype=name)  # one row over the cached token
    out = attend_native(torch.randn(1, 1, 256), None, None, cache, md, 1.0, None)
    assert torch.equal(out[0, 0], values * 0.375)


# ---- the engine ------------------------------------------------------------------------------------


def test_llm_int8_cache_agrees_with_float32_and_bounds_the_logit_error(model_dir):
    def check(runner):
        assert (runner.kv_cache.dtype, runner.kv_cache_format.name) == (torch.uint8, "int8")

    prompts, base, int8, by_dtype = kv_dtype_runs(model_dir, check)
    ref, logits, fp8 = by_dtype["float32"], by_dtype["int8"], by_dtype["fp8_e4m3"]
    # The tiny model's random weights leave near-ties (top-2 logit gaps down to 0.01), so greedy runs do
    # part; most of each output is float32's, up to where they part.
    agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(base, int8)]
    assert sum(agreed) >= 0.6 * sum(map(len, base)), agreed
    assert sum(a == b for a, b in zip(base, int8)) >= len(prompts) // 3, agreed
    assert logits.shape == ref.shape == fp8.shape
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean() >= 0.95  # the same next token nearly always
    errors = {"int8": (logits - ref).abs().max().item(), "fp8_e4m3": (fp8 - ref).abs().max().item()}
    spread = (ref.amax(-1) - ref.amin(-1)).mean().item()  # about 60 for this model
    assert 0 < errors["int8"] < 0.02 * spread, (errors, spread)  # quantized, yet close (measured: 0.65)
    assert errors["int8"] < errors["fp8_e4m3"] < 0.1 * spread, (errors, spread)  # 7 bits beat 3 (2.3)


@needs_kernel
def test_select_backend_takes_quantized_caches_to_the_kernel():
    for name in QUANTIZED_KV_DTYPES:
        assert select_backend("auto", torch.device("cpu"), name) == "paged"
    assert select_backend("auto", torch.device("cpu"), "float16") == "reference"


# ---- the KV transfer -------------------------------------------------------------------------------


def test_wire_meta_names_the_kv_dtype_and_the_model_head_dim():
    layer = torch.zeros(2, 3, 16, 2, 68, dtype=torch.uint8)
    for name in QUANTIZED_KV_DTYPES:
        meta = wire.make_meta("r", 4, layer, name).tolist()
        assert meta[6] == 64 and meta[7] == wire._DTYPE_CODES[name]
        assert wire.dtype_from_name(name) == torch.uint8 and wire.row_len(name, 64) == 68
    assert len({wire._DTYPE_CODES[n] for n in QUANTIZED_KV_DTYPES}) == 3
    with pytest.raises(wire.KVTransferError, match="cannot be transferred"):
        wire.make_meta("r", 4, layer)  # uint8 alone does not say which format
    with pytest.raises(wire.KVTransferError, match="must be torch.uint8"):
        wire.make_meta("r", 4, layer.float(), "int8")


def _worker(cls, model_dir, router_addr, kv_cache_dtype):
    engine = EngineConfig(model=model_dir, kv_cache_memory=4 * 2**20, remote_prefill_threshold=0,
                          kv_cache_dtype=kv_cache_dtype)
    return cls(engine, WorkerConfig(role=cls.role.name.lower(), router_addr=router_addr, transfer_timeout_s=30.0))


def _serve(workers):
    loops = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for loop in loops:
        loop.start()
    return loops


def _stop(workers, loops):
    for w in workers:
        w.stop()
    for loop in loops:
        loop.join(timeout=10)


def test_fp8_kv_moves_between_real_workers_as_the_cache_holds_it(model_dir):
    """A real PrefillWorker and DecodeWorker (KV over a real gloo pair), both fp8_e4m3: the decode
    worker's greedy output equals the offline LLM's with the same cache dtype, and the bytes that
    moved are the packed rows' (head_dim + 4 bytes per row: 20 here, against 64 in float32)."""
    router = FakeRouter()
    decode = _worker(DecodeWorker, model_dir, router.addr, "fp8_e4m3")
    prefill = _worker(PrefillWorker, model_dir, router.addr, "fp8_e4m3")
    assert decode.runner.kv_layout().kv_cache_dtype == "fp8_e4m3"
    loops = _serve((decode, prefill))
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(decode.mailbox.address)
    ids = list(range(40, 77))  # 37 tokens: 3 blocks of 16
    try:
        push.send_multipart(encode(GenerateRequest(
            request_id="r", prompt_token_ids=ids, sampling_params=GREEDY, prefill_worker_id=prefill.worker_id,
            prefill_addr=prefill.mailbox.address, prefill_layout=prefill.runner.kv_layout())))
        deadline = time.monotonic() + 60
        while router.finished("r") is None:
            assert time.monotonic() < deadline, "the request did not finish"
            router.poll(0.1)
        tokens = router.tokens("r")
    finally:
        _stop((decode, prefill), loops)
        ctx.destroy(linger=0)
        router.close()
    assert decode.stats.num_kv_transfers == 1 and decode.stats.kv_transfer_failures == 0
    row = kv_cache_format("fp8_e4m3").bytes_per_row(16)
    assert decode.stats.kv_transfer_bytes == 2 * 2 * 3 * 16 * 2 * row  # layers, K/V, blocks, slots, heads
    assert row / (16 * 4) == pytest.approx(20 / 64)
    llm = LLM(model_dir, kv_cache_dtype="fp8_e4m3", kv_cache_memory="4MiB")
    try:
        assert tokens == llm.generate([ids], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    finally:
        llm.close()


def test_a_decode_worker_refuses_a_prefill_worker_with_another_kv_dtype(model_dir, caplog):
    router, prefill = FakeRouter(), Peer()
    decode = _worker(DecodeWorker, model_dir, router.addr, "int8")
    try:
        layout = KVLayout(num_layers=2, num_kv_heads=2, kv_cache_dtype="float32")
        with caplog.at_level(logging.WARNING):
            decode.handle(GenerateRequest(request_id="r", prompt_token_ids=list(range(40, 70)),
                                          sampling_params=GREEDY, prefill_worker_id="p0", prefill_addr=prefill.addr,
                                          prefill_layout=layout))
            drive(decode, lambda: router.finished("r") is not None)
        assert "holds a float32 KV cache and this decode worker a int8 one" in caplog.text
        assert not prefill.of_type(RemotePrefillRequest)  # never asked: prefilled here
        assert len(router.tokens("r")) == GREEDY.max_tokens
    finally:
        decode.close()
        router.close()
        prefill.close()


def test_the_router_pairs_only_equal_kv_dtypes_and_says_so_at_registration(caplog):
    registry = WorkerRegistry(worker_timeout_s=60)

    def register(worker_id, role, kv_dtype):
        registry.register(RegisterWorker(worker_id=worker_id, role=role, input_addr=f"tcp://{worker_id}",
                                         model_name="m", kv_layout=KVLayout(kv_cache_dtype=kv_dtype)), now=0.0)
        return registry.get(worker_id)

    d = register("d0", WorkerRole.DECODE, "int8")
    with caplog.at_level(logging.WARNING, logger="pdserve.router.registry"):
        p_int8 = register("p0", WorkerRole.PREFILL, "int8")
        assert not caplog.records
        p_f32 = register("p1", WorkerRole.PREFILL, "float32")
    assert "p1 (prefill) holds a float32 KV cache (weights: None), but decode worker(s) d0 hold int8" in caplog.text
    assert p_int8.kv_compatible(d) and not p_f32.kv_compatible(d)
    assert registry.candidates(WorkerRole.PREFILL, lambda w: w.kv_compatible(d)) == [p_int8]
    assert p_f32.to_json(0.0)["kv_cache_dtype"] == "float32"


def test_the_router_pairs_only_equal_weight_quantizations():
    registry = WorkerRegistry(worker_timeout_s=60)

    def register(worker_id, role, quantization):
        layout = KVLayout(kv_cache_dtype="float32", quantization=quantization)
        registry.register(RegisterWorker(worker_id=worker_id, role=role, input_addr=f"tcp://{worker_id}",
                                         model_name="m", kv_layout=layout), now=0.0)
        return registry.get(worker_id)

    d = register("d0", WorkerRole.DECODE, "int8")
    p_int8, p_float, p_old = (register("p0", WorkerRole.PREFILL, "int8"), register("p1", WorkerRole.PREFILL, "none"),
                              register("p2", WorkerRole.PREFILL, None))
    assert p_int8.kv_compatible(d) and not p_float.kv_compatible(d) and p_old.kv_compatible(d)
    assert p_float.to_json(0.0)["quantization"] == "none"
    with pytest.raises(ValueError, match="runs none weights and this decode worker int8 ones"):
        check_kv_dtype("p1", KVLayout(kv_cache_dtype="float32", quantization="none"), "float32", "int8")


def test_draft_model_speculation_over_an_int8_cache(model_dir):
    """The draft model's cache takes the target's KV dtype; greedy speculation stays token-identical."""
    import json

    prompts = [[5, 17, 300, 41, 9, 77, 5, 17, 300, 41], list(range(100, 130))]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    spec = json.dumps({"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3})
    with LLM(model_dir, kv_cache_dtype="int8", kv_cache_memory="4MiB") as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    with LLM(model_dir, kv_cache_dtype="int8", kv_cache_memory="4MiB", speculative_config=spec) as llm:
        draft = llm.core.proposer.runner
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        stats = llm.scheduler.stats
    assert got == want
    assert stats.spec_decode_num_accepted_tokens > 0
    assert draft.kv_cache_format.name == "int8" and draft.kv_cache.dtype == torch.uint8
