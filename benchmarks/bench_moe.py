"""One sparse MoE layer's forward at decode batch sizes: grouped experts against naive ones, and
expert parallelism against tensor parallelism over two ranks.

    python benchmarks/bench_moe.py [--hidden 1024] [--intermediate 384] [--experts 64] [--top-k 8]
                                   [--batches 1 32] [--repeats 20]

* **grouped**: ``pdserve.engine.models.moe.FusedExperts`` (pairs sorted by expert, one GEMM pair
  per expert that got tokens), one thread on core 0;
* **per-token loop**: each token runs its k experts one by one (a straightforward port);
* **dense**: every expert on every token, weighted by a mostly-zero routing matrix;
* **TP 2 / EP 2**: two gloo ranks on cores 0 and 1, one thread each: TP slices every expert's
  intermediate size, EP gives each rank half the experts whole; both end in one all-reduce.

Random weights and routing (uniform over experts), float32; median of ``--repeats`` forwards
after two warm-ups. Prints milliseconds per layer forward. As in a worker, GEMMs of up to 16 rows
go through pdserve's decode linear kernel where it builds (``--no-kernel``: MKL for all).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F


def _experts(args, tp_group=None, expert_parallel=False):
    from pdserve.engine.models.moe import DOWN, GATE, UP, FusedExperts

    experts = FusedExperts(args.experts, args.hidden, args.intermediate, tp_group, torch.float32, "cpu",
                           expert_parallel)
    gen = torch.Generator().manual_seed(0)
    for e in range(args.experts):  # the full weights, loaded as the checkpoint loader would
        gate, up = (torch.randn(args.intermediate, args.hidden, generator=gen) * 0.02 for _ in range(2))
        down = torch.randn(args.hidden, args.intermediate, generator=gen) * 0.02
        for part, w in ((GATE, gate), (UP, up), (DOWN, down)):
            if experts.holds_shard((e, part)):
                experts.weight_loader(experts.w2_weight if part == DOWN else experts.w13_weight, w, (e, part))
    return experts


def _inputs(args, batch):
    gen = torch.Generator().manual_seed(batch)
    x = torch.randn(batch, args.hidden, generator=gen)
    ids = torch.stack([torch.randperm(args.experts, generator=gen)[:args.top_k] for _ in range(batch)])
    weights = torch.softmax(torch.randn(batch, args.top_k, generator=gen), -1)
    return x, ids, weights


def _time(fn, repeats):
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _per_token(experts, x, ids, weights):
    i = experts.local_intermediate
    y = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[n, j])
            gu = F.linear(x[n:n + 1], experts.w13_weight[e])
            y[n] += weights[n, j] * F.linear(F.silu(gu[:, :i]) * gu[:, i:], experts.w2_weight[e])[0]
    return y


def _dense(experts, x, ids, weights):
    i = experts.local_intermediate
    route = torch.zeros(x.shape[0], experts.num_experts).scatter_(1, ids, weights)  # (N, E), mostly zero
    y = torch.zeros_like(x)
    for e in range(experts.num_experts):
        gu = F.linear(x, experts.w13_weight[e])
        y += route[:, e:e + 1] * F.linear(F.silu(gu[:, :i]) * gu[:, i:], experts.w2_weight[e])
    return y


def _kernel(args) -> str:
    from pdserve.engine.layers import decode_linear

    on = not args.no_kernel and decode_linear.build_kernel()
    return "decode linear kernel for <= 16 rows" if on else "MKL for every GEMM"


def _rank(rank, args, init_file, out_file, expert_parallel):
    import torch.distributed as dist

    _kernel(args)
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        experts = _experts(args, dist.group.WORLD, expert_parallel)
        result = {}
        for batch in args.batches:
            x, ids, weights = _inputs(args, batch)
            dist.barrier()
            result[batch] = _time(lambda: experts(x, ids, weights), args.repeats)
        if rank == 0:
            torch.save(result, out_file)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=384)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no-kernel", action="store_true", help="F.linear (MKL) for every GEMM")
    args = parser.parse_args()
    _kernel(args)

    import torch.multiprocessing as mp

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    experts = _experts(args)
    mib = (experts.w13_weight.nbytes + experts.w2_weight.nbytes) / 2**20
    print(f"MoE layer: hidden {args.hidden}, {args.experts} experts of {args.intermediate}, top {args.top_k}; "
          f"{mib:.0f} MiB of expert weights, float32, {_kernel(args)}")
    rows = {}
    for batch in args.batches:
        x, ids, weights = _inputs(args, batch)
        want = _dense(experts, x, ids, weights)
        torch.testing.assert_close(experts(x, ids, weights), want, atol=1e-4, rtol=1e-4)
        rows[batch] = {
            "grouped (1 core)": _time(lambda: experts(x, ids, weights), args.repeats),
            "per-token loop (1 core)": _time(lambda: _per_token(experts, x, ids, weights), max(3, args.repeats // 4)),
            "dense, all experts (1 core)": _time(lambda: _dense(experts, x, ids, weights), max(3, args.repeats // 4)),
        }
    del experts
    for name, ep in (("TP 2 (2 cores)", False), ("EP 2 (2 cores)", True)):
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.pt")
            mp.spawn(_rank, args=(args, os.path.join(tmp, "init"), out, ep), nprocs=2)
            for batch, ms in torch.load(out).items():
                rows[batch][name] = ms
    names = list(next(iter(rows.values())))
    print("| batch | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for batch, r in rows.items():
        print(f"| {batch} | " + " | ".join(f"{r[n]:.2f} ms" for n in names) + " |")


if __name__ == "__main__":
    main()
