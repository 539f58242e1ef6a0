"""What idle costs a worker with two torch threads, with its OpenMP threads bound one to a core and without.

Unbound, a thread that slept through a long idle may be woken on the core of the thread that woke it (the
scheduler's wake-affine placement) and wait there behind it while it spins at the region's barrier
(pdserve.common.thread_affinity). Two parts, each taking turns between bound and unbound
(``$PDSERVE_NO_THREAD_BINDING``):

* ``ops``: in a process of its own, torch on two threads pinned to two cores as a worker is, a sequence of 24
  matmuls of [200, 512] x [512, 512] run warm, then after each idle gap: the first op's median time and the
  sequence's;
* ``cluster``: a real ``pdserve up --colocated`` (the built-in default model) serving lone prompts of 256 fresh
  tokens (one token out) one after another after each idle gap: the client's latency (median) and the router's
  prompt-compute hop (mean, ``pdserve:request_phase_seconds``).

    python benchmarks/bench_idle_wake.py [--parts ops cluster] [--gaps 0.01 0.1 0.5] [--rounds 2]

Figures for docs/benchmarks.md, never a test. Needs two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time

_OPS = r"""
import json, os, statistics, sys, time
import torch
from pdserve.common.utils import pin_to_cores
pin_to_cores(sys.argv[1], 2)
gaps = [float(g) for g in sys.argv[2:]]
x, ws = torch.randn(200, 512), [torch.randn(512, 512) for _ in range(24)]

def sequence():
    times, y = [], x
    for w in ws:
        start = time.perf_counter()
        y = torch.tanh(y @ w)
        times.append(time.perf_counter() - start)
    return times

for _ in range(40):
    sequence()
warm = statistics.median(t for _ in range(10) for t in sequence())
out = {"warm_op_ms": warm * 1e3}
for gap in gaps:
    runs = []
    for _ in range(16):
        time.sleep(gap)
        runs.append(sequence())
    out[str(gap)] = {"first_op_ms": statistics.median(r[0] for r in runs) * 1e3,
                     "sequence_ms": statistics.median(sum(r) for r in runs) * 1e3}
print(json.dumps(out))
"""


def env(bound: bool) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "PDSERVE_NO_THREAD_BINDING"}
    if not bound:
        e["PDSERVE_NO_THREAD_BINDING"] = "1"
    return e


def ops(cores: str, gaps: list[float], bound: bool) -> dict:
    out = subprocess.run([sys.executable, "-c", _OPS, cores, *map(str, gaps)], env=env(bound), check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


async def lone_prompts(url: str, gaps: list[float], num: int, rng: random.Random) -> dict:
    import httpx

    from pdserve.bench import phases

    out = {}
    async with httpx.AsyncClient(timeout=120) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        for gap in gaps:
            before = await phases.scrape(client, url)
            latencies = []
            for _ in range(num):
                await asyncio.sleep(gap)
                prompt = [rng.randrange(10, 1000) for _ in range(256)]
                start = time.perf_counter()
                resp = await client.post(f"{url}/v1/completions",
                                         json={"model": model, "prompt": prompt, "max_tokens": 1})
                resp.raise_for_status()
                latencies.append(time.perf_counter() - start)
            hops = phases.summarize(before, await phases.scrape(client, url))["phases"]
            out[str(gap)] = {"latency_ms": statistics.median(latencies) * 1e3,
                             "compute_ms": hops["local_prefill_compute"]["mean_s"] * 1e3}
    return out


def cluster(gaps: list[float], bound: bool, num: int, seed: int, port: int = 8391) -> dict:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_sim_calibration as cal

    model = subprocess.run(cal.PDSERVE + ["default-model"], check=True, capture_output=True,
                           text=True).stdout.strip().splitlines()[-1]
    proc = subprocess.Popen(cal.PDSERVE + ["--log-level", "warning", "up", "--colocated", "--model", model,
                                           "--port", str(port)], env=env(bound), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        cal.wait_up(url, 1, proc)
        time.sleep(25)  # past the first half minute after start, which runs slower on this machine
        return asyncio.run(lone_prompts(url, gaps, num, random.Random(seed)))
    finally:
        cal.stop(proc)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", nargs="+", default=["ops", "cluster"], choices=["ops", "cluster"])
    ap.add_argument("--gaps", type=float, nargs="+", default=[0.01, 0.1, 0.5], help="idle seconds before each")
    ap.add_argument("--rounds", type=int, default=2, help="turns of bound and unbound")
    ap.add_argument("--prompts", type=int, default=24, help="lone prompts per gap (cluster)")
    args = ap.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print("needs two cores")
        return 1
    pair = f"{cores[0]},{cores[1]}"
    for r in range(args.rounds):
        for bound in (False, True):
            tag = "bound  " if bound else "unbound"
            if "ops" in args.parts:
                res = ops(pair, args.gaps, bound)
                print(f"round {r} ops     {tag}: warm op {res['warm_op_ms']:.2f} ms; " + "; ".join(
                    f"after {g:g} s idle: first op {res[str(g)]['first_op_ms']:.2f}, 24 ops "
                    f"{res[str(g)]['sequence_ms']:.1f}" for g in args.gaps), flush=True)
            if "cluster" in args.parts:
                res = cluster(args.gaps, bound, args.prompts, seed=100 * r + bound)
                print(f"round {r} cluster {tag}: " + "; ".join(
                    f"after {g:g} s idle: latency p50 {res[str(g)]['latency_ms']:.1f} ms, compute hop "
                    f"{res[str(g)]['compute_ms']:.1f}" for g in args.gaps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
