"""Quantized weights: --quantization int8 (weight-only, torchao) and compressed-tensors W8A16 / W4A16
checkpoints (written here with the compressed-tensors library). The layer against float, the
offline LLM and a disaggregated cluster against the unquantized model, TP 2, batch invariance,
exactness of the loaded checkpoint, bad input."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil

import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.bench.agreement import greedy_agreement, greedy_outputs, teacher_forced_logits
from pdserve.common.utils import free_port
from pdserve.engine.layers.compressed_tensors import unpack_int32
from pdserve.engine.config import EngineConfig
from pdserve.engine.layers.int8_linear import (KERNEL_MAX_ROWS, build_kernel, dequantize_int8, int8_linear_kernel,
                                       kernel_applies)
from pdserve.engine.layers.base import ColumnParallelLinear, RowParallelLinear, batch_invariant_linear, quantized_linear
from pdserve.engine.layers.quantization import quantize_model, quantized_layers, weight_bytes
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import WORDS
from tests.threads import torch_threads

torchao = pytest.importorskip("torchao")

NUM_PROMPTS, MAX_TOKENS = 24, 16


def write_compressed_checkpoint(src: str, dst: str, num_bits: int, strategy: str, group_size: int | None = None,
                                fmt: str | None = None) -> str:
    """``src`` (a float HF checkpoint) quantized by the compressed-tensors library: symmetric int
    weights (absmax scales per channel or group), activations untouched, ``lm_head`` ignored, saved
    in format ``fmt`` (None: the library's choice, pack-quantized) with its quantization_config."""
    ct = pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    del ct
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    weights = QuantizationArgs(num_bits=num_bits, type="int", symmetric=True, strategy=strategy, group_size=group_size)
    scheme = QuantizationScheme(targets=["Linear"], weights=weights)
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme}, ignore=["lm_head"]))
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is None:
            continue
        w = module.weight.detach()  # (out, in) -> (out, num_groups, group) per group
        w = w.reshape(w.shape[0], -1, group_size or w.shape[1])
        scale, zero_point = calculate_qparams(w.amin(dim=2), w.amax(dim=2), weights)
        module.weight_scale.data.copy_(scale.reshape(module.weight_scale.shape))
        module.weight_zero_point.data.copy_(zero_point.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    compressor.compress_model(model)
    model.save_pretrained(dst)
    compressor.update_config(dst)
    for name in os.listdir(src):
        if name.startswith(("tokenizer", "special_tokens", "generation_config")):
            shutil.copy(os.path.join(src, name), dst)
    return dst


@pytest.fixture(scope="module")
def w8a16_dir(model_dir, tmp_path_factory):
    return write_compressed_checkpoint(model_dir, str(tmp_path_factory.mktemp("w8a16")), 8, "channel")


@pytest.fixture(scope="module")
def w4a16_dir(model_dir, tmp_path_factory):
    return write_compressed_checkpoint(model_dir, str(tmp_path_factory.mktemp("w4a16")), 4, "group", 16)


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
    assert mod.col.weight.dtype == torch.int8 and mod.col.weight_scale.shape == (128, 1)
    assert mod.col.weight_scale.dtype == torch.float32
    # int8 values (1 byte) + one float32 scale per output row, instead of 4 bytes per weight
    assert weight_bytes(mod) == 128 * 96 + 128 * 4 + 96 * 128 + 96 * 4
    x = torch.randn(7, 96, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for layer, w, inp in ((mod.col, w_col, x), (mod.row, w_row, torch.randn(7, 128))):
            got, want = layer(inp), F.linear(inp, w)
            # Symmetric round-to-nearest: |w - q * s| <= s / 2 per weight, so per output
            # |err| <= s_row / 2 * sum_k |x_k| (plus float32 rounding).
            scale = layer.weight_scale.flatten()  # (out,)
            bound = inp.abs().sum(-1, keepdim=True) * scale / 2 * 1.01 + 1e-5  # (M, out)
            err = (got - want).abs()
            assert (err <= bound).all()
            assert err.max() < 0.02 * want.abs().max()  # and far from that worst case


def test_batch_invariant_rows_keep_their_bits_with_int8_weights():
    mod, _, _ = quantized_pair()
    layer = mod.col
    x = torch.randn(3 * KERNEL_MAX_ROWS, 96, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        alone = quantized_linear(x[:1], layer.weight, layer.weight_scale, batch_invariant=True)
        for m in (2, 3, 4, 5, 7, 9, KERNEL_MAX_ROWS + 1, 3 * KERNEL_MAX_ROWS):
            assert torch.equal(quantized_linear(x[:m], layer.weight, layer.weight_scale, batch_invariant=True)[:1],
                               alone)
        dequantized = layer.weight.float() * layer.weight_scale  # the fallback (no kernel) pads rows instead
        assert torch.equal(batch_invariant_linear(x[:9], dequantized)[:1], batch_invariant_linear(x[:1], dequantized))


def test_greedy_agreement_counts_tokens_up_to_the_first_divergence():
    agree = greedy_agreement([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]], [[1, 2, 0, 4], [5, 6, 7, 8], [0, 9]])
    assert (agree.num_prompts, agree.num_identical) == (3, 1)
    assert agree.mean_prefix_share == pytest.approx((2 / 4 + 1 + 0) / 3)
    with pytest.raises(ValueError):
        greedy_agreement([[1]], [])


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


@pytest.fixture(scope="module")
def w8a16_llm(w8a16_dir):
    with LLM(w8a16_dir, enable_prefix_caching=False, kv_cache_memory="4MiB", num_threads=1) as llm:
        yield llm


def test_llm_int8_agrees_with_the_float_model(int8_llm, prompts, float_run):
    """Measured on the tiny checkpoint: ~60% of outputs identical over 16 tokens, ~85% of tokens
    identical up to the first divergence; teacher-forced argmax ~99%, max logit error ~1.5 of logits up to ~70."""
    float_outputs, float_logits = float_run
    runner = int8_llm.core.runner
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == torch.int8 and qkv.weight_scale is not None
    assert runner.model.lm_head.weight.dtype == torch.float32  # head kept in float
    agree = greedy_agreement(float_outputs, greedy_outputs(int8_llm, prompts, MAX_TOKENS))
    assert agree.identical_share >= 0.35 and agree.mean_prefix_share >= 0.7, agree
    logits = teacher_forced_logits(int8_llm, [p + o for p, o in zip(prompts, float_outputs)])
    rows = sum(f.shape[0] for f in float_logits)
    top1 = sum((f.argmax(-1) == q.argmax(-1)).sum().item() for f, q in zip(float_logits, logits)) / rows
    max_err = max((f - q).abs().max().item() for f, q in zip(float_logits, logits))
    assert top1 >= 0.95 and 0 < max_err < 3.0, (top1, max_err)


def test_compressed_tensors_w8a16_holds_the_checkpoints_int8_values_exactly(w8a16_dir, w8a16_llm, int8_llm,
                                                                            prompts, float_run):
    """The loaded int8 weight is the checkpoint's int8 values and scales bit for bit. The library's
    scheme is --quantization int8's (absmax / 127.5 per row): same scales, same int8 values but
    for weights at exactly +-127.5 scales, which round the other way (~0.1%)."""
    from safetensors import safe_open

    assert w8a16_llm.core.runner.quantization == "compressed-tensors"
    qkv = w8a16_llm.core.runner.model.model.layers[0].self_attn.qkv_proj
    with safe_open(os.path.join(w8a16_dir, "model.safetensors"), "pt") as f:
        name = "model.layers.0.self_attn.{}_proj.{}"
        values = [unpack_int32(f.get_tensor(name.format(p, "weight_packed")), 8,
                               int(f.get_tensor(name.format(p, "weight_shape"))[1])) for p in "qkv"]
        scales = [f.get_tensor(name.format(p, "weight_scale")) for p in "qkv"]
    assert torch.equal(qkv.weight, torch.cat(values)) and torch.equal(qkv.weight_scale, torch.cat(scales).float())
    loaded = [m for _, m in quantized_layers(w8a16_llm.core.runner.model)]
    made = [m for _, m in quantized_layers(int8_llm.core.runner.model)]
    assert len(loaded) == len(made) == 2 * 4  # qkv, o, gate_up, down per layer
    num_differ = sum((a.weight != b.weight).sum().item() for a, b in zip(loaded, made))
    assert all(torch.equal(a.weight_scale, b.weight_scale) for a, b in zip(loaded, made))
    assert all((a.weight.int() - b.weight.int()).abs().max() <= 1 for a, b in zip(loaded, made))
    assert num_differ <= 0.005 * sum(a.weight.numel() for a in loaded)
    agree = greedy_agreement(float_run[0], greedy_outputs(w8a16_llm, prompts, MAX_TOKENS))
    assert agree.identical_share >= 0.35 and agree.mean_prefix_share >= 0.7, agree


def test_compressed_tensors_int_quantized_format_loads_the_same_weights(model_dir, w8a16_llm, tmp_path):
    """int-quantized stores int8 ``weight`` tensors instead of packed int32 words: same model."""
    path = write_compressed_checkpoint(model_dir, str(tmp_path / "intq"), 8, "channel", fmt="int-quantized")
    with LLM(path, kv_cache_memory="1MiB", num_threads=1) as llm:
        got = [m for _, m in quantized_layers(llm.core.runner.model)]
        want = [m for _, m in quantized_layers(w8a16_llm.core.runner.model)]
        assert len(got) == len(want) == 8
        assert all(torch.equal(a.weight, b.weight) and torch.equal(a.weight_scale, b.weight_scale)
                   for a, b in zip(got, want))
        assert llm.core.runner.model.lm_head.weight.dtype == torch.float32  # ignored: loaded as float


def test_compressed_tensors_w4a16_group_matches_transformers(w4a16_dir, prompts, float_run):
    """int4, one scale per 16 inputs, held one value per int8 byte: the logits are transformers' own
    (its compressed-tensors loader decompresses to float) within 1e-4; int4 on this 64-wide model is
    far from the float one (measured: teacher-forced argmax ~75%, 18% of tokens before divergence)."""
    from transformers import AutoModelForCausalLM

    sequences = [p + o for p, o in zip(prompts[:6], float_run[0])]
    hf = AutoModelForCausalLM.from_pretrained(w4a16_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        want = [hf(torch.tensor([seq])).logits[0] for seq in sequences]
    with LLM(w4a16_dir, enable_prefix_caching=False, kv_cache_memory="4MiB", num_threads=1) as llm:
        down = llm.core.runner.model.model.layers[0].mlp.down_proj
        assert down.weight.min() >= -8 and down.weight.max() <= 7
        assert down.weight_scale.shape == (down.weight.shape[0], down.weight.shape[1] // 16)
        got = teacher_forced_logits(llm, sequences)
        logits = teacher_forced_logits(llm, [p + o for p, o in zip(prompts, float_run[0])])
    assert max((w - g).abs().max().item() for w, g in zip(want, got)) < 1e-4
    rows = sum(f.shape[0] for f in float_run[1])
    top1 = sum((f.argmax(-1) == q.argmax(-1)).sum().item() for f, q in zip(float_run[1], logits)) / rows
    assert 0.6 <= top1 < 0.95, top1  # lossy, but still the same model


@pytest.mark.parametrize("checkpoint", ["int8", "w8a16"])
def test_tensor_parallel_2_and_batch_invariance(checkpoint, request, prompts):
    """TP 2: each rank quantizes its own shard (--quantization int8: RowParallelLinear's scales per
    half row) or takes its slice of the checkpoint's scales; the all-reduce sums dequantized partials.
    --batch-invariant: outputs do not change with the batch."""
    some = prompts[:8]
    single = request.getfixturevalue("int8_llm" if checkpoint == "int8" else "w8a16_llm")
    want = greedy_outputs(single, some, MAX_TOKENS)
    model = request.getfixturevalue("model_dir" if checkpoint == "int8" else "w8a16_dir")
    with LLM(model, quantization="int8" if checkpoint == "int8" else None, tensor_parallel_size=2,
             batch_invariant=True, kv_cache_memory="4MiB", num_threads=1, rank_timeout_s=30) as tp2:
        together = greedy_outputs(tp2, some, MAX_TOKENS)
        alone = [greedy_outputs(tp2, [p], MAX_TOKENS)[0] for p in some[:3]]
    assert alone == together[:3]  # batch-invariant: one at a time == all at once, token for token
    assert greedy_agreement(want, together).mean_prefix_share >= 0.7


def test_fingerprint_and_rank_args_carry_the_quantization(model_dir, int8_llm):
    with LLM(model_dir, kv_cache_memory="1MiB", num_threads=1) as plain:
        assert plain.core.runner.model_fingerprint != int8_llm.core.runner.model_fingerprint
    args = EngineConfig(model_dir, quantization="int8").rank_cli_args(1, "127.0.0.1", 1234)
    assert args[args.index("--quantization") + 1] == "int8"


def test_int8_decode_step_compiles_with_the_kernel_and_gives_the_eager_tokens(model_dir, int8_llm, prompts):
    """The kernel is a custom op, so the compiled decode step keeps it (one opaque node per layer)."""
    want = greedy_outputs(int8_llm, prompts[:6], MAX_TOKENS)  # the fixture runs eagerly
    with LLM(model_dir, quantization="int8", enforce_eager=False, kv_cache_memory="4MiB", num_threads=1) as llm:
        assert llm.core.runner._compiled_decode is not None
        assert greedy_outputs(llm, prompts[:6], MAX_TOKENS) == want


def test_int8_bfloat16_decode_step_runs_eagerly_and_says_why(model_dir, caplog):
    """bfloat16 activations have no int8 kernel: the weight is dequantized per call, and inductor's
    code for that is slower than eager's, so the step stays eager (logged)."""
    with caplog.at_level("INFO", logger="pdserve.engine.execution.model_runner"):
        with LLM(model_dir, quantization="int8", dtype="bfloat16", enforce_eager=False, kv_cache_memory="1MiB",
                 num_threads=1) as llm:
            assert llm.core.runner._compiled_decode is None
            out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
                               use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 4
    assert "decode_step: eager (--quantization int8 without the int8 kernel" in caplog.text


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 11, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("out_features,in_features,group_size", [(1, 8, 8), (7, 64, 64), (96, 176, 176),
                                                                (38, 96, 16), (130, 256, 32)])
def test_int8_kernel_matches_the_dequantized_matmul(num_rows, out_features, in_features, group_size):
    """Every tile shape (rows mod 4, output features mod 3), per-row and grouped scales, against
    float64 over the dequantized weight; 2 threads give the 1-thread bits."""
    if not build_kernel():
        pytest.skip("no C++ compiler: int8 layers take the dequantizing path")
    g = torch.Generator().manual_seed(num_rows * 1000 + out_features)
    weight = torch.randint(-127, 128, (out_features, in_features), generator=g, dtype=torch.int8)
    scale = torch.rand(out_features, in_features // group_size, generator=g) * 0.02 + 1e-3
    x = torch.randn(num_rows, in_features, generator=g)
    assert kernel_applies(x, weight, scale, batch_invariant=False)
    want = x.double() @ dequantize_int8(weight, scale, torch.float64).T
    got = int8_linear_kernel(x, weight, scale)
    assert got.dtype == torch.float32 and got.shape == (num_rows, out_features)
    tol = 1e-5 * (x.double().abs() @ dequantize_int8(weight, scale, torch.float64).abs().T) + 1e-6
    assert ((got.double() - want).abs() <= tol).all()
    with torch_threads(2):
        assert torch.equal(int8_linear_kernel(x, weight, scale), got)


def test_int8_kernel_serves_few_rows_and_refuses_what_it_cannot_compute():
    weight, scale = torch.ones(4, 24, dtype=torch.int8), torch.ones(4, 1)
    if not build_kernel():
        pytest.skip("no C++ compiler: int8 layers take the dequantizing path")
    assert kernel_applies(torch.ones(KERNEL_MAX_ROWS, 24), weight, scale, batch_invariant=False)
    assert not kernel_applies(torch.ones(KERNEL_MAX_ROWS + 1, 24), weight, scale, batch_invariant=False)  # prefill
    assert kernel_applies(torch.ones(KERNEL_MAX_ROWS + 1, 24), weight, scale, batch_invariant=True)
    assert not kernel_applies(torch.ones(2, 24, dtype=torch.bfloat16), weight, scale, batch_invariant=False)
    assert not kernel_applies(torch.ones(2, 20), torch.ones(4, 20, dtype=torch.int8), scale, batch_invariant=False)
    assert not kernel_applies(torch.ones(2, 24), weight, torch.ones(4, 2), batch_invariant=False)  # groups of 12
    with pytest.raises(RuntimeError, match="refused K=20"):  # the kernel checks too
        int8_linear_kernel(torch.ones(2, 20), torch.ones(4, 20, dtype=torch.int8), scale)
    # what the kernel does not take, quantized_linear computes over the dequantized weight
    x = torch.randn(3, 20)
    w20 = torch.randint(-5, 6, (4, 20), dtype=torch.int8)
    torch.testing.assert_close(quantized_linear(x, w20, torch.full((4, 1), 0.5)), x @ (w20.float() * 0.5).T)


def test_bad_quantization_inputs_fail_clearly(model_dir, w8a16_dir, tmp_path):
    with pytest.raises(ValueError, match="unknown quantization 'int4'"):
        EngineConfig(model_dir, quantization="int4")
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", model_dir, "--quantization", "fp8"])
    assert EngineConfig.from_cli_args(parser.parse_args(["--model", model_dir, "-q", "int8"])).quantization == "int8"
    with pytest.raises(ValueError, match="--quantization int8 supports a CPU with --dtype float32 or bfloat16"):
        LLM(model_dir, quantization="int8", dtype="float16")
    with pytest.raises(ValueError, match="already quantized .compressed-tensors, int8 channel.; leave out"):
        LLM(w8a16_dir, quantization="int8")
    with pytest.raises(ValueError, match="has no compressed-tensors quantization_config"):
        LLM(model_dir, quantization="compressed-tensors")
    bad = shutil.copytree(w8a16_dir, tmp_path / "asym")
    with open(bad / "config.json") as f:
        config = json.load(f)
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = False
    config["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    with open(bad / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="unsupported compressed-tensors scheme: activation quantization .*; "
                                         "asymmetric weights"):
        LLM(str(bad))


@pytest.mark.cluster
@pytest.mark.parametrize("checkpoint", ["int8", "w8a16"])
def test_disaggregated_cluster_serves_quantized_weights_end_to_end(checkpoint, request, prompts, tmp_path):
    """1 prefill + 1 decode worker, both quantized (--quantization int8 on the float checkpoint, or
    the compressed-tensors checkpoint: named on the prefill worker, detected on the decode worker):
    prefill's KV crosses to the decode worker, and the tokens equal the offline LLM's."""
    from tests.helpers.cluster import metric_totals, wait_metric_increase

    model = request.getfixturevalue("model_dir" if checkpoint == "int8" else "w8a16_dir")
    offline = request.getfixturevalue("int8_llm" if checkpoint == "int8" else "w8a16_llm")
    tok = AutoTokenizer.from_pretrained(model)
    long_prompts = [p for p in prompts if len(p) >= 12][:2]  # past the threshold: prefilled remotely
    want = [greedy_outputs(offline, [p], MAX_TOKENS)[0] for p in long_prompts]  # batch 1, as served below
    flag = ["--quantization", "int8" if checkpoint == "int8" else "compressed-tensors"]
    spec = ClusterSpec(model=model, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "4MiB", "--remote-prefill-threshold", "8"],
                       prefill_args=flag, decode_args=flag if checkpoint == "int8" else [])
    with LocalCluster(spec, log_dir=str(tmp_path)) as cluster:
        api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
        before = metric_totals(cluster)
        served = api.models.list().data[0].id
        for prompt, out in zip(long_prompts, want):
            choice = api.completions.create(model=served, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            extra_body={"ignore_eos": True}).choices[0]
            assert choice.text == tok.decode(out, skip_special_tokens=True)
        assert wait_metric_increase(cluster, "pdserve:kv_transfers_total", before, len(long_prompts)) \
            >= len(long_prompts), "the prompts were not prefilled by the prefill worker"


def test_lora_adapter_on_int8_weights_matches_peft_on_the_dequantized_model(model_dir, tmp_path):
    """--enable-lora over int8 base weights (QLoRA-style serving): the adapter's delta is added to the
    int8 layer's output; the tokens equal peft's on transformers loaded with the dequantized weights."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from pdserve.common.protocol import LoRARequest

    torch.manual_seed(1)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora_config = peft.LoraConfig(init_lora_weights=False, r=8, lora_alpha=16, target_modules="all-linear")
    peft.get_peft_model(base, lora_config).save_pretrained(str(tmp_path / "adapter"))
    prompts = [[3 + (7 * i + 5 * j) % 1900 for j in range(20 + 2 * i)] for i in range(4)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    lora = LoRARequest(lora_name="a", lora_int_id=1, lora_path=str(tmp_path / "adapter"))
    with LLM(model_dir, quantization="int8", enable_lora=True, kv_cache_memory="4MiB", num_threads=1) as llm:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=lora, use_tqdm=False)]
        plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        dequantized = {f"{n}.weight": dequantize_int8(m.weight, m.weight_scale, torch.float32)
                       for n, m in quantized_layers(llm.core.runner.model)}  # our name -> [out, in]
    assert got != plain  # the adapter mattered
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = hf.state_dict()
    for name, weight in dequantized.items():  # our fused layers back into HF's q/k/v and gate/up
        prefix, fused = name.rsplit(".", 2)[0], name.rsplit(".", 2)[1]
        parts = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}.get(fused)
        targets = [state[f"{prefix}.{p}.weight"] for p in parts] if parts else [state[name]]
        for target, piece in zip(targets, weight.split([t.shape[0] for t in targets])):
            target.copy_(piece)
    reference = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        want = [reference.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, eos_token_id=None,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert got == want
