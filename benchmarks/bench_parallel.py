"""Decode throughput of one engine at different tensor/pipeline-parallel layouts (offline ``LLM``).

Runs the same greedy batch (``--num-requests`` prompts of ``--prompt-len`` tokens,
``--output-len`` tokens each, EOS ignored) through ``pdserve.LLM`` at each layout
and prints, per layout: decode tokens/s (output tokens after the first, over the
time after the last prefill), the mean decode step time, and the cores in use.
Every rank gets ``--threads-per-rank`` torch threads, so a layout with R ranks
uses R * threads cores.

For pipeline parallelism the driver keeps one batch in flight (no micro-batches):
stage s waits while the other stages run, so P stages on P cores finish a step no
faster than one rank holding every layer on one core. "core efficiency" =
(TP=1 step time x 1 core) / (this step time x its cores); 1.0 means every core
added bought its full share, 0.5 means half of each core idled (the bubble, for PP=2).

    python benchmarks/bench_parallel.py                          # bench preset, TP=1/TP=2/PP=2
    python benchmarks/bench_parallel.py --layouts 1x1 2x1 --output-len 32   # quick
    python benchmarks/bench_parallel.py --transfer-plan          # KV bytes per rank per prompt token

``--transfer-plan`` prints, for mixed prefill -> decode layouts, what each prefill
rank sends per prompt token (the pieces of ``pdserve.common.sharding.transfer_pieces``;
the wire adds one 64-byte header tensor per piece and request, and rounds to whole blocks).
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from transformers import AutoConfig

from pdserve import LLM, SamplingParams
from pdserve.common.sharding import KVLayoutSpec, transfer_pieces
from pdserve.default_model.tiny_model import ensure_default_model

PLAN_LAYOUTS = [((1, 1), (1, 1)), ((2, 1), (1, 1)), ((1, 1), (2, 1)), ((1, 2), (1, 1)), ((1, 1), (1, 2)),
                ((2, 2), (4, 1)), ((4, 1), (1, 2))]


def print_transfer_plan(model: str, bytes_per_value: int = 4) -> None:
    """Bytes each prefill rank sends per prompt token, for each (prefill TPxPP -> decode TPxPP) layout."""
    config = AutoConfig.from_pretrained(model)
    num_kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    print(f"KV bytes per prompt token ({config.num_hidden_layers} layers, {num_kv_heads} KV heads x {head_dim}, "
          f"{bytes_per_value}-byte values): each prefill rank -> [decode ranks]")
    for (ptp, ppp), (dtp, dpp) in PLAN_LAYOUTS:
        p = KVLayoutSpec(ptp, ppp, config.num_hidden_layers, num_kv_heads)
        d = KVLayoutSpec(dtp, dpp, config.num_hidden_layers, num_kv_heads)
        per_rank: dict[int, list[str]] = {}
        for piece in transfer_pieces(p, d):
            size = piece.slice.num_layers * 2 * piece.slice.num_heads * head_dim * bytes_per_value
            per_rank.setdefault(piece.prefill_rank, []).append(f"{size} B -> D{piece.decode_rank}")
        line = "; ".join(f"P{r}: {', '.join(v)}" for r, v in sorted(per_rank.items()))
        print(f"  P TP={ptp} PP={ppp} -> D TP={dtp} PP={dpp}:  {line}")


def run_layout(model: str, tp: int, pp: int, threads: int, prompts: list[list[int]], output_len: int) -> dict:
    with LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=threads,
             kv_cache_memory="512MiB", max_num_batched_tokens=8192) as llm:
        params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
        llm.generate([prompts[0]], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)  # warm up
        core = llm.core
        for i, ids in enumerate(prompts):
            core.add_request(f"bench-{i}", ids, params)
        prefill_done = None
        steps = 0
        tokens_after_prefill = 0
        start = time.perf_counter()
        while core.has_unfinished():
            scheduler_output, outputs = core.step()
            if prefill_done is None:
                if all(r.num_computed_tokens >= r.num_prompt_tokens for r, _ in scheduler_output.scheduled):
                    prefill_done = time.perf_counter()
                continue
            steps += 1
            tokens_after_prefill += len(outputs)
        end = time.perf_counter()
    decode_s = end - prefill_done
    return {"tok_s": tokens_after_prefill / decode_s, "step_ms": 1e3 * decode_s / max(steps, 1),
            "cores": tp * pp * threads, "prefill_s": prefill_done - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint (default: the built-in bench preset)")
    parser.add_argument("--layouts", nargs="+", default=["1x1", "2x1", "1x2"], help="TPxPP layouts")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--threads-per-rank", type=int, default=1)
    parser.add_argument("--transfer-plan", action="store_true", help="print KV bytes per rank per token and exit")
    args = parser.parse_args()
    model = args.model or str(ensure_default_model("bench"))
    if args.transfer_plan:
        print_transfer_plan(model)
        return
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 16000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    torch.set_num_threads(args.threads_per_rank)
    print(f"model {model}; {args.num_requests} requests x ({args.prompt_len} prompt + {args.output_len} output) "
          f"tokens, greedy, {args.threads_per_rank} thread(s) per rank")
    results = {}
    for layout in args.layouts:
        tp, pp = (int(x) for x in layout.split("x"))
        results[layout] = r = run_layout(model, tp, pp, args.threads_per_rank, prompts, args.output_len)
        base = results.get("1x1")
        efficiency = (base["step_ms"] * base["cores"]) / (r["step_ms"] * r["cores"]) if base else float("nan")
        print(f"TP={tp} PP={pp}: decode {r['tok_s']:7.1f} tok/s   step {r['step_ms']:7.1f} ms   "
              f"cores {r['cores']}   core efficiency {efficiency:4.2f}   (prefill {r['prefill_s']:.1f} s)",
              flush=True)


if __name__ == "__main__":
    main()
