"""How steady this machine's speed is: one core running the same ~1 ms of Python back to back.

A shared VM's core does not run at one speed. On the 2-core Zen 4 of 2026-12-02 the same loop took its
fastest time in about a third of 3,000 back-to-back calls and ~1.7x that in the rest, in runs of a few calls
to over half a second, and the share of slow calls moved over tens of minutes (a calibration run's real
colocated TPOT at 4 req/s was 1.75 ms at 06:15 UTC and 3.8 ms at 06:55, the same code). Every timing taken
on such a machine carries that factor: run this before trusting a benchmark's single figure, and compare
figures taken at the same hour.

    python benchmarks/bench_host_speed.py [--calls 3000] [--core 0] [--rounds 1]

Prints per round: the fastest call, the median and mean over it, the share of calls within 1.35x of the
fastest ("fast"), and the longest and median runs of fast and of slow calls. Pure Python, no torch: it
measures the core, not a library. A figure for the machine, never a test.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

SLOW = 1.35  # a call this many times the fastest or slower counts as slow


def one_call(n: int) -> float:
    """Seconds of ``n`` additions in a Python loop (the unit of work)."""
    start = time.perf_counter()
    x = 0
    for i in range(n):
        x += i
    return time.perf_counter() - start


def runs(labels: list[bool]) -> dict[bool, list[int]]:
    """Lengths of the runs of equal labels, by label."""
    out: dict[bool, list[int]] = {True: [], False: []}
    count = 0
    for i, label in enumerate(labels):
        count += 1
        if i + 1 == len(labels) or labels[i + 1] != label:
            out[label].append(count)
            count = 0
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--work", type=int, default=40000, help="additions a call (~1 ms on a 2.6 GHz Zen 4)")
    args = parser.parse_args()
    os.sched_setaffinity(0, {args.core})
    for r in range(args.rounds):
        times = [one_call(args.work) * 1e3 for _ in range(args.calls)]
        fastest = min(times)
        fast = [t < SLOW * fastest for t in times]
        lengths = runs(fast)
        print(f"round {r}, core {args.core}, {args.calls} calls: fastest {fastest:.3f} ms, median "
              f"{statistics.median(times) / fastest:.2f}x, mean {statistics.fmean(times) / fastest:.2f}x; "
              f"fast {100 * sum(fast) / len(fast):.0f}% of calls; runs of fast calls: median "
              f"{statistics.median(lengths[True] or [0]):.0f}, longest {max(lengths[True] or [0])}; of slow calls: "
              f"median {statistics.median(lengths[False] or [0]):.0f}, longest {max(lengths[False] or [0])}",
              flush=True)


if __name__ == "__main__":
    main()
