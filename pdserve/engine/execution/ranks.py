"""Starting and stopping the ranks of a tensor/pipeline-parallel engine.

The driver (rank 0) calls ``start_ranks``. Without a rendezvous address it
picks a free port on 127.0.0.1 and starts ranks 1..N-1 on this machine as
``python -m pdserve rank ...`` subprocesses (plain command-line arguments);
with one (``--master-addr``/``--master-port`` or torch's
MASTER_ADDR/MASTER_PORT) it waits for ranks started elsewhere, by hand, by Ray
or by Kubernetes, with the same command. ``serve_rank`` is the life of a
non-driver rank: join, load its share, run the steps the driver broadcasts.
"""

from __future__ import annotations

import logging
import subprocess
import sys

from pdserve.common.utils import free_port, resolve_device
from pdserve.engine.config import EngineConfig
from pdserve.engine.execution.parallel import RankGroup, RendezvousConfig

logger = logging.getLogger(__name__)

_LOCALHOST = "127.0.0.1"


def rank_device(config: EngineConfig, rank: int):
    """The device of ``rank``: one CUDA device per rank on a multi-GPU machine, else the configured one."""
    device = resolve_device(config.device)
    if device.type == "cuda" and device.index is None:
        import torch

        return torch.device("cuda", rank % max(1, torch.cuda.device_count()))
    return device


def start_ranks(config: EngineConfig) -> tuple[RankGroup | None, list[subprocess.Popen]]:
    """On the driver: join (and if needed start) the engine's other ranks.

    Returns (this process's RankGroup, the local rank processes it started); (None, []) for
    a single-rank engine.

    Raises:
        RuntimeError: the ranks did not all join within ``config.rank_timeout_s``.
    """
    world_size = config.parallel.world_size
    if world_size == 1:
        return None, []
    procs: list[subprocess.Popen] = []
    if config.master_addr is None or config.master_port is None:
        addr, port = _LOCALHOST, free_port(_LOCALHOST)
        for rank in range(1, world_size):
            cmd = [sys.executable, "-m", "pdserve", "rank", *config.rank_cli_args(rank, addr, port)]
            procs.append(subprocess.Popen(cmd))
        logger.info("started ranks 1..%d locally (rendezvous %s:%d)", world_size - 1, addr, port)
    else:
        addr, port = config.master_addr, config.master_port
        logger.info("waiting for ranks 1..%d at %s:%d", world_size - 1, addr, port)
    try:
        ranks = RankGroup(config.parallel, RendezvousConfig(0, addr, port, config.rank_timeout_s),
                          rank_device(config, 0))
    except BaseException:
        stop_processes(procs)
        raise
    return ranks, procs


def serve_rank(config: EngineConfig, cluster_secret: str | None = None) -> int:
    """A non-driver rank: join the driver's group, load this rank's share, run steps until told to stop.

    ``cluster_secret``: the cluster's, for the CURVE keys of what the rank sends its driver's mailbox.
    Returns the process exit code (1 if the group broke: a rank died or timed out).
    """
    from pdserve.common.curve import cluster_keys
    from pdserve.engine.execution.model_runner import ModelRunner  # torch-heavy; only ranks need it

    if config.rank == 0:
        raise ValueError("rank 0 is the driver: start it as a worker (pdserve prefill|decode) or LLM")
    if config.master_addr is None or config.master_port is None:
        raise ValueError(f"rank {config.rank} needs the driver's --master-addr and --master-port")
    ranks = RankGroup(config.parallel, RendezvousConfig(config.rank, config.master_addr, config.master_port,
                                                        config.rank_timeout_s), rank_device(config, config.rank))
    try:
        runner = ModelRunner(config, ranks)
        runner.serve_rank(cluster_keys(cluster_secret))
        return 0
    except Exception as e:  # noqa: BLE001  the driver or a peer rank is gone: leave, do not hang
        logger.error("rank %d leaves: %s", config.rank, e)
        return 1
    finally:
        ranks.close()


def stop_processes(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
    """Wait for local rank processes to exit (after a shutdown step), then kill any left."""
    for proc in procs:
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)
