"""Configuration every worker process shares (identity, addresses, timeouts)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import uuid
from dataclasses import dataclass, field

from pdserve.common.auth import CLUSTER_SECRET_ENV, from_env


def _default_worker_id(role: str) -> str:
    return f"{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def resolve_router_addrs(entries: list[str]) -> list[str]:
    """The routers behind ``entries`` (``tcp://HOST:PORT`` each): a HOST that is a name becomes one
    ``tcp://IP:PORT`` per IPv4 address it resolves to (a Kubernetes headless Service names every
    router pod), an IP stays as it is, and a name that does not resolve now stays as it is (ZMQ
    resolves it when it connects). Order: as given, each name's addresses sorted; no duplicates.
    """
    out: list[str] = []
    for entry in entries:
        host, _, port = entry[len("tcp://"):].rpartition(":")
        try:
            ipaddress.ip_address(host.strip("[]"))
            found = [entry]
        except ValueError:
            try:
                infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
                found = [f"tcp://{ip}:{port}" for ip in sorted({info[4][0] for info in infos})]
            except (OSError, ValueError):
                found = [entry]
        out += [addr for addr in found if addr not in out]
    return out


@dataclass
class WorkerConfig:
    """How a worker finds the router and its peers.

    Args:
        role: ``prefill`` or ``decode``.
        router_addr: the routers' ZMQ addresses, comma-separated, e.g. ``tcp://127.0.0.1:8001`` or
            ``tcp://10.0.0.5:8001,tcp://10.0.0.6:8001``; a name that resolves to several addresses (a
            Kubernetes headless Service) names every router behind it, re-resolved at each
            re-registration (``resolve_router_addrs``). The worker registers with, heartbeats to and
            streams each request's outputs to every router (``router_addrs``).
        host: interface this worker binds and advertises (its ZMQ input and KV store).
        port: ZMQ input port; None picks a free one.
        worker_id: cluster-unique name; generated if empty.
        heartbeat_interval_s: seconds between heartbeats to the router.
        transfer_timeout_s: longest wait for any KV transfer step (connect, each layer).
        remote_prefill_timeout_s: decode worker: how long a request may wait for its remote KV.
        prefill_failure_policy: decode worker: ``recompute`` the prompt locally or ``fail`` the request
            when the remote prefill fails or times out.
        cluster_secret: shared with the router, which admits only workers that prove they know it
            (``pdserve.common.auth``), and the key of every ZMQ socket's CurveZMQ (``pdserve.common.curve``);
            default ``$PDSERVE_CLUSTER_SECRET``.
        health_file: touched at every heartbeat while the step loop moves (loop stalled less than
            ``health_stall_s``), for process supervisors' probes (Kubernetes ``exec`` liveness); None: none.
        drain_timeout_s: after SIGTERM (or the router's ``DrainWorker``), how long the worker may take
            to finish what it holds before it hands the rest back (the router migrates them) and exits.
            SIGINT exits at once.
        router_timeout_s: once the connection to every router has been down this long (their
            processes died, the network went away), the worker drops every request it holds (their
            clients are gone with the routers), freeing their KV blocks; it keeps registering, so a
            router that comes back finds it. One router of several that is down while another is
            up is dead, not cut off: its requests are dropped at once (``ROUTER_LOST_S``).
        lend_flag: prefill worker: publish in this file whether it is idle, for a decode worker that
            borrows its cores meanwhile (``pdserve.cluster.core_lending``); None: lends nothing.
        borrow_flag, borrow_threads: decode worker: run each step with ``borrow_threads`` more torch
            threads while the prefill worker publishing ``borrow_flag`` is idle (its threads' cores:
            ``GOMP_CPU_AFFINITY``, which the launcher sets); None: borrows nothing.
    """

    role: str
    router_addr: str
    host: str = "127.0.0.1"
    port: int | None = None
    worker_id: str = ""
    heartbeat_interval_s: float = 1.0
    transfer_timeout_s: float = 30.0
    remote_prefill_timeout_s: float = 60.0
    prefill_failure_policy: str = "recompute"
    cluster_secret: str | None = None
    health_file: str | None = None
    health_stall_s: float = 300.0
    drain_timeout_s: float = 30.0
    router_timeout_s: float = 10.0
    lend_flag: str | None = None
    borrow_flag: str | None = None
    borrow_threads: int = 1
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {self.role!r}")
        if self.prefill_failure_policy not in ("recompute", "fail"):
            raise ValueError(f"prefill_failure_policy must be recompute or fail, got {self.prefill_failure_policy!r}")
        if not self.router_addrs or not all(a.startswith("tcp://") and ":" in a[6:] for a in self.router_addrs):
            raise ValueError(f"router_addr must look like tcp://HOST:PORT[,tcp://HOST:PORT...], "
                             f"got {self.router_addr!r}")
        if not self.worker_id:
            self.worker_id = _default_worker_id(self.role)
        if self.lend_flag and self.role != "prefill" or self.borrow_flag and self.role != "decode":
            raise ValueError("a prefill worker lends its cores (--lend-flag), a decode worker borrows them "
                             "(--borrow-flag)")
        if self.borrow_threads < 1:
            raise ValueError(f"--borrow-threads must be >= 1, got {self.borrow_threads}")

    @property
    def router_addrs(self) -> list[str]:
        """The router entries as given (``router_addr`` split at commas), before DNS resolution."""
        return [a.strip() for a in self.router_addr.split(",") if a.strip()]

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("worker")
        g.add_argument("--router", "--router-addr", required=True, dest="router_addr",
                       help="the routers' ZMQ addresses, tcp://HOST:PORT[,tcp://HOST:PORT...]; a HOST name that "
                            "resolves to several addresses (a headless Service) names every router behind it")
        g.add_argument("--host", default="127.0.0.1", help="interface to bind and advertise")
        g.add_argument("--port", type=int, default=None, help="ZMQ input port (default: any free port)")
        g.add_argument("--worker-id", default="", help="this worker's name in the pools (default: role-host-pid-random)")
        g.add_argument("--heartbeat-interval", type=float, default=1.0, dest="heartbeat_interval_s",
                       help="seconds between heartbeats to each router")
        g.add_argument("--transfer-timeout", type=float, default=30.0, dest="transfer_timeout_s",
                       help="seconds any one KV transfer step may take before the transfer fails")
        g.add_argument("--remote-prefill-timeout", type=float, default=60.0, dest="remote_prefill_timeout_s",
                       help="seconds a decode worker waits for a prompt's KV from a prefill worker")
        g.add_argument("--prefill-failure-policy", choices=["recompute", "fail"], default="recompute",
                       help="when a remote prefill fails: recompute the prompt on the decode worker, or fail "
                            "the request")
        g.add_argument("--cluster-secret", default=None,
                       help="the cluster's secret: proves this worker to the router and makes every ZMQ socket "
                            "CurveZMQ (default: $PDSERVE_CLUSTER_SECRET)")
        g.add_argument("--health-file", default=None,
                       help="touch this file at every heartbeat while the step loop moves (for liveness probes)")
        g.add_argument("--health-stall-s", type=float, default=300.0,
                       help="stop touching --health-file once the step loop has not moved for this long")
        g.add_argument("--router-timeout-s", type=float, default=10.0, dest="router_timeout_s",
                       help="drop every request held once every router's connection has been down this long "
                            "(their clients went with the routers); keep registering for the next router. A "
                            "router down while another is up loses its own requests at once")
        g.add_argument("--lend-flag", default=None,
                       help="prefill worker: publish in this file (one byte, shared) whether the worker is idle, so "
                            "that a decode worker on the same machine computes on its cores meanwhile (pdserve up "
                            "sets it with --core-lending)")
        g.add_argument("--borrow-flag", default=None,
                       help="decode worker: while the prefill worker publishing this file is idle, run each step "
                            "with --borrow-threads more threads, bound to its cores by GOMP_CPU_AFFINITY")
        g.add_argument("--borrow-threads", type=int, default=1, help="threads a step adds while borrowing (default 1)")
        g.add_argument("--drain-timeout", type=float, default=30.0, dest="drain_timeout_s",
                       help="SIGTERM drains: the router stops routing here and the worker finishes what it holds "
                            "for up to this many seconds, then exits (SIGINT exits at once)")

    @classmethod
    def from_cli_args(cls, role: str, args: argparse.Namespace) -> "WorkerConfig":
        return cls(role=role, router_addr=args.router_addr, host=args.host, port=args.port, worker_id=args.worker_id,
                   heartbeat_interval_s=args.heartbeat_interval_s, transfer_timeout_s=args.transfer_timeout_s,
                   remote_prefill_timeout_s=args.remote_prefill_timeout_s,
                   prefill_failure_policy=args.prefill_failure_policy,
                   cluster_secret=from_env(args.cluster_secret, CLUSTER_SECRET_ENV), health_file=args.health_file,
                   health_stall_s=args.health_stall_s, drain_timeout_s=args.drain_timeout_s,
                   router_timeout_s=args.router_timeout_s, lend_flag=args.lend_flag, borrow_flag=args.borrow_flag,
                   borrow_threads=args.borrow_threads)
