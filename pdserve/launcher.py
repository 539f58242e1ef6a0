"""``pdserve up``: a local cluster as separate OS processes.

Starts the router, ``num_prefill`` prefill workers and ``num_decode`` decode
workers (each ``python -m pdserve <role> ...``), waits until the router reports
every worker live, prints the URL, and on Ctrl-C / SIGTERM (or any child
exiting) stops all of them, by pid.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field

from pdserve.common.utils import free_port

logger = logging.getLogger(__name__)


@dataclass
class ClusterSpec:
    """What ``pdserve up`` starts.

    Args:
        model: checkpoint directory.
        num_prefill, num_decode: pool sizes (num_prefill may be 0: decode workers then prefill locally).
        host, port: the router's HTTP address; zmq_port: the router's ZMQ port (None = free port).
        worker_args: extra CLI args for every worker (engine flags such as --kv-cache-memory).
        router_args: extra CLI args for the router.
        prefill_args, decode_args: extra CLI args for the workers of one pool only (after worker_args).
        threads_per_worker: torch CPU threads per worker rank (None: cores / ranks, at least 1).
        prefill_tensor_parallel_size, prefill_pipeline_parallel_size, decode_tensor_parallel_size,
            decode_pipeline_parallel_size: ranks of each worker of that pool (each rank is a process;
            the worker's driver starts its other ranks).
    """

    model: str
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_port: int | None = None
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    threads_per_worker: int | None = None
    prefill_tensor_parallel_size: int = 1
    prefill_pipeline_parallel_size: int = 1
    decode_tensor_parallel_size: int = 1
    decode_pipeline_parallel_size: int = 1

    def __post_init__(self):
        if self.num_decode < 1:
            raise ValueError("a cluster needs at least one decode worker")
        if self.num_prefill < 0:
            raise ValueError("num_prefill must be >= 0")
        for name in ("prefill_tensor_parallel_size", "prefill_pipeline_parallel_size",
                     "decode_tensor_parallel_size", "decode_pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")

    def parallel_args(self, role: str) -> list[str]:
        """The worker flags that give ``role``'s workers their ranks."""
        return ["--tensor-parallel-size", str(getattr(self, f"{role}_tensor_parallel_size")),
                "--pipeline-parallel-size", str(getattr(self, f"{role}_pipeline_parallel_size"))]

    @property
    def num_ranks(self) -> int:
        """Processes all workers run together (for sharing the cores)."""
        return (self.num_prefill * self.prefill_tensor_parallel_size * self.prefill_pipeline_parallel_size
                + self.num_decode * self.decode_tensor_parallel_size * self.decode_pipeline_parallel_size)


class ClusterLauncher:
    """What every launcher shares: waiting until the router reports every pool live, and ``with``.

    Subclasses set ``spec`` and provide ``url``, ``start()``, ``stop()`` and ``dead()`` (the processes
    that exited, as ``"name (exit code)"``).
    """

    spec: ClusterSpec
    ready_timeout_s: float = 300.0

    @property
    def url(self) -> str:
        raise NotImplementedError

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def dead(self) -> list[str]:
        raise NotImplementedError

    def wait_healthy(self, should_stop=lambda: False) -> bool:
        """Block until /health reports every worker live; False if ``should_stop()`` became true first.

        Raises:
            RuntimeError: a process exited, or ``ready_timeout_s`` passed.
        """
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if should_stop():
                return False
            if dead := self.dead():
                raise RuntimeError(f"cluster process exited during start-up: {', '.join(dead)}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    health = json.load(resp)
                if (health.get("num_prefill"), health.get("num_decode")) == (self.spec.num_prefill,
                                                                             self.spec.num_decode):
                    return True
            except OSError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"cluster not healthy after {self.ready_timeout_s:.0f} s")

    def __enter__(self):
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class LocalCluster(ClusterLauncher):
    """Start, wait for, and stop the processes of a ``ClusterSpec``."""

    def __init__(self, spec: ClusterSpec, log_dir: str | None = None):
        self.spec = spec
        self.zmq_port = spec.zmq_port or free_port(spec.host)
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.log_dir = log_dir

    @property
    def url(self) -> str:
        return f"http://{self.spec.host}:{self.spec.port}"

    def _spawn(self, name: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "pdserve", *args]
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None)
        self.procs.append((name, proc))

    def start(self) -> None:
        s = self.spec
        threads = s.threads_per_worker or max(1, (os.cpu_count() or 1) // s.num_ranks)
        router_zmq = f"tcp://{s.host}:{self.zmq_port}"
        self._spawn("router", ["router", "--model", s.model, "--host", s.host, "--port", str(s.port),
                               "--zmq-port", str(self.zmq_port), *s.router_args])
        common = ["--model", s.model, "--router", router_zmq, "--host", s.host, "--num-threads", str(threads),
                  *s.worker_args]
        for i in range(s.num_prefill):
            self._spawn(f"prefill-{i}", ["prefill", "--worker-id", f"prefill-{i}", *common,
                                         *s.parallel_args("prefill"), *s.prefill_args])
        for i in range(s.num_decode):
            self._spawn(f"decode-{i}", ["decode", "--worker-id", f"decode-{i}", *common,
                                        *s.parallel_args("decode"), *s.decode_args])

    def dead(self) -> list[str]:
        return [f"{name} (exit {p.returncode})" for name, p in self.procs if p.poll() is not None]

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM every process, then SIGKILL what is left after ``timeout_s``."""
        for _, proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for _, proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_cluster(spec: ClusterSpec) -> int:
    """Start the cluster and serve until Ctrl-C/SIGTERM or a process dies. Returns an exit code."""
    return serve_until_stopped(LocalCluster(spec))


def serve_until_stopped(cluster) -> int:
    """Start ``cluster`` (a ``LocalCluster`` or ``RayCluster``), wait until every worker is live, and
    serve until Ctrl-C/SIGTERM or one of its processes exits; then stop everything. Returns an exit code.

    A cluster with a ``connect()`` (Ray) is connected first: Ray installs signal handlers of its own
    when it connects, and ours must come after.
    """
    stopping = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    if hasattr(cluster, "connect"):
        cluster.connect()
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    spec = cluster.spec
    try:
        cluster.start()
        if not cluster.wait_healthy(should_stop=lambda: stopping):
            return 0
        print(f"pdserve is up: {cluster.url}/v1  (model {spec.model}; "
              f"{spec.num_prefill} prefill, {spec.num_decode} decode). Ctrl-C stops it.", flush=True)
        while not stopping:
            if dead := cluster.dead():
                print(f"pdserve: process exited: {', '.join(dead)}; stopping", file=sys.stderr)
                return 1
            time.sleep(0.5)
        return 0
    except RuntimeError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 1
    finally:
        cluster.stop()
