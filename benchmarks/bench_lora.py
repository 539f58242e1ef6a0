"""What serving LoRA adapters costs: decode and prefill throughput with and without adapters.

One offline ``LLM`` per configuration, all in this process and pinned to ``--cores``, greedy,
``--batch`` prompts, timed in turn over ``--rounds`` rounds (the best of each kept):

* ``base``: LoRA off (the compiled decode step, unless ``--enforce-eager``);
* ``lora-on, base requests``: ``--enable-lora`` but no request names an adapter: a step
  with no adapter adds nothing and keeps the compiled decode step;
* ``1 adapter``: every request uses the same adapter;
* ``N adapters``: requests spread round-robin over ``--num-adapters`` adapters (and the
  base model), all in the same batches (``max_loras = num_adapters``).

Adapters are written by ``peft`` (random non-zero weights, rank ``--rank``, every
projection) on the checkpoint, so the figures include the real number of adapted layers.
Prints output tokens/s and the time to prefill the batch, and the ratio to ``base``.

    python benchmarks/bench_lora.py                      # bench preset, 4 adapters of rank 16, batch 32
    python benchmarks/bench_lora.py --model DIR --rank 8 --num-adapters 2
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from pdserve.common.protocol import LoRARequest, SamplingParams
from pdserve.llm import LLM
from pdserve.default_model.tiny_model import ensure_default_model


def write_adapters(model: str, out_dir: str, num: int, rank: int) -> list[str]:
    """``num`` PEFT adapters (all seven projections, rank ``rank``) of ``model``, written by peft."""
    import peft
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(num):
        torch.manual_seed(i)
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False)
        path = os.path.join(out_dir, f"adapter{i}")
        peft.get_peft_model(base, config).save_pretrained(path)
        paths.append(path)
    return paths


def time_config(llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None], max_tokens: int
                ) -> tuple[float, float]:
    """(prefill seconds of the batch, output tokens/s of the whole run) of one timed round."""
    llm.core.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0), lora_request=loras, use_tqdm=False)
    prefill_s = time.perf_counter() - start
    llm.core.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                        lora_request=loras, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return prefill_s, sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset, written once)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per configuration (the best is kept)")
    ap.add_argument("--cores", default="0", help="pin the engine to these cores")
    ap.add_argument("--enforce-eager", action="store_true")
    args = ap.parse_args()
    model = args.model or str(ensure_default_model("bench"))
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_adapters(model, tmp, args.num_adapters, args.rank)
        adapters = [LoRARequest(lora_name=f"a{i}", lora_int_id=i + 1, lora_path=p) for i, p in enumerate(paths)]
        prompts = [[(17 * i + 5 * j) % 1000 + 10 for j in range(args.prompt_len)] for i in range(args.batch)]
        lora = dict(enable_lora=True, max_lora_rank=args.rank)
        mixed = [adapters[i % len(adapters)] if i % (len(adapters) + 1) else None for i in range(args.batch)]
        if args.batch < len(adapters) + 1:  # a small batch: every adapter still appears (no base request)
            mixed = [adapters[i % len(adapters)] for i in range(args.batch)]
        configs = [  # (label, the batch's adapters, engine flags)
            ("base (LoRA off)", [None] * args.batch, {}),
            ("LoRA on, base requests", [None] * args.batch, dict(**lora, max_loras=1)),
            ("1 adapter, every request", [adapters[0]] * args.batch, dict(**lora, max_loras=1)),
            (f"{len(adapters)} adapters + base, mixed", mixed, dict(**lora, max_loras=len(adapters))),
        ]
        engines = [LLM(model, kv_cache_memory="256MiB", max_num_seqs=args.batch, cpu_cores=args.cores,
                       enforce_eager=args.enforce_eager, **flags) for _, _, flags in configs]
        try:
            for llm, (_, loras, _) in zip(engines, configs):  # warm-up, then rounds over every configuration in
                llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0), lora_request=loras,  # turn, so
                             use_tqdm=False)  # a drift of the machine's speed hits them all alike
            best = [(float("inf"), 0.0)] * len(configs)
            for _ in range(args.rounds):
                for i, (llm, (_, loras, _)) in enumerate(zip(engines, configs)):
                    prefill_s, tok_s = time_config(llm, prompts, loras, args.max_tokens)
                    best[i] = (min(best[i][0], prefill_s), max(best[i][1], tok_s))
        finally:
            for llm in engines:
                llm.close()
        rows = [{"label": label, "prefill_s": p, "tok_s": t} for (label, _, _), (p, t) in zip(configs, best)]
    base = rows[0]
    print(f"model {model}; batch {args.batch}, prompts of {args.prompt_len} tokens, {args.max_tokens} output "
          f"tokens, rank {args.rank}, cores {args.cores}{', eager' if args.enforce_eager else ''}")
    print(f"{'configuration':34s} {'output tok/s':>12s} {'vs base':>8s} {'prefill s':>10s} {'vs base':>8s}")
    for row in rows:
        print(f"{row['label']:34s} {row['tok_s']:12.1f} {row['tok_s'] / base['tok_s']:8.2f} "
              f"{row['prefill_s']:10.2f} {row['prefill_s'] / base['prefill_s']:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
