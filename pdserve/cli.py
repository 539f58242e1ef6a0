"""The ``pdserve`` command.

    pdserve up [--model DIR] [--num-prefill N] [--num-decode M] [--colocated] [--host H] [--port P]
               [--num-routers R] [--{prefill,decode}-{tensor,pipeline}-parallel-size K]
    pdserve router  --model DIR [--host H] [--port P] [--zmq-port Z] [--reuse-port --direct-port D --pool-owner URL]
    pdserve prefill --model DIR --router tcp://HOST:Z[,tcp://HOST2:Z2...]
    pdserve decode  --model DIR --router tcp://HOST:Z [--tensor-parallel-size T] [--pipeline-parallel-size P]
    pdserve rank    --model DIR --rank R --master-addr H --master-port M [--cluster-secret S] ...
                    (one rank of a T x P worker)
    pdserve scale   [--router http://HOST:PORT] [--prefill N] [--decode M] [--wait]   (pools of a running cluster)
    pdserve default-model [OUT_DIR]   (the built-in trained model: its path, or a copy at OUT_DIR)
    pdserve tiny-model OUT_DIR [--preset tiny|bench]
    pdserve bench serve [--url URL] [--dataset random|shared-prefix|jsonl] [--request-rate R] ...
    pdserve bench compare [--model DIR] [--systems a,b,...] [--out-dir DIR] ...

``up`` runs a whole local cluster; the others start one part alone, which is
how Ray and Kubernetes start them.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help, with each flag's default appended where its own text does not give it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        return _with_default(action)


def _with_default(action: argparse.Action) -> str:
    text = action.help or ""
    default = action.default
    shown = not (default is None or isinstance(default, bool) or default in ("", [], argparse.SUPPRESS))
    shown = shown and bool(action.option_strings)
    return f"{text} (default {action.default})" if shown and "default" not in text else text


def flag_table(parser: argparse.ArgumentParser) -> str:
    """``parser``'s flags as a Markdown table (flag | meaning, default included): what README.md shows
    for ``pdserve up`` and ``pdserve flags`` prints. Every flag has help (tests/test_cli.py checks)."""
    rows = ["| flag | meaning |", "|---|---|"]
    for action in parser._actions:
        if not action.option_strings or action.help == argparse.SUPPRESS or "-h" in action.option_strings:
            continue
        flags = " / ".join(f"`{o}`" for o in action.option_strings)
        rows.append(f"| {flags} | {_with_default(action).replace('|', '/')} |")
    return "\n".join(rows) + "\n"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s")


def _cmd_up(args: argparse.Namespace, extra: list[str]) -> int:
    from pdserve.common.auth import API_KEY_ENV, from_env
    from pdserve.cluster.launcher import run_cluster
    from pdserve.cluster.spec import ClusterSpec
    from pdserve.router.config import lora_args, routing_args, tracing_args
    from pdserve.default_model.train import shipped_model_dir

    model = args.model
    if model is None:
        model = str(shipped_model_dir())
        print(f"pdserve: no --model given; using the built-in default model (a small Llama trained on "
              f"Python's standard library) at {model}", flush=True)
    if (refused := _unsupported_model(model)) is not None:
        print(f"pdserve: error: {refused}", file=sys.stderr)
        return 2
    num_prefill = 1 if args.num_prefill is None else args.num_prefill
    if args.colocated:
        if num_prefill and args.num_prefill is not None:
            print("pdserve: --colocated runs no prefill workers; drop --num-prefill", file=sys.stderr)
            return 2
        num_prefill = 0
    if args.core_lending and (args.ray or not num_prefill):
        print("pdserve: --core-lending lends a local prefill worker's idle cores to a decode worker on the same "
              "machine: it needs prefill workers and no --ray", file=sys.stderr)
        return 2
    if args.otlp_traces_endpoint:  # the router would refuse to start: say why here
        from pdserve.router.tracing import check_otel_installed

        try:
            check_otel_installed()
        except ValueError as e:
            print(f"pdserve: {e}", file=sys.stderr)
            return 2
    router_args, worker_args = routing_args(args) + lora_args(args) + tracing_args(args), list(extra)
    if args.enable_lora:  # the workers apply the adapters; --max-loras and the like reach them as extra flags
        worker_args += ["--enable-lora", "--max-lora-rank", str(args.max_lora_rank)]
    if args.cluster_secret:
        router_args += ["--cluster-secret", args.cluster_secret]
        worker_args += ["--cluster-secret", args.cluster_secret]
    spec = ClusterSpec(model=model, num_prefill=num_prefill, num_decode=args.num_decode, host=args.host,
                       port=args.port, zmq_port=args.zmq_port, worker_args=worker_args, router_args=router_args,
                       api_key=from_env(args.api_key, API_KEY_ENV), max_restarts=args.max_restarts,
                       threads_per_worker=args.threads_per_worker, num_routers=args.num_routers,
                       core_lending=args.core_lending, **pool_parallel_sizes(args))
    on_up = None
    if args.autoscale:
        from pdserve.sizing.commands import make_autoscaler

        try:
            autoscaler = make_autoscaler(args, f"http://{'127.0.0.1' if args.host == '0.0.0.0' else args.host}:"
                                               f"{args.port}", spec.api_key, colocated=num_prefill == 0)
        except (ValueError, OSError) as e:
            print(f"pdserve: --autoscale: {e}", file=sys.stderr)
            return 2

        def on_up():
            _, stop = autoscaler.start()
            return stop.set
    if args.ray:
        from pdserve.cluster.supervisor import serve_until_stopped
        from pdserve.cluster.ray_launcher import RayCluster

        return serve_until_stopped(RayCluster(spec, address=args.address,
                                              prefill_resources=json.loads(args.prefill_resources or "{}"),
                                              decode_resources=json.loads(args.decode_resources or "{}")),
                                   on_up=on_up)
    _exit_now(run_cluster(spec, on_up=on_up))  # every process it started is stopped by now
    return 0  # not reached


def pool_parallel_sizes(args: argparse.Namespace) -> dict[str, int]:
    """``pdserve up``'s parallel flags as ClusterSpec fields: a pool's own flag wins over the shared one."""
    sizes = {}
    for role in ("prefill", "decode"):
        for kind in ("tensor", "pipeline"):
            value = getattr(args, f"{role}_{kind}_parallel_size")
            sizes[f"{role}_{kind}_parallel_size"] = value or getattr(args, f"{kind}_parallel_size") or 1
    return sizes


def _unsupported_model(model_dir: str) -> str | None:
    """Why pdserve cannot serve the checkpoint at ``model_dir`` (one line), or None."""
    from pdserve.engine.models import UnsupportedArchitecture, check_model_dir

    try:
        check_model_dir(model_dir)
    except UnsupportedArchitecture as e:
        return str(e)
    return None


def _cmd_router(args: argparse.Namespace) -> int:
    from pdserve.router.config import RouterConfig
    from pdserve.router.server import run_router

    try:
        config = RouterConfig.from_cli_args(args)
    except ValueError as e:  # e.g. --otlp-traces-endpoint without the OpenTelemetry packages
        print(f"pdserve router: error: {e}", file=sys.stderr)
        return 2
    run_router(config)
    _exit_now(0)
    return 0  # not reached


def _exit_now(code: int) -> None:
    """Leave a router, worker or rank process once it has shut down cleanly, skipping interpreter teardown.

    Its sockets are closed and its messages sent by now; what teardown would add is C++ static
    destruction, which aborts the process ("terminate called without an active exception", exit -6)
    while a gloo thread is still connecting a KV pair or a group, and a launcher would then see a
    failure where there was a clean exit; and for a router, ~0.9 s of CPU freeing what the tokenizer,
    torch and uvicorn hold (two thirds of a stopped router's exit on a 2-core Xeon). ``pdserve up`` (local
    processes) leaves the same way once it has stopped them.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    logging.shutdown()
    os._exit(code)


def _cmd_rank(args: argparse.Namespace) -> int:
    from pdserve.common.auth import CLUSTER_SECRET_ENV, from_env
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.execution.ranks import serve_rank

    secret = from_env(args.cluster_secret, CLUSTER_SECRET_ENV)
    _exit_now(serve_rank(EngineConfig.from_cli_args(args), cluster_secret=secret))
    return 0  # not reached


def _cmd_worker(role: str, args: argparse.Namespace) -> int:
    from pdserve.common.config import WorkerConfig
    from pdserve.engine.config import EngineConfig

    engine_config = EngineConfig.from_cli_args(args, role)
    if (refused := _unsupported_model(engine_config.model)) is not None:
        print(f"pdserve {role}: error: {refused}", file=sys.stderr)
        return 2
    if engine_config.rank != 0:  # a rank of a multi-rank worker started by hand (or by Ray / Kubernetes)
        return _cmd_rank(args)
    worker_config = WorkerConfig.from_cli_args(role, args)
    if worker_config.cluster_secret:  # the ranks this driver starts inherit it (never on their command line)
        from pdserve.common.auth import CLUSTER_SECRET_ENV

        os.environ[CLUSTER_SECRET_ENV] = worker_config.cluster_secret
    if role == "prefill":
        from pdserve.prefill_worker.worker import PrefillWorker as Worker
    else:
        from pdserve.decode_worker.worker import DecodeWorker as Worker
    Worker(engine_config, worker_config).run()
    _exit_now(0)
    return 0  # not reached


def _cmd_scale(args: argparse.Namespace) -> int:
    from pdserve.common.auth import API_KEY_ENV, from_env
    from pdserve.cluster.scale import print_pools, scale_pools

    try:
        pools = scale_pools(args.router, prefill=args.prefill, decode=args.decode,
                            api_key=from_env(args.api_key, API_KEY_ENV), wait=args.wait, timeout_s=args.timeout)
    except (OSError, RuntimeError, TimeoutError) as e:
        print(f"pdserve scale: {e}", file=sys.stderr)
        return 1
    print_pools(pools)
    return 0


def _cmd_tiny_model(args: argparse.Namespace) -> int:
    from pdserve.default_model.tiny_model import write_tiny_model

    path = write_tiny_model(args.out_dir, preset=args.preset, seed=args.seed)
    print(path)
    return 0


def _cmd_default_model(args: argparse.Namespace) -> int:
    """Print the built-in default model's directory, or copy it to ``args.out_dir`` (for images and
    nodes that serve it from a path of their own) and print that."""
    import shutil

    from pdserve.default_model.train import shipped_model_dir

    path = shipped_model_dir()
    if args.out_dir is not None:
        path = shutil.copytree(path, args.out_dir, dirs_exist_ok=True)
    print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from pdserve.common.config import WorkerConfig
    from pdserve.engine.config import EngineConfig
    from pdserve.router.config import RouterConfig, add_lora_cli_args, add_routing_cli_args, add_tracing_cli_args

    parser = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving.")
    parser.add_argument("--log-level", default="info", help="logging level: debug, info, warning, error")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start a local cluster (router + workers as processes)",
                        description="Any other flag (e.g. --kv-cache-memory 1GiB) is passed to every worker.")
    up.add_argument("--model", default=None,
                    help="checkpoint directory (default: the built-in model trained on Python's standard library)")
    up.add_argument("--num-prefill", type=int, default=None, help="prefill workers (default 1)")
    up.add_argument("--num-decode", type=int, default=1, help="decode workers")
    up.add_argument("--colocated", action="store_true",
                    help="no prefill workers: each worker prefills (chunked, mixed with decode) and decodes, "
                         "the baseline disaggregation is measured against")
    up.add_argument("--host", default="127.0.0.1",
                    help="interface the router's HTTP API binds, with or without --ray (0.0.0.0: every interface, "
                         "for other machines)")
    up.add_argument("--port", type=int, default=8000, help="the router's HTTP port")
    up.add_argument("--zmq-port", type=int, default=None,
                    help="the router's ZMQ port, where workers push (default: a free one)")
    up.add_argument("--num-routers", type=int, default=1,
                    help="routers serving the one worker pool (a router tier): they share --port (SO_REUSEPORT), "
                         "each has its own ZMQ port, every worker registers with all of them, and a router's "
                         "death loses only its own requests (it is restarted)")
    up.add_argument("--threads-per-worker", type=int, default=None, help="torch CPU threads per worker rank")
    up.add_argument("--core-lending", action="store_true",
                    help="a decode worker runs its steps on a prefill worker's cores too while that worker is idle "
                         "(local clusters, single-rank workers on cores of their own; docs/architecture.md)")
    up.add_argument("--ray", action="store_true",
                    help="run every process as a Ray actor, each worker's ranks in one placement group")
    up.add_argument("--address", default=None, help="with --ray: the Ray cluster to join (auto, HOST:PORT); "
                                                    "default: start a local one")
    up.add_argument("--prefill-resources", default=None,
                    help='with --ray: JSON resources every prefill rank asks for, e.g. \'{"prefill_node": 1}\'')
    up.add_argument("--decode-resources", default=None, help="with --ray: the same for decode ranks")
    up.add_argument("--max-restarts", type=int, default=5,
                    help="restart a failed worker (backoff 1, 2, 4.. s) at most this many times in a row")
    up.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY on /v1/* "
                                                    "(or set $PDSERVE_API_KEY)")
    up.add_argument("--cluster-secret", default=None, help="secret the workers prove to join the router's pools, "
                                                           "and the key of every ZMQ socket's CurveZMQ "
                                                           "(or set $PDSERVE_CLUSTER_SECRET)")
    for kind in ("tensor", "pipeline"):  # -tp / -pp as the workers spell them: else they would reach the
        # workers as extra flags and the pools' own --{kind}-parallel-size 1 after them would win
        up.add_argument(f"--{kind}-parallel-size", f"-{kind[0]}p", type=int, default=None,
                        help=f"{kind} parallel size of every worker (default 1)")
        for role in ("prefill", "decode"):
            up.add_argument(f"--{role}-{kind}-parallel-size", type=int, default=None,
                            help=f"{kind} parallel size of the {role} workers (overrides --{kind}-parallel-size)")

    from pdserve.sizing.commands import add_autoscale_args, add_plan_args, add_profile_args, add_simulate_args

    add_routing_cli_args(up)
    add_lora_cli_args(up)
    add_tracing_cli_args(up)
    RouterConfig.add_cli_args(sub.add_parser("router", help="start the router alone"))
    rank = sub.add_parser("rank", help="run one non-driver rank of a tensor/pipeline-parallel engine",
                          description="Joins the driver at --master-addr:--master-port and runs the steps it "
                                      "broadcasts. Drivers start these themselves unless given a rendezvous.")
    EngineConfig.add_cli_args(rank)
    rank.add_argument("--cluster-secret", default=None,
                      help="the cluster's secret, for the CURVE keys of the rank's reports to its driver "
                           "(default: $PDSERVE_CLUSTER_SECRET)")
    for role in ("prefill", "decode"):
        p = sub.add_parser(role, help=f"start one {role} worker")
        EngineConfig.add_cli_args(p)
        WorkerConfig.add_cli_args(p)

    scale = sub.add_parser("scale", help="grow or shrink the pools of a running cluster",
                           description="Sets each pool's target size at the router. A shrinking pool's surplus "
                                       "workers are drained (no request fails); pdserve up / up --ray start "
                                       "workers for a growing one. Without --prefill/--decode: list the pools.")
    scale.add_argument("--router", default="http://127.0.0.1:8000", help="the router's HTTP address")
    scale.add_argument("--prefill", type=int, default=None, help="target number of prefill workers")
    scale.add_argument("--decode", type=int, default=None, help="target number of decode workers")
    scale.add_argument("--api-key", default=None, help="the router's API key (or set $PDSERVE_API_KEY)")
    scale.add_argument("--wait", action="store_true", help="wait until every pool serves exactly its target")
    scale.add_argument("--timeout", type=float, default=300.0, help="with --wait: give up after this many seconds")

    default = sub.add_parser("default-model", help="print the built-in trained model's directory, or copy it")
    default.add_argument("out_dir", nargs="?", default=None, help="copy the checkpoint here (created if missing)")

    tiny = sub.add_parser("tiny-model", help="write a deterministic random-weight Llama checkpoint")
    tiny.add_argument("out_dir")
    tiny.add_argument("--preset", default="tiny", choices=["tiny", "bench"],
                      help="tiny: the tests' 2-layer model; bench: ~100M parameters")
    tiny.add_argument("--seed", type=int, default=0, help="seed of the random weights")

    from pdserve.bench.commands import add_compare_args, add_serve_args

    bench = sub.add_parser("bench", help="serving benchmarks (serve: load one server; compare: several systems)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    add_serve_args(bench_sub.add_parser(
        "serve", help="load an OpenAI-compatible server and report throughput, TTFT/TPOT/ITL/E2EL, goodput",
        description="Streams /v1/completions requests (greedy, EOS ignored) at a rate or all at once."))
    add_compare_args(bench_sub.add_parser(
        "compare", help="one workload against pdserve (disagg, colocated), vLLM, transformers serve, HF generate",
        description="Writes results.json, results.md and plots to --out-dir."))

    add_autoscale_args(up, standalone=False)
    add_autoscale_args(sub.add_parser(
        "autoscale", help="size a running cluster's pools from its live load and a profile (SLA autoscaler)",
        description="Reads the router's /metrics every interval and sets the pools' targets through "
                    "/admin/scale: beside pdserve up --ray, Kubernetes, or any cluster."), standalone=True)
    add_profile_args(sub.add_parser(
        "profile", help="measure real workers (prefill, decode, KV transfer) into a profile for simulate and plan",
        description="Any other flag (e.g. --kv-cache-memory 1GiB) is a worker flag, as with pdserve up."))
    add_simulate_args(sub.add_parser(
        "simulate", help="simulate a cluster on a workload from a profile: TTFT/TPOT/ITL/E2EL, goodput, usage",
        description="Runs pdserve's own scheduler, block manager and routing with the profile's step times."))
    add_plan_args(sub.add_parser(
        "plan", help="the prefill/decode split that serves the most load within SLOs (simulated)",
        description="DistServe's placement search over pdserve simulate."))
    flags = sub.add_parser("flags", help="print a command's flags as a Markdown table (README's tables)")
    flags.add_argument("of", choices=[c for c in _subcommands(parser) if c != "bench"], help="the command")
    for sub_parser in [parser, *_subcommands(parser).values(), *_subcommands(bench).values()]:
        sub_parser.formatter_class = HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("up", "profile"):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _setup_logging(args.log_level)
    if args.command in _SERVING_COMMANDS:
        _stop_cleanly_while_starting(args.command)
    return _run(parser, args, extra)


_SERVING_COMMANDS = ("up", "router", "prefill", "decode", "rank")


def _stop_cleanly_while_starting(command: str) -> None:
    """Until the command installs its own stop (the launcher's, uvicorn's, a worker's), SIGINT and SIGTERM end
    this process at once with one line and exit status 0: it is still importing or loading, with nothing to
    drain. Not a KeyboardInterrupt: raised inside a library's import it can leave the module half-made and
    surface as another error with a traceback (numpy's lazy ``dtypes`` recursed to a RecursionError)."""
    def stop(signum, frame):
        print(f"pdserve {command}: stopped", file=sys.stderr, flush=True)
        os._exit(0)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace, extra: list[str]) -> int:
    if args.command == "up":
        return _cmd_up(args, extra)
    if args.command == "router":
        return _cmd_router(args)
    if args.command in ("prefill", "decode"):
        return _cmd_worker(args.command, args)
    if args.command == "rank":
        return _cmd_rank(args)
    if args.command == "scale":
        return _cmd_scale(args)
    if args.command == "bench":
        from pdserve.bench.commands import cmd_compare, cmd_serve

        return cmd_serve(args) if args.bench_command == "serve" else cmd_compare(args)
    if args.command in ("profile", "simulate", "plan", "autoscale"):
        from pdserve.sizing import commands

        if args.command == "profile":
            return commands.cmd_profile(args, extra)
        if args.command == "autoscale":
            return commands.cmd_autoscale(args)
        return commands.cmd_simulate(args) if args.command == "simulate" else commands.cmd_plan(args)
    if args.command == "default-model":
        return _cmd_default_model(args)
    if args.command == "flags":
        print(flag_table(_subcommands(parser)[args.of]), end="")
        return 0
    return _cmd_tiny_model(args)


if __name__ == "__main__":
    sys.exit(main())
