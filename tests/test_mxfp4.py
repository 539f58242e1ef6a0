"""gpt-oss checkpoints with MXFP4 experts (as OpenAI ships them), against transformers.

A random-weight gpt-oss checkpoint is written by transformers, then its MoE expert tensors are
quantized here to MXFP4 (OCP Microscaling Formats v1.0, 2023: 32 FP4 E2M1 values per E8M0
power-of-two scale) and stored as the released checkpoints store them (``*_blocks`` uint8
[E, R, G, 16], low nibble first; ``*_scales`` uint8 [E, R, G], bias 127) with
``quantization_config: {"quant_method": "mxfp4"}``. The reference is transformers reading those
same packed bytes (``Mxfp4Config(dequantize=True)``), so a wrong nibble order, scale bias or
transpose in pdserve's dequantizer changes the tokens or logprobs.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, GptOssConfig, GptOssForCausalLM, Mxfp4Config

from pdserve import LLM, SamplingParams
from pdserve.engine.layers import mxfp4
from tests.checkpoints import TOKENIZER_FILES, greedy_reference
from tests.checkpoints import PROMPTS

CONFIG = dict(hidden_size=64, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              num_hidden_layers=2, vocab_size=2048, max_position_embeddings=512, initializer_range=0.1,
              sliding_window=8, num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
QUANTIZATION_CONFIG = {"quant_method": "mxfp4",
                       "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                  "model.embed_tokens", "lm_head"]}
MAX_TOKENS = 16


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., K] (K a multiple of 32) -> (blocks uint8 [..., K / 32, 16], scales uint8
    [..., K / 32]): per block of 32 the MX spec's shared exponent floor(log2(absmax)) - 2 (E2M1's
    largest exponent), each value rounded to the nearest E2M1 value (saturating at +-6), value
    2j in byte j's low nibble and 2j + 1 in its high nibble. Independent of pdserve's code."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    x = w.float().reshape(*w.shape[:-1], -1, 32)
    absmax = x.abs().amax(-1, keepdim=True).clamp(min=2.0 ** -120)
    exponent = torch.floor(torch.log2(absmax)) - 2
    scaled = (x / torch.exp2(exponent)).clamp(-6, 6)
    magnitude = (scaled.abs().unsqueeze(-1) - grid).abs().argmin(-1)  # nearest E2M1 magnitude's index
    code = (magnitude | ((scaled < 0).long() << 3)).to(torch.uint8)
    blocks = code[..., 0::2] | (code[..., 1::2] << 4)
    return blocks.contiguous(), (exponent.squeeze(-1) + 127).to(torch.uint8)


def write_mxfp4_checkpoint(path, tokenizer_dir) -> None:
    """transformers' float gpt-oss checkpoint at ``path``, its experts then replaced by MXFP4 pairs.
    transformers' gate_up_proj [E, H, 2I] / down_proj [E, I, H] are [in, out] per expert; the packed
    tensors run along each output row's inputs ([E, out, in / 32, 16]), as the released files do."""
    torch.manual_seed(0)
    hf = GptOssForCausalLM(GptOssConfig(**CONFIG)).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias") or name.endswith("sinks"):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    weights = load_file(path / "model.safetensors")
    for name in [n for n in weights if n.endswith((".experts.gate_up_proj", ".experts.down_proj"))]:
        blocks, scales = quantize_mxfp4(weights.pop(name).transpose(1, 2))
        weights[f"{name}_blocks"], weights[f"{name}_scales"] = blocks, scales
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with open(path / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = QUANTIZATION_CONFIG
    with open(path / "config.json", "w") as f:
        json.dump(config, f, indent=2)
    for f in TOKENIZER_FILES:
        shutil.copy(f"{tokenizer_dir}/{f}", path / f)


@pytest.fixture(scope="module")
def mxfp4_dir(model_dir, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    write_mxfp4_checkpoint(path, model_dir)
    return str(path)


@pytest.fixture(scope="module")
def prompt_ids(mxfp4_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(mxfp4_dir)
    return [tok(p).input_ids for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(mxfp4_dir, prompt_ids):
    """transformers' greedy tokens and chosen-token logprobs, from the packed bytes it dequantizes."""
    hf = GptOssForCausalLM.from_pretrained(mxfp4_dir, dtype=torch.float32,
                                           quantization_config=Mxfp4Config(dequantize=True)).eval()
    experts = hf.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float32 and experts.gate_up_proj.shape == (4, 64, 64)
    return greedy_reference(hf, prompt_ids, MAX_TOKENS)


def _check(outputs, reference) -> None:
    for (want_tokens, want_logprobs), out in zip(reference, outputs):
        got = out.outputs[0]
        assert got.token_ids == want_tokens
        assert max(abs(g.logprob - w) for g, w in zip(got.logprobs, want_logprobs)) < 1e-4


def test_the_checkpoint_is_packed_as_released(mxfp4_dir):
    """The test's own checkpoint has the released files' names, dtypes and shapes, and no float experts."""
    weights = load_file(f"{mxfp4_dir}/model.safetensors")
    assert weights["model.layers.0.mlp.experts.gate_up_proj_blocks"].shape == (4, 64, 2, 16)  # [E, 2I, H/32, 16]
    assert weights["model.layers.0.mlp.experts.gate_up_proj_scales"].shape == (4, 64, 2)
    assert weights["model.layers.1.mlp.experts.down_proj_blocks"].shape == (4, 64, 1, 16)  # [E, H, I/32, 16]
    assert weights["model.layers.1.mlp.experts.down_proj_blocks"].dtype == torch.uint8
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in weights)


def test_dequantizer_matches_transformers_bit_for_bit():
    """Every byte and every scale (but 0xFF, NaN), float32 and bfloat16, against transformers' function."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 20, 4, 16), dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 20, 4), dtype=torch.uint8)
    scales[0, 0, :3] = torch.tensor([0, 127, 254], dtype=torch.uint8)
    for dtype in (torch.float32, torch.bfloat16):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # (3, 128, 20), inf where 6 * 2^127
        got = mxfp4.dequantize_experts(blocks, scales, dtype)
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.equal(got, want)
    scales[1, 2, 3] = 0xFF
    with pytest.raises(ValueError, match="0xFF"):
        mxfp4.dequantize_experts(blocks, scales, torch.float32)


def test_llm_on_mxfp4_checkpoint_gives_transformers_tokens_and_logprobs(mxfp4_dir, prompt_ids, reference, caplog):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    with caplog.at_level("INFO", logger="pdserve.engine.models.loader"):
        with LLM(mxfp4_dir, max_num_batched_tokens=16, enable_prefix_caching=True) as llm:
            outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    _check(outputs, reference)
    line = next(r.getMessage() for r in caplog.records if "MXFP4" in r.getMessage())
    assert "dequantized from MXFP4 to float32" in line and "4 tensors" in line and "MiB packed" in line


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_tensor_parallel_2_shards_the_dequantized_experts(mxfp4_dir, prompt_ids, reference, expert_parallel):
    """TP 2: each rank takes its slice of every expert (or, with --enable-expert-parallel, its two
    whole experts) from the dequantized tensors; the tokens stay transformers'."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=0, ignore_eos=True)
    with LLM(mxfp4_dir, tensor_parallel_size=2, enable_expert_parallel=expert_parallel,
             kv_cache_memory="2MiB") as llm:
        experts = llm.core.runner.model.model.layers[0].mlp.experts  # the driver rank's
        assert experts.expert_parallel == expert_parallel
        assert experts.num_local_experts == (2 if expert_parallel else 4)
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
    _check(outputs, reference)


def _with_quantization_config(src: str, dst, quantization_config: dict) -> str:
    shutil.copytree(src, dst)
    with open(dst / "config.json") as f:
        config = json.load(f)
    config["quantization_config"] = quantization_config
    with open(dst / "config.json", "w") as f:
        json.dump(config, f)
    return str(dst)


def test_an_unsupported_quant_method_is_named_in_the_error(mxfp4_dir, model_dir, tmp_path):
    fp8 = _with_quantization_config(mxfp4_dir, tmp_path / "fp8", {"quant_method": "fp8",
                                                                   "weight_block_size": [128, 128]})
    with pytest.raises(ValueError, match="quant_method='fp8' is not supported"):
        LLM(fp8)
    llama = _with_quantization_config(model_dir, tmp_path / "llama_mxfp4", QUANTIZATION_CONFIG)
    with pytest.raises(ValueError, match="'mxfp4' is supported for gpt-oss's MoE experts only, not for model_type "
                                         "'llama'"):
        LLM(llama)
