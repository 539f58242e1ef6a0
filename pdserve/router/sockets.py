"""The router's outbound side: one PUSH socket per worker, an outbox, and a watch on every connection.

Handlers only ``put_nowait`` into the outbox (``send``), so submitting and
aborting never await, which matters in cancelled tasks (client gone); one task
drains the outbox in order. Each PUSH socket is connected on first use (the
router connects at a worker's registration) and watched by a ZMQ socket
monitor: when the worker's process dies or its host goes away, the TCP
connection drops and ``on_disconnect(addr)`` runs at once, long before a
heartbeat timeout would notice.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.common.curve import CurveKeys, secure_client
from pdserve.common.transport import encode

logger = logging.getLogger(__name__)


class WorkerSockets:
    """PUSH sockets to workers, keyed by their input address, sharing the router's ZMQ context.

    Args:
        ctx: the router's asyncio ZMQ context.
        on_disconnect: called (in the event loop) with the address whose connection dropped.
        keys: the cluster's CURVE keys: every socket is a CURVE client (``pdserve.common.curve``). None: plain.
    """

    SNDHWM = 100_000

    def __init__(self, ctx: zmq.asyncio.Context, on_disconnect: Callable[[str], None],
                 keys: CurveKeys | None = None):
        self._ctx = ctx
        self._keys = keys
        self._on_disconnect = on_disconnect
        self._push: dict[str, zmq.asyncio.Socket] = {}
        self._monitors: dict[str, asyncio.Task] = {}
        self._outbox: asyncio.Queue = asyncio.Queue()

    def send(self, addr: str, msg: msgspec.Struct) -> None:
        """Queue ``msg`` for the worker at ``addr`` (never awaits; per-address order is kept)."""
        self._outbox.put_nowait((addr, encode(msg)))

    def connect(self, addr: str) -> zmq.asyncio.Socket:
        """The PUSH socket to ``addr``, connected and watched on first use."""
        sock = self._push.get(addr)
        if sock is None:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, self.SNDHWM)
            secure_client(sock, self._keys)
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            sock.connect(addr)
            self._push[addr] = sock
            self._monitors[addr] = asyncio.create_task(self._watch(addr, monitor), name=f"router-watch-{addr}")
        return sock

    def close(self, addr: str, linger: int = 0) -> None:
        """Stop watching and close the socket to ``addr`` (a later ``send`` reconnects)."""
        task = self._monitors.pop(addr, None)
        if task is not None:
            task.cancel()
        sock = self._push.pop(addr, None)
        if sock is not None:
            sock.disable_monitor()
            sock.close(linger=linger)

    async def flush(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the outbox to drain."""
        try:
            await asyncio.wait_for(self._outbox.join(), timeout=timeout_s)
        except asyncio.TimeoutError:
            logger.warning("router stopped with %d unsent messages", self._outbox.qsize())

    def close_all(self, linger: int = 100) -> None:
        for addr in list(self._push):
            self.close(addr, linger=linger)

    async def send_loop(self) -> None:
        """Drain the outbox into the sockets, forever (a failed send is logged, never raised)."""
        while True:
            addr, frames = await self._outbox.get()
            try:
                await self.connect(addr).send_multipart(frames, copy=False)
            except Exception as e:  # e.g. the socket was closed because its worker died
                logger.error("sending to %s failed: %s", addr, e)
            finally:
                self._outbox.task_done()

    async def _watch(self, addr: str, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    self._on_disconnect(addr)
        except (asyncio.CancelledError, zmq.ZMQError):
            pass
        finally:
            monitor.close(linger=0)
