"""Routing benchmark: prefix-cache hit rate and throughput per ``--routing-policy``.

For each policy, starts a fresh local cluster (router + ``--num-decode`` decode
workers, colocated: no prefill workers, each decode worker prefills its own
prompts with chunked prefill, which is what fits on a 2-core machine), sends the
same shared-prefix workload and reads the workers' prefix-cache counters from
the router's ``/metrics`` (``vllm:prefix_cache_hits`` / ``vllm:prefix_cache_queries``,
in prompt tokens). A fresh cluster per policy, so every policy starts with cold caches.

Workload: ``--num-groups`` groups (think: system prompts or few-shot templates),
each ``--requests-per-group`` requests of the group's own ``--prefix-len``-token
prefix plus a random suffix (``pdserve.bench``'s ``shared-prefix`` dataset, one
per group, seeded), in a seeded random order, at most ``--max-concurrency`` in
flight. Each worker's KV cache is ``--num-kv-blocks`` blocks: enough for its
running requests and a share of the prefixes, not for every prefix, so where a
prefix is sent decides whether it is still cached.

    python benchmarks/bench_routing.py                        # the figures in docs/benchmarks.md
    python benchmarks/bench_routing.py --policies prefix_aware --num-groups 4   # quick

``--workload multi-turn`` (issue 39): ``--num-conversations`` chats of ``--turns`` turns behind one
shared ``--system-len``-token system prompt; each turn's prompt is the whole conversation so far (the
earlier prompts, a stand-in for each reply of ``--reply-len`` tokens, and a new user message of
``--min-suffix``..``--max-suffix`` tokens). Rounds, each in its own seeded order: every conversation's
turn 1, then every turn 2, ..., each half of a round's order a shuffle of the same half of the round
before, so a conversation comes back more than half a round (``--num-conversations`` / 2 requests,
keep ``--max-concurrency`` at most that) after its previous turn, and the hot context (every conversation's
latest prompt) is sized to exceed one worker's KV cache. The ceiling is the hit rate of a cache that
never evicts: each turn can reuse the full blocks of the turn before it (the model's real reply is
not the stand-in, so its blocks never match).

    python benchmarks/bench_routing.py --workload multi-turn --num-decode 2 --num-kv-blocks 512

A worker that lacks a prefix another holds pulls it (the router's ``kv_pull``): the holder serves the
prefill from its cache, so its hit counts, and the puller's lookup counts as a query with no hit; the
hit rate is then under-stated and ``prompt tokens not computed`` (1 - the workers'
``pdserve:prompt_tokens_computed_total`` over the workload's prompt tokens) is the measure of reuse.
``--pull off`` runs each policy without pulls (``--local-prefill-margin-s inf``) for comparison.

Default model: the built-in ``tiny`` preset (random weights), workers eager
(``--enforce-eager``: no compile at start-up), one torch thread each.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import httpx
import psutil

from pdserve.bench import BenchRequest, DatasetConfig, ServeConfig, build_requests, run_benchmark_sync
from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.default_model.tiny_model import ensure_default_model
from pdserve.router.routing import ROUTING_POLICIES


def grouped_workload(num_groups: int, per_group: int, prefix_len: int, min_suffix: int, max_suffix: int,
                     output_len: int, vocab_size: int, seed: int) -> list[BenchRequest]:
    """``num_groups`` shared-prefix datasets (each its own prefix), interleaved in a seeded random order."""
    requests = []
    for g in range(num_groups):
        requests += build_requests(DatasetConfig(
            name="shared-prefix", num_prompts=per_group, prefix_len=prefix_len, min_input=min_suffix,
            max_input=max_suffix, min_output=output_len, max_output=output_len, vocab_size=vocab_size,
            seed=seed * 1000 + g))
    random.Random(seed).shuffle(requests)
    return requests



def multi_turn_workload(num_conversations: int, turns: int, system_len: int, reply_len: int, min_user: int,
                        max_user: int, output_len: int, vocab_size: int, seed: int,
                        block_size: int = 16) -> tuple[list[BenchRequest], float]:
    """Conversations in rounds (every conversation's turn 1, then every turn 2, ...), and the ceiling
    hit rate (prompt tokens in full blocks of each conversation's previous turn / all prompt tokens)."""
    rng = random.Random(seed)
    low = min(10, vocab_size - 1)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(low, vocab_size) for _ in range(n)]

    system = tokens(system_len)
    history = [list(system) for _ in range(num_conversations)]
    requests, reusable, total = [], 0, 0
    order = list(range(num_conversations))
    half = num_conversations // 2
    for turn in range(turns):
        # each round in its own order (a fixed one would let round robin stay sticky), each half of the last
        # round's order shuffled in place: a conversation's next turn comes more than half a round later
        first, second = order[:half], order[half:]
        rng.shuffle(first)
        rng.shuffle(second)
        order = first + second
        for c in order:
            prev = len(history[c]) if turn else 0
            if turn:
                history[c] += tokens(reply_len)
            history[c] += tokens(rng.randint(min_user, max_user))
            requests.append(BenchRequest(prompt=list(history[c]), output_len=output_len))
            reusable += (prev // block_size) * block_size if turn else (system_len // block_size) * block_size * (c != order[0])
            total += len(history[c])
    return requests, reusable / total


def metric_totals(url: str) -> dict[str, float]:
    """Each Prometheus sample of ``/metrics`` summed over its label sets (by sample name)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for sample in family.samples:
            key = sample.name
            if sample.name == "pdserve:routing_decisions_total":
                key = f"{sample.name}:{sample.labels['role']}:{sample.labels['decision']}"
            totals[key] = totals.get(key, 0.0) + sample.value
    return totals


def worker_cpu_s(procs: list[psutil.Process]) -> float:
    """CPU seconds (user + system) the worker processes have used: the work done, whatever else
    shares the machine (wall-clock throughput on a shared machine is not)."""
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


def run_policy(policy: str, balance_factor: float | None, args, model_dir: str, block_bytes: int,
               workload: list[BenchRequest], offload_blocks: int = 0, pull: bool = True) -> dict:
    spec = ClusterSpec(model=model_dir, num_prefill=0, num_decode=args.num_decode, port=free_port(),
                       threads_per_worker=1,
                       worker_args=["--kv-cache-memory", str(args.num_kv_blocks * block_bytes),
                                    "--kv-offload-memory", str(offload_blocks * block_bytes),
                                    "--max-num-seqs", str(args.max_concurrency), "--enforce-eager"],
                       router_args=["--routing-policy", policy, "--routing-prefix-blocks",
                                    str(args.routing_prefix_blocks),
                                    *(["--routing-balance-factor", str(balance_factor)] if balance_factor else []),
                                    *([] if pull else ["--local-prefill-margin-s", "inf"])])
    name = os.path.basename(model_dir.rstrip("/"))
    with LocalCluster(spec, log_dir=os.environ.get("PDSERVE_BENCH_LOGS")) as cluster:
        workers = [psutil.Process(proc.pid) for name_, proc in cluster.procs if name_ != "router"]
        before = metric_totals(cluster.url)
        cpu_before = worker_cpu_s(workers)
        res = run_benchmark_sync(ServeConfig(url=cluster.url, model=name, max_concurrency=args.max_concurrency,
                                             percentiles=[50, 90, 99], disable_tqdm=True), workload)
        cpu_s = worker_cpu_s(workers) - cpu_before
        time.sleep(2.5)  # a heartbeat or two, so the workers' counters are current
        after = metric_totals(cluster.url)
        routed = sorted(w["num_routed"] for w in httpx.get(f"{cluster.url}/workers", timeout=10).json())
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    m = res.metrics
    hits, queries = delta.get("vllm:prefix_cache_hits_total", 0.0), delta.get("vllm:prefix_cache_queries_total", 0.0)
    decisions = {k.split(":", 3)[-1]: int(v) for k, v in delta.items()
                 if k.startswith("pdserve:routing_decisions_total:decode:") and v}
    return {"policy": policy, "balance_factor": balance_factor, "offload_blocks": offload_blocks,
            "hit_rate": hits / max(queries, 1.0), "onload_blocks": delta.get("pdserve:kv_onload_blocks_total", 0.0),
            "hits": hits, "queries": queries,
            "output_throughput": m["output_throughput"], "request_throughput": m["request_throughput"],
            "p50_ttft_ms": m["p50_ttft_ms"], "p90_ttft_ms": m["p90_ttft_ms"], "p99_ttft_ms": m.get("p99_ttft_ms"),
            "duration_s": m["duration"],
            "failed": m["failed"], "preemptions": delta.get("vllm:num_preemptions_total", 0.0),
            "routed_per_worker": routed, "decisions": decisions, "worker_cpu_s": cpu_s,
            "computed": delta.get("pdserve:prompt_tokens_computed_total", 0.0),
            "pulls": int(delta.get("pdserve:routing_decisions_total:prefill:kv_pull", 0.0))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the built-in tiny preset)")
    ap.add_argument("--workload", choices=("shared-prefix", "multi-turn"), default="shared-prefix")
    ap.add_argument("--num-conversations", type=int, default=32, help="multi-turn: conversations")
    ap.add_argument("--turns", type=int, default=8, help="multi-turn: turns per conversation")
    ap.add_argument("--system-len", type=int, default=64, help="multi-turn: the shared system prompt's tokens")
    ap.add_argument("--reply-len", type=int, default=16, help="multi-turn: a reply's stand-in tokens per turn")
    ap.add_argument("--policies", nargs="+", default=list(ROUTING_POLICIES), choices=ROUTING_POLICIES)
    ap.add_argument("--num-decode", type=int, default=4)
    ap.add_argument("--num-groups", type=int, default=16)
    ap.add_argument("--requests-per-group", type=int, default=12)
    ap.add_argument("--prefix-len", type=int, default=512)
    ap.add_argument("--min-suffix", type=int, default=16)
    ap.add_argument("--max-suffix", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--num-kv-blocks", type=int, default=256, help="KV cache blocks per decode worker")
    ap.add_argument("--routing-prefix-blocks", type=int, default=4)
    ap.add_argument("--kv-offload-blocks", type=int, nargs="+", default=[0],
                    help="host-memory offload tier per worker, in blocks (--kv-offload-memory); several: one run "
                         "of each policy per value")
    ap.add_argument("--routing-balance-factor", type=float, nargs="+", default=[1.5],
                    help="prefix_aware's bounded-load factor; several: one prefix_aware run per value")
    ap.add_argument("--pull", nargs="+", choices=("on", "off"), default=["on"],
                    help="pulls from a peer (the router's default: on; off: --local-prefill-margin-s inf); several: "
                         "one run of each policy per value")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()

    model_dir = args.model or str(ensure_default_model("tiny"))
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    block_bytes = cfg["num_hidden_layers"] * 2 * 16 * cfg["num_key_value_heads"] * head_dim * 4  # float32, block_size 16
    if args.workload == "multi-turn":
        workload, ceiling = multi_turn_workload(args.num_conversations, args.turns, args.system_len, args.reply_len,
                                                args.min_suffix, args.max_suffix, args.output_len, cfg["vocab_size"],
                                                args.seed)
        hot = sum(len(r.prompt) for r in workload[-args.num_conversations:]) // 16
        what = (f"{args.num_conversations} conversations x {args.turns} turns behind a {args.system_len}-token system "
                f"prompt, user {args.min_suffix}-{args.max_suffix} + reply {args.reply_len} tokens a turn; hot context "
                f"{hot} blocks; ceiling hit rate {ceiling:.1%}")
    else:
        workload = grouped_workload(args.num_groups, args.requests_per_group, args.prefix_len, args.min_suffix,
                                    args.max_suffix, args.output_len, cfg["vocab_size"], args.seed)
        what = (f"{args.num_groups} prefixes of {args.prefix_len} tokens x {args.requests_per_group}, suffix "
                f"{args.min_suffix}-{args.max_suffix}")
    print(f"model {model_dir}; {args.num_decode} decode workers (colocated), {args.num_kv_blocks} KV blocks each; "
          f"{len(workload)} requests: {what}, output {args.output_len}, concurrency {args.max_concurrency}", flush=True)
    results = []
    prompt_tokens = sum(len(r.prompt) for r in workload)
    runs = [(p, f, t, pull) for pull in args.pull for t in args.kv_offload_blocks for p in args.policies
            for f in (args.routing_balance_factor if p == "prefix_aware" else [None])]
    for policy, factor, offload_blocks, pull in runs:
        r = run_policy(policy, factor, args, model_dir, block_bytes, workload, offload_blocks, pull == "on")
        r["pull"] = pull == "on"
        r["reused"] = 1.0 - r["computed"] / prompt_tokens  # prompt tokens no worker computed
        results.append(r)
        label = ((f"{policy} c={factor:g}" if factor else policy) + (f" +host {offload_blocks}" if offload_blocks else "")
                 + ("" if pull == "on" else " no-pull"))
        print(f"{label:18s} prefix-cache hits {r['hit_rate']:6.1%} ({r['hits']:.0f}/{r['queries']:.0f} tokens, "
              f"{r['onload_blocks']:.0f} blocks from host)  prompt tokens not computed {r['reused']:6.1%}  "
              f"pulls {r['pulls']}  "
              f"output {r['output_throughput']:7.1f} tok/s  {r['request_throughput']:5.2f} req/s  "
              f"TTFT p50 {r['p50_ttft_ms']:7.1f} ms p99 {r['p99_ttft_ms']:7.1f} ms  worker CPU {r['worker_cpu_s']:5.1f} s  failed {r['failed']}  "
              f"preemptions {r['preemptions']:.0f}  "
              f"routed per worker {r['routed_per_worker']}  decisions {r['decisions']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
