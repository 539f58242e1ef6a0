"""Core lending (``pdserve up --core-lending``) on two cores: what a decode step gains from the idle prefill core,
and whether prompts on that core lose anything to it.

1. **The step**: a decode ``EngineCore`` (the bench preset by default) at batch ``--batch``, its main thread on core
   ``--decode-core`` and OpenMP's second thread bound to ``--prefill-core`` (``GOMP_CPU_AFFINITY``), timed on one
   thread, on two, alternating every step, and on one and two with the prefill core busy (a spinning process).
2. **The prompts**: a prefill ``EngineCore`` pinned to the prefill core times ``--prompts`` prompts of
   ``--prompt-tokens`` tokens, 0.4 s apart, publishing when it is idle (``LenderFlag``); beside it a decode engine at
   batch ``--batch`` steps without pause, borrowing the prefill core while it is idle (``CoreBorrower``), or not.

    python benchmarks/bench_core_lending.py                 # both parts, cores 0 (prefill) and 1 (decode)

Each engine is a process of its own, pinned, one torch thread (two while borrowing), float32.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def engine(model: str, core: int, batch: int):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core import EngineCore

    return EngineCore(EngineConfig(model=model, dtype="float32", kv_cache_memory=2 * 2**30, max_num_seqs=max(batch, 1),
                                   max_num_batched_tokens=4096, num_threads=1, cpu_cores=str(core),
                                   enable_prefix_caching=False))


def fill(core, model: str, batch: int) -> None:
    from pdserve.common.protocol import SamplingParams

    with open(os.path.join(model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = random.Random(0)
    for i in range(batch):
        core.add_request(f"r{i}", [rng.randrange(10, vocab) for _ in range(rng.randint(64, 512))],
                         SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True), stop_at_max_model_len=True)
    while core.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running):
        core.step()


def part_step(args) -> None:
    import torch

    core = engine(args.model, args.decode_core, args.batch)
    fill(core, args.model, args.batch)

    def timed(n: int, threads_of) -> float:
        times = []
        for i in range(n):
            if torch.get_num_threads() != threads_of(i):
                torch.set_num_threads(threads_of(i))
            t0 = time.perf_counter()
            core.step()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    timed(5, lambda i: 2)
    for _ in range(2):
        print(f"decode step at batch {args.batch}: one thread {timed(30, lambda i: 1):.1f} ms, two (the second on the "
              f"prefill core) {timed(30, lambda i: 2):.1f} ms, alternating {timed(30, lambda i: 1 + i % 2):.1f} ms",
              flush=True)
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{args.prefill_core}}})\n"
                            "while True: pass"])
    try:
        time.sleep(0.5)
        print(f"  with the prefill core busy: one thread {timed(30, lambda i: 1):.1f} ms, two "
              f"{timed(30, lambda i: 2):.1f} ms", flush=True)
    finally:
        hog.kill()
    core.close()


def part_decode(args) -> None:
    from pdserve.cluster.core_lending import CoreBorrower

    core = engine(args.model, args.decode_core, args.batch)
    fill(core, args.model, args.batch)
    borrower = CoreBorrower(args.flag, 1, 1) if args.borrow else None
    open(args.flag + ".ready", "w").close()
    while not os.path.exists(args.flag + ".stop"):
        if borrower is not None:
            borrower.before_step()
        core.step()
    core.close()


def part_prefill(args) -> None:
    from pdserve.cluster.core_lending import LenderFlag
    from pdserve.common.protocol import SamplingParams

    core = engine(args.model, args.prefill_core, 1)
    flag = LenderFlag(args.flag)
    rng = random.Random(1)
    times = []
    for i in range(args.prompts + 2):
        flag.set_idle(False)
        t0 = time.perf_counter()
        core.add_request(f"p{i}", [rng.randrange(10, 4000) for _ in range(args.prompt_tokens + i)],
                         SamplingParams(max_tokens=1))
        while core.has_unfinished():
            core.step()
        times.append(time.perf_counter() - t0)
        flag.set_idle(True)
        time.sleep(0.4)
    print(f"  {args.prompt_tokens}-token prompts: median {statistics.median(times[2:]) * 1e3:.1f} ms "
          f"(each: {', '.join(f'{t * 1e3:.0f}' for t in times[2:])})", flush=True)
    core.close()


def run(args, part: str, extra: list[str] = (), env: dict | None = None, wait: bool = True):
    cmd = [sys.executable, __file__, "--part", part, "--model", args.model, "--batch", str(args.batch),
           "--prefill-core", str(args.prefill_core), "--decode-core", str(args.decode_core),
           "--prompts", str(args.prompts), "--prompt-tokens", str(args.prompt_tokens),
           *(["--flag", args.flag] if args.flag else []), *extra]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
    if wait:
        proc.wait()
    return proc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bench preset)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prefill-core", type=int, default=0)
    ap.add_argument("--decode-core", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--part", default="all", choices=["all", "step", "decode", "prefill"])
    ap.add_argument("--flag", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--borrow", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.model is None:
        from pdserve.default_model.tiny_model import ensure_default_model

        args.model = str(ensure_default_model("bench"))
    if args.part == "step":
        part_step(args)
    elif args.part == "decode":
        part_decode(args)
    elif args.part == "prefill":
        part_prefill(args)
    else:
        gomp = {"GOMP_CPU_AFFINITY": f"{args.decode_core} {args.prefill_core}"}
        run(args, "step", env=gomp)
        for borrow in (False, True):
            with tempfile.TemporaryDirectory() as tmp:
                args.flag = os.path.join(tmp, "prefill.idle")
                print(f"prompts on the prefill core, a decode engine beside it "
                      f"{'borrowing' if borrow else 'not borrowing'} the core while idle:", flush=True)
                decode = run(args, "decode", ["--borrow"] if borrow else [], env=gomp, wait=False)
                try:
                    while not os.path.exists(args.flag + ".ready"):
                        time.sleep(0.1)
                    run(args, "prefill")
                finally:
                    open(args.flag + ".stop", "w").close()
                    decode.wait(60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
