"""--batch-invariant: how often one request's output changes with its neighbours, and what the flag costs.

Two parts, both on one torch thread, in this process (``LLM`` / ``EngineCore``):

* **distinct completions**: one sampled request (fixed seed, temperature 1, logprobs on) is
  run ``--runs`` times, each time among random other traffic (1-4 other prompts of 2-60
  tokens, greedy or sampled) under a random step budget (``max_num_batched_tokens``), so its
  prefill is chunked differently and its decode steps see other batch sizes. Prints the number
  of distinct completions (token sequences) and of distinct logprob sequences (compared bit
  for bit), with the flag and without it. Tiny preset by default (runs are cheap).
* **speed**: decode tok/s at several batch sizes (prompts of ``--decode-prompt`` tokens, the
  median and the fastest of ``--steps`` decode steps) and prefill tok/s (one step over
  ``--prefill-prompts`` prompts of ``--prefill-len`` tokens, median and fastest of 3), with and
  without the flag, on the bench preset. Both sides run the decode step eagerly (the flag forces it; the compiled
  step's own gain is in docs/benchmarks.md).

    python benchmarks/bench_batch_invariance.py                 # 1,000 runs each way + speed
    python benchmarks/bench_batch_invariance.py --runs 200 --skip-speed
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

from pdserve.common.protocol import SamplingParams
from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.llm import LLM
from pdserve.default_model.tiny_model import ensure_default_model

TARGET = SamplingParams(max_tokens=32, temperature=1.0, seed=1234, logprobs=3, ignore_eos=True)


def count_distinct(model: str, batch_invariant: bool, runs: int, seed: int) -> tuple[int, int, float]:
    """(distinct completions, distinct logprob sequences, seconds) over ``runs`` runs of the target."""
    rng = random.Random(seed)
    start = time.perf_counter()
    with LLM(model, batch_invariant=batch_invariant, enable_prefix_caching=False, num_threads=1,
             enforce_eager=True) as llm:
        prompt = [random.Random(7).randrange(3, llm.vocab_size) for _ in range(53)]
        completions, logprob_sets = set(), set()
        for _ in range(runs):
            llm.scheduler.config.max_num_batched_tokens = rng.choice([11, 16, 29, 40, 64, 2048])
            others = [[rng.randrange(3, llm.vocab_size) for _ in range(rng.randint(2, 60))]
                      for _ in range(rng.randint(1, 4))]
            params = [SamplingParams(max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 0.8]),
                                     ignore_eos=True) for _ in others]
            where = rng.randint(0, len(others))
            outs = llm.generate(others[:where] + [prompt] + others[where:],
                                params[:where] + [TARGET] + params[where:], use_tqdm=False)
            choice = outs[where].outputs[0]
            completions.add(tuple(choice.token_ids))
            logprob_sets.add(tuple((lp.logprob, tuple(lp.top_logprobs)) for lp in choice.logprobs))
    return len(completions), len(logprob_sets), time.perf_counter() - start


def make_core(model: str, batch_invariant: bool, max_num_seqs: int) -> EngineCore:
    return EngineCore(EngineConfig(model=model, dtype="float32", kv_cache_memory=2 * 2**30, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=8192, num_threads=1, enable_prefix_caching=False,
                                   enforce_eager=True, batch_invariant=batch_invariant))


def decode_tok_s(model: str, batch_invariant: bool, batch: int, prompt_len: int, steps: int,
                 vocab: int) -> tuple[float, float]:
    """Decode tokens/s at ``batch`` sequences: batch / the median decode step, and batch / the fastest
    (the fastest is the better estimate on a machine shared with other work)."""
    core = make_core(model, batch_invariant, batch)
    rng = random.Random(0)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"r{i}", [rng.randrange(10, vocab) for _ in range(prompt_len)], params)
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    core.step()  # warm-up
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    core.close()
    return batch / statistics.median(times), batch / min(times)


def prefill_tok_s(model: str, batch_invariant: bool, num_prompts: int, prompt_len: int,
                  vocab: int) -> tuple[float, float]:
    """Prefill tokens/s: num_prompts fresh prompts of prompt_len tokens in one step (median and best of 3)."""
    core = make_core(model, batch_invariant, num_prompts)
    rng = random.Random(1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for rep in range(4):
        for i in range(num_prompts):
            core.add_request(f"p{rep}-{i}", [rng.randrange(10, vocab) for _ in range(prompt_len)], params)
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
        while core.has_unfinished():
            core.step()
    core.close()
    return num_prompts * prompt_len / statistics.median(times[1:]), num_prompts * prompt_len / min(times[1:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=1000, help="runs of the target request per setting")
    ap.add_argument("--count-model", default=None, help="checkpoint for the count (default: tiny preset)")
    ap.add_argument("--speed-model", default=None, help="checkpoint for the speed part (default: bench preset)")
    ap.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    ap.add_argument("--decode-prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prefill-prompts", type=int, default=2)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--core", type=int, default=None, help="pin to this core")
    ap.add_argument("--skip-count", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    result: dict = {"cpu": torch.backends.cpu.get_cpu_capability()}

    if not args.skip_count:
        model = args.count_model or str(ensure_default_model("tiny"))
        for flag in (True, False):
            n_tok, n_lp, secs = count_distinct(model, flag, args.runs, seed=3)
            name = "with --batch-invariant" if flag else "without the flag"
            print(f"{name}: {args.runs} runs -> {n_tok} distinct completion(s), {n_lp} distinct logprob "
                  f"sequence(s) ({secs:.0f} s)", flush=True)
            result[f"count_{'on' if flag else 'off'}"] = {"runs": args.runs, "completions": n_tok,
                                                          "logprob_sequences": n_lp}

    if not args.skip_speed:
        model = args.speed_model or str(ensure_default_model("bench"))
        with open(os.path.join(model, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        for batch in (int(b) for b in args.batches.split(",")):
            off = decode_tok_s(model, False, batch, args.decode_prompt, args.steps, vocab)
            on = decode_tok_s(model, True, batch, args.decode_prompt, args.steps, vocab)
            print(f"decode batch {batch:3d}: median step {off[0]:8.1f} tok/s without, {on[0]:8.1f} with the flag "
                  f"({on[0] / off[0]:.2f}x); fastest step {off[1]:8.1f} vs {on[1]:8.1f} ({on[1] / off[1]:.2f}x)",
                  flush=True)
            result[f"decode_b{batch}"] = {"off": off, "on": on}
        off = prefill_tok_s(model, False, args.prefill_prompts, args.prefill_len, vocab)
        on = prefill_tok_s(model, True, args.prefill_prompts, args.prefill_len, vocab)
        print(f"prefill {args.prefill_prompts} x {args.prefill_len} tokens: median {off[0]:8.1f} tok/s without, "
              f"{on[0]:8.1f} with the flag ({on[0] / off[0]:.2f}x); fastest {off[1]:8.1f} vs {on[1]:8.1f} "
              f"({on[1] / off[1]:.2f}x)", flush=True)
        result["prefill"] = {"off": off, "on": on}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
