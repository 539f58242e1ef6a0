"""What a cluster is made of: ``ClusterSpec`` (``pdserve up``'s and ``pdserve up --ray``'s flags as data)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ClusterSpec:
    """What ``pdserve up`` starts.

    Args:
        model: checkpoint directory.
        num_prefill, num_decode: pool sizes (num_prefill may be 0: decode workers then prefill locally).
        host, port: the routers' HTTP address; zmq_port: the first router's ZMQ port (None = free port).
        num_routers: routers serving the one worker pool (a router tier); they share ``port``.
        worker_args: extra CLI args for every worker (engine flags such as --kv-cache-memory).
        router_args: extra CLI args for the router.
        api_key: the router's ``--api-key`` (the launcher uses it to read ``/admin/pools``).
        max_restarts: a worker that fails (non-zero exit) is restarted, with exponential backoff, at most
            this many times in a row (a run of ``RESTART_RESET_S`` resets the count); then the cluster stops.
        prefill_args, decode_args: extra CLI args for the workers of one pool only (after worker_args).
        threads_per_worker: torch CPU threads per worker rank (None: cores / ranks, at least 1).
        prefill_tensor_parallel_size, prefill_pipeline_parallel_size, decode_tensor_parallel_size,
            decode_pipeline_parallel_size: ranks of each worker of that pool (each rank is a process;
            the worker's driver starts its other ranks).
        core_lending: a local cluster's decode worker runs its steps on a prefill worker's cores too while
            that worker is idle (``pdserve.cluster.core_lending``; single-rank workers on cores of their own).
    """

    model: str
    num_prefill: int = 1
    num_decode: int = 1
    host: str = "127.0.0.1"
    port: int = 8000
    zmq_port: int | None = None
    worker_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_restarts: int = 5
    prefill_args: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    threads_per_worker: int | None = None
    prefill_tensor_parallel_size: int = 1
    prefill_pipeline_parallel_size: int = 1
    decode_tensor_parallel_size: int = 1
    decode_pipeline_parallel_size: int = 1
    num_routers: int = 1
    core_lending: bool = False

    def __post_init__(self):
        if self.num_routers < 1:
            raise ValueError("a cluster needs at least one router")
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

    def router_names(self) -> list[str]:
        """The routers' names (their log files): ``router`` alone, else ``router-0`` .. ``router-{N-1}``."""
        return ["router"] if self.num_routers == 1 else [f"router-{i}" for i in range(self.num_routers)]

    def router_auth_args(self) -> list[str]:
        return ["--api-key", self.api_key] if self.api_key else []

    def ranks_per_worker(self, role: str) -> int:
        """Processes one worker of pool ``role`` runs."""
        return getattr(self, f"{role}_tensor_parallel_size") * getattr(self, f"{role}_pipeline_parallel_size")

    @property
    def num_ranks(self) -> int:
        """Processes all workers run together (for sharing the cores)."""
        return (self.num_prefill * self.prefill_tensor_parallel_size * self.prefill_pipeline_parallel_size
                + self.num_decode * self.decode_tensor_parallel_size * self.decode_pipeline_parallel_size)
