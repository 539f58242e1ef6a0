"""Run the router: ``python -m pdserve.router --model DIR [--port 8000 --zmq-port 8001 ...]``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import socket
import threading
import time

import uvicorn

from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig


_SAME_SIGNAL_S = 1.0  # signals this close after the first that stopped the router are the same stop


class _RouterServer(uvicorn.Server):
    """uvicorn's server, plus a drain, and a clean exit status.

    SIGTERM (Kubernetes, a supervisor) drains: ``on_drain()`` makes ``/health``
    answer 503 and new requests get 503, and in-flight requests may finish for
    up to ``shutdown_timeout_s``; then, or on SIGINT, or on a second signal,
    ``on_exit()`` fails what is left (503 / an error event, and AbortRequest to
    their workers) and the server stops. Returns normally (exit status 0)
    rather than re-raising the signal.
    """

    def __init__(self, config: uvicorn.Config, on_drain, on_exit, num_inflight, shutdown_timeout_s: float):
        super().__init__(config)
        self._on_drain, self._on_exit, self._num_inflight = on_drain, on_exit, num_inflight
        self._shutdown_timeout_s = shutdown_timeout_s
        self._draining = False
        self._exit_requested_at = float("-inf")

    def handle_exit(self, sig, frame) -> None:
        now = time.monotonic()
        if self.should_exit and now - self._exit_requested_at < _SAME_SIGNAL_S:
            # One Ctrl-C arrives twice under `pdserve up`: from the terminal (to the whole process group) and
            # from the launcher. uvicorn would take the second for "force exit" and cancel the app's shutdown
            # mid-way (a CancelledError traceback); a later signal still forces.
            return
        self._exit_requested_at = now
        if sig == signal.SIGTERM and not self._draining and self._shutdown_timeout_s > 0:
            self._draining = True
            self._on_drain()
            threading.Thread(target=self._drain, name="router-drain", daemon=True).start()
            return
        self._on_exit()
        super().handle_exit(sig, frame)

    def _drain(self) -> None:
        deadline = time.monotonic() + self._shutdown_timeout_s
        while self._num_inflight() > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        logging.getLogger(__name__).info("router drained (%d requests still in flight); stopping",
                                         self._num_inflight())
        self._on_exit()
        super().handle_exit(signal.SIGTERM, None)

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket bound to ``host:port`` for uvicorn to serve on (it calls ``listen``).

    With ``reuse_port``, ``SO_REUSEPORT``: every router of a tier on this host binds the same port
    this way and the kernel spreads new connections over the live ones, so clients keep one URL
    (the way multi-process API servers share a port). A router that dies stops getting connections
    at once; those it had accepted are lost with it.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


def run_router(config: RouterConfig) -> None:
    """Serve HTTP and ZMQ until SIGTERM/SIGINT (blocking), then return.

    With ``reuse_port`` the HTTP port is shared with the other routers of the tier on this host
    (``listen_socket``); ``direct_port`` serves this router alone.

    SIGTERM drains first (``/health`` 503, new requests 503, in-flight ones finish within
    ``config.shutdown_timeout_s``). Then, or at once on SIGINT, what is left fails with 503
    (streams: an error event) and is aborted at its decode workers, and all sockets are closed.
    """
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    engine, serving = app.state.engine, app.state.serving

    def on_drain() -> None:
        serving.draining = True
        logging.getLogger(__name__).info("SIGTERM: draining %d in-flight requests (at most %.0f s)",
                                         engine.num_inflight, config.shutdown_timeout_s)

    server = _RouterServer(
        # keep-alive longer than clients' and load balancers' idle timeouts (httpx: 5 s, AWS ALB: 60 s): a
        # server that closes an idle connection first races a client reusing it, whose request then gets
        # no answer (uvicorn's default is 5 s, the same as httpx's)
        # uvicorn's own lines (started, startup complete, shutting down, finished: eight a run) only at debug;
        # the router prints its address at start and one line at exit
        uvicorn.Config(app, host=config.host, port=config.port,
                       log_level=config.log_level if config.log_level == "debug" else "warning",
                       timeout_graceful_shutdown=5, timeout_keep_alive=75, access_log=config.log_level == "debug"),
        on_drain=on_drain, on_exit=lambda: engine.abort_all_threadsafe("the router is shutting down"),
        num_inflight=lambda: engine.num_inflight, shutdown_timeout_s=config.shutdown_timeout_s)
    if not config.reuse_port and config.direct_port is None:
        server.run()
    else:
        sockets = [listen_socket(config.host, config.port, reuse_port=config.reuse_port)]
        if config.direct_port is not None:
            sockets.append(listen_socket(config.host, config.direct_port))
        server.run(sockets=sockets)
    print(f"pdserve router {config.router_id}: stopped", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pdserve-router", description="pdserve router (OpenAI API)")
    parser.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    RouterConfig.add_cli_args(parser)
    args = parser.parse_args(argv)
    try:
        config = RouterConfig.from_cli_args(args)
    except ValueError as e:
        parser.error(str(e))
    run_router(config)
