"""The ranks of one worker: tensor parallel (TP) x pipeline parallel (PP) groups.

A worker with ``tensor_parallel_size = T`` and ``pipeline_parallel_size = P`` is
``T * P`` processes (ranks) in one torch.distributed group of their own::

    rank = pp_rank * T + tp_rank          stage pp_rank holds layers stage_layer_range(pp_rank)
    TP group of stage s = ranks [s*T, (s+1)*T)   (all-reduce after each row-parallel linear)
    rank 0 = the driver: scheduler, sampling, ZMQ, KV transfer bookkeeping

Each step the driver broadcasts the step's flattened inputs (``ExecuteModel``,
msgspec bytes only) over a gloo group; every rank runs its layers;
stage s sends its hidden states to stage s+1 (same tp_rank); the last stage's
TP rank 0 sends the rows to sample back to the driver, which holds the final
norm and LM head and samples. One batch is in flight at a time (no
micro-batches), so with P stages each stage idles (P-1)/P of a step: the
pipeline bubble, measured in docs/benchmarks.md.

Backends: gloo on CPU, NCCL for CUDA tensors (the control broadcast always
uses a gloo group). Every group has a timeout, so a dead rank makes the others
fail (and exit) instead of hanging in a collective.

Rendezvous: the driver's TCPStore listens on exactly ``master_addr:master_port``
(a socket bound here and handed to torch), never on all interfaces as torch's
own ``tcp://`` init would; the other ranks connect to it as clients.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import msgspec
import torch
import torch.distributed as dist

from pdserve.common.protocol import ExecuteModel
from pdserve.common.utils import listen_socket
from pdserve.engine.config import ParallelConfig

logger = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(ExecuteModel)


@dataclass(frozen=True)
class RendezvousConfig:
    """Where this rank joins its worker's group.

    Args:
        rank: this process's global rank in the worker (0 = the driver).
        master_addr, master_port: the driver's TCPStore (torch's MASTER_ADDR / MASTER_PORT); the driver
            listens on exactly this address, so it must be one of the driver's own.
        timeout_s: every collective and point-to-point wait of the group gives up after this.
    """

    rank: int
    master_addr: str
    master_port: int
    timeout_s: float = 120.0

    @classmethod
    def from_env(cls, rank: int | None = None, master_addr: str | None = None, master_port: int | None = None,
                 timeout_s: float = 120.0) -> "RendezvousConfig | None":
        """Explicit values first, then torch's usual RANK / MASTER_ADDR / MASTER_PORT; None if no address."""
        addr = master_addr or os.environ.get("MASTER_ADDR")
        port = master_port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None)
        if addr is None or port is None:
            return None
        if rank is None:
            rank = int(os.environ.get("RANK", "0"))
        return cls(rank=rank, master_addr=addr, master_port=port, timeout_s=timeout_s)


def interface_towards(addr: str) -> str | None:
    """The name of the local network interface that routes to ``addr`` (None for loopback or unknown).

    gloo binds each rank's sockets to the address its hostname resolves to, often 127.0.0.1,
    which peers on other hosts cannot reach; naming the interface (GLOO_SOCKET_IFNAME) fixes it.
    """
    import ipaddress
    import socket

    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((addr, 9))  # no packet is sent: this only asks the routing table
            local_ip = s.getsockname()[0]
    except OSError:
        return None
    if ipaddress.ip_address(local_ip).is_loopback:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local_ip for a in addrs):
            return name
    return None


class RankGroup:
    """This process's place among its worker's ranks, and the communication steps uses.

    Creates the worker's default process group (``init_process_group``) and one TP
    group per stage. ``device`` picks the backend (gloo for CPU, nccl for CUDA).

    The rendezvous is a TCPStore: on the driver (rank 0) it listens on a socket bound to
    exactly ``rendezvous.master_addr:master_port`` (``listen_socket``), never on all
    interfaces; every other rank connects to that address as a client.

    Raises:
        OSError: the driver cannot bind ``master_addr:master_port`` (not an address of this machine, or taken).
        RuntimeError / DistBackendError / DistStoreError: the rendezvous did not complete within the timeout.
    """

    def __init__(self, parallel: ParallelConfig, rendezvous: RendezvousConfig, device: torch.device):
        self.parallel = parallel
        self.rank = rendezvous.rank
        self.world_size = parallel.world_size
        self.device = device
        self.pp_rank, self.tp_rank = parallel.coords(self.rank)
        self.timeout = timedelta(seconds=rendezvous.timeout_s)
        backend = "nccl" if device.type == "cuda" else "gloo"
        if "GLOO_SOCKET_IFNAME" not in os.environ and (ifname := interface_towards(rendezvous.master_addr)):
            os.environ["GLOO_SOCKET_IFNAME"] = ifname  # ranks on several hosts: bind where the peers are
            logger.info("rank %d: gloo binds interface %s (towards %s)", self.rank, ifname, rendezvous.master_addr)
        self._listener: socket.socket | None = None
        self._store: dist.TCPStore | None = None
        try:
            self._store = self._rendezvous_store(rendezvous)
            dist.init_process_group(backend, store=self._store, rank=self.rank, world_size=self.world_size,
                                    timeout=self.timeout)
        except BaseException:
            self._close_store()
            raise
        self.cpu_group = dist.new_group(backend="gloo", timeout=self.timeout) if backend != "gloo" else None
        self.tp_group = None
        tp = parallel.tensor_parallel_size
        for stage in range(parallel.pipeline_parallel_size):  # every rank creates every group, in order
            ranks = [parallel.rank_of(stage, t) for t in range(tp)]
            group = dist.new_group(ranks, timeout=self.timeout) if tp > 1 else None
            if stage == self.pp_rank:
                self.tp_group = group
        logger.info("rank %d of %d joined (pp_rank %d, tp_rank %d, %s)", self.rank, self.world_size, self.pp_rank,
                    self.tp_rank, backend)

    def _rendezvous_store(self, rendezvous: RendezvousConfig) -> dist.TCPStore:
        """The group's TCPStore: served from ``master_addr:master_port`` by the driver, a client elsewhere.

        The driver's store gets a duplicate of the bound socket's fd (torch closes the fd it is
        given when the store goes); ``self._listener`` keeps the original, closed by ``close``.
        Returns once every rank has joined (the driver waits for all, the others for the driver).
        """
        use_libuv = os.environ.get("USE_LIBUV", "1") == "1"  # as torch's tcp:// init method decides
        if not self.is_driver:
            return dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, self.world_size, is_master=False,
                                 timeout=self.timeout, use_libuv=use_libuv)
        self._listener = listen_socket(rendezvous.master_addr, rendezvous.master_port)
        logger.info("rank 0: rendezvous store listens on %s", self._listener.getsockname()[:2])
        return dist.TCPStore(rendezvous.master_addr, rendezvous.master_port, self.world_size, is_master=True,
                             timeout=self.timeout, multi_tenant=True, master_listen_fd=os.dup(self._listener.fileno()),
                             use_libuv=use_libuv)

    def _close_store(self) -> None:
        """Drop the store (torch closes its copy of the listening fd), then close the bound socket."""
        self._store = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.parallel.pipeline_parallel_size - 1

    # ---- the driver's per-step broadcast ---------------------------------------------------

    def broadcast_step(self, msg: ExecuteModel | None) -> ExecuteModel:
        """The driver sends ``msg``; every other rank returns it (a length, then msgpack bytes)."""
        group = self.cpu_group
        if self.is_driver:
            payload = torch.frombuffer(bytearray(_ENCODER.encode(msg)), dtype=torch.uint8)
            size = torch.tensor([payload.numel()], dtype=torch.int64)
        else:
            size = torch.empty(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=group)
        if not self.is_driver:
            payload = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=group)
        return msg if self.is_driver else _DECODER.decode(payload.numpy().tobytes())

    # ---- pipeline stages ----------------------------------------------------------------------

    def recv_hidden(self, num_tokens: int, hidden_size: int, dtype: torch.dtype) -> torch.Tensor:
        """Hidden states [num_tokens, hidden_size] from the previous stage (same tp_rank)."""
        hidden = torch.empty(num_tokens, hidden_size, dtype=dtype, device=self.device)
        dist.recv(hidden, src=self.parallel.rank_of(self.pp_rank - 1, self.tp_rank))
        return hidden

    def send_hidden(self, hidden: torch.Tensor) -> None:
        """Hidden states to the next stage (same tp_rank)."""
        dist.send(hidden.contiguous(), dst=self.parallel.rank_of(self.pp_rank + 1, self.tp_rank))

    @property
    def sends_samples(self) -> bool:
        """Whether this rank sends the rows to sample to the driver (last stage, tp_rank 0, not the driver)."""
        return self.is_last_stage and self.tp_rank == 0 and not self.is_driver

    def exchange_sample_rows(self, rows: torch.Tensor | None, shape: tuple[int, int],
                             dtype: torch.dtype) -> torch.Tensor | None:
        """Last stage -> driver: the hidden rows [num_sampled, hidden_size] to sample from."""
        last = self.parallel.rank_of(self.parallel.pipeline_parallel_size - 1, 0)
        if self.sends_samples:
            dist.send(rows.contiguous(), dst=0)
            return None
        if self.is_driver and last != 0:
            rows = torch.empty(shape, dtype=dtype, device=self.device)
            dist.recv(rows, src=last)
        return rows

    def gather_objects(self, obj) -> list:
        """Every rank's ``obj`` (picklable), in rank order, on every rank."""
        out = [None] * self.parallel.world_size
        dist.all_gather_object(out, obj, group=self.cpu_group)
        return out

    def min_over_ranks(self, value: int) -> int:
        """The smallest ``value`` any rank holds (e.g. KV blocks, so block ids agree everywhere)."""
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def close(self) -> None:
        """Leave the group and let go of its groups and store.

        On the driver the store stops listening on ``master_addr:master_port`` once nothing else
        holds a group (a model built with ``tp_group`` does, until it is freed): torch keeps the
        store, and its copy of the listening fd, alive as long as any group that uses it.
        """
        if dist.is_initialized():
            dist.destroy_process_group()
        self.tp_group = self.cpu_group = None
        self._close_store()
