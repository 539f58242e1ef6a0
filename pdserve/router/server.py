"""Run the router: ``python -m pdserve.router --model DIR [--port 8000 --zmq-port 8001 ...]``."""

from __future__ import annotations

import argparse
import contextlib
import logging
import signal
import threading

import uvicorn

from pdserve.router.app import build_app
from pdserve.router.config import RouterConfig


class _RouterServer(uvicorn.Server):
    """uvicorn's server, plus: on SIGINT/SIGTERM fail in-flight requests at once
    (503 / an error event, and AbortRequest to their workers) instead of waiting
    for them, and return normally (exit status 0) rather than re-raising the signal."""

    def __init__(self, config: uvicorn.Config, on_exit):
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        self._on_exit()
        super().handle_exit(sig, frame)

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


def run_router(config: RouterConfig) -> None:
    """Serve HTTP and ZMQ until SIGTERM/SIGINT (blocking), then return.

    On the signal, in-flight requests fail with 503 (streams: an error event),
    are aborted at their decode workers, and all sockets are closed.
    """
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app(config)
    engine = app.state.engine
    server = _RouterServer(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                       timeout_graceful_shutdown=5, access_log=config.log_level == "debug"),
        on_exit=lambda: engine.abort_all_threadsafe("the router is shutting down"))
    server.run()


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
