"""The driver's rendezvous store listens on the configured address only, never on all interfaces.

Two real rank processes form a gloo group on 127.0.0.1; while it is up, the driver's
listening socket on the rendezvous port is looked up from outside (psutil, i.e. the
kernel's socket tables for that pid).
"""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap

import psutil
import pytest

from pdserve.common.utils import free_port

# One rank: join, say READY, wait for "go", prove the group works, leave, say CLOSED, wait for "exit".
RANK = textwrap.dedent("""
    import sys, torch
    from pdserve.engine.config import ParallelConfig
    from pdserve.engine.execution.parallel import RankGroup, RendezvousConfig
    rank, addr, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    group = RankGroup(ParallelConfig(tensor_parallel_size=2), RendezvousConfig(rank, addr, port, 30.0),
                      torch.device("cpu"))
    print("READY", flush=True)
    assert sys.stdin.readline().strip() == "go"
    print("MIN", group.min_over_ranks(10 + rank), flush=True)
    group.close()
    print("CLOSED", flush=True)
    sys.stdin.readline()
""")


def _listening(pid: int, port: int) -> list[str]:
    """The local addresses process ``pid`` listens on at TCP ``port``."""
    proc = psutil.Process(pid)
    conns = proc.net_connections("tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
    return sorted(c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port == port)


def _expect(proc: subprocess.Popen, word: str) -> str:
    line = proc.stdout.readline()
    assert line.startswith(word), f"expected {word!r}, got {line!r} (exit {proc.poll()})"
    return line


@pytest.fixture
def two_ranks():
    """Ranks 0 (the driver) and 1 of one gloo group at 127.0.0.1:<free port>, both joined."""
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), "127.0.0.1", str(port)], text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE) for rank in (0, 1)]
    try:
        for proc in procs:
            _expect(proc, "READY")
        yield procs, port
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)


def test_driver_store_listens_on_master_addr_only(two_ranks):
    (driver, rank1), port = two_ranks
    assert _listening(driver.pid, port) == ["127.0.0.1"]  # not 0.0.0.0 / ::
    assert _listening(rank1.pid, port) == []  # a client only
    for proc in (driver, rank1):
        proc.stdin.write("go\n")
        proc.stdin.flush()
    for proc in (driver, rank1):
        assert _expect(proc, "MIN").split() == ["MIN", "10"]  # the group works over that store
        _expect(proc, "CLOSED")
    assert _listening(driver.pid, port) == []  # close() stopped listening
    for proc in (driver, rank1):
        proc.stdin.write("exit\n")
        proc.stdin.flush()
        assert proc.wait(timeout=20) == 0


def test_kv_pair_store_listens_only_on_the_worker_host():
    """The decode worker's KV pair store (``PairStoreServer``) binds its ``--host``, not all interfaces."""
    from pdserve.kvtransfer.pair import PairStoreServer

    server = PairStoreServer("127.0.0.1")
    try:
        listening = [c.laddr.ip for c in psutil.Process().net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.port == server.port]
        assert listening == ["127.0.0.1"]
    finally:
        server.close()


def test_free_ports_lie_outside_the_range_outgoing_connections_take_theirs_from():
    """A port the launcher picks for a router is bound by it seconds later: meanwhile no outgoing connection
    may take it, so it comes from below the kernel's ephemeral range (a router once failed to bind its ZMQ
    port in the suite), is free, and is never handed out twice by one process."""
    from pdserve.common.utils import ephemeral_port_range

    first, last = ephemeral_port_range()
    ports = [free_port() for _ in range(200)]
    assert len(set(ports)) == len(ports)
    if first - 20000 >= 1024:
        assert all(20000 <= p < first for p in ports), (first, last, sorted(ports)[:5])
    for port in ports[:20]:  # each still free
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
