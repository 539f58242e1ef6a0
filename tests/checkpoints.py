"""Random-weight checkpoints that transformers itself writes, for the tests that compare pdserve with it."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Gemma3TextConfig, GptOssConfig, MixtralConfig,
                          Olmo2Config, Phi3Config, Qwen3Config, Qwen3MoeConfig)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# The families beyond Llama, each small (3 layers of 64) with the family's own features switched on; the
# tiny default model's tokenizer fits their 2,048-token vocabulary.
COMMON = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              num_hidden_layers=3, vocab_size=2048, max_position_embeddings=512, initializer_range=0.1,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)
FAMILIES = {
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=True),
    "phi3": lambda: Phi3Config(**COMMON, partial_rotary_factor=0.5, tie_word_embeddings=False),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                        norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=False),
    "mixtral": lambda: MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2,
                                     tie_word_embeddings=False),
    "olmo2": lambda: Olmo2Config(**COMMON, tie_word_embeddings=False),
    "gemma3": lambda: Gemma3TextConfig(**COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=16,
                                       layer_types=["sliding_attention", "sliding_attention", "full_attention"]),
    "deepseek_v3": lambda: DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, moe_intermediate_size=32,
                                            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                            topk_group=1, first_k_dense_replace=1, kv_lora_rank=32, q_lora_rank=24,
                                            qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                            tie_word_embeddings=False),
    "gpt_oss": lambda: GptOssConfig(**{**COMMON, "intermediate_size": 32}, head_dim=16, sliding_window=8,
                                    num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=False),
}
PROMPTS = [
    "def parse(path):\n    with open(path) as f:\n        return",
    "def parse(path):\n    with open(path) as f:\n        for line in f:",  # shares a prefix with the first
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, name, value, default=None):\n        self.",
]


def write_checkpoint(config, path: Path, tokenizer_dir: str, perturb_biases: bool = True) -> str:
    """Save ``AutoModelForCausalLM.from_config(config)`` (float32, seed 0) at ``path`` with the tokenizer files of
    ``tokenizer_dir``. Norm weights (and biases, with ``perturb_biases``) get seeded noise of 0.1 so that a
    model which skipped them would not pass for one that applies them. Returns ``str(path)``."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or (perturb_biases and name.endswith("bias")):
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path)
    for f in TOKENIZER_FILES:
        shutil.copy(f"{tokenizer_dir}/{f}", Path(path) / f)
    return str(path)


def greedy_reference(hf, prompt_ids: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[float]]]:
    """transformers' own greedy ``generate`` on a loaded model, one prompt at a time: (tokens, each chosen
    token's logprob) per prompt."""
    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids], device=hf.device), max_new_tokens=max_tokens, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        tokens = gen.sequences[0, len(ids):].tolist()
        out.append((tokens, [torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(gen.logits, tokens)]))
    return out


def assert_packed_llm_gives_transformers_tokens(model_dir: str, layout: str) -> None:
    """The tiny model with every decoder linear and its (untied) LM head packed into ``layout``
    (``--linear-weight-format``: ``onednn`` or ``panel``), prefill steps eager and decode steps
    compiled: no plain copy kept, and transformers' greedy tokens with logprobs within 1e-4."""
    from pdserve import LLM, SamplingParams

    prompts = [[5, 17, 42, 8, 99, 3, 12, 77, 41, 19] * 3, [7, 7, 9, 100, 3], [11, 12]]
    ref = greedy_reference(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), prompts, 12)
    with LLM(model_dir, linear_weight_format=layout, max_num_batched_tokens=16, enforce_eager=False) as llm:
        runner = llm.core.runner
        assert runner.num_packed_linears == 4 * runner.num_layers  # qkv, o, gate_up, down
        assert runner.lm_head_packed  # the tiny model's head is untied: weight_format.pack_lm_head
        assert runner.model.lm_head.weight.untyped_storage().nbytes() <= 4  # no plain copy kept
        assert runner._compiled_decode is not None  # packed weights reach the compiled graph too
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(max_tokens=12, temperature=0.0, logprobs=0, ignore_eos=True),
                            use_tqdm=False)
    for (tokens, logprobs), out in zip(ref, outs):
        assert out.outputs[0].token_ids == tokens
        assert max(abs(g.logprob - w) for g, w in zip(out.outputs[0].logprobs, logprobs)) < 1e-4
