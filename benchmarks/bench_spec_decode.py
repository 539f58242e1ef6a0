"""Speculative decoding on a code-editing workload: acceptance rate and speed-up.

Each prompt shows a slice of Python standard-library source, then starts the
same code again after an "edited" marker, as an editor asking for a rewrite
with small changes would: the continuation mostly copies the original, which
is where prompt lookup (``ngram``) shines. The same prompts run through the
offline ``LLM`` (one engine in this process, pinned to ``--cores``) without
speculation and with each ``--speculative-config`` given, greedy, and the
script prints per configuration: output tokens/s, speed-up over plain
decoding, acceptance rate (accepted / proposed draft tokens), mean tokens
emitted per verification step, and whether the output equals plain decoding's
token for token (greedy must).

    python benchmarks/bench_spec_decode.py                         # default model, ngram k=2,4
    python benchmarks/bench_spec_decode.py --model DIR --draft-model SMALL_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import time

from pdserve.common.protocol import SamplingParams
from pdserve.llm import LLM
from pdserve.default_model.train import shipped_model_dir


def code_editing_prompts(num_prompts: int, num_lines: int, seed_lines: int = 3) -> list[str]:
    """Deterministic prompts: stdlib source slices, then their first ``seed_lines`` lines again."""
    stdlib = sysconfig.get_paths()["stdlib"]
    names = sorted(n for n in os.listdir(stdlib) if n.endswith(".py"))
    prompts = []
    for name in names[::max(1, len(names) // (num_prompts * 2))]:
        with open(os.path.join(stdlib, name), encoding="utf-8", errors="replace") as f:
            lines = [line for line in f.read().splitlines() if line.strip()]
        if len(lines) < num_lines + 40:
            continue
        body = lines[30:30 + num_lines]  # past the module docstring and imports
        prompts.append("# original\n" + "\n".join(body) + "\n\n# edited\n" + "\n".join(body[:seed_lines]) + "\n")
        if len(prompts) == num_prompts:
            break
    return prompts


def run(model: str, prompts: list[str], max_tokens: int, spec: str | None, args) -> dict:
    llm = LLM(model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.batch, speculative_config=spec,
              cpu_cores=args.cores, num_threads=args.threads, enforce_eager=args.enforce_eager)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    try:
        # Warm-up over the whole batch: any recompilation of the compiled decode step happens here.
        llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0), use_tqdm=False)
        stats = llm.scheduler.stats
        before = (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
                  stats.spec_decode_num_accepted_tokens)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        drafts, draft_tokens, accepted = (stats.spec_decode_num_drafts - before[0],
                                          stats.spec_decode_num_draft_tokens - before[1],
                                          stats.spec_decode_num_accepted_tokens - before[2])
    finally:
        llm.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"spec": spec or "none", "tok_s": tokens / elapsed, "elapsed_s": elapsed, "tokens": tokens,
            "acceptance": accepted / draft_tokens if draft_tokens else None,
            "tokens_per_step": (accepted + drafts) / drafts if drafts else None,
            "outputs": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="target checkpoint (default: the built-in default model)")
    parser.add_argument("--draft-model", default=None, help="also run draft_model speculation with this checkpoint")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--num-lines", type=int, default=24, help="source lines per prompt")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="max_num_seqs (1: latency, one request at a time)")
    parser.add_argument("--k", default="2,4", help="num_speculative_tokens values to try")
    parser.add_argument("--cores", default="0", help="CPU cores to pin the engine to")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="no compiled decode step (verification steps always run eagerly)")
    parser.add_argument("--json", default=None, help="also write the figures here")
    args = parser.parse_args()
    model = args.model or str(shipped_model_dir())
    prompts = code_editing_prompts(args.num_prompts, args.num_lines)
    configs: list[str | None] = [None]
    for k in (int(x) for x in args.k.split(",")):
        configs.append(json.dumps({"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4}))
        if args.draft_model:
            configs.append(json.dumps({"method": "draft_model", "model": args.draft_model,
                                       "num_speculative_tokens": k}))
    print(f"model {model}; {len(prompts)} code-editing prompts, {args.max_tokens} tokens each (greedy), "
          f"batch {args.batch}, cores {args.cores}")
    results = [run(model, prompts, args.max_tokens, spec, args) for spec in configs]
    base = results[0]
    print(f"{'speculation':<72} {'tok/s':>7} {'speed-up':>8} {'accept':>7} {'tok/step':>8} exact")
    for r in results:
        acc = f"{r['acceptance']:.1%}" if r["acceptance"] is not None else "-"
        per_step = f"{r['tokens_per_step']:.2f}" if r["tokens_per_step"] is not None else "1.00"
        exact = "yes" if r["outputs"] == base["outputs"] else "NO"
        print(f"{r['spec']:<72} {r['tok_s']:7.1f} {r['tok_s'] / base['tok_s']:7.2f}x {acc:>7} {per_step:>8} {exact}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{k: v for k, v in r.items() if k != "outputs"} for r in results], f, indent=1)


if __name__ == "__main__":
    main()
