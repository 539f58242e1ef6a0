"""What a KV cache's first touch costs a prefill worker: wall and system time per prompt, by window.

A CPU KV cache is an anonymous mapping (``kv_cache.zero_pages_on_touch``): a page costs its zero-fill
when first written, and in a VM whose memory the host backs lazily the host's fault too. The runner
makes the pages resident in the background at idle priority (``kv_cache.populate_when_idle``), which
only helps where the worker has idle time before its cache is written. This runs the prefill worker's
engine in this process on one pinned core and prefills ``--prompts`` fresh prompts of ``--tokens``
tokens back to back, after ``--idle-s`` seconds of idling, and prints, for each window of 20 prompts,
the median wall time per prompt and the system CPU time per prompt (page faults are system time)::

    python benchmarks/bench_first_touch.py --idle-s 0   # the step loop meets every page first
    python benchmarks/bench_first_touch.py --idle-s 5   # the idle thread got there first

With ``--kv-cache-memory 512MiB`` (default) 512-token prompts fill the cache in ~42 prompts: the
windows before that write pages never written, the windows after reuse them.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

WINDOW = 20


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: the bench preset)")
    p.add_argument("--kv-cache-memory", default="512MiB")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--prompts", type=int, default=120)
    p.add_argument("--idle-s", type=float, default=0.0, help="seconds idle between start and the first prompt")
    p.add_argument("--core", type=int, default=1)
    args = p.parse_args()
    os.sched_setaffinity(0, {args.core})

    import torch

    from pdserve.common.protocol import SamplingParams
    from pdserve.default_model.tiny_model import ensure_default_model
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core import EngineCore

    torch.set_num_threads(1)
    model = args.model or str(ensure_default_model("bench"))
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    engine_args = parser.parse_args(["--model", model, "--num-threads", "1", "--enforce-eager",
                                     "--kv-cache-memory", args.kv_cache_memory])
    core = EngineCore(EngineConfig.from_cli_args(engine_args, role="prefill"))
    vocab = core.runner.vocab_size
    rng = random.Random(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    time.sleep(args.idle_s)
    walls, systems = [], []
    for i in range(args.prompts):
        sys_start, start = os.times().system, time.perf_counter()
        core.add_request(f"r{i}", [rng.randrange(3, vocab) for _ in range(args.tokens)], params)
        while core.has_unfinished():
            core.step()
        walls.append((time.perf_counter() - start) * 1e3)
        systems.append((os.times().system - sys_start) * 1e3)
    print(f"{args.tokens}-token prompts, KV cache {core.runner.kv_cache_bytes / 2**20:.0f} MiB, "
          f"{args.idle_s:g} s idle first, one core:")
    print("| prompts | wall ms / prompt (median) | system ms / prompt (mean) |")
    print("|---|---|---|")
    for j in range(0, args.prompts, WINDOW):
        print(f"| {j + 1}-{min(j + WINDOW, args.prompts)} | {statistics.median(walls[j:j + WINDOW]):.1f} | "
              f"{statistics.mean(systems[j:j + WINDOW]):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
