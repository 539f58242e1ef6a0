"""Decode speed and KV bytes per family: pdserve's `LLM` against transformers' `generate` on the same
checkpoint, one pinned core, one thread each (issue 20, "Measure and document").

    python benchmarks/bench_families.py                      # every family, batch 1 and 8
    python benchmarks/bench_families.py --families llama gemma3 --batches 1

For each family a random-weight checkpoint of about 30-60M parameters (hidden 512, 8 layers; the
family's own features as in tests/test_model_families.py) is written with transformers, float32.
Decode tok/s is measured as vLLM's benchmarks do for a fixed prompt: the time of `max_tokens = 1 +
N` minus the time of `max_tokens = 1` (the prefill and first token), for B prompts of 128 tokens at
once, best of ``--repeats``; transformers runs `generate` (greedy, its default dynamic cache) on
the same token ids. The KV bytes per token are the engine's own (one block's bytes over its slots):
MLA's latent row against what per-head K and V of the same width would take.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
from transformers import (AutoModelForCausalLM, DeepseekV3Config, Gemma3TextConfig, GptOssConfig, LlamaConfig,
                          MixtralConfig, Olmo2Config, Phi3Config, Qwen3Config, Qwen3MoeConfig)

from pdserve import LLM, SamplingParams
from pdserve.default_model.tiny_model import ensure_default_model

CORE = 0
COMMON = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2,
              num_hidden_layers=8, vocab_size=16384, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
              pad_token_id=0, tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2)
FAMILIES = {
    "llama": lambda: LlamaConfig(**COMMON),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=64),
    "phi3": lambda: Phi3Config(**COMMON, partial_rotary_factor=0.5),
    "olmo2": lambda: Olmo2Config(**COMMON),
    "gemma3": lambda: Gemma3TextConfig(**COMMON, head_dim=64, sliding_window=512, query_pre_attn_scalar=64),
    "qwen3_moe": lambda: Qwen3MoeConfig(**COMMON, moe_intermediate_size=512, num_experts=8, norm_topk_prob=True,
                                        **MOE),
    "mixtral": lambda: MixtralConfig(**{**COMMON, "intermediate_size": 512}, num_local_experts=8, **MOE),
    "deepseek_v3": lambda: DeepseekV3Config(**{**COMMON, "num_key_value_heads": 8}, moe_intermediate_size=512,
                                            n_routed_experts=8, n_shared_experts=1, n_group=2, topk_group=1,
                                            first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=192,
                                            qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, **MOE),
    "gpt_oss": lambda: GptOssConfig(**{**COMMON, "intermediate_size": 512}, head_dim=64, sliding_window=128,
                                    num_local_experts=8, **MOE),
}


def write_checkpoint(family: str, root: str) -> str:
    path = os.path.join(root, family)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=torch.float32).eval()
    model.save_pretrained(path)
    tokenizer_dir = ensure_default_model("bench")  # its 16,384-token vocabulary matches the checkpoints'
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer_dir / name, os.path.join(path, name))
    return path


def best_of(repeats: int, fn) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def pdserve_decode(path: str, prompts: list[list[int]], new_tokens: int, repeats: int) -> tuple[float, float]:
    """(decode tok/s, KV bytes per token) of pdserve's LLM on one thread."""
    with LLM(path, dtype="float32", num_threads=1, cpu_cores=str(CORE), kv_cache_memory="512MiB",
             enable_prefix_caching=False) as llm:
        def run(max_tokens):
            return lambda: llm.generate([{"prompt_token_ids": p} for p in prompts],
                                        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                                        use_tqdm=False)

        run(1 + new_tokens)()  # warm
        first = best_of(repeats, run(1))
        whole = best_of(repeats, run(1 + new_tokens))
        runner = llm.core.runner
        cache = runner.kv_cache  # [layers, slots, blocks, block_size, kv_heads, row]
        per_token = cache[:, :, 0].numel() * cache.element_size() / cache.shape[3]
    return len(prompts) * new_tokens / (whole - first), per_token


def hf_decode(path: str, prompts: list[list[int]], new_tokens: int, repeats: int) -> float:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor(prompts)

    def run(max_new):
        def go():
            with torch.no_grad():
                model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, min_new_tokens=max_new,
                               do_sample=False, pad_token_id=0)
        return go

    run(1 + new_tokens)()
    first = best_of(repeats, run(1))
    whole = best_of(repeats, run(1 + new_tokens))
    return len(prompts) * new_tokens / (whole - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.sched_setaffinity(0, {CORE})
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for family in args.families:
            path = write_checkpoint(family, root)
            params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(path).parameters()) / 1e6
            for batch in args.batches:
                prompts = torch.randint(3, 16000, (batch, args.prompt_len), generator=g).tolist()
                ours, kv_bytes = pdserve_decode(path, prompts, args.new_tokens, args.repeats)
                theirs = hf_decode(path, prompts, args.new_tokens, args.repeats)
                rows.append((family, params, batch, ours, theirs, kv_bytes))
                print(f"{family:12s} {params:5.1f}M batch {batch:2d}: pdserve {ours:7.1f} tok/s, transformers "
                      f"{theirs:7.1f} tok/s ({ours / theirs:.2f}x); KV {kv_bytes / 1024:.1f} KiB/token", flush=True)
    print("\n| family | params | batch | pdserve tok/s | transformers tok/s | ratio | KV bytes/token |")
    print("|---|---|---|---|---|---|---|")
    for family, params, batch, ours, theirs, kv_bytes in rows:
        print(f"| {family} | {params:.1f}M | {batch} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | "
              f"{kv_bytes:,.0f} |")


if __name__ == "__main__":
    main()
