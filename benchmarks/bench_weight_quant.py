"""Weight-only int8 (``--quantization int8``) against the float32 model: memory, speed, agreement.

For each checkpoint (default: the ``bench`` preset and the shipped default model) this prints

* **weight memory**: bytes of the model's parameters, float32 and int8 (int8 values + float32
  per-row scales for the decoder's linear layers; embedding and LM head unchanged);
* **decode tok/s at batch 1 and batch 32** (prompts 64-256 tokens, median of ``--steps`` steps; best of
  ``--rounds`` rounds, float32 and int8 interleaved)
  and **prefill tok/s** (8 prompts of 256 tokens in one step), on one pinned core and one torch
  thread, as benchmarks/bench_decode.py runs;
* **greedy agreement** over ``--num-prompts`` prompts (text from Python's standard library,
  ``--prompt-len`` tokens, ``--max-tokens`` generated): share of outputs identical token for token,
  mean share of tokens identical up to the first divergence;
* **teacher-forced logits** on the float model's own greedy sequences: max |logit error| (and
  the largest |logit| for scale), and the share of positions whose argmax agrees.

    python benchmarks/bench_weight_quant.py                  # both checkpoints, compiled decode for float32
    python benchmarks/bench_weight_quant.py --enforce-eager  # both runs eager
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import statistics
import sys
import sysconfig
import time

import torch

from pdserve.bench.agreement import greedy_agreement, greedy_outputs, teacher_forced_logits
from pdserve.common.protocol import SamplingParams
from pdserve.engine.layers.quantization import weight_bytes
from pdserve.llm import LLM
from pdserve.default_model.tiny_model import ensure_default_model
from pdserve.default_model.train import shipped_model_dir


def stdlib_prompts(tokenizer, num_prompts: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    """``num_prompts`` prompts of ``prompt_len`` tokens, each from a random place in a random stdlib file."""
    rng = random.Random(seed)
    files = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    prompts = []
    while len(prompts) < num_prompts:
        with open(rng.choice(files), encoding="utf-8", errors="replace") as f:
            text = f.read()
        start = rng.randrange(max(len(text) - 4000, 1))
        ids = tokenizer(text[start:start + 4000], add_special_tokens=False)["input_ids"]
        if len(ids) >= prompt_len:
            prompts.append(ids[:prompt_len])
    return prompts


def decode_tok_s(llm: LLM, batch: int, steps: int, vocab: int) -> float:
    """Decode tokens/s at ``batch``: median step time over ``steps`` steps after prefilling."""
    core = llm.core
    rng = random.Random(batch)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        core.add_request(f"d{batch}-{i}", [rng.randrange(10, vocab) for _ in range(rng.randint(64, 256))], params,
                         stop_at_max_model_len=True)
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()
    for _ in range(3):  # warm-up
        core.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - t0)
    while core.has_unfinished():  # run the batch out (max_tokens) so the next measurement starts empty
        core.step()
    return batch / statistics.median(times)


def prefill_tok_s(llm: LLM, vocab: int, num: int = 8, length: int = 256, repeats: int = 3) -> float:
    """Prefill tokens/s: ``num`` prompts of ``length`` tokens, one token generated, best of ``repeats``."""
    rng = random.Random(1)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for _ in range(repeats):
        prompts = [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(num)]
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - t0)
    return num * length / best


def make_llm(model: str, quantization: str | None, args) -> LLM:
    return LLM(model, dtype="float32", quantization=quantization, num_threads=1, max_num_seqs=32,
               kv_cache_memory="1GiB", enable_prefix_caching=False, enforce_eager=args.enforce_eager)


def timings(llm: LLM, args) -> dict:
    vocab = llm.vocab_size
    out = {"prefill_tok_s": prefill_tok_s(llm, vocab)}
    for batch in (1, 32):
        out[f"decode_b{batch}_tok_s"] = decode_tok_s(llm, batch, args.steps, vocab)
    return out


def compare(name: str, model: str, args) -> dict:
    from transformers import AutoTokenizer

    prompts = stdlib_prompts(AutoTokenizer.from_pretrained(model), args.num_prompts, args.prompt_len)
    llms = {"float32": make_llm(model, None, args), "int8": make_llm(model, "int8", args)}
    runs = {k: {"weight_bytes": weight_bytes(llm.core.runner.model),
                "compiled_decode": llm.core.runner._compiled_decode is not None} for k, llm in llms.items()}
    for _ in range(args.rounds):  # interleaved, best of each: other load on the machine hits both alike
        for key, llm in llms.items():
            for figure, value in timings(llm, args).items():
                runs[key][figure] = max(runs[key].get(figure, 0.0), value)
    outputs = {k: greedy_outputs(llm, prompts, args.max_tokens) for k, llm in llms.items()}
    sequences = [p + o for p, o in zip(prompts, outputs["float32"])][: args.num_logit_prompts]
    logits = {k: teacher_forced_logits(llm, sequences) for k, llm in llms.items()}
    for llm in llms.values():
        llm.close()
    ref, q = runs["float32"], runs["int8"]
    ref["outputs"], q["outputs"], ref["logits"], q["logits"] = outputs["float32"], outputs["int8"], \
        logits["float32"], logits["int8"]
    agree = greedy_agreement(ref["outputs"], q["outputs"])
    err = max((a - b).abs().max().item() for a, b in zip(ref["logits"], q["logits"]))
    scale = max(a.abs().max().item() for a in ref["logits"])
    rows = sum(a.shape[0] for a in ref["logits"])
    top1 = sum((a.argmax(-1) == b.argmax(-1)).sum().item() for a, b in zip(ref["logits"], q["logits"])) / rows
    print(f"\n## {name} ({model})")
    print(f"| | float32 | int8 | int8 / float32 |\n|---|---:|---:|---:|")
    print(f"| weight memory (MiB) | {ref['weight_bytes'] / 2**20:.1f} | {q['weight_bytes'] / 2**20:.1f} | "
          f"{q['weight_bytes'] / ref['weight_bytes']:.2f} |")
    for key, label in (("decode_b1_tok_s", "decode tok/s, batch 1"), ("decode_b32_tok_s", "decode tok/s, batch 32"),
                       ("prefill_tok_s", "prefill tok/s (8 x 256 tokens)")):
        print(f"| {label} | {ref[key]:.1f} | {q[key]:.1f} | {q[key] / ref[key]:.2f} |")
    print(f"(decode step compiled: float32 {ref['compiled_decode']}, int8 {q['compiled_decode']})")
    print(f"greedy agreement over {agree.num_prompts} prompts x {args.max_tokens} tokens: "
          f"{agree.identical_share:.1%} identical, {agree.mean_prefix_share:.1%} of tokens identical up to the "
          f"first divergence")
    print(f"teacher-forced over {rows} positions: max |logit error| {err:.4f} (largest |logit| {scale:.2f}), "
          f"argmax agrees at {top1:.2%}")
    keys = ("weight_bytes", "prefill_tok_s", "decode_b1_tok_s", "decode_b32_tok_s", "compiled_decode")
    return {"float32": {k: ref[k] for k in keys}, "int8": {k: q[k] for k in keys},
            "identical_share": agree.identical_share, "mean_prefix_share": agree.mean_prefix_share,
            "max_logit_error": err, "max_abs_logit": scale, "teacher_forced_top1": top1}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="*", default=None, help="checkpoint dirs (default: bench preset, shipped)")
    ap.add_argument("--num-prompts", type=int, default=128)
    ap.add_argument("--num-logit-prompts", type=int, default=32, help="prompts the logit error is taken over")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3, help="timing rounds, float32 and int8 interleaved; best kept")
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--core", type=int, default=0, help="pin to this core")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    models = {os.path.basename(m.rstrip("/")): m for m in args.models} if args.models else \
        {"bench preset": str(ensure_default_model("bench")), "shipped default": str(shipped_model_dir())}
    print(f"CPU {torch.backends.cpu.get_cpu_capability()}, one core, torch {torch.__version__}")
    results = {name: compare(name, model, args) for name, model in models.items()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
