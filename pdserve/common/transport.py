"""ZeroMQ transport for protocol messages.

Wire format: a two-frame multipart message ``[kind: 1 byte, payload: msgpack]``.
``encode`` picks the kind from the struct's type; ``decode`` picks the typed
decoder from the kind byte, so a payload is only ever decoded as the struct its
kind names (msgpack only, no untyped fallback).

``Mailbox`` is what a worker uses: one PULL socket bound on the worker's input
address and one PUSH socket per peer address, owned by two IO threads (CURVE
server and clients under a cluster secret: ``pdserve.common.curve``). The step
loop only touches the mailbox's queues (``get``/``put``), never a socket, so it
never blocks on the network (vLLM v1's engine-core busy loop works the same way).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Sequence

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from pdserve.common.curve import HANDSHAKE_FAILED, CurveKeys, Gatekeeper, secure_client, secure_server
from pdserve.common.protocol import KIND_OF, MESSAGE_TYPES, MsgKind

logger = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {kind: msgspec.msgpack.Decoder(t) for kind, t in MESSAGE_TYPES.items()}


class ProtocolError(ValueError):
    """A frame that is not a well-formed protocol message."""


def encode(msg: msgspec.Struct) -> list[bytes]:
    """Return the frames ``[kind, payload]`` for ``msg``.

    Raises:
        ProtocolError: ``msg`` is not one of ``protocol.MESSAGE_TYPES``.
    """
    kind = KIND_OF.get(type(msg))
    if kind is None:
        raise ProtocolError(f"not a protocol message: {type(msg).__name__}")
    return [bytes((kind,)), _ENCODER.encode(msg)]


def decode(frames: Sequence[bytes]) -> msgspec.Struct:
    """Decode the frames made by ``encode``.

    Raises:
        ProtocolError: wrong frame count, unknown kind, or a payload that does
            not match the kind's struct.
    """
    if len(frames) != 2 or len(frames[0]) != 1:
        raise ProtocolError(f"expected [kind, payload] frames, got {len(frames)} frames")
    try:
        kind = MsgKind(frames[0][0])
    except ValueError as e:
        raise ProtocolError(f"unknown message kind {frames[0][0]}") from e
    try:
        return _DECODERS[kind].decode(frames[1])
    except msgspec.DecodeError as e:
        raise ProtocolError(f"bad {kind.name} payload: {e}") from e


def bind_pull(ctx: zmq.Context, host: str, port: int | None = None,
              keys: CurveKeys | None = None) -> tuple[zmq.Socket, str]:
    """Bind a PULL socket on ``host`` (``port`` None = any free port); return it and its address.

    With ``keys`` it is a CURVE server (``pdserve.common.curve``; ``ctx`` needs its ``Gatekeeper``)."""
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    secure_server(sock, keys)
    if port is None:
        port = sock.bind_to_random_port(f"tcp://{host}")
    else:
        sock.bind(f"tcp://{host}:{port}")
    return sock, f"tcp://{host}:{port}"


class Mailbox:
    """A worker's ZMQ endpoint: inbound and outbound queues fed by IO threads.

    Args:
        host: interface to bind the inbound PULL socket on.
        port: inbound port, or None for a free one. ``self.address`` is the
            address peers should push to.
        watch: peers whose connection is watched (a worker: its routers; more with ``watch``);
            ``down_for(addr=...)`` says how long each has been down.
        keys: the cluster's CURVE keys (``pdserve.common.curve``): only holders may push
            here, and every outbound socket presents them. None: plain TCP.

    ``get(timeout)`` returns the next decoded message or None on timeout.
    ``put(addr, msg)`` queues ``msg`` for the peer at ``addr``; messages to one
    peer keep their order. Malformed inbound frames are logged and dropped.
    ``tap``, when set, sees every inbound message (``inject``'s too) on the thread
    that receives it, before it is queued: for work that must not wait for the step
    loop (``pdserve.decode_worker.first_token``). It must be quick and thread-safe.
    """

    _POLL_MS = 100
    _LINGER_MS = 500  # at close, how long queued messages may take to leave (a dead peer: dropped; a watched
    # peer whose connection is down, e.g. a router stopped first: dropped at once)

    def __init__(self, host: str, port: int | None = None, watch: str | Sequence[str] | None = None,
                 keys: CurveKeys | None = None):
        self._ctx = zmq.Context()
        self._keys = keys
        self._gatekeeper = Gatekeeper(self._ctx, keys)
        try:
            self._pull, self.address = bind_pull(self._ctx, host, port, keys)
        except BaseException:
            self._gatekeeper.stop()
            self._ctx.destroy(linger=0)
            raise
        self._inbox: queue.Queue = queue.Queue()
        self._outbox: queue.Queue = queue.Queue()
        self.tap: Callable[[object], None] | None = None
        # peers whose connection is watched (a worker: its routers) -> down since (None: connected)
        self._down_since: dict[str, float | None] = {}
        for addr in [watch] if isinstance(watch, str) else watch or []:
            self.watch(addr)
        self._refused: set[str] = set()  # watched peers that refused a handshake (each said once)
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._recv_loop, name="mailbox-recv", daemon=True),
            threading.Thread(target=self._send_loop, name="mailbox-send", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def get(self, timeout: float | None = None):
        try:
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def get_nowait(self):
        return self.get(timeout=0) if not self._inbox.empty() else None

    def watch(self, addr: str) -> None:
        """Watch the connection to ``addr`` from now on (before the first ``put`` to it); it counts
        as down until it first connects."""
        self._down_since.setdefault(addr, time.monotonic())

    def down_for(self, now: float | None = None, addr: str | None = None) -> float:
        """Seconds the watched peer ``addr``'s connection has been down (default: the first watched;
        0 while it is up; since ``watch`` until it first connects)."""
        since = self._down_since.get(addr if addr is not None else next(iter(self._down_since), None))
        return 0.0 if since is None else (time.monotonic() if now is None else now) - since

    def put(self, addr: str, msg: msgspec.Struct) -> None:
        self._outbox.put((addr, encode(msg)))

    def inject(self, msg) -> None:
        """Queue a message (or any event object) for the step loop from this process."""
        self._deliver(msg)

    def _deliver(self, msg) -> None:
        """Show ``msg`` to ``tap`` (its errors logged, never raised here), then queue it for the step loop."""
        if self.tap is not None:
            try:
                self.tap(msg)
            except Exception:  # noqa: BLE001  the message still reaches the step loop
                logger.exception("mailbox tap failed on %s", type(msg).__name__)
        self._inbox.put(msg)

    def close(self) -> None:
        """Send what is queued (each socket lingers up to ``_LINGER_MS`` to deliver it), then close."""
        self._outbox.put(None)
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        self._gatekeeper.stop()
        self._ctx.destroy(linger=0)

    def _recv_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(self._POLL_MS):
                continue
            frames = self._pull.recv_multipart()
            try:
                self._deliver(decode(frames))
            except ProtocolError as e:
                logger.warning("dropping malformed message: %s", e)

    def _send_loop(self) -> None:
        sockets: dict[str, zmq.Socket] = {}
        monitors: dict[str, zmq.Socket] = {}
        while True:
            try:
                item = self._outbox.get(timeout=self._POLL_MS / 1000 if monitors else None)
            except queue.Empty:
                item = ()
            for watched, monitor in monitors.items():
                self._read_monitor(watched, monitor)
            if item is None:
                break
            if not item:
                continue
            addr, frames = item
            sock = sockets.get(addr)
            if sock is None:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 100_000)
                secure_client(sock, self._keys)
                if addr in self._down_since:
                    events = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | HANDSHAKE_FAILED
                    monitors[addr] = sock.get_monitor_socket(events)
                sock.connect(addr)
                sockets[addr] = sock
            sock.send_multipart(frames, copy=False)
        for monitor in monitors.values():
            monitor.close(linger=0)
        for addr, sock in sockets.items():  # a watched peer known to be down takes nothing more: no linger
            sock.close(linger=0 if self._down_since.get(addr) is not None else self._LINGER_MS)

    def _read_monitor(self, addr: str, monitor: zmq.Socket) -> None:
        """Track a watched peer's TCP connection from its socket monitor's events."""
        while monitor.poll(0):
            event = parse_monitor_message(monitor.recv_multipart())["event"]
            if event == zmq.EVENT_CONNECTED:
                self._down_since[addr] = None
            elif event == zmq.EVENT_DISCONNECTED and self._down_since.get(addr) is None:
                self._down_since[addr] = time.monotonic()
            elif event & HANDSHAKE_FAILED and addr not in self._refused:
                self._refused.add(addr)
                logger.warning("%s refused this process's handshake: does it have the same --cluster-secret?", addr)


class PushSocket:
    """One PUSH socket to ``addr`` that any thread may ``send`` protocol messages on (a lock serialises them).

    For the few messages a non-driver rank sends its driver; workers use ``Mailbox``.
    """

    def __init__(self, addr: str, keys: CurveKeys | None = None):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUSH)
        self._sock.setsockopt(zmq.LINGER, 1000)
        secure_client(self._sock, keys)
        self._sock.connect(addr)
        self._lock = threading.Lock()

    def send(self, msg: msgspec.Struct) -> None:
        with self._lock:
            self._sock.send_multipart(encode(msg))

    def close(self) -> None:
        with self._lock:
            self._ctx.destroy(linger=1000)
