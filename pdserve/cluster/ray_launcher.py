"""``pdserve up --ray``: the same processes as ``pdserve up``, placed by Ray across nodes.

Each process (the router, every rank of every worker) runs as ``python -m
pdserve ...`` inside a ``PdserveProcess`` actor on the node Ray picked; the
actor only starts, watches and stops it, so the process is exactly what the
other launchers run and speaks only msgspec on its own sockets (Ray's own
calls carry just argument lists and node addresses). Each worker's ranks are
one placement group, one bundle per rank: ``STRICT_PACK`` (one node) when the
worker is only tensor parallel, ``PACK`` when its pipeline stages may span
nodes. ``--prefill-resources`` / ``--decode-resources`` add a custom resource
(or a node label's resource) to every bundle of that pool, to pin a pool to a
node type. Rendezvous addresses (the router's ZMQ port, each worker's
``--master-addr``/``--master-port``) come from the actors' node IPs, asked of
Ray, never hard-coded. Ctrl-C or SIGTERM stops every process, kills the actors
and removes the placement groups. Pools grow and shrink as for ``pdserve up``
(``ClusterLauncher.reconcile``): a new worker gets its own placement group, and
a drained one's actors and group are removed once its driver exits.

Routers run on the node that ran ``pdserve up --ray`` (the Ray driver's node) and bind HTTP where
``--host`` says, as ``pdserve up`` does: 127.0.0.1 by default, 0.0.0.0 where other machines must
reach it. Their ZMQ sockets bind the node's address, which workers on every node can reach.
``pdserve is up:`` prints an address that works from that machine (the node's address for 0.0.0.0).
``--num-routers N`` starts N router actors there: they share the HTTP port (``--reuse-port``),
each has its own ZMQ port and a direct port, and router-0 keeps the pools' targets. A router that
exits is restarted in its actor on the same ports. ``url`` is router-0's.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field

from pdserve.common.utils import free_port, reachable_host
from pdserve.cluster.spec import ClusterSpec
from pdserve.engine.config import DEFAULT_MEMORY_UTILIZATION
from pdserve.cluster.supervisor import ClusterLauncher

logger = logging.getLogger(__name__)


class PdserveProcess:
    """A Ray actor that runs one ``pdserve`` command on its node (wrapped by ``ray.remote`` at use)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None

    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def free_port(self) -> int:
        return free_port(self.node_ip())

    def start(self, args: list[str]) -> int:
        self.proc = subprocess.Popen([sys.executable, "-m", "pdserve", *args])
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, sig: int = signal.SIGINT, timeout_s: float = 10.0) -> int | None:
        """Signal the process (SIGINT: workers exit at once; SIGTERM would drain them), wait, then kill."""
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


@dataclass
class _Router:
    actor: object
    args: list[str]  # its command line, the same at every restart
    url: str  # this router alone (its direct port in a tier)


@dataclass
class _Worker:
    name: str
    placement_group: object
    actors: list = field(default_factory=list)  # rank order
    removed: bool = False


def placement_unfit(bundle: dict[str, float], num_bundles: int, strategy: str,
                    nodes: list[dict[str, float]]) -> str | None:
    """Why ``num_bundles`` copies of ``bundle`` can never be placed on these nodes (each node's total
    resources), or None if they can once the nodes are free. ``STRICT_PACK`` (a worker's tensor-
    parallel ranks) needs one node holding them all; ``PACK`` may spread them over nodes, a
    bundle whole on one node. The message names what is missing and how to get it."""
    need = {k: v * num_bundles for k, v in bundle.items()}
    if strategy == "STRICT_PACK":
        if any(all(node.get(k, 0) >= v for k, v in need.items()) for node in nodes):
            return None
        best = max((node.get("CPU", 0) for node in nodes), default=0)
        return (f"it needs {need} on one node (its {num_bundles} tensor-parallel ranks stay together), and the "
                f"largest node has {best:g} CPU (nodes: {nodes}); add a larger node, lower --threads-per-worker "
                f"or the tensor-parallel size, or give Ray more logical CPUs (ray start --num-cpus N)")
    fits = sum(min((int(node.get(k, 0) // v) if v else num_bundles) for k, v in bundle.items()) for node in nodes)
    if fits >= num_bundles:
        return None
    return (f"it needs {num_bundles} bundles of {bundle}, and the nodes hold {fits} (nodes: {nodes}); add nodes, "
            f"lower --threads-per-worker, or give Ray more logical CPUs (ray start --num-cpus N)")


def rank_memory_share(threads: int, num_ranks: int, node_cpus: float) -> float:
    """``--memory-utilization`` for a rank of a ``num_ranks``-rank worker that Ray placed with ``threads`` CPUs
    on a node of ``node_cpus`` CPUs (Ray's count), for ``--kv-cache-memory auto``.

    Workers Ray packs onto one node share its memory as they share its CPUs: each rank may hold
    ``DEFAULT_MEMORY_UTILIZATION`` of the node times its part of the node's CPUs, as ``pdserve up`` splits
    one host among its workers' ranks. The worker's value is that times ``num_ranks`` (the auto budget gives
    each rank an equal part of its worker's share), at most ``DEFAULT_MEMORY_UTILIZATION``: ranks whose
    pipeline stages Ray spread over nodes take less than their part, never more."""
    if node_cpus <= 0:
        return DEFAULT_MEMORY_UTILIZATION
    return min(DEFAULT_MEMORY_UTILIZATION, DEFAULT_MEMORY_UTILIZATION * threads * num_ranks / node_cpus)


class RayCluster(ClusterLauncher):
    """Start, watch and stop a ``ClusterSpec`` on a Ray cluster.

    Args:
        spec: what to run (as for ``pdserve up``).
        address: a Ray cluster to join (``auto``, ``ray://…`` or ``HOST:PORT``); None starts a local one.
        prefill_resources, decode_resources: extra resources every bundle of that pool asks for.
    """

    def __init__(self, spec: ClusterSpec, address: str | None = None, prefill_resources: dict | None = None,
                 decode_resources: dict | None = None, ready_timeout_s: float = 300.0):
        super().__init__(spec, ready_timeout_s)
        self.address = address
        self.resources = {"prefill": prefill_resources or {}, "decode": decode_resources or {}}
        self.router_url: str | None = None
        self.router_zmqs: list[str] = []
        self._started_ray = False

    @property
    def url(self) -> str:
        assert self.router_url is not None
        return self.router_url

    def router_urls(self) -> list[str]:
        return [r.handle.url for r in self.routers.values()]

    def needed_cpus(self) -> int:
        """Logical CPUs the spec's workers ask Ray for: every rank of every worker, ``threads_per_worker``
        each (the router asks for none)."""
        s = self.spec
        threads = s.threads_per_worker or 1
        return sum(getattr(s, f"num_{role}") * s.ranks_per_worker(role) * threads for role in ("prefill", "decode"))

    def connect(self) -> None:
        """Join (or start) the Ray cluster. Ray installs signal handlers here: install yours after.

        A Ray that pdserve starts itself declares at least as many logical CPUs as the workers ask for
        (``needed_cpus``), as the local launcher oversubscribes cores: Ray's CPUs are a count for
        placement, not a pinning."""
        import ray

        if not ray.is_initialized():
            if self.address is None:
                ray.init(num_cpus=max(os.cpu_count() or 1, self.needed_cpus()), logging_level=logging.WARNING)
            else:
                ray.init(address=self.address, logging_level=logging.WARNING)
            self._started_ray = self.address is None

    def _actor_class(self):
        import ray

        return ray.remote(PdserveProcess)

    def _start_router(self, index: int = 0) -> _Router:
        """Start router ``index`` in an actor of its own (again in the same actor, on the same ports,
        once it ran before)."""
        import ray

        self.connect()
        s = self.spec
        name = s.router_names()[index]
        if name in self.routers:
            router = self.routers[name].handle
            ray.get(router.actor.start.remote(router.args))
            return router
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # on this machine's node, so that --host 127.0.0.1 (the default) serves this machine as without Ray
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
        actor = self._actor_class().options(num_cpus=0, name=f"pdserve-{name}", scheduling_strategy=here).remote()
        ip = ray.get(actor.node_ip.remote())
        zmq_port = ray.get(actor.free_port.remote())
        args = ["router", "--model", s.model, "--host", s.host, "--zmq-host", ip, "--port", str(s.port),
                "--zmq-port", str(zmq_port), "--expect-prefill-workers", str(s.num_prefill)]
        http_host = reachable_host(s.host, ip)
        url = f"http://{http_host}:{s.port}"
        if s.num_routers > 1:
            direct_port = ray.get(actor.free_port.remote())
            url = f"http://{http_host}:{direct_port}"
            args += ["--router-id", name, "--reuse-port", "--direct-port", str(direct_port)]
            if index > 0:  # router-0 keeps the pools' targets
                args += ["--pool-owner", self.router_urls()[0]]
        args += [*s.router_auth_args(), *s.router_args]
        router = _Router(actor, args, url)
        ray.get(actor.start.remote(args))
        if index == 0:
            self.router_url = f"http://{http_host}:{s.port}"
        self.router_zmqs.append(f"tcp://{ip}:{zmq_port}")
        logger.info("pdserve on Ray: %s at %s", name, url)
        return self._record_router(index, router)

    def _start_worker(self, role: str, name: str) -> _Worker:
        """One placement group (a bundle per rank) and one actor per rank, each running its rank."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        s = self.spec
        threads = s.threads_per_worker or 1
        tp = getattr(s, f"{role}_tensor_parallel_size")
        pp = getattr(s, f"{role}_pipeline_parallel_size")
        bundle = {"CPU": threads, **self.resources[role]}
        strategy = "STRICT_PACK" if pp == 1 else "PACK"
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        if (why := placement_unfit(bundle, tp * pp, strategy, nodes)) is not None:
            raise RuntimeError(f"{name} cannot be placed on this Ray cluster: {why}")
        pg = placement_group([dict(bundle) for _ in range(tp * pp)], strategy=strategy, name=f"pdserve-{name}")
        try:
            ray.get(pg.ready(), timeout=self.ready_timeout_s)
        except ray.exceptions.GetTimeoutError:  # it fits the cluster, but what it needs stayed taken
            ray.util.remove_placement_group(pg)
            raise RuntimeError(f"{name}: its placement group ({tp * pp} x {bundle}) was not granted within "
                               f"{self.ready_timeout_s:.0f} s; the cluster's resources are held by other work "
                               f"(free now: {ray.available_resources()})") from None
        worker = _Worker(name, pg)
        actor_cls = self._actor_class()
        for rank in range(tp * pp):
            worker.actors.append(actor_cls.options(
                num_cpus=threads, resources=self.resources[role], name=f"pdserve-{name}-rank{rank}",
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=rank)).remote())
        ips = ray.get([a.node_ip.remote() for a in worker.actors])
        master_port = ray.get(worker.actors[0].free_port.remote())
        # each rank's share of its node's memory, by its share of the node's CPUs (a flag given for the
        # workers comes later and wins)
        bundle_nodes = ray.util.placement_group_table(pg)["bundles_to_node_id"]
        node_cpus = {n["NodeID"]: n.get("Resources", {}).get("CPU", 0.0) for n in ray.nodes() if n.get("Alive")}
        common = [role, "--model", s.model, "--router", ",".join(self.router_zmqs), "--num-threads", str(threads),
                  "--tensor-parallel-size", str(tp), "--pipeline-parallel-size", str(pp),
                  "--master-addr", ips[0], "--master-port", str(master_port)]
        given = [*s.worker_args, *(s.prefill_args if role == "prefill" else s.decode_args)]
        for rank, (actor, ip) in enumerate(zip(worker.actors, ips)):
            share = rank_memory_share(threads, tp * pp, node_cpus.get(bundle_nodes.get(rank), 0.0))
            extra = ["--worker-id", name] if rank == 0 else []
            ray.get(actor.start.remote([*common, "--memory-utilization", f"{share:.4g}", *given, "--host", ip,
                                        "--rank", str(rank), *extra]))
        logger.info("pdserve on Ray: %s placed (%d ranks on %s)", name, tp * pp, ", ".join(sorted(set(ips))))
        return worker

    def _router_exit_code(self, router: _Router) -> int | None:
        import ray

        return ray.get(router.actor.poll.remote())

    def _worker_exit_code(self, worker: _Worker) -> int | None:
        """The driver's exit code once it exited; else the first non-driver rank's that failed."""
        import ray

        codes = ray.get([a.poll.remote() for a in worker.actors])
        if codes[0] is not None:
            return codes[0]
        return next((c for c in codes[1:] if c not in (None, 0)), None)

    def _remove_worker(self, worker: _Worker) -> None:
        """Stop what is left of a worker's ranks, kill its actors, remove its placement group."""
        import ray
        from ray.util.placement_group import remove_placement_group

        if worker.removed:
            return
        worker.removed = True
        ray.get([a.stop.remote() for a in reversed(worker.actors)])
        for actor in worker.actors:
            ray.kill(actor)
        remove_placement_group(worker.placement_group)

    def stop(self) -> None:
        """Stop every process (workers first), kill the actors, remove the placement groups."""
        import ray

        for worker in reversed(list(self.workers.values())):
            self._remove_worker(worker.handle)
        self.workers = {}
        for router in self.routers.values():
            ray.get(router.handle.actor.stop.remote())
            ray.kill(router.handle.actor)
        self.routers = {}
        if self._started_ray:
            ray.shutdown()
