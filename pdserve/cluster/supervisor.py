"""Supervision shared by every launcher: the processes it started, restarts with back-off, pool
reconciliation (start workers while a pool is below the target ``pdserve scale`` set), the wait for
a healthy cluster, and ``serve_until_stopped`` (``pdserve up``'s main loop, local or on Ray).

A launcher (``LocalCluster``: OS processes; ``RayCluster``: Ray actors) implements how to start,
poll and stop one router or worker; ``ClusterLauncher`` decides when.
"""

from __future__ import annotations

import itertools
import json
import logging
import signal
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

from pdserve.cluster.scale import admin_request
from pdserve.cluster.spec import ClusterSpec

logger = logging.getLogger(__name__)


@dataclass
class LaunchedWorker:
    """A process a launcher started: a worker (its name = ``--worker-id``, its pool) or a router (role
    ``router``), and the launcher's handle on it."""

    name: str
    role: str
    handle: object  # LocalCluster: the driver's Popen; RayCluster: its actors and placement group
    seen_registered: bool = False  # the router has listed it at least once (a router: it answered /health)
    started_at: float = field(default_factory=time.monotonic)
    num_restarts: int = 0  # restarts in a row that each ran less than RESTART_RESET_S
    restart_at: float | None = None  # it failed: start it again at this time (time.monotonic())


class ClusterLauncher:
    """What every launcher shares: the worker bookkeeping, pool reconciliation, health wait, ``with``.

    Subclasses set ``spec`` and call ``ClusterLauncher.__init__``; they provide ``url``,
    ``router_urls()``, ``_start_router(index)`` (which records the router in ``routers``),
    ``_start_worker(role, name) -> handle``, ``_router_exit_code(handle)``,
    ``_worker_exit_code(handle)``, ``_remove_worker(handle)`` and ``stop()``.

    Pools change while serving (``pdserve scale``, ``POST /admin/scale``): the router keeps each
    pool's target size and drains the surplus itself; ``reconcile()`` reads ``/admin/pools`` and
    starts workers while a pool is below its target. A worker that exits with code 0 (drained, or
    stopped by SIGINT) has left the cluster and is forgotten. A worker that fails (any other exit,
    a signal included) is restarted under the same name after 1, 2, 4, ... s (at most
    ``MAX_BACKOFF_S``), at most ``spec.max_restarts`` times in a row; the router meanwhile migrates
    its requests to the survivors. Routers are supervised the same way: one that fails (any exit) is
    restarted on the same ports with the same backoff; the workers, which keep registering with
    every router, join it within one re-registration. Only a router that exits before it ever
    answered ``/health``, or a process out of restarts, is fatal.
    ``serve_until_stopped`` runs ``supervise_once`` in its loop; used as a context manager, a
    launcher runs it on a background thread (fatal exits are then kept in ``fatal``).
    """

    spec: ClusterSpec
    ready_timeout_s: float = 300.0
    MAX_BACKOFF_S = 30.0
    RESTART_RESET_S = 60.0

    def __init__(self, spec: ClusterSpec, ready_timeout_s: float = 300.0):
        self.spec = spec
        self.ready_timeout_s = ready_timeout_s
        self.workers: dict[str, LaunchedWorker] = {}
        self.routers: dict[str, LaunchedWorker] = {}  # by name, in spec.router_names() order
        self._next_index = {"prefill": 0, "decode": 0}
        self._lock = threading.RLock()  # the worker table: the supervisor thread and callers share it
        self.fatal: list[str] = []
        self._supervisor: threading.Thread | None = None
        self._supervisor_stop = threading.Event()

    @property
    def url(self) -> str:
        raise NotImplementedError

    def router_urls(self) -> list[str]:
        """Each router's own HTTP URL, in ``spec.router_names()`` order."""
        return [self.url]

    def _start_router(self, index: int = 0) -> object:
        """Start router ``index`` (again, on the same ports, if it ran before), record it in ``routers``
        and return its handle."""
        raise NotImplementedError

    def _record_router(self, index: int, handle) -> object:
        name = self.spec.router_names()[index]
        if name in self.routers:
            self.routers[name].handle = handle
        else:
            self.routers[name] = LaunchedWorker(name, "router", handle)
        return handle

    def _start_worker(self, role: str, name: str) -> object:
        raise NotImplementedError

    def _router_exit_code(self, handle) -> int | None:
        raise NotImplementedError

    def _worker_exit_code(self, handle) -> int | None:
        raise NotImplementedError

    def _remove_worker(self, handle) -> None:
        """Release what the launcher holds for a worker that exited (Ray: actors, placement group)."""

    def log_tail(self, name: str, num_lines: int = 5) -> str:
        """The last lines a process (``router`` or a worker's name) wrote, for an error message ("" if
        this launcher keeps no log of it)."""
        return ""

    def _why(self, name: str) -> str:
        tail = self.log_tail(name)
        return f"; its last log lines: {tail}" if tail else ""

    def stop(self) -> None:
        raise NotImplementedError

    # ---- workers ------------------------------------------------------------------

    def start(self) -> None:
        """Start the routers, then ``num_prefill`` prefill and ``num_decode`` decode workers."""
        for index in range(self.spec.num_routers):
            self._start_router(index)
        for role, count in (("prefill", self.spec.num_prefill), ("decode", self.spec.num_decode)):
            for _ in range(count):
                self.add_worker(role)

    def add_worker(self, role: str) -> str:
        """Start one more worker of ``role`` (named ``role-K``, K never reused); returns its name."""
        with self._lock:
            name = f"{role}-{self._next_index[role]}"
            self._next_index[role] += 1
            self.workers[name] = LaunchedWorker(name, role, self._start_worker(role, name))
            return name

    def dead(self) -> list[str]:
        """Every process that exited, as ``"name (exit code)"`` (exited now; ``check`` decides what is fatal)."""
        out = []
        for w in [*self.routers.values(), *self.workers.values()]:
            if (code := self._worker_exit_code(w.handle)) is not None:
                out.append(f"{w.name} (exit {code})")
        return out

    def check(self) -> list[str]:
        """From start-up on: forget workers that left cleanly (exit 0), restart failed ones and every
        router that exited (with backoff); return the fatal exits (a router that never answered
        ``/health``; a process out of restarts; a worker that exits with 2, a usage or configuration
        error, before it ever registered: a restart would only fail again), each with the process's
        last log lines where the launcher keeps its log."""
        now = time.monotonic()
        fatal = self._check_routers(now)
        with self._lock:
            workers = list(self.workers.items())
        for name, w in workers:
            if w.restart_at is not None:
                if now >= w.restart_at:
                    self._restart(w)
                continue
            code = self._worker_exit_code(w.handle)
            if code is None:
                continue
            self._remove_worker(w.handle)
            if code == 0:
                logger.info("worker %s left the cluster", name)
                print(f"pdserve: {name} left the cluster", flush=True)
                with self._lock:
                    self.workers.pop(name, None)
                continue
            never_up = "exit 2 before it ever registered: bad flags or model" \
                if code == 2 and not w.seen_registered else None
            if (why := self._schedule_restart(w, "worker", code, now, never_up)) is not None:
                fatal.append(why)
            else:
                w.seen_registered = False  # counts as starting for reconcile
        return fatal

    def _schedule_restart(self, proc, kind: str, code: int, now: float, never_up: str | None) -> str | None:
        """The one restart rule for routers and workers: a process that ran ``RESTART_RESET_S`` starts
        its count again; one that never came up (``never_up`` says how) or is out of restarts is fatal
        (the returned message); otherwise it restarts after 1, 2, 4 .. s (``proc.restart_at``)."""
        name = proc.name
        if now - proc.started_at >= self.RESTART_RESET_S:
            proc.num_restarts = 0
        if never_up is not None:
            return f"{name} ({never_up}){self._why(name)}"
        if proc.num_restarts >= self.spec.max_restarts:
            return f"{name} (exit {code}; restarted {proc.num_restarts} times in a row){self._why(name)}"
        delay = min(self.MAX_BACKOFF_S, 2.0 ** proc.num_restarts)
        proc.restart_at = now + delay
        logger.warning("%s %s exited with %s; restarting it in %.0f s", kind, name, code, delay)
        print(f"pdserve: {name} exited ({code}); restarting it in {delay:.0f} s", flush=True)
        return None

    def _check_routers(self, now: float) -> list[str]:
        """Restart routers that exited (after 1, 2, 4 .. s); the fatal exits."""
        fatal = []
        for index, name in enumerate(self.spec.router_names()):
            r = self.routers.get(name)
            if r is None:
                continue
            if r.restart_at is not None:
                if now >= r.restart_at:
                    r.num_restarts += 1
                    r.restart_at, r.started_at = None, time.monotonic()
                    self._start_router(index)
                    logger.info("router %s restarted (restart %d in a row)", name, r.num_restarts)
                    print(f"pdserve: {name} restarted", flush=True)
                continue
            code = self._router_exit_code(r.handle)
            if code is None:
                continue
            never_up = None if r.seen_registered else f"exit {code} before it ever served"
            if (why := self._schedule_restart(r, "router", code, now, never_up)) is not None:
                fatal.append(why)
        return fatal

    def _restart(self, w: LaunchedWorker) -> None:
        w.num_restarts += 1
        w.restart_at = None
        w.started_at = time.monotonic()
        w.handle = self._start_worker(w.role, w.name)
        logger.info("worker %s restarted (restart %d in a row)", w.name, w.num_restarts)

    def reconcile(self) -> list[str]:
        """Start workers for every pool below its target (``/admin/pools``); returns the names started.

        A pool counts its serving workers plus those this launcher started that have not registered
        yet; draining workers do not count (they are leaving).
        """
        try:
            pools = admin_request(self.url, "/admin/pools", self.spec.api_key)
        except (OSError, RuntimeError, ValueError) as e:
            logger.debug("reading the router's pools failed: %s", e)
            return []
        with self._lock:
            return self._start_missing(pools)

    def _start_missing(self, pools: dict) -> list[str]:
        started = []
        for role in ("prefill", "decode"):
            pool = pools.get(role) or {}
            registered = {w["id"]: w for w in pool.get("workers", [])}
            for name in registered:
                if name in self.workers:
                    self.workers[name].seen_registered = True
            desired = pool.get("desired")
            if desired is None:
                continue
            serving = sum(1 for w in registered.values() if w.get("state") != "draining")
            starting = sum(1 for w in self.workers.values()
                           if w.role == role and not w.seen_registered and w.name not in registered)
            for _ in range(desired - serving - starting):
                name = self.add_worker(role)
                logger.info("pool %s below its target %d: started %s", role, desired, name)
                print(f"pdserve: started {name} (the {role} pool's target is {desired})", flush=True)
                started.append(name)
        return started

    def wait_healthy(self, should_stop=lambda: False) -> bool:
        """Block until every router's /health reports every worker live; False if ``should_stop()``
        became true first.

        Supervision runs from the first second: a worker that fails meanwhile (before or after it
        registered; a client may already be using the ones that are up) is restarted as it would be
        while serving, and its requests migrate; start-up fails only as ``check`` says (a router
        that exits before it ever answered, a worker that cannot start, a process out of restarts),
        with the log lines why.

        Raises:
            RuntimeError: a fatal exit, or ``ready_timeout_s`` passed.
        """
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if should_stop():
                return False
            self.reconcile()  # marks the workers that registered (and starts any a pool lacks)
            if fatal := self.check():
                raise RuntimeError(f"cluster process failed during start-up: {'; '.join(fatal)}")
            if self._routers_healthy():
                return True
            time.sleep(0.25)
        raise RuntimeError(f"cluster not healthy after {self.ready_timeout_s:.0f} s")

    def wait_decode_steps_compiled(self, timeout_s: float = 900.0) -> bool:
        """Block until every worker in router-0's ``/workers`` reports how its decode step runs and none
        still compiles it in the background (``decode_step`` "compiling"): what a benchmark of
        steady-state speed waits for after ``wait_healthy``. False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"{self.router_urls()[0]}/workers", timeout=5) as resp:
                    states = [w.get("decode_step") for w in json.load(resp)]
            except (OSError, ValueError, AttributeError):
                states = []
            if states and "compiling" not in states and all(states):
                return True
            time.sleep(0.5)
        return False

    def _routers_healthy(self) -> bool:
        """Whether every router's /health lists every worker of the spec (marks the routers that answer)."""
        healthy = True
        for name, url in zip(self.spec.router_names(), self.router_urls()):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                    health = json.load(resp)
            except OSError:
                healthy = False
                continue
            if name in self.routers:
                self.routers[name].seen_registered = True
            if (health.get("num_prefill"), health.get("num_decode")) != (self.spec.num_prefill, self.spec.num_decode):
                healthy = False
        return healthy

    def supervise_once(self) -> list[str]:
        """One supervision round: forget workers that left, start what the pools lack; the fatal exits."""
        fatal = self.check()
        self.reconcile()
        return fatal

    def _supervise(self, interval_s: float = 0.5) -> None:
        while not self._supervisor_stop.wait(interval_s):
            try:
                if fatal := self.supervise_once():
                    logger.error("cluster process exited: %s", ", ".join(fatal))
                    self.fatal = fatal
                    return
            except Exception:  # noqa: BLE001  keep supervising; Ray or the router may be briefly unreachable
                logger.exception("supervising the cluster failed")

    def __enter__(self):
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="cluster-supervisor", daemon=True)
        self._supervisor.start()
        return self

    def __exit__(self, *exc) -> None:
        self._supervisor_stop.set()
        if self._supervisor is not None:
            self._supervisor.join(timeout=30)
        self.stop()


def serve_until_stopped(cluster, on_up: Callable[[], Callable[[], None]] | None = None) -> int:
    """Start ``cluster`` (a ``LocalCluster`` or ``RayCluster``), wait until every worker is live, and
    serve until Ctrl-C/SIGTERM, or a router or worker out of restarts (a worker that exits 0 has
    left the cluster: drained or scaled away; one that fails is restarted); meanwhile start workers while
    a pool is below the target ``pdserve scale`` set.
    Then stop everything. Returns an exit code.

    A cluster with a ``connect()`` (Ray) is connected first: Ray installs signal handlers of its own
    when it connects, and ours must come after. ``on_up`` is called once every process is live (the
    SLA autoscaler starts there) and returns what stops it, called before the cluster stops.
    """
    stopping = False
    stop_controller = None

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
        routers = f"{spec.num_routers} routers sharing the port, " if spec.num_routers > 1 else ""
        print(f"pdserve is up: {cluster.url}/v1  (model {spec.model}; {routers}"
              f"{spec.num_prefill} prefill, {spec.num_decode} decode). Ctrl-C stops it.", flush=True)
        if on_up is not None:
            stop_controller = on_up()
        for tick in itertools.count():  # a signal seen within 0.1 s (a sleep resumes after it), rounds 0.5 s apart
            if stopping:
                return 0
            if tick % 5 == 0 and (fatal := cluster.supervise_once()):
                print(f"pdserve: process exited: {', '.join(fatal)}; stopping", file=sys.stderr)
                return 1
            time.sleep(0.1)
    except RuntimeError as e:
        print(f"pdserve: {e}", file=sys.stderr)
        return 1
    finally:
        if stop_controller is not None:
            stop_controller()
        cluster.stop()
