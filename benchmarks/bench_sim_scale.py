"""How far ``pdserve simulate`` scales: a thousand workers and a million requests on one core.

Pinned to one core, the simulator runs a synthetic workload (Poisson arrivals; prompt and output
lengths uniform in the given ranges, a shared prefix) on ``--prefill`` + ``--decode`` workers of the
profile, and prints the wall time, the events handled, the simulated seconds, and the peak resident
memory (``ru_maxrss``), with the run's own figures (TTFT/TPOT, pool utilisation). The request rate
defaults to 7/8 of the highest the profile's sizer fits in both pools at 80% busy (about 70%).

    python benchmarks/bench_sim_scale.py --profile /tmp/profile.json [--prefill 250 --decode 750]
        [--num-prompts 1000000] [--input 256 --output 32] [--routing-policy round_robin] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

from pdserve.bench.datasets import DatasetConfig
from pdserve.sizing.profile import load_profile
from pdserve.sizing.simulator import SimConfig, Simulator
from pdserve.sizing.sizer import ProfileSizer
from pdserve.sizing.workload import synthetic


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True)
    ap.add_argument("--prefill", type=int, default=250)
    ap.add_argument("--decode", type=int, default=750)
    ap.add_argument("--num-prompts", type=int, default=1_000_000)
    ap.add_argument("--input", type=int, default=256, help="mean prompt tokens (uniform +-50%%)")
    ap.add_argument("--output", type=int, default=32, help="mean output tokens (uniform +-50%%)")
    ap.add_argument("--prefix-len", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=None)
    ap.add_argument("--routing-policy", default="round_robin")
    ap.add_argument("--kv-blocks", type=int, default=2048,
                    help="KV blocks per worker (default 2048: 32k tokens of 16; the profile's own size may be "
                         "far larger than a simulated fleet's workers need, and every block is state)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    profile = load_profile(args.profile)
    rate = args.request_rate
    if rate is None:  # the highest rate the sizer fits in both pools (each at most 80% busy), at 7/8 of it
        sizer = ProfileSizer(profile, {})
        mean_input = args.input + args.prefix_len

        def fits(r: float) -> bool:
            prefill, decode = sizer(r, mean_input, args.output)
            return prefill <= max(1, args.prefill) and decode <= args.decode

        lo, hi = 0.0, 1.0
        while fits(hi):
            lo, hi = hi, hi * 2
        for _ in range(40):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        rate = 0.875 * lo
    cfg = DatasetConfig(num_prompts=args.num_prompts, input_len=args.input, range_ratio=0.5, output_len=args.output,
                        prefix_len=args.prefix_len, seed=0)
    config = SimConfig(num_prefill=args.prefill, num_decode=args.decode, routing_policy=args.routing_policy,
                       kv_cache_memory=args.kv_blocks * profile.worker("decode").block_bytes)
    start = time.perf_counter()
    last = [start]

    def progress(n: int) -> None:
        now = time.perf_counter()
        if now - last[0] > 30:
            last[0] = now
            print(f"  {n:,} requests done, {now - start:.0f} s", flush=True)

    result = Simulator(profile, config, on_progress=progress).run(synthetic(cfg, rate), goodput_slos={"ttft": 1000})
    wall = time.perf_counter() - start
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    m, sim = result.metrics, result.sim
    figures = {"workers": args.prefill + args.decode, "num_prefill": args.prefill, "num_decode": args.decode,
               "requests": m["completed"], "request_rate": rate, "wall_seconds": wall, "events": sim["num_events"],
               "simulated_seconds": sim["simulated_seconds"], "peak_rss_mib": rss_mib,
               "output_tokens": m["total_output_tokens"], "median_ttft_ms": m["median_ttft_ms"],
               "median_tpot_ms": m["median_tpot_ms"], "routing_policy": args.routing_policy,
               "pools": sim["pools"], "cpu": profile.machine.get("cpu"), "isa": profile.machine.get("isa")}
    print(json.dumps({k: v for k, v in figures.items() if k != "pools"}, indent=1))
    for name, pool in sim["pools"].items():
        print(f"{name}: {pool['num_workers']} workers, {100 * pool['utilization']:.1f}% busy")
    print(f"{m['completed']:,} requests on {args.prefill + args.decode} workers in {wall:.0f} s on one core "
          f"({sim['num_events'] / wall:,.0f} events/s, {m['total_output_tokens'] / wall:,.0f} tokens/s), "
          f"peak RSS {rss_mib:.0f} MiB")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
