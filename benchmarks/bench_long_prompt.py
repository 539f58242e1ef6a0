"""Short prompts queued behind a long one on the prefill worker (issue 23 item 4: "a long prompt never
blocks a queue of short ones").

    python benchmarks/bench_long_prompt.py                       # thresholds 0 (off) and 256 (the default)
    python benchmarks/bench_long_prompt.py --thresholds 0 128 256 --long 1900 --rounds 3

A 1P+1D cluster on the ``bench`` preset (prefill worker on core 0, decode worker on core 1, one
thread each) gets, per round, one long prompt and then, ``--gap-s`` after it, ``--num-short`` short
prompts sent together: each asks for one token, so a TTFT is the prompt's wait plus its prefill. The
prefill worker runs with ``--long-prefill-token-threshold T`` (vLLM's flag: most tokens one prompt
computes in a step). T = 0 lets the long prompt take whole 512-token steps, and the short ones wait
for its last; T = 256 leaves half of each step to them. Every prompt is fresh (no prefix-cache hits).
A first round per cluster is discarded (warm-up). Prints TTFT (ms) per threshold: the long prompt's,
and the short ones' median and worst.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time

import httpx

from pdserve.common.utils import free_port
from pdserve.default_model.tiny_model import ensure_default_model
from pdserve.cluster.launcher import ClusterSpec, LocalCluster


async def ttft_ms(client: httpx.AsyncClient, url: str, model: str, prompt: list[int]) -> float:
    """Milliseconds to the first streamed token of a one-token completion of ``prompt`` (token ids)."""
    started = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                return (time.perf_counter() - started) * 1e3
    raise RuntimeError("no token streamed")


async def one_round(url: str, model: str, rng: random.Random, vocab: int, args) -> tuple[float, list[float]]:
    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    async with httpx.AsyncClient(timeout=120) as client:
        long_task = asyncio.create_task(ttft_ms(client, url, model, prompt(args.long)))
        await asyncio.sleep(args.gap_s)
        shorts = await asyncio.gather(*(ttft_ms(client, url, model, prompt(args.short))
                                        for _ in range(args.num_short)))
        return await long_task, list(shorts)


def run(threshold: int, args, model_dir: str, vocab: int) -> tuple[list[float], list[float]]:
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "512MiB"],
                       prefill_args=["--long-prefill-token-threshold", str(threshold)])
    longs, shorts = [], []
    with LocalCluster(spec) as cluster:  # returns once the router reports both workers healthy
        workers = [proc for name, proc in cluster.procs if name != "router"]
        for i, proc in enumerate(workers):  # prefill on core 0, decode on core 1
            os.sched_setaffinity(proc.pid, {i % (os.cpu_count() or 1)})
        url = cluster.url
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        rng = random.Random(threshold * 7919 + 1)  # fresh prompts per cluster; the lengths are what matter
        for i in range(args.rounds + 1):
            long_ms, short_ms = asyncio.run(one_round(url, model, rng, vocab, args))
            if i:  # round 0 warms the cluster up
                longs.append(long_ms)
                shorts.extend(short_ms)
            time.sleep(1.0)
    return longs, shorts


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--thresholds", type=int, nargs="+", default=[0, 256])
    ap.add_argument("--long", type=int, default=1900, help="long prompt tokens (default 1900)")
    ap.add_argument("--short", type=int, default=64, help="short prompt tokens (default 64)")
    ap.add_argument("--num-short", type=int, default=4)
    ap.add_argument("--gap-s", type=float, default=0.3, help="seconds between the long prompt and the short ones")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    model_dir = str(ensure_default_model("bench"))
    with open(os.path.join(model_dir, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    print(f"1P+1D, bench preset; per round one {args.long}-token prompt, then {args.num_short} x {args.short} "
          f"tokens {args.gap_s:g} s later; {args.rounds} rounds after one warm-up round; TTFT in ms")
    print("| --long-prefill-token-threshold | long prompt TTFT (median) | short prompts TTFT median | worst |")
    print("|---|---|---|---|")
    for threshold in args.thresholds:
        longs, shorts = run(threshold, args, model_dir, vocab)
        print(f"| {threshold} | {statistics.median(longs):.0f} | {statistics.median(shorts):.0f} | "
              f"{max(shorts):.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
