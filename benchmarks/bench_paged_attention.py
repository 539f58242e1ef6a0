"""Paged-attention kernel microbenchmark: a decode step's attention alone, and the KV bandwidth it reaches.

Times ``torch.ops.pdserve.paged_decode_attention`` (the op the compiled decode step calls: write the new
K/V, then the native kernel; ``paged_decode_attention_f32`` for a float32 cache) over every layer of a
cache shaped like the ``bench`` preset's (12 layers, 4 KV heads of 64, 12 query heads, blocks of 16 or
``--block-size``, float32 by default), on one pinned core with one torch thread. The cache is allocated
as the engine allocates it (``allocate_kv_cache``: 2 MiB pages where the kernel grants them) and holds
exactly the batch's blocks, handed out in a random order as a busy block manager's free queue would, so
at batch 8 and 32 the KV comes from memory, not from the caches. Prints per batch: the median time of one
step's worth of calls (every layer once), the KV bytes those calls read, and that rate in GB/s.

    python benchmarks/bench_paged_attention.py                      # batch 1 / 8 / 32, contexts 156 / 350 / 300
    python benchmarks/bench_paged_attention.py --dtype bfloat16
    python benchmarks/bench_paged_attention.py --cases 16:512 64:256
    python benchmarks/bench_paged_attention.py --cases 8:389 32:341 --block-size 16 64 128
    python benchmarks/bench_paged_attention.py --cases 1:16 1:512 8:512 --against-python 12

``--against-python N`` times each case N times with the operator's C++ kernel (kernels/torch_ops.cpp) and N
times with its Python implementation (a ``torch.library`` override of the CPU kernel), taking turns, and
prints both medians and how often the C++ one was faster (float32 only: the other caches' operator is
Python's).

A figure for the kernel's speed on this machine, never a test: it compares only with runs of
itself on the same machine (docs/benchmarks.md says which changes it measured).
"""

from __future__ import annotations

import argparse
import os
import statistics
import warnings

import torch
from bench_linear_formats import median_ms  # this folder's timing loop (run as a script, it is on sys.path)

NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, NUM_HEADS = 12, 4, 64, 12


def time_case(batch: int, context: int, dtype: torch.dtype, repeats: int, block_size: int = 16,
              against_python: int = 0) -> dict:
    """Median seconds of one step's attention (every layer) at ``batch`` sequences of ``context`` tokens,
    in blocks of ``block_size`` token slots; with ``against_python``, that many medians each way (the C++
    kernel, the Python one), taking turns."""
    from pdserve.engine.layers import paged_backend  # importing it registers the ops
    from pdserve.engine.execution.kv_cache import allocate_kv_cache
    from pdserve.kernels import load_torch_ops

    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    generator = torch.Generator().manual_seed(batch * 1000 + context)
    cache = allocate_kv_cache(NUM_LAYERS, num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM, dtype, "cpu")
    cache.normal_(generator=generator)
    order = torch.randperm(num_blocks, generator=generator)[: batch * blocks_per_seq]
    block_tables = order.view(batch, blocks_per_seq).contiguous()
    seq_lens = torch.full((batch,), context, dtype=torch.int64)
    query_start_loc = torch.arange(batch + 1, dtype=torch.int64)
    last = (context - 1) // block_size
    slot_mapping = (block_tables[:, last] * block_size + (context - 1) % block_size).contiguous()
    query = torch.randn(batch, NUM_HEADS, HEAD_DIM, generator=generator)
    key = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    value = torch.randn(batch, NUM_KV_HEADS, HEAD_DIM, generator=generator).to(dtype)
    float32 = dtype == torch.float32
    load_torch_ops()
    metadata = (slot_mapping, block_tables, seq_lens, query_start_loc, HEAD_DIM**-0.5, 0)
    op = torch.ops.pdserve.paged_decode_attention_f32 if float32 else torch.ops.pdserve.paged_decode_attention
    extra = () if float32 else ("", None)

    def step() -> None:
        for layer in range(NUM_LAYERS):
            op(query, key, value, cache, layer, *metadata, *extra)

    step()
    step_ms = median_ms(step, repeats)  # one warm call, then the median of `repeats`
    kv_bytes = NUM_LAYERS * batch * context * 2 * NUM_KV_HEADS * HEAD_DIM * cache.element_size()
    result = {"batch": batch, "context": context, "step_s": step_ms / 1e3, "kv_bytes": kv_bytes}
    if against_python and float32:
        cpp, python = [], []
        for r in range(against_python):
            for kind in ("cpp", "python") if r % 2 == 0 else ("python", "cpp"):
                override = None
                if kind == "python":  # the Python implementation in place of the C++ kernel, for this round
                    override = torch.library.Library("pdserve", "IMPL")
                    override.impl("paged_decode_attention_f32", paged_backend._decode_float32, "CPU")
                step()
                (cpp if kind == "cpp" else python).append(median_ms(step, repeats) / 1e3)
                if override is not None:
                    override._destroy()
        result.update(cpp_s=statistics.median(cpp), python_s=statistics.median(python),
                      cpp_faster=sum(a < b for a, b in zip(cpp, python)), rounds=against_python)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=["1:156", "8:350", "32:300"],
                        help="BATCH:CONTEXT pairs (default: the bench_decode MBU batches' mean contexts)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--core", type=int, default=0)
    parser.add_argument("--block-size", type=int, nargs="+", default=[16],
                        help="token slots per KV block (several: each case at each size; the engine's default 16)")
    parser.add_argument("--against-python", type=int, default=0, metavar="N",
                        help="also N rounds each of the C++ kernel and the Python one, taking turns")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message=".*[Oo]verrid")  # the Python implementation put over the C++ one
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    print(f"paged attention, {NUM_LAYERS} layers x {NUM_HEADS} heads over {NUM_KV_HEADS} KV heads of {HEAD_DIM}, "
          f"{args.dtype} cache, one core (cpu capability {torch.backends.cpu.get_cpu_capability()})")
    for case in args.cases:
        batch, context = (int(x) for x in case.split(":"))
        for block_size in args.block_size:
            r = time_case(batch, context, dtype, args.repeats, block_size, args.against_python)
            print(f"  batch {batch:3d}, context {context:5d}, blocks of {block_size:3d}: "
                  f"{r['step_s'] * 1e3:7.2f} ms a step, "
                  f"KV {r['kv_bytes'] / 2**20:6.1f} MiB -> {r['kv_bytes'] / r['step_s'] / 1e9:5.1f} GB/s")
            if "cpp_s" in r:
                print(f"      C++ kernel {r['cpp_s'] * 1e3:.3f} ms, Python {r['python_s'] * 1e3:.3f} ms a step "
                      f"({NUM_LAYERS} calls): C++ faster in {r['cpp_faster']} of {r['rounds']} rounds")


if __name__ == "__main__":
    main()
