"""--quantization int8 (weight-only, torchao): the layer against float, the offline LLM and a
disaggregated cluster against the unquantized model, TP 2, batch invariance, bad input."""

from __future__ import annotations

import argparse
import random

import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.bench.agreement import greedy_agreement, greedy_outputs, teacher_forced_logits
from pdserve.common.utils import free_port
from pdserve.engine.config import EngineConfig
from pdserve.engine.layers import ColumnParallelLinear, RowParallelLinear, batch_invariant_linear
from pdserve.engine.quantization import quantize_model, weight_bytes
from pdserve.launcher import ClusterSpec, LocalCluster
from tests.test_cluster import WORDS

torchao = pytest.importorskip("torchao")

NUM_PROMPTS, MAX_TOKENS = 24, 16


def quantized_pair(seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A fused qkv-like ColumnParallelLinear and a RowParallelLinear, quantized; and their float weights."""
    g = torch.Generator().manual_seed(seed)
    mod = torch.nn.Module()
    mod.col = ColumnParallelLinear(96, [64, 32, 32])
    mod.row = RowParallelLinear(128, 96)
    w_col, w_row = torch.randn(128, 96, generator=g) * 0.05, torch.randn(96, 128, generator=g) * 0.05
    mod.col.weight.data.copy_(w_col)
    mod.row.weight.data.copy_(w_row)
    quantize_model(mod, "int8")
    return mod, w_col, w_row


def test_quantized_linear_matches_float_within_the_rounding_bound():
    mod, w_col, w_row = quantized_pair()
    assert isinstance(mod.col.weight, torchao.quantization.Int8Tensor)
    assert mod.col.weight.qdata.dtype == torch.int8 and mod.col.weight.scale.shape == (128, 1)
    # int8 values (1 byte) + one float32 scale per output row, instead of 4 bytes per weight
    assert weight_bytes(mod) == 128 * 96 + 128 * 4 + 96 * 128 + 96 * 4
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for layer, w, inp in ((mod.col, w_col, x), (mod.row, w_row, torch.randn(7, 128))):
            got, want = layer(inp), F.linear(inp, w)
            # Symmetric round-to-nearest: |w - q * s| <= s / 2 per weight, so per output
            # |err| <= s_row / 2 * sum_k |x_k| (plus float32 rounding).
            scale = layer.weight.scale.flatten()  # (out,)
            bound = inp.abs().sum(-1, keepdim=True) * scale / 2 * 1.01 + 1e-5  # (M, out)
            err = (got - want).abs()
            assert (err <= bound).all()
            assert err.max() < 0.02 * want.abs().max()  # and far from that worst case


def test_batch_invariant_rows_keep_their_bits_with_int8_weights():
    mod, _, _ = quantized_pair()
    x = torch.randn(9, 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = batch_invariant_linear(x[:1], mod.col.weight)
        for m in range(2, 10):
            assert torch.equal(batch_invariant_linear(x[:m], mod.col.weight)[:1], alone)


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = random.Random(0)
    return [tok(" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 20)))).input_ids for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module")
def float_run(model_dir, prompts):
    with LLM(model_dir, enable_prefix_caching=False, kv_cache_memory="4MiB", num_threads=1) as llm:
        outputs = greedy_outputs(llm, prompts, MAX_TOKENS)
        logits = teacher_forced_logits(llm, [p + o for p, o in zip(prompts, outputs)])
    return outputs, logits


@pytest.fixture(scope="module")
def int8_llm(model_dir):
    with LLM(model_dir, quantization="int8", enable_prefix_caching=False, kv_cache_memory="4MiB",
             num_threads=1) as llm:
        yield llm


def test_llm_int8_agrees_with_the_float_model(int8_llm, prompts, float_run):
    """Measured on the tiny checkpoint: ~60% of outputs identical over 16 tokens, ~85% of tokens
    identical up to the first divergence; teacher-forced argmax ~99%, max logit error ~1.5 of logits up to ~70."""
    float_outputs, float_logits = float_run
    runner = int8_llm.core.runner
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.weight, torchao.quantization.Int8Tensor)
    assert not isinstance(runner.model.lm_head.weight, torchao.quantization.Int8Tensor)  # head kept in float
    agree = greedy_agreement(float_outputs, greedy_outputs(int8_llm, prompts, MAX_TOKENS))
    assert agree.identical_share >= 0.35 and agree.mean_prefix_share >= 0.7, agree
    logits = teacher_forced_logits(int8_llm, [p + o for p, o in zip(prompts, float_outputs)])
    rows = sum(f.shape[0] for f in float_logits)
    top1 = sum((f.argmax(-1) == q.argmax(-1)).sum().item() for f, q in zip(float_logits, logits)) / rows
    max_err = max((f - q).abs().max().item() for f, q in zip(float_logits, logits))
    assert top1 >= 0.95 and 0 < max_err < 3.0, (top1, max_err)


def test_int8_with_tensor_parallel_2_and_batch_invariance(model_dir, prompts, int8_llm):
    """TP 2: each rank quantizes its own shard (RowParallelLinear's scales per half row), the
    all-reduce sums dequantized partials. --batch-invariant: outputs do not change with the batch."""
    some = prompts[:8]
    want = greedy_outputs(int8_llm, some, MAX_TOKENS)
    with LLM(model_dir, quantization="int8", tensor_parallel_size=2, batch_invariant=True,
             kv_cache_memory="4MiB", num_threads=1, rank_timeout_s=30) as tp2:
        together = greedy_outputs(tp2, some, MAX_TOKENS)
        alone = [greedy_outputs(tp2, [p], MAX_TOKENS)[0] for p in some[:3]]
    assert alone == together[:3]  # batch-invariant: one at a time == all at once, token for token
    assert greedy_agreement(want, together).mean_prefix_share >= 0.7


def test_fingerprint_and_rank_args_carry_the_quantization(model_dir, int8_llm):
    with LLM(model_dir, kv_cache_memory="1MiB", num_threads=1) as plain:
        assert plain.core.runner.model_fingerprint != int8_llm.core.runner.model_fingerprint
    args = EngineConfig(model_dir, quantization="int8").rank_cli_args(1, "127.0.0.1", 1234)
    assert args[args.index("--quantization") + 1] == "int8"


def test_int8_decode_step_runs_eagerly_and_says_why(model_dir, caplog):
    with caplog.at_level("INFO", logger="pdserve.engine.model_runner"):
        with LLM(model_dir, quantization="int8", enforce_eager=False, kv_cache_memory="1MiB", num_threads=1) as llm:
            assert llm.core.runner._compiled_decode is None
    assert "decode step runs eagerly: --quantization int8" in caplog.text


def test_bad_quantization_inputs_fail_clearly(model_dir):
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        EngineConfig(model_dir, quantization="int4")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", model_dir, "--quantization", "fp8"])
    assert EngineConfig.from_cli_args(parser.parse_args(["--model", model_dir, "-q", "int8"])).quantization == "int8"
    with pytest.raises(ValueError, match="--quantization int8 supports a CPU with --dtype float32 or bfloat16"):
        LLM(model_dir, quantization="int8", dtype="float16")


@pytest.mark.cluster
def test_disaggregated_cluster_serves_int8_end_to_end(model_dir, prompts, int8_llm, tmp_path):
    """1 prefill + 1 decode worker, both --quantization int8: prefill's KV crosses to the decode
    worker, and the tokens equal the offline int8 LLM's."""
    from tests.test_cluster_engine import metric_totals, wait_metric_increase

    tok = AutoTokenizer.from_pretrained(model_dir)
    long_prompts = [p for p in prompts if len(p) >= 12][:2]  # past the threshold: prefilled remotely
    want = [greedy_outputs(int8_llm, [p], MAX_TOKENS)[0] for p in long_prompts]  # batch 1, as served below
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "4MiB", "--quantization", "int8",
                                    "--remote-prefill-threshold", "8"])
    with LocalCluster(spec, log_dir=str(tmp_path)) as cluster:
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
        before = metric_totals(cluster)
        for prompt, out in zip(long_prompts, want):
            choice = api.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0]
            assert choice.text == tok.decode(out, skip_special_tokens=True)
        assert wait_metric_increase(cluster, "pdserve:kv_transfers_total", before, len(long_prompts)) \
            >= len(long_prompts), "the prompts were not prefilled by the prefill worker"
