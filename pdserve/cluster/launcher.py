"""``pdserve up``: a local cluster as separate OS processes.

Starts ``num_routers`` routers, ``num_prefill`` prefill workers and
``num_decode`` decode workers (each ``python -m pdserve <role> ...``), waits
until every router reports every worker live, prints the URL, starts workers
when ``pdserve scale`` grows a pool, restarts routers and workers that fail, and
on Ctrl-C / SIGTERM (or a process out of restarts) stops all of them, by pid.

A router tier (``num_routers`` > 1): the routers share the one HTTP port
(``--reuse-port``: SO_REUSEPORT, the kernel spreads connections over the live
ones), each has its own ZMQ port and a direct HTTP port of its own, and every
worker is given every router's ZMQ address. router-0 keeps the pools' targets;
the others forward ``/admin/pools`` and ``/admin/scale`` to it (``--pool-owner``).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from pdserve.common.utils import format_cpu_list, free_port, parse_cpu_list, reachable_host
from pdserve.cluster.core_lending import gomp_cpu_affinity
from pdserve.cluster.spec import ClusterSpec
from pdserve.engine.config import DEFAULT_MEMORY_UTILIZATION
from pdserve.cluster.supervisor import ClusterLauncher, serve_until_stopped

logger = logging.getLogger(__name__)


class LocalCluster(ClusterLauncher):
    """Start, wait for, and stop the processes of a ``ClusterSpec`` on this machine."""

    def __init__(self, spec: ClusterSpec, log_dir: str | None = None):
        super().__init__(spec)
        self.zmq_ports = [spec.zmq_port or free_port(spec.host)] + [free_port(spec.host)
                                                                     for _ in range(spec.num_routers - 1)]
        self.zmq_port = self.zmq_ports[0]
        # a tier's routers share spec.port; each also serves alone on a direct port
        self.direct_ports = [free_port(spec.host) for _ in range(spec.num_routers)] if spec.num_routers > 1 else []
        self.log_dir = log_dir
        self.worker_cores: dict[str, list[int]] = {}  # worker name -> the cores it was pinned to
        self.lent: dict[str, str] = {}  # prefill worker -> the decode worker borrowing its cores
        self._flag_dir: str | None = None  # core lending's flags (made when a worker first lends)

    @property
    def url(self) -> str:
        return f"http://{reachable_host(self.spec.host)}:{self.spec.port}"

    def router_urls(self) -> list[str]:
        if not self.direct_ports:
            return [self.url]
        return [f"http://{reachable_host(self.spec.host)}:{port}" for port in self.direct_ports]

    @property
    def router_proc(self) -> subprocess.Popen | None:
        """The first router's process."""
        first = self.routers.get(self.spec.router_names()[0])
        return None if first is None else first.handle

    @property
    def router_addrs(self) -> str:
        """What workers get as ``--router``: every router's ZMQ address."""
        return ",".join(f"tcp://{reachable_host(self.spec.host)}:{port}" for port in self.zmq_ports)

    @property
    def procs(self) -> list[tuple[str, subprocess.Popen]]:
        """Every process started and not forgotten, routers first."""
        return [(w.name, w.handle) for w in [*self.routers.values(), *self.workers.values()]]

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "pdserve", *args]
        out = None
        if self.log_dir:
            os.makedirs(self.log_dir, exist_ok=True)
            out = open(os.path.join(self.log_dir, f"{name}.log"), "ab")
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT if out else None,
                                env={**os.environ, **env} if env else None)

    def _start_router(self, index: int = 0) -> subprocess.Popen:
        s = self.spec
        name = s.router_names()[index]
        tier = []
        if s.num_routers > 1:
            tier = ["--router-id", name, "--reuse-port", "--direct-port", str(self.direct_ports[index])]
            if index > 0:  # router-0 keeps the pools' targets
                tier += ["--pool-owner", self.router_urls()[0]]
        return self._record_router(index, self._spawn(name, [
            "router", "--model", s.model, "--host", s.host, "--port", str(s.port), "--zmq-port",
            str(self.zmq_ports[index]), "--expect-prefill-workers", str(s.num_prefill), *tier,
            *s.router_auth_args(), *s.router_args]))

    def _cores_for(self, role: str, name: str) -> tuple[list[int], int]:
        """This worker's cores and threads per rank: an even share of the cores this process may use.

        Each rank of the spec's workers gets ``cores // ranks`` cores (at least one); a new or
        restarted worker takes the least-used cores, so prefill and decode never share one while
        there are enough (a single colocated worker gets them all)."""
        s = self.spec
        available = sorted(os.sched_getaffinity(0))
        self.worker_cores.pop(name, None)
        per_rank = max(1, len(available) // max(1, s.num_ranks))
        ranks = s.ranks_per_worker(role)
        want = min(len(available), per_rank * ranks)
        used = {c: 0 for c in available}
        for cores in self.worker_cores.values():
            for c in cores:
                if c in used:
                    used[c] += 1
        cores = sorted(sorted(available, key=lambda c: (used[c], c))[:want])
        self.worker_cores[name] = cores
        return cores, s.threads_per_worker or max(1, len(cores) // ranks)

    def _start_worker(self, role: str, name: str) -> subprocess.Popen:
        s = self.spec
        pool_args = s.prefill_args if role == "prefill" else s.decode_args
        user_placed = "--cpu-cores" in [*s.worker_args, *pool_args]
        if user_placed or not hasattr(os, "sched_getaffinity"):  # the user placed it, or no pinning on this OS
            threads = s.threads_per_worker or max(1, (os.cpu_count() or 1) // s.num_ranks)
            placement = ["--num-threads", str(threads)]
            given = [*s.worker_args, *pool_args]
            if user_placed:  # where it runs, for core lending (the last --cpu-cores given wins, as argparse reads)
                last = max(i for i, a in enumerate(given) if a == "--cpu-cores")
                self.worker_cores[name] = parse_cpu_list(given[last + 1]) if last + 1 < len(given) else []
        else:
            cores, threads = self._cores_for(role, name)
            placement = ["--num-threads", str(threads), "--cpu-cores", format_cpu_list(cores)]
        lending, env = self._lending(role, name) if s.core_lending else ([], None)
        # the workers share this host's memory: each rank an equal part of what one worker alone would take
        # (with --kv-cache-memory auto; a flag given for the workers comes later and wins)
        share = DEFAULT_MEMORY_UTILIZATION * s.ranks_per_worker(role) / max(1, s.num_ranks)
        argv = [role, "--worker-id", name, "--model", s.model, "--router", self.router_addrs, "--host", s.host,
                *placement, *lending, "--memory-utilization", f"{share:.4g}", *s.worker_args,
                *s.parallel_args(role), *pool_args]
        return self._spawn(name, argv, env=env) if env else self._spawn(name, argv)

    def _lending(self, role: str, name: str) -> tuple[list[str], dict[str, str] | None]:
        """Core lending's flags (and environment) for a worker about to start, when every rank of the spec has
        cores of its own: a single-rank prefill worker publishes when it is idle; a single-rank decode worker
        borrows the cores of a prefill worker that no other worker uses and that lends to no one yet (prefill
        workers start first), its OpenMP threads bound own cores first (``core_lending.gomp_cpu_affinity``).
        Workers added later onto a lender's cores (scaling past the machine's cores) are not seen by its
        borrower: turn lending off to scale that far."""
        s = self.spec
        if s.ranks_per_worker("prefill") != 1 or s.ranks_per_worker("decode") != 1 \
                or not hasattr(os, "sched_getaffinity") or s.num_ranks > len(os.sched_getaffinity(0)):
            return [], None  # several ranks, or workers that will share cores: nothing is idle to lend
        if self._flag_dir is None:
            self._flag_dir = tempfile.mkdtemp(prefix="pdserve-lending-")
        if role == "prefill":  # a restarted one takes up its flag again, and its borrower with it
            return ["--lend-flag", os.path.join(self._flag_dir, f"{name}.idle")], None
        own = self.worker_cores.get(name, [])
        self.lent = {p: d for p, d in self.lent.items() if d != name}
        for lender, cores in self.worker_cores.items():
            if not lender.startswith("prefill-") or lender in self.lent or lender not in self.workers:
                continue
            others = [w for w, c in self.worker_cores.items() if w not in (lender, name) and set(c) & set(cores)]
            if others or set(cores) & set(own):
                continue
            self.lent[lender] = name
            return (["--borrow-flag", os.path.join(self._flag_dir, f"{lender}.idle"), "--borrow-threads",
                     str(len(cores))], {"GOMP_CPU_AFFINITY": gomp_cpu_affinity(own, cores)})
        return [], None

    def log_tail(self, name: str, num_lines: int = 5) -> str:
        if not self.log_dir:
            return ""  # the process wrote to this terminal: its lines are above
        try:
            with open(os.path.join(self.log_dir, f"{name}.log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 8192))
                lines = f.read().decode("utf-8", "replace").splitlines()
        except OSError:
            return ""
        return " | ".join(line.strip() for line in lines[-num_lines:] if line.strip())

    def _router_exit_code(self, handle: subprocess.Popen) -> int | None:
        return handle.poll()

    def _worker_exit_code(self, handle: subprocess.Popen) -> int | None:
        return handle.poll()

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT every process (exit now: SIGTERM would drain them), the routers first so that none of them
        reports the workers leaving; SIGKILL what is left after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        routers = [w.handle for w in self.routers.values()]
        for group in (routers, [w.handle for w in self.workers.values()]):
            for proc in group:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGINT)
            for proc in group:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if self._flag_dir:
            shutil.rmtree(self._flag_dir, ignore_errors=True)


def run_cluster(spec: ClusterSpec, on_up=None) -> int:
    """Start the cluster and serve until Ctrl-C/SIGTERM or a process dies. Returns an exit code.
    ``on_up``: see ``serve_until_stopped``."""
    return serve_until_stopped(LocalCluster(spec), on_up=on_up)
