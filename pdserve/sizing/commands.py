"""Command-line flags and entry points of ``pdserve profile``, ``pdserve simulate`` and ``pdserve plan``.

Imports nothing heavy at module level: ``pdserve --help`` builds these parsers. The workload flags
are ``pdserve bench serve``'s own (``add_dataset_args``, ``add_load_args``), so one workload line
drives a real benchmark and a simulation alike; the routing flags are the router's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time

from pdserve.bench.commands import add_dataset_args, add_load_args, dataset_config_from_args
from pdserve.bench.metrics import format_table, parse_goodput
from pdserve.router.config import add_routing_cli_args


def add_profile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="checkpoint directory (default: the built-in model pdserve up serves)")
    p.add_argument("--out", required=True, help="the profile file to write (JSON)")
    p.add_argument("--kinds", default="prefill,decode,colocated",
                   help="worker kinds to measure, comma-separated: prefill, decode (each on its share of the "
                        "cores, as pdserve up places them), colocated (all cores) (default: all three)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per measured point (median; default 5)")
    p.add_argument("--no-transfer", dest="transfer", action="store_false", help="skip the KV transfer measure")
    p.add_argument("--transfer-layouts", nargs="+", default=[], metavar="PREFILL:DECODE",
                   help="measure the KV transfer between these worker layouts too, e.g. tp2pp1:tp1pp1 tp1pp2:tp2pp1 "
                        "(each rank a process; the profiled workers' own pair is always measured), so that pdserve "
                        "plan prices a transfer between layouts profiled apart from a measurement")
    p.add_argument("--no-serving", dest="serving", action="store_false",
                   help="skip measuring the colocated and decode kinds inside a real cluster (router, streaming "
                        "client): the simulator then knows only the engines' own step times")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def add_cluster_args(p: argparse.ArgumentParser, several_profiles: bool = False) -> None:
    """The simulated cluster's flags (shared by simulate and plan; ``several_profiles``: plan's
    ``--profile`` takes one file per layout)."""
    if several_profiles:
        p.add_argument("--profile", required=True, nargs="+",
                       help="profile files (pdserve profile --out), one per layout measured (e.g. one made with "
                            "-tp 1, one with -tp 2): each pool may take any of their layouts")
    else:
        p.add_argument("--profile", required=True, help="the profile file (pdserve profile --out)")
    p.add_argument("--trace", default=None,
                   help="replay this trace instead of a synthetic workload: JSONL (Mooncake's timestamp (ms), "
                        "input_length, output_length, hash_ids; or arrival_s, input_len, output_len) or an Azure "
                        "CSV (TIMESTAMP, ContextTokens, GeneratedTokens)")
    p.add_argument("--trace-block-tokens", type=int, default=512, help="tokens per trace hash id (Mooncake: 512)")
    p.add_argument("--trace-time-scale", type=float, default=1.0, help="divide the trace's arrival times by this")
    p.add_argument("--machine-cores", type=int, default=None,
                   help="the workers share this many cores, placed as pdserve up places them (default: each "
                        "worker has the cores it was profiled with to itself)")
    p.add_argument("--host-load", choices=["none", "router", "router+client"], default="router",
                   help="with --machine-cores: the processes besides the workers on those cores, whose CPU per "
                        "request and per token (measured by pdserve profile) slows the steps: the router (default), "
                        "the router and a benchmark client on the same machine, or none")
    p.add_argument("--kv-cache-memory", default=None, help="KV cache per worker, e.g. 1GiB (default: as profiled)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="per worker (default: as profiled)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="per worker (default: as profiled)")
    p.add_argument("--no-step-jitter", dest="step_jitter", action="store_false",
                   help="every step exactly the cost model's (default: steps scatter by the profile's measured "
                        "jitter, seeded by --seed)")
    add_routing_cli_args(p)


def add_simulate_args(p: argparse.ArgumentParser) -> None:
    add_cluster_args(p)
    p.add_argument("--prefill", type=int, default=1, help="prefill workers (0: colocated; default 1)")
    p.add_argument("--decode", type=int, default=1, help="decode workers (default 1)")
    p.add_argument("--result-file", default=None,
                   help="write settings and metrics as JSON here (pdserve bench serve's keys, plus \"sim\")")
    add_dataset_args(p)
    add_load_args(p)


def add_plan_args(p: argparse.ArgumentParser) -> None:
    add_cluster_args(p, several_profiles=True)
    p.add_argument("--workers", type=int, required=True,
                   help="devices to split between the pools (a worker of TP x PP ranks holds TP x PP of them; "
                        "with TP-1 workers, the number of workers)")
    p.add_argument("--slo", nargs="+", required=True, metavar="METRIC:MS",
                   help="the SLOs goodput counts, e.g. --slo ttft:500 tpot:50")
    p.add_argument("--attainment", type=float, default=0.9,
                   help="the SLO attainment a rate must keep to count as served (DistServe: 0.9)")
    p.add_argument("--colocated", choices=["yes", "no", "only"], default="yes",
                   help="also try every worker colocated (yes), never (no), or only that (only)")
    p.add_argument("--seeds", type=int, default=2,
                   help="simulated runs pooled at each rate tried, each with its own draw of the workload (seeds "
                        "--seed, --seed+1, ...) and of the step jitter (default 2; 1 for the fastest plan)")
    p.add_argument("--min-duration", type=float, default=10.0,
                   help="seconds of arrivals each simulated run spans at least: at a rate r a synthetic workload has "
                        "max(--num-prompts, r x this) requests, so a high rate is a steady load, not a burst of "
                        "--num-prompts that ends before queues build (default 10; 0: --num-prompts always)")
    p.add_argument("--jobs", type=int, default=None,
                   help="candidates simulated at once, a process each (default: one per core this process may use; "
                        "the plan is the same for any count)")
    p.add_argument("--result-file", default=None, help="write every alternative tried as JSON here")
    add_dataset_args(p)
    add_load_args(p)


def add_autoscale_args(p: argparse.ArgumentParser, standalone: bool) -> None:
    """The SLA autoscaler's flags: ``pdserve autoscale`` (``standalone``: it names the router) and
    ``pdserve up --autoscale``."""
    g = p.add_argument_group("SLA autoscaler")
    if standalone:
        g.add_argument("--router", default="http://127.0.0.1:8000", help="the router's HTTP address")
        g.add_argument("--kubernetes", action="store_true",
                       help="set the pools as the replicas of Deployments pdserve-prefill and pdserve-decode "
                            "(kubectl scale; the routers run --pool-owner none), not through the router; delete "
                            "k8s/base/autoscaling.yaml's HPAs first")
        g.add_argument("--namespace", default="default", help="with --kubernetes: the Deployments' namespace")
        g.add_argument("--api-key", default=None, help="the router's API key (or set $PDSERVE_API_KEY)")
        g.add_argument("--profile", required=True, help="the workers' profile (pdserve profile --out)")
        g.add_argument("--slo", nargs="+", required=True, metavar="METRIC:MS",
                       help="the SLOs to size for, e.g. --slo ttft:500 tpot:50")
    else:
        g.add_argument("--autoscale", action="store_true",
                       help="size the pools from the live load every --autoscale-interval (needs --profile, --slo)")
        g.add_argument("--profile", default=None, help="with --autoscale: the workers' profile (pdserve profile)")
        g.add_argument("--slo", nargs="+", default=None, metavar="METRIC:MS",
                       help="with --autoscale: the SLOs to size for, e.g. --slo ttft:500 tpot:50")
    g.add_argument("--autoscale-interval", type=float, default=10.0, help="seconds between decisions (default 10)")
    g.add_argument("--max-prefill", type=int, default=8, help="most prefill workers the autoscaler asks for")
    g.add_argument("--max-decode", type=int, default=8, help="most decode workers the autoscaler asks for")
    g.add_argument("--min-decode", type=int, default=1, help="fewest decode workers (default 1)")
    g.add_argument("--scale-down-intervals", type=int, default=3,
                   help="shrink a pool only after this many intervals in a row wanted fewer (default 3)")


def make_autoscaler(args: argparse.Namespace, router: str, api_key: str | None, colocated: bool):
    """The ``Autoscaler`` the flags describe, sizing from the profile. Raises ValueError / OSError."""
    from pdserve.cluster.autoscaler import Autoscaler, KubectlPools
    from pdserve.sizing.profile import load_profile
    from pdserve.sizing.sizer import ProfileSizer

    if not args.profile or not args.slo:
        raise ValueError("the autoscaler needs --profile and --slo")
    slos = parse_goodput(args.slo)
    sizer = ProfileSizer(load_profile(args.profile), slos, colocated=colocated)
    return Autoscaler(router, sizer, slos, interval_s=args.autoscale_interval, min_prefill=0 if colocated else 1,
                      max_prefill=0 if colocated else args.max_prefill, min_decode=args.min_decode,
                      max_decode=args.max_decode, scale_down_intervals=args.scale_down_intervals, api_key=api_key,
                      on_interval=lambda interval: print(interval.line(), flush=True),
                      pools=KubectlPools(args.namespace) if getattr(args, "kubernetes", False) else None)


def cmd_autoscale(args: argparse.Namespace) -> int:
    """``pdserve autoscale``: the controller beside any cluster (Ray, Kubernetes) whose router it can reach."""
    import threading

    from pdserve.cluster.scale import admin_request
    from pdserve.common.auth import API_KEY_ENV, from_env

    api_key = from_env(args.api_key, API_KEY_ENV)
    try:
        pools = admin_request(args.router, "/admin/pools", api_key)
        colocated = pools["prefill"]["num_serving"] == 0 and not pools["prefill"].get("desired")
        autoscaler = make_autoscaler(args, args.router, api_key, colocated)
        autoscaler.pools.read()  # kubectl or the router answers before the loop starts
    except (ValueError, OSError, RuntimeError) as e:
        print(f"pdserve autoscale: {e}", file=sys.stderr)
        return 1
    stop = threading.Event()
    try:
        autoscaler.run(stop)
    except KeyboardInterrupt:
        pass
    return 0


def _workload(args, vocab_size: int | None = None):
    from pdserve.sizing.workload import synthetic, trace

    if args.trace:
        return trace(args.trace, args.num_prompts, args.trace_block_tokens, args.trace_time_scale)
    return synthetic(dataset_config_from_args(args, vocab_size), args.request_rate, args.burstiness)


def sim_config_from_args(args, num_prefill: int, num_decode: int):
    from pdserve.common.utils import parse_size
    from pdserve.sizing.simulator import SimConfig

    return SimConfig(num_prefill=num_prefill, num_decode=num_decode, routing_policy=args.routing_policy,
                     routing_prefix_blocks=args.routing_prefix_blocks,
                     routing_balance_factor=args.routing_balance_factor,
                     local_prefill_margin_s=args.local_prefill_margin_s,
                     local_prefill_margin_per_request_s=args.local_prefill_margin_per_request_s,
                     machine_cores=args.machine_cores,
                     kv_cache_memory=parse_size(args.kv_cache_memory) if args.kv_cache_memory else None,
                     max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                     step_jitter=args.step_jitter, seed=args.seed, host_load=args.host_load)


def _check_load_flags(args) -> None:
    if args.max_concurrency is not None:
        raise ValueError("the simulator replays open-loop arrivals: --max-concurrency is not simulated")


def cmd_profile(args: argparse.Namespace, worker_flags: list[str]) -> int:
    from pdserve.default_model.train import shipped_model_dir
    from pdserve.sizing.profiler import run_profile
    from pdserve.sizing.transfer_profiler import parse_layout_pair

    model = args.model or str(shipped_model_dir())
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    try:
        layouts = [parse_layout_pair(text) for text in args.transfer_layouts]
        profile = run_profile(model, args.out, kinds, worker_flags, repeats=args.repeats, transfer=args.transfer,
                              serving=args.serving, disable_tqdm=args.disable_tqdm, transfer_layouts=layouts)
    except (ValueError, RuntimeError) as e:
        print(f"pdserve profile: {e}", file=sys.stderr)
        return 1
    machine = profile.machine
    print(f"wrote {args.out}: {', '.join(profile.workers)} on {machine.get('cpu', '?')} ({machine.get('isa', '?')}, "
          f"{machine.get('cores')} cores) in {profile.profile_seconds:.0f} s")
    for t in (profile.transfer, *profile.transfers):
        if t is not None:
            print(f"KV transfer {t.prefill_layout} -> {t.decode_layout}: " + ", ".join(
                f"{b / 2**20:.1f} MiB {1000 * s:.1f} ms" for b, s in zip(t.bytes, t.seconds)))
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from pdserve.sizing.profile import load_profile
    from pdserve.sizing.simulator import Simulator

    try:
        _check_load_flags(args)
        slos = parse_goodput(args.goodput)
        profile = load_profile(args.profile)
        config = sim_config_from_args(args, args.prefill, args.decode)
        workload = _workload(args)
        bar = tqdm(total=args.num_prompts, desc="simulated requests", disable=args.disable_tqdm)
        done = [0]

        def progress(n: int) -> None:
            bar.update(n - done[0])
            done[0] = n

        result = Simulator(profile, config, on_progress=progress).run(workload, args.percentiles, slos or None)
        bar.update(result.metrics["completed"] - done[0])
        bar.close()
    except (ValueError, OSError, RuntimeError) as e:
        print(f"pdserve simulate: {e}", file=sys.stderr)
        return 1
    settings = {"date": time.strftime("%Y%m%d-%H%M%S"), "backend": "pdserve-simulate", "model": profile.model,
                "num_prompts": result.metrics["completed"],
                "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
                "burstiness": args.burstiness, "max_concurrency": None, "seed": args.seed,
                "goodput_slos_ms": slos or None, "percentiles": args.percentiles,
                "dataset": {"trace": args.trace} if args.trace else dataclasses.asdict(dataset_config_from_args(args)),
                "profile": args.profile, "num_prefill": args.prefill, "num_decode": args.decode,
                "routing_policy": args.routing_policy, "machine_cores": args.machine_cores,
                "host_load": args.host_load if args.machine_cores else None}
    header = {"Profile:": args.profile, "Pools (P+D):": f"{args.prefill}+{args.decode}",
              "Request rate (req/s):": settings["request_rate"]}
    print(format_table(result.metrics, args.percentiles, title="Simulated Serving Result", header=header))
    sim = result.sim
    for name, pool in sim["pools"].items():
        print(f"{name} pool: {pool['num_workers']} workers, {100 * pool['utilization']:.1f}% busy, "
              f"{pool['num_preemptions']} preemptions, peak KV usage {100 * sim['max_kv_usage'][name]:.1f}%")
    print(f"simulated {sim['simulated_seconds']:.1f} s in {sim['wall_seconds']:.1f} s ({sim['num_events']} events)")
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump({**settings, **result.metrics, "errors": [], "sim": sim}, f, indent=2)
            f.write("\n")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.sizing.planner import plan, format_plan
    from pdserve.sizing.profile import load_profile

    try:
        _check_load_flags(args)
        slos = parse_goodput(args.slo)
        profiles = [load_profile(path) for path in args.profile]
        result = plan(profiles, lambda p, d: sim_config_from_args(args, p, d),
                      lambda rate, k: _workload_at(args, rate, k), args.workers, slos, attainment=args.attainment,
                      colocated=args.colocated,
                      request_rate=None if math.isinf(args.request_rate) else args.request_rate,
                      on_try=None if args.disable_tqdm else lambda line: print(line, flush=True),
                      rate_unit="x the trace's speed" if args.trace else "req/s", seeds=args.seeds, jobs=args.jobs)
    except (ValueError, OSError, RuntimeError) as e:
        print(f"pdserve plan: {e}", file=sys.stderr)
        return 1
    result.update(min_duration_s=args.min_duration, machine_cores=args.machine_cores,
                  host_load=args.host_load if args.machine_cores else None)
    print(format_plan(result))
    if args.result_file:
        with open(args.result_file, "w") as f:
            json.dump(result, f, indent=2)
            f.write("\n")
    return 0


def _workload_at(args, rate: float, k: int = 0):
    """The workload of the flags, arriving at ``rate`` per second (a trace: its times scaled to that rate);
    ``k``: the ``k``-th draw of a synthetic workload (seed ``--seed + k``; a trace is the same every time),
    of at least ``--min-duration`` seconds of arrivals."""
    from pdserve.bench.datasets import DEFAULT_NUM_PROMPTS
    from pdserve.sizing.workload import synthetic, trace

    if args.trace:
        return trace(args.trace, args.num_prompts, args.trace_block_tokens, args.trace_time_scale * rate)
    cfg = dataset_config_from_args(args)
    num_prompts = max(cfg.num_prompts or DEFAULT_NUM_PROMPTS, math.ceil(rate * args.min_duration))
    return synthetic(dataclasses.replace(cfg, seed=cfg.seed + k, num_prompts=num_prompts), rate, args.burstiness)
