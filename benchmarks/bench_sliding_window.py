"""KV blocks a long request holds when every layer attends through a sliding window.

Writes a small random-weight Mistral checkpoint with transformers (every layer slides over the
last ``--window`` positions), runs one request of ``--prompt`` tokens plus ``--output`` generated
tokens through an ``EngineCore`` with chunked prefill, and prints, step by step at the points that
matter, the blocks the request holds (``KVCacheManager.free_out_of_window`` frees the rest) next to
what it would hold with every block kept (its length in blocks, as before this feature and as
Gemma 3 / gpt-oss still do: their layers mix windows with full attention). Also prints what
those blocks weigh for Mistral-7B's geometry (32 layers, 8 KV heads of 128, bfloat16).

    python benchmarks/bench_sliding_window.py                  # 2,000-token prompt, window 512
    python benchmarks/bench_sliding_window.py --window 4096 --prompt 8000
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, MistralConfig

from pdserve.common.protocol import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.kv_cache_manager import NULL_BLOCK

MISTRAL_7B_BLOCK_BYTES = 32 * 2 * 8 * 128 * 2  # per token: layers x K/V x KV heads x head dim x bf16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=2000)
    ap.add_argument("--output", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    torch.manual_seed(0)
    config = MistralConfig(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=2, vocab_size=2048, max_position_embeddings=args.prompt + args.output + 16,
                           sliding_window=args.window, bos_token_id=1, eos_token_id=2)
    with tempfile.TemporaryDirectory() as path:
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
        core = EngineCore(EngineConfig(model=path, block_size=args.block_size, enforce_eager=True,
                                       max_num_batched_tokens=args.max_num_batched_tokens, num_threads=1,
                                       remote_prefill_threshold=0, kv_cache_memory=64 * 2**20))
        try:
            prompt = [(7 * i) % 2000 + 10 for i in range(args.prompt)]
            core.add_request("r", prompt, SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True))
            request = core.scheduler.requests["r"]
            bs = args.block_size
            print(f"window {args.window} tokens, blocks of {bs}, prefill chunks of {args.max_num_batched_tokens}; "
                  f"one request of {args.prompt} + {args.output} tokens")
            print("| after step | tokens computed | blocks held between steps | blocks if all kept | Mistral-7B KV held | "
                  "if all kept |")
            print("|---|---|---|---|---|---|")
            peak, step = 0, 0
            while core.has_unfinished():
                core.step()
                step += 1
                if request.status.is_finished:
                    break
                held = sum(1 for b in request.block_table if b != NULL_BLOCK)
                peak = max(peak, held)
                kept = -(-request.num_computed_tokens // bs)
                if request.num_computed_tokens <= args.prompt or step % 16 == 0:
                    mib = 2**20 / (bs * MISTRAL_7B_BLOCK_BYTES)
                    print(f"| {step} | {request.num_computed_tokens} | {held} | {kept} | {held / mib:.0f} MiB | "
                          f"{kept / mib:.0f} MiB |")
            total = -(-(args.prompt + args.output) // bs)
            print(f"peak between steps: {peak} blocks held against {total} with every block kept ({peak / total:.0%}); "
                  f"while a prefill chunk computes it holds up to the window and the chunk, at most "
                  f"{core.limits.max_seq_blocks} blocks (the engine's cap per sequence); "
                  f"free blocks at the end: {core.block_manager.num_free_blocks}/{core.block_manager.num_blocks}")
        finally:
            core.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
