"""The router's configuration: one dataclass, validated on construction."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import uuid

from pdserve.common.auth import API_KEY_ENV, CLUSTER_SECRET_ENV, from_env
from pdserve.router.routing import ROUTING_POLICIES
from pdserve.router.tracing import check_otel_installed

# config.json keys that name the context length, in order of preference.
_CONTEXT_LEN_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length")


def read_context_len(model: str) -> int | None:
    """The context length recorded in ``{model}/config.json``, or None if absent."""
    path = os.path.join(model, "config.json")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    for key in _CONTEXT_LEN_KEYS:
        value = cfg.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


# Load-aware prefill placement's price of a local prefill, in seconds (routing.prefers_local_prefill): the
# values every goodput run of 1P+1D in docs/benchmarks.md used (runs F-M on a Zen 5 class EPYC; issue 35's
# AVX2 EPYC, where they lifted SLO attainment at 0.5 req/s from 63% to 81%), so `pdserve up` serves as
# benchmarked. --local-prefill-margin-s inf turns placement off.
DEFAULT_LOCAL_PREFILL_MARGIN_S = 0.1
DEFAULT_LOCAL_PREFILL_MARGIN_PER_REQUEST_S = 0.03


@dataclasses.dataclass
class RouterConfig:
    """Everything the router process needs.

    Attributes:
        model: checkpoint directory (the tokenizer and config.json are read from it).
        served_model_name: the name clients pass as ``model``; default: basename of ``model``.
        host: interface of the HTTP server (and of the ZMQ PULL socket unless ``zmq_host`` is set).
        zmq_host: interface of the ZMQ PULL socket workers push to, where it differs from ``host``
            (``pdserve up --ray``: HTTP where ``--host`` says, ZMQ on the node's address for workers on
            other nodes); None: ``host``.
        port: HTTP port.
        zmq_port: port of the PULL socket workers push to; 0 picks a free one
            (the bound address is then logged and shown by ``GET /info``).
        max_model_len: prompt + completion token limit; default: config.json's
            ``max_position_embeddings``.
        worker_timeout_s: a worker silent for longer than this is dead.
        step_timeout_s: a worker whose heartbeats say its step loop has not moved for
            longer than this is stuck: nothing is routed to it and its requests fail.
        worker_wait_s: a request that finds no decode worker waits this long for one to register
            (a pool being scaled, a worker restarting) before it fails with 503; 0: fail at once. The
            default, 30 s, covers a launcher's restart of a worker (about 8-11 s for the tiny model
            on 2 loaded cores: process start, model load, compiled decode step).
        max_num_waiting_requests: admit a request only while fewer than this many are waiting for
            their first token (None: no bound); past it, 503 with ``Retry-After`` at once.
        max_num_waiting_tokens: the same bound on the prompt tokens of the waiting requests.
        max_request_body_bytes: a request body larger than this (by ``Content-Length``) gets 413.
        request_timeout_s: a request not finished this long after it arrived is aborted at its worker
            (its blocks freed) and answered 504 (a stream: an error event). None: no limit.
        expect_prefill_workers: how many prefill workers the deployment starts; while it is > 0,
            ``/ready`` also waits for a prefill worker (it always waits for a decode worker).
        shutdown_timeout_s: on SIGTERM the router drains: ``/health`` answers 503, new requests get
            503, and in-flight ones may finish for this long before they fail. SIGINT stops at once.
        log_level: uvicorn / logging level name.
        api_key: clients must send ``Authorization: Bearer <api_key>`` on ``/v1/*`` (None: open);
            default ``$PDSERVE_API_KEY``.
        cluster_secret: workers must prove they know it to register, and every ZMQ connection is CurveZMQ
            keyed by it (None: any process may send); default ``$PDSERVE_CLUSTER_SECRET``. See
            ``pdserve.common.auth`` and ``pdserve.common.curve``.
        routing_policy: how a request's workers are picked, one of ``round_robin``,
            ``least_loaded``, ``prefix_aware``, ``kv_aware`` (``pdserve/router/routing.py``). Default
            ``kv_aware``: each worker's KV events say what it caches, a request goes where the least
            of its prompt is left to prefill (its queue included), and bounded loads keep every
            worker within ``routing_balance_factor`` of the average. It won the routing benchmark
            (docs/benchmarks.md, "A KV cache beyond one worker").
        routing_prefix_blocks: prefix_aware: full KV blocks at the start of a prompt that make its key.
        routing_balance_factor: prefix_aware and kv_aware: a worker holding more than this times the
            average requests in flight (rounded up) is skipped; >= 1.
        local_prefill_margin_s: load-aware prefill placement (``routing.prefers_local_prefill``): a
            prompt is prefilled by its decode worker instead of the chosen prefill worker when the
            decode worker is expected to finish it this many seconds sooner, by the prefill queues
            in tokens and each worker's measured prefill speed; ``inf`` turns it off. The margin is
            what a prefill costs the decode worker's running requests (their tokens wait for it): it
            trades their TPOT for this prompt's TTFT. Default ``DEFAULT_LOCAL_PREFILL_MARGIN_S``.
        local_prefill_margin_per_request_s: added to the margin once per request in flight on the
            decode worker (default ``DEFAULT_LOCAL_PREFILL_MARGIN_PER_REQUEST_S``): a local prefill
            delays each of them, so a small batch at light load prefills locally at a short prefill
            queue and a large one near saturation only at a long one.
        enable_lora: serve LoRA adapters as models of their own (``pdserve.router.lora``), with
            ``POST /v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``; the workers need
            ``--enable-lora`` too. lora_modules: ``name=PATH`` adapters served from the start.
            max_lora_rank: adapters of a larger rank are refused (the workers' limit).
        otlp_traces_endpoint: export one OpenTelemetry trace per request (a span per hop of its way
            to the first token, ``pdserve.router.tracing``) over OTLP/HTTP protobuf to this URL, e.g.
            ``http://127.0.0.1:4318/v1/traces`` (vLLM's flag). None: no traces. Needs the ``otel`` extra.
        router_id: this router's name in a router tier (several routers serving one worker pool); it
            starts every request id, so ids never collide across routers. Default: a random one.
        reuse_port: bind the HTTP port with ``SO_REUSEPORT``, so several routers on one host share it
            (the kernel spreads connections over them; one that dies stops getting any).
        direct_port: also serve HTTP on this port, this router alone (the launcher, the other routers
            and operators reach one router of a tier here). None: no such port.
        pool_owner: where the pools' target sizes live (``/admin/scale``): None, this router (a lone
            router, or the tier's designated one); ``http://HOST:PORT``, the designated router, to
            which ``GET /admin/pools`` and ``POST /admin/scale`` are forwarded; ``none``, outside
            pdserve (Kubernetes Deployments' replicas): ``/admin/scale`` answers 409.
    """

    model: str
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_port: int = 8001
    zmq_host: str | None = None
    max_model_len: int | None = None
    worker_timeout_s: float = 10.0
    step_timeout_s: float = 300.0
    worker_wait_s: float = 30.0
    max_num_waiting_requests: int | None = None
    max_num_waiting_tokens: int | None = None
    max_request_body_bytes: int = 16 * 2**20
    request_timeout_s: float | None = None
    shutdown_timeout_s: float = 30.0
    expect_prefill_workers: int = 0
    log_level: str = "info"
    api_key: str | None = None
    cluster_secret: str | None = None
    routing_policy: str = "kv_aware"
    routing_prefix_blocks: int = 4
    routing_balance_factor: float = 1.5
    local_prefill_margin_s: float = DEFAULT_LOCAL_PREFILL_MARGIN_S
    local_prefill_margin_per_request_s: float = DEFAULT_LOCAL_PREFILL_MARGIN_PER_REQUEST_S
    enable_lora: bool = False
    lora_modules: list[str] = dataclasses.field(default_factory=list)
    max_lora_rank: int = 16
    otlp_traces_endpoint: str | None = None
    router_id: str = ""
    reuse_port: bool = False
    direct_port: int | None = None
    pool_owner: str | None = None

    def __post_init__(self) -> None:
        if not os.path.isdir(self.model):
            raise ValueError(f"model must be a checkpoint directory; {self.model!r} is not a directory")
        if not self.served_model_name:
            self.served_model_name = os.path.basename(os.path.normpath(self.model))
        if self.max_model_len is None:
            self.max_model_len = read_context_len(self.model)
            if self.max_model_len is None:
                raise ValueError(f"{self.model}/config.json names no context length "
                                 f"({', '.join(_CONTEXT_LEN_KEYS)}); pass max_model_len")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        for name in ("port", "zmq_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {value}")
        if not self.worker_timeout_s > 0:
            raise ValueError(f"worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        if not self.step_timeout_s > 0:
            raise ValueError(f"step_timeout_s must be > 0, got {self.step_timeout_s}")
        if not self.worker_wait_s >= 0:
            raise ValueError(f"worker_wait_s must be >= 0, got {self.worker_wait_s}")
        for name in ("max_num_waiting_requests", "max_num_waiting_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s}")
        if self.routing_policy not in ROUTING_POLICIES:
            raise ValueError(f"routing_policy must be one of {', '.join(ROUTING_POLICIES)}, "
                             f"got {self.routing_policy!r}")
        if self.routing_prefix_blocks < 1:
            raise ValueError(f"routing_prefix_blocks must be >= 1, got {self.routing_prefix_blocks}")
        if not self.routing_balance_factor >= 1.0:
            raise ValueError(f"routing_balance_factor must be >= 1, got {self.routing_balance_factor}")
        if not self.local_prefill_margin_s >= 0:
            raise ValueError(f"local_prefill_margin_s must be >= 0 (inf: off), got {self.local_prefill_margin_s}")
        if not 0 <= self.local_prefill_margin_per_request_s < math.inf:
            raise ValueError("local_prefill_margin_per_request_s must be >= 0 and finite, got "
                             f"{self.local_prefill_margin_per_request_s}")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules needs enable_lora (--enable-lora)")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.otlp_traces_endpoint is not None:
            if not self.otlp_traces_endpoint.startswith(("http://", "https://")):
                raise ValueError(f"otlp_traces_endpoint must be an http(s) URL (OTLP/HTTP), e.g. "
                                 f"http://127.0.0.1:4318/v1/traces; got {self.otlp_traces_endpoint!r}")
            check_otel_installed()
        if not self.router_id:
            self.router_id = f"r{uuid.uuid4().hex[:8]}"
        if not self.router_id.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"router_id must be letters, digits, - and _; got {self.router_id!r}")
        if self.direct_port is not None and not 0 < self.direct_port <= 65535:
            raise ValueError(f"direct_port must be in [1, 65535], got {self.direct_port}")
        if self.pool_owner is not None and self.pool_owner != "none" and \
                not self.pool_owner.startswith(("http://", "https://")):
            raise ValueError(f"pool_owner must be an http(s) URL of the router that keeps the pools' targets, "
                             f"or none; got {self.pool_owner!r}")
        self.lora_modules = list(self.lora_modules or [])
        parse_lora_modules(self.lora_modules)  # a malformed entry fails here
        self.log_level = self.log_level.lower()
        self.api_key = from_env(self.api_key, API_KEY_ENV)
        self.cluster_secret = from_env(self.cluster_secret, CLUSTER_SECRET_ENV)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add the router's flags. ``--log-level`` is not among them (the caller's
        top-level parser owns it); ``from_cli_args`` uses ``args.log_level`` if present."""
        g = parser.add_argument_group("router")
        g.add_argument("--model", required=True, help="checkpoint directory (tokenizer + config.json)")
        g.add_argument("--served-model-name", default=None,
                       help="model name clients use (default: basename of --model)")
        g.add_argument("--host", default=cls.host, help="interface for HTTP and the ZMQ PULL socket (default "
                       f"{cls.host}; 0.0.0.0: every interface)")
        g.add_argument("--zmq-host", default=None, help="interface of the ZMQ PULL socket only, and the address "
                       "workers are told (default: --host)")
        g.add_argument("--port", type=int, default=cls.port, help="HTTP port")
        g.add_argument("--zmq-port", type=int, default=cls.zmq_port,
                       help="port workers push to (0 = a free port, printed at start-up)")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="prompt + completion token limit (default: from config.json)")
        g.add_argument("--worker-timeout-s", type=float, default=cls.worker_timeout_s,
                       help="seconds without a heartbeat after which a worker is dead")
        g.add_argument("--step-timeout-s", type=float, default=cls.step_timeout_s,
                       help="seconds a worker's step loop may go without finishing an iteration "
                            "before the worker counts as stuck (its heartbeats report it)")
        g.add_argument("--worker-wait-s", type=float, default=cls.worker_wait_s,
                       help="a request that finds no decode worker waits this long for one before the 503")
        g.add_argument("--max-num-waiting-requests", type=int, default=None,
                       help="503 + Retry-After at once while this many requests wait for their first token")
        g.add_argument("--max-num-waiting-tokens", type=int, default=None,
                       help="the same bound on the prompt tokens of the waiting requests")
        g.add_argument("--max-request-body-bytes", type=int, default=cls.max_request_body_bytes,
                       help="413 for a request body larger than this")
        g.add_argument("--request-timeout", type=float, default=None, dest="request_timeout_s",
                       help="abort a request (504) not finished this many seconds after it arrived")
        g.add_argument("--shutdown-timeout", type=float, default=cls.shutdown_timeout_s, dest="shutdown_timeout_s",
                       help="SIGTERM: refuse new requests (/health 503) and let in-flight ones finish for this "
                            "many seconds; SIGINT stops at once")
        g.add_argument("--expect-prefill-workers", type=int, default=0,
                       help="prefill workers the deployment starts (pdserve up passes --num-prefill): /ready "
                            "then also waits for one of them")
        g.add_argument("--api-key", default=None,
                       help="require Authorization: Bearer KEY on /v1/* and /admin/* (default: $PDSERVE_API_KEY)")
        g.add_argument("--cluster-secret", default=None,
                       help="admit only workers that know this secret, and only CurveZMQ connections keyed by it "
                            "(default: $PDSERVE_CLUSTER_SECRET)")
        t = parser.add_argument_group("router tier (several routers, one worker pool)")
        t.add_argument("--router-id", default="",
                       help="this router's name in the tier; it starts every request id (default: random)")
        t.add_argument("--reuse-port", action="store_true",
                       help="bind --port with SO_REUSEPORT so several routers on this host share it")
        t.add_argument("--direct-port", type=int, default=None,
                       help="also serve HTTP on this port, this router alone (for the launcher and operators)")
        t.add_argument("--pool-owner", default=None,
                       help="where the pools' target sizes live: unset = this router; http://HOST:PORT = the "
                            "designated router (/admin/pools and /admin/scale are forwarded there); none = "
                            "outside pdserve (Kubernetes: kubectl scale), /admin/scale answers 409")
        add_routing_cli_args(parser)
        add_lora_cli_args(parser)
        add_tracing_cli_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "RouterConfig":
        names = [f.name for f in dataclasses.fields(cls)]
        return cls(**{n: getattr(args, n) for n in names if hasattr(args, n)})


def add_routing_cli_args(parser: argparse.ArgumentParser) -> None:
    """The router's routing flags (``pdserve router`` and ``pdserve up`` share them)."""
    g = parser.add_argument_group("routing")
    g.add_argument("--routing-policy", choices=ROUTING_POLICIES, default=RouterConfig.routing_policy,
                   help="how requests are spread over the workers: round_robin (registration order), "
                        "least_loaded (fewest requests, then KV cache usage), prefix_aware (the worker that "
                        "likely caches the prompt's first blocks: consistent hashing with bounded loads), "
                        "kv_aware (the worker whose KV events say it holds most of the prompt, priced against "
                        "its prefill queue, under the same bounded loads; default)")
    g.add_argument("--routing-prefix-blocks", type=int, default=RouterConfig.routing_prefix_blocks,
                   help="prefix_aware: KV blocks at the start of the prompt that key its worker")
    g.add_argument("--routing-balance-factor", type=float, default=RouterConfig.routing_balance_factor,
                   help="prefix_aware and kv_aware: skip a worker holding more than this times the average "
                        "requests in flight (>= 1)")
    g.add_argument("--local-prefill-margin-s", type=float, default=RouterConfig.local_prefill_margin_s,
                   help="prefill a prompt on its decode worker when that is expected to finish it this many "
                        "seconds sooner than the prefill pool (queued prompt tokens / measured prefill "
                        f"speed); default {DEFAULT_LOCAL_PREFILL_MARGIN_S}, inf: never (it trades the decode "
                        "batch's TPOT for TTFT)")
    g.add_argument("--local-prefill-margin-per-request-s", type=float,
                   default=RouterConfig.local_prefill_margin_per_request_s,
                   help="added to --local-prefill-margin-s for each request in flight on the decode worker "
                        f"(default {DEFAULT_LOCAL_PREFILL_MARGIN_PER_REQUEST_S}): local prefills at light load, "
                        "rarely near saturation")


def parse_lora_modules(specs: list[str]) -> list[tuple[str, str]]:
    """``["name=PATH", ...]`` (``--lora-modules``) -> [(name, path)].

    Raises:
        ValueError: an entry without ``=``, an empty name or path, or a name given twice.
    """
    modules: list[tuple[str, str]] = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"--lora-modules entries are name=PATH, got {spec!r}")
        modules.append((name.strip(), path.strip()))
    names = [n for n, _ in modules]
    if len(set(names)) != len(names):
        raise ValueError(f"--lora-modules names a LoRA adapter twice: {names}")
    return modules


def add_lora_cli_args(parser: argparse.ArgumentParser) -> None:
    """The router's LoRA flags (``pdserve router`` and ``pdserve up``, which also hands the workers
    ``--enable-lora`` and ``--max-lora-rank``)."""
    g = parser.add_argument_group("LoRA")
    g.add_argument("--enable-lora", action="store_true",
                   help="serve LoRA adapters, each under its own model name (workers need --enable-lora too)")
    g.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                   help="LoRA adapters (PEFT directories) to serve from the start")
    g.add_argument("--max-lora-rank", type=int, default=RouterConfig.max_lora_rank,
                   help="largest LoRA rank accepted")


def lora_args(args: argparse.Namespace) -> list[str]:
    """``add_lora_cli_args``'s parsed flags as router command-line arguments (for launchers)."""
    if not args.enable_lora:
        return []
    out = ["--enable-lora", "--max-lora-rank", str(args.max_lora_rank)]
    return out + (["--lora-modules", *args.lora_modules] if args.lora_modules else [])


def routing_args(args: argparse.Namespace) -> list[str]:
    """``add_routing_cli_args``'s parsed flags as router command-line arguments (for launchers)."""
    return ["--routing-policy", args.routing_policy, "--routing-prefix-blocks", str(args.routing_prefix_blocks),
            "--routing-balance-factor", str(args.routing_balance_factor),
            "--local-prefill-margin-s", str(args.local_prefill_margin_s),
            "--local-prefill-margin-per-request-s", str(args.local_prefill_margin_per_request_s)]


def add_tracing_cli_args(parser: argparse.ArgumentParser) -> None:
    """The router's tracing flag (``pdserve router`` and ``pdserve up``)."""
    g = parser.add_argument_group("tracing")
    g.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                   help="export one OpenTelemetry trace per request (a span per hop to its first token) over "
                        "OTLP/HTTP to this URL, e.g. http://127.0.0.1:4318/v1/traces (pip install 'pdserve[otel]')")


def tracing_args(args: argparse.Namespace) -> list[str]:
    """``add_tracing_cli_args``'s parsed flag as router command-line arguments (for launchers)."""
    return ["--otlp-traces-endpoint", args.otlp_traces_endpoint] if args.otlp_traces_endpoint else []
