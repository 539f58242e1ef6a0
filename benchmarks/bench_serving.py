"""Serving benchmark: a local pdserve cluster vs Hugging Face static batching.

Starts a cluster (router + prefill + decode processes) on the ``bench`` preset
(~100M parameters), sends ``--num-requests`` concurrent streaming requests
(prompts 64-512 tokens, outputs 16-256 tokens, EOS ignored so lengths are
exact), and prints output tokens/s, TTFT and ITL percentiles and each worker's
resident memory against model + KV budget. Then runs Hugging Face ``generate``
on the same prompts in static batches of ``--hf-batch-size`` (a batch runs
until its longest request is done, the way static batching works) and prints
its output tokens/s.

    python benchmarks/bench_serving.py                 # defaults as in the issue
    python benchmarks/bench_serving.py --num-requests 8 --max-output 64   # quick

On a 2-core machine the prefill worker is pinned to core 0 and the decode
worker to core 1 (one torch thread each); Hugging Face gets both cores.

The workload, the load generator, the latency metrics and the Hugging Face
baseline are ``pdserve.bench``'s (``pdserve bench serve`` / ``pdserve bench
compare``); this script adds the cluster's own counters and memory.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import httpx
import psutil

from pdserve.bench import BenchRequest, DatasetConfig, ServeConfig, build_requests, run_benchmark_sync
from pdserve.bench.hf_static import hf_static_generate
from pdserve.common.utils import free_port, parse_size
from pdserve.default_model.tiny_model import ensure_default_model
from pdserve.cluster.launcher import ClusterSpec, LocalCluster


def make_workload(n: int, vocab_size: int, seed: int, min_in: int, max_in: int, min_out: int, max_out: int,
                  shared_prefix: int = 0) -> list[BenchRequest]:
    """n requests of random token ids; the first ``shared_prefix`` prompt tokens are common to all."""
    return build_requests(DatasetConfig(name="shared-prefix" if shared_prefix else "random", num_prompts=n,
                                        min_input=min_in, max_input=max_in, min_output=min_out,
                                        max_output=max_out, prefix_len=shared_prefix, vocab_size=vocab_size,
                                        seed=seed))


def percentiles(metrics: dict, name: str) -> str:
    if metrics[f"p50_{name}_ms"] is None:
        return "n/a"
    return "   ".join(f"{p} {metrics[f'{p}_{name}_ms']:8.1f} ms" for p in ("p50", "p90", "p99"))


def run_load(url: str, model: str, workload: list[BenchRequest]):
    """Send every request at once and measure (``pdserve.bench``'s load generator)."""
    return run_benchmark_sync(ServeConfig(url=url, model=model, disable_tqdm=True), workload)


def metric_totals(text: str) -> dict[str, float]:
    """Each Prometheus sample name summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def pin_cluster(cluster: LocalCluster) -> None:
    """Workers round-robin over cores (1P+1D: prefill on 0, decode on 1); the router shares core 0."""
    num_cores = os.cpu_count() or 1
    workers = [proc for name, proc in cluster.procs if name != "router"]
    for i, proc in enumerate(workers):
        os.sched_setaffinity(proc.pid, {i % num_cores})
    os.sched_setaffinity(dict(cluster.procs)["router"].pid, {0})


def memory_report(cluster: LocalCluster, model_bytes: int, kv_bytes: int) -> list[str]:
    lines = []
    for name, proc in cluster.procs:
        if name == "router":
            continue
        rss = psutil.Process(proc.pid).memory_info().rss
        overhead = rss - model_bytes - kv_bytes
        lines.append(f"  {name:10s} RSS {rss / 2**20:7.0f} MiB = model {model_bytes / 2**20:.0f} + KV budget "
                     f"{kv_bytes / 2**20:.0f} + overhead {overhead / 2**20:.0f} MiB")
    return lines


def hf_static_batching(model_dir: str, workload: list[BenchRequest], batch_size: int) -> dict:
    wall_s, _ = hf_static_generate(model_dir, workload, batch_size)
    return {"wall_s": wall_s, "output_tokens": sum(r.output_len for r in workload)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bench preset, created once)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--min-input", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--min-output", type=int, default=16)
    ap.add_argument("--max-output", type=int, default=256)
    ap.add_argument("--num-prefill", type=int, default=1)
    ap.add_argument("--num-decode", type=int, default=1)
    ap.add_argument("--colocated", action="store_true", help="no prefill workers (use with --num-decode 2)")
    ap.add_argument("--shared-prefix", type=int, default=0, help="tokens every prompt starts with")
    ap.add_argument("--no-prefix-caching", action="store_true")
    ap.add_argument("--remote-prefill-threshold", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--hf-batch-size", type=int, default=8)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    model_dir = args.model or str(ensure_default_model("bench"))
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    model_bytes = sum(os.path.getsize(os.path.join(model_dir, n)) for n in os.listdir(model_dir)
                      if n.endswith(".safetensors"))
    kv_bytes = parse_size(args.kv_cache_memory)
    workload = make_workload(args.num_requests, cfg["vocab_size"], args.seed, args.min_input, args.max_input,
                             args.min_output, args.max_output, args.shared_prefix)
    if args.colocated:
        args.num_prefill = 0
    name = os.path.basename(model_dir.rstrip("/"))
    print(f"model {model_dir} ({model_bytes / 2**20:.0f} MiB), {len(workload)} requests, "
          f"prompts {args.min_input}-{args.max_input} tokens, outputs {args.min_output}-{args.max_output} tokens")

    spec = ClusterSpec(model=model_dir, num_prefill=args.num_prefill, num_decode=args.num_decode, port=free_port(),
                       threads_per_worker=1,
                       worker_args=["--kv-cache-memory", args.kv_cache_memory,
                                    "--max-num-seqs", str(max(64, args.num_requests)),
                                    "--remote-prefill-threshold", str(args.remote_prefill_threshold),
                                    *(["--no-prefix-caching"] if args.no_prefix_caching else [])])
    with LocalCluster(spec, log_dir=os.environ.get("PDSERVE_BENCH_LOGS")) as cluster:
        pin_cluster(cluster)
        cluster.wait_decode_steps_compiled()  # steady state: decode steps compiled (they start eager)
        warmup = make_workload(2, cfg["vocab_size"], args.seed + 1, 16, 32, 4, 4)  # shares no prefix
        if args.shared_prefix:  # steady state: the shared prefix (a system prompt) has been seen once
            warmup.append(BenchRequest(workload[0].prompt[:args.shared_prefix] + [11, 12, 13], 4))
        run_load(cluster.url, name, warmup)
        time.sleep(1.5)  # let the warm-up's counters reach the router
        base = metric_totals(httpx.get(f"{cluster.url}/metrics").text)
        res = run_load(cluster.url, name, workload)
        time.sleep(1.5)  # one more heartbeat, so the worker counters are current
        stats = httpx.get(f"{cluster.url}/workers").json()
        metrics = {k: v - base.get(k, 0.0)
                   for k, v in metric_totals(httpx.get(f"{cluster.url}/metrics").text).items()}
        mem = memory_report(cluster, model_bytes, kv_bytes)
    m = res.metrics
    tps = m["output_throughput"]
    mode = "colocated" if args.colocated else "disaggregated"
    print(f"\npdserve {mode} ({args.num_prefill}P + {args.num_decode}D, continuous batching, "
          f"prefix caching {'off' if args.no_prefix_caching else 'on'})")
    print(f"  output tokens/s {tps:8.1f}   ({m['total_output_tokens']} tokens in {m['duration']:.1f} s, "
          f"{m['failed']} requests failed)")
    print(f"  TTFT  {percentiles(m, 'ttft')}")
    print(f"  ITL   {percentiles(m, 'itl')}")
    print(f"  E2EL  {percentiles(m, 'e2el')}")
    for w in stats:
        print(f"  {w['role']:7s} {w['id']}: largest step batch {w.get('max_step_batch_size')}, "
              f"steps {w.get('num_steps')}")
    queries = metrics.get("vllm:prefix_cache_queries_total", 0.0)
    hits = metrics.get("vllm:prefix_cache_hits_total", 0.0)
    print(f"  prefix cache: {hits:.0f} of {queries:.0f} prompt tokens hit ({hits / max(queries, 1):.1%}), "
          f"preemptions {metrics.get('vllm:num_preemptions_total', 0):.0f}")
    print(f"  KV transfer: {metrics.get('pdserve:kv_transfer_bytes_total', 0) / 2 / 2**20:.1f} MiB in "
          f"{metrics.get('pdserve:kv_transfers_total', 0) / 2:.0f} transfers, "
          f"failures {metrics.get('pdserve:kv_transfer_failures_total', 0):.0f}, "
          f"local prefills {metrics.get('pdserve:local_prefills_total', 0):.0f}")
    print("  memory:")
    print("\n".join(mem))
    if not args.skip_hf:
        hf = hf_static_batching(model_dir, workload, args.hf_batch_size)
        hf_tps = hf["output_tokens"] / hf["wall_s"]
        print(f"\nHugging Face generate, static batches of {args.hf_batch_size}")
        print(f"  output tokens/s {hf_tps:8.1f}   ({hf['output_tokens']} tokens in {hf['wall_s']:.1f} s)")
        print(f"\ncontinuous / static throughput: {tps / hf_tps:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
