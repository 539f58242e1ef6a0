"""KV blocks a long request holds when layers attend through a sliding window.

Writes a small random-weight checkpoint with transformers, runs one request of ``--prompt``
tokens plus ``--output`` generated tokens through an ``EngineCore`` with chunked prefill, and
prints, step by step at the points that matter, the KV the request holds next to what it would
hold with every block kept:

* ``--family mistral``: every layer slides over the last ``--window`` positions; one block table
  (``KVCacheManager.free_out_of_window``). Also what those blocks weigh in Mistral-7B's geometry
  (32 layers, 8 KV heads of 128, bfloat16).
* ``--family gemma3``: five sliding layers per full-attention one (12 layers: 10 sliding, 2 full),
  so the layers form KV cache groups (``pdserve.common.kv_cache_groups``): one full group and five
  sliding ones of 2 layers each. The same request runs twice, with the groups and with
  ``--disable-hybrid-kv-cache-manager`` (one table, every block kept). KV is counted in
  *layer-blocks* (one block of one layer), so the two layouts compare; also in Gemma 3 1B's
  geometry (26 layers: 22 sliding with a 512-token window, 4 full; 1 KV head of 256, bfloat16).

    python benchmarks/bench_sliding_window.py                          # Mistral, 2,000 tokens, window 512
    python benchmarks/bench_sliding_window.py --family gemma3           # Gemma 3, with and without groups
    python benchmarks/bench_sliding_window.py --window 4096 --prompt 8000
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, MistralConfig

from pdserve.common.protocol import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.scheduling.kv_cache_manager import NULL_BLOCK

MISTRAL_7B_TOKEN_BYTES = 32 * 2 * 8 * 128 * 2  # per token: layers x K/V x KV heads x head dim x bf16
GEMMA3_1B_LAYER_TOKEN_BYTES = 2 * 1 * 256 * 2  # per token and layer: K/V x KV heads x head dim x bf16
GEMMA3_1B_LAYERS = (22, 4)  # sliding, full


def held_layer_blocks(core: EngineCore, request) -> int:
    """Blocks the request holds, each counted once per layer it serves (its group's positions)."""
    per_block = core.runner.kv_groups.num_cache_layers
    return per_block * sum(1 for table in request.block_tables for b in table if b != NULL_BLOCK)


def run(path: str, args, disable_hybrid: bool = False) -> tuple[list[tuple[int, ...]], EngineCore]:
    """One request through a fresh engine: per step (step, tokens computed, layer-blocks held, blocks held by
    the first group, blocks held by the last group)."""
    core = EngineCore(EngineConfig(model=path, block_size=args.block_size, enforce_eager=True,
                                   max_num_batched_tokens=args.max_num_batched_tokens, num_threads=1,
                                   remote_prefill_threshold=0, kv_cache_memory=64 * 2**20,
                                   disable_hybrid_kv_cache_manager=disable_hybrid))
    prompt = [(7 * i) % 2000 + 10 for i in range(args.prompt)]
    core.add_request("r", prompt, SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True))
    request = core.scheduler.requests["r"]
    rows, step = [], 0
    try:
        while core.has_unfinished():
            core.step()
            step += 1
            if request.status.is_finished:
                break
            live = [sum(1 for b in table if b != NULL_BLOCK) for table in request.block_tables]
            rows.append((step, request.num_computed_tokens, held_layer_blocks(core, request), live[0], live[-1]))
        assert core.block_manager.num_free_blocks == core.block_manager.num_blocks
    finally:
        core.close()
    return rows, core


def shown(rows, args):
    return [r for r in rows if r[1] <= args.prompt or r[0] % 16 == 0]


def mistral(path: str, args) -> None:
    rows, core = run(path, args)
    bs = args.block_size
    layers = core.runner.num_layers
    print(f"Mistral: window {args.window} tokens, blocks of {bs}, prefill chunks of {args.max_num_batched_tokens}; "
          f"one request of {args.prompt} + {args.output} tokens")
    print("| after step | tokens computed | blocks held between steps | blocks if all kept | Mistral-7B KV held | "
          "if all kept |")
    print("|---|---|---|---|---|---|")
    mib = 2**20 / (bs * MISTRAL_7B_TOKEN_BYTES)
    for step, computed, layer_blocks, _, _ in shown(rows, args):
        held, kept = layer_blocks // layers, -(-computed // bs)
        print(f"| {step} | {computed} | {held} | {kept} | {held / mib:.0f} MiB | {kept / mib:.0f} MiB |")
    peak = max(r[2] for r in rows) // layers
    total = -(-(args.prompt + args.output) // bs)
    print(f"peak between steps: {peak} blocks held against {total} with every block kept ({peak / total:.0%}); "
          f"while a prefill chunk computes it holds up to the window and the chunk, at most "
          f"{core.limits.kv_group_caps[0]} blocks (the engine's cap per sequence)")


def gemma3(path: str, args) -> None:
    grouped, core = run(path, args)
    kept, _ = run(path, args, disable_hybrid=True)
    groups = core.runner.kv_groups
    bs = args.block_size
    kinds = ", ".join("full" if w is None else str(w) for w in groups.windows)
    print(f"Gemma 3 (12 layers: 10 sliding, 2 full): window {args.window} tokens, blocks of {bs}, prefill chunks of "
          f"{args.max_num_batched_tokens}; one request of {args.prompt} + {args.output} tokens; KV cache groups: "
          f"{groups.num_groups} of {groups.num_cache_layers} layers ({kinds})")
    print("| after step | tokens computed | layer-blocks held, groups | every block kept | share | "
          "Gemma 3 1B KV held, groups | every block kept |")
    print("|---|---|---|---|---|---|---|")
    sliding, full = GEMMA3_1B_LAYERS
    mib = 2**20 / (bs * GEMMA3_1B_LAYER_TOKEN_BYTES)
    for (step, computed, held, full_blocks, window_blocks), (_, _, all_kept, blocks, _) in \
            zip(shown(grouped, args), shown(kept, args)):
        # 1B's layers hold what this model's groups of their kind hold (same window, blocks and request)
        real_held = full * full_blocks + sliding * window_blocks
        print(f"| {step} | {computed} | {held} | {all_kept} | {held / all_kept:.0%} | {real_held / mib:.0f} MiB | "
              f"{(full + sliding) * blocks / mib:.0f} MiB |")
    peak, peak_kept = max(r[2] for r in grouped), max(r[2] for r in kept)
    print(f"peak between steps: {peak} layer-blocks held with KV cache groups against {peak_kept} with every block "
          f"kept ({peak / peak_kept:.0%}); the full-attention layers ({2 / 12:.0%} of them) hold every block either way")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", choices=("mistral", "gemma3"), default="mistral")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    small = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=2048, max_position_embeddings=args.prompt + args.output + 16, sliding_window=args.window,
                 bos_token_id=1, eos_token_id=2)
    if args.family == "mistral":
        config = MistralConfig(**small, num_hidden_layers=2)
    else:
        layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(12)]
        config = Gemma3TextConfig(**small, num_hidden_layers=12, head_dim=16, query_pre_attn_scalar=16,
                                  layer_types=layer_types)
    with tempfile.TemporaryDirectory() as path:
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        (mistral if args.family == "mistral" else gemma3)(path, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
