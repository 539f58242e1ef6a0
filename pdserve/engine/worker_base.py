"""What the prefill and decode workers share: an EngineCore, a mailbox, liveness, the loop.

The loop is ``handle inbox -> step`` (each worker's step is the engine core's
``schedule -> execute -> update`` plus its own IO). IO threads own the
sockets: the ``Mailbox`` threads move messages, and the liveness thread sends
``RegisterWorker`` and ``Heartbeat`` on its own clock, so a step that runs for
minutes (a long CPU prefill) never makes a healthy worker look dead. Each
heartbeat carries ``loop_stall_s``, the seconds since the loop last finished an
iteration, so the router still notices a step that hangs.
"""

from __future__ import annotations

import logging
import pathlib
import signal
import threading
import time

from pdserve.common.auth import registration_token
from pdserve.common.config import WorkerConfig
from pdserve.common.protocol import (ErrorKind, FinishReason, Heartbeat, RankAttach, RegisterWorker, RequestDelta,
                                     WorkerRole, WorkerStats)
from pdserve.common.sharding import KVLayoutSpec
from pdserve.common.transport import Mailbox
from pdserve.common.validation import ValidationError
from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore

logger = logging.getLogger(__name__)

REGISTER_EVERY_S = 5.0
_IDLE_WAIT_S = 0.05
_RANK_PING_S = 1.0


class WorkerBase:
    """A worker process: ``EngineCore`` + mailbox + liveness thread + the step loop.

    Subclasses implement ``handle(msg)`` for inbound messages and events, and
    ``step() -> bool`` (True if it did any work). ``run()`` serves until
    ``stop()``; tests may instead call ``handle``/``step`` themselves.

    Attributes:
        core: the engine (runner, KV cache, block manager, scheduler).
        stats: the worker's KV transfer counters; the engine's are merged in heartbeats.
    """

    role: WorkerRole

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig):
        self.engine_config = engine_config
        self.config = worker_config
        self.worker_id = worker_config.worker_id
        self.core = EngineCore(engine_config)
        self.runner = self.core.runner
        self.stats = WorkerStats()
        try:
            self.mailbox = Mailbox(worker_config.host, worker_config.port)
        except BaseException:
            self.core.close()
            raise
        self.model_name = engine_config.model.rstrip("/").split("/")[-1]
        self._stop = threading.Event()
        self._loop_tick = time.monotonic()  # when the step loop last finished an iteration
        self._last_step = self._loop_tick  # when the ranks last heard from the driver
        self._liveness: threading.Thread | None = None

    def attach_kv_agent(self) -> None:
        """Give every rank its KV transfer agent; ranks report back through this worker's mailbox."""
        try:
            self.runner.attach_kv_agent(RankAttach(worker_id=self.worker_id, role=self.role,
                                                   driver_addr=self.mailbox.address, host=self.config.host,
                                                   transfer_timeout_s=self.config.transfer_timeout_s),
                                        report=self.mailbox.inject)
        except BaseException:
            self.close()
            raise
        self.kv_layout = self.runner.kv_layout()
        self.kv_layout_spec = KVLayoutSpec(self.kv_layout.tensor_parallel_size, self.kv_layout.pipeline_parallel_size,
                                           self.kv_layout.num_layers, self.kv_layout.num_kv_heads)

    # ---- hooks ------------------------------------------------------------------

    def handle(self, msg) -> None:
        raise NotImplementedError

    def step(self) -> bool:
        raise NotImplementedError

    def registration(self) -> RegisterWorker:
        limits = self.core.limits
        secret = self.config.cluster_secret
        return RegisterWorker(worker_id=self.worker_id, role=self.role, input_addr=self.mailbox.address,
                              model_name=self.model_name, num_blocks=limits.num_blocks,
                              block_size=limits.block_size, max_model_len=limits.max_model_len,
                              vocab_size=limits.vocab_size, kv_layout=self.runner.kv_layout(),
                              auth=registration_token(secret, self.worker_id, self.role, self.mailbox.address)
                              if secret else None)

    def close(self) -> None:
        self._stop.set()
        if self._liveness is not None:
            self._liveness.join(timeout=2)
        self.mailbox.close()
        self.core.close()

    # ---- liveness (IO thread) -----------------------------------------------------

    def start_liveness(self) -> None:
        """Start the thread that registers and heartbeats (``run`` does this)."""
        if self._liveness is None:
            self._liveness = threading.Thread(target=self._liveness_loop, name="liveness", daemon=True)
            self._liveness.start()

    def _liveness_loop(self) -> None:
        last_register = float("-inf")
        while True:
            now = time.monotonic()
            if now - last_register >= REGISTER_EVERY_S:
                last_register = now
                self.mailbox.put(self.config.router_addr, self.registration())
            try:
                beat = self.heartbeat()
                self.mailbox.put(self.config.router_addr, beat)
                if self.config.health_file and beat.loop_stall_s < self.config.health_stall_s:
                    pathlib.Path(self.config.health_file).touch()
            except Exception:  # a figure read mid-update must not end liveness
                logger.exception("building a heartbeat failed")
            if self._stop.wait(self.config.heartbeat_interval_s):
                return

    def heartbeat(self) -> Heartbeat:
        """Load figures, read from the step loop's objects without a lock (ints and lengths only)."""
        core, scheduler = self.core, self.core.scheduler
        return Heartbeat(worker_id=self.worker_id, role=self.role, num_running=scheduler.num_running,
                         num_waiting=scheduler.num_waiting, num_free_blocks=core.block_manager.num_free_blocks,
                         num_blocks=core.block_manager.num_blocks, max_step_batch_size=core.max_step_batch_size,
                         num_steps=core.num_steps, stats=core.stats(self.stats),
                         loop_stall_s=max(0.0, time.monotonic() - self._loop_tick))

    # ---- loop -------------------------------------------------------------------

    def stop(self, *_args) -> None:
        self._stop.set()

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT or ``stop()``."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        logger.info("%s %s listening on %s", self.role.name.lower(), self.worker_id, self.mailbox.address)
        self.start_liveness()
        try:
            while not self._stop.is_set():
                self.run_once()
        finally:
            self.close()

    def run_once(self) -> None:
        """One loop iteration: periodic checks, the inbox, one step.

        A multi-rank worker idle for ``_RANK_PING_S`` pings its ranks, so a dead rank ends the
        worker (an exception out of ``run``) even when no request arrives.
        """
        now = time.monotonic()
        self.periodic(now)
        busy = self.core.has_unfinished()
        self.drain_inbox(wait=0 if busy else _IDLE_WAIT_S)
        if self.step():
            self._last_step = now
        elif self.core.has_unfinished():
            time.sleep(0.001)  # waiting on remote KV / peers only
        elif self.core.world_size > 1 and now - self._last_step > _RANK_PING_S:
            self.core.ping_ranks()
            self._last_step = now
        self._loop_tick = time.monotonic()

    def drain_inbox(self, wait: float = 0) -> None:
        """Handle every queued message (waiting up to ``wait`` seconds for the first)."""
        msg = self.mailbox.get(timeout=wait) if wait else self.mailbox.get_nowait()
        while msg is not None:
            try:
                self.handle(msg)
            except Exception:  # a bad message must not kill the worker
                logger.exception("error handling %s", type(msg).__name__)
            msg = self.mailbox.get_nowait()

    def periodic(self, now: float) -> None:
        """Subclass hook, called every loop iteration before the inbox is drained."""


def error_delta(request_id: str, error: str, kind: ErrorKind = ErrorKind.INTERNAL) -> RequestDelta:
    """The delta that fails a whole router request; the router answers ``kind.http_status``."""
    return RequestDelta(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error,
                        error_kind=kind)


def rejection_delta(request_id: str, error: ValueError) -> RequestDelta:
    """An ``error_delta`` for a request the engine refused at ``add_request``."""
    kind = ErrorKind.INVALID_REQUEST if isinstance(error, ValidationError) else ErrorKind.INTERNAL
    return error_delta(request_id, str(error), kind)
