"""A prefill chunk's attention after cached rows: one masked SDPA call against the split one.

Times ``prefill_attention.causal_sdpa`` under the chunk's explicit [Q, L] mask (the KV heads repeated
for torch's flash kernel) against ``prefill_attention.chunk_sdpa`` (two flash calls merged by their
log-sum-exps: the cached keys unmasked with the query heads folded onto their KV head, then the chunk's
own keys causally), on one pinned core with one torch thread, with the ``bench`` preset's heads (12
query / 4 KV heads of 64), float32. Prints per shape the median ms of each, their ratio, and whether
``prefill_attention.splits`` sends that shape to the split. ``ATEN_CPU_CAPABILITY=avx2`` times torch's
AVX2 kernels on an AVX-512 machine.

    python benchmarks/bench_chunk_attention.py
    python benchmarks/bench_chunk_attention.py --cases 256:512 512:1024 --repeats 9
    ATEN_CPU_CAPABILITY=avx2 python benchmarks/bench_chunk_attention.py

A figure for this machine, never a test: the split's rule came from these ratios on an Intel Xeon with
AVX-512 and with ATen capped at AVX2 (docs/benchmarks.md, twenty-fourth session).
"""

from __future__ import annotations

import argparse
import os

import torch
from bench_linear_formats import median_ms  # this folder's timing loop (run as a script, it is on sys.path)
from bench_prefill import cpu_description

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 4, 64
CASES = ["16:64", "32:256", "128:384", "256:512", "256:768", "256:1024", "256:2048", "512:768", "512:1024",
         "1024:2048"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="+", default=CASES, metavar="ROWS:KEYS",
                    help="a chunk of ROWS new rows over KEYS keys (KEYS - ROWS of them cached)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--core", type=int, default=0)
    args = ap.parse_args()
    from pdserve.engine.layers.prefill_attention import causal_sdpa, chunk_sdpa, splits

    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    rep, scale = NUM_HEADS // NUM_KV_HEADS, HEAD_DIM ** -0.5
    print(f"{cpu_description()}; {NUM_HEADS} query / {NUM_KV_HEADS} KV heads of {HEAD_DIM}, float32, one core, "
          f"median of {args.repeats}, ms")
    print("| chunk rows | keys | masked | split | split / masked | split taken |")
    print("|---|---|---|---|---|---|")
    for case in args.cases:
        rows, keys = (int(x) for x in case.split(":"))
        q = torch.randn(rows, NUM_HEADS, HEAD_DIM, generator=g)
        k = torch.randn(keys, NUM_KV_HEADS, HEAD_DIM, generator=g)
        v = torch.randn(keys, NUM_KV_HEADS, HEAD_DIM, generator=g)
        mask = torch.ones(rows, keys, dtype=torch.bool).tril(keys - rows)
        masked = median_ms(lambda: causal_sdpa(q, k, v, rep, scale, mask), args.repeats)
        split = median_ms(lambda: chunk_sdpa(q, k, v, rep, scale), args.repeats)
        print(f"| {rows} | {keys} | {masked:.2f} | {split:.2f} | {split / masked:.2f} | "
              f"{'yes' if splits(rows, keys - rows) else 'no'} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
