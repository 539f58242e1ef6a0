"""What the prefill and decode workers share: engine, mailbox, heartbeats, step loop.

The loop is ``handle inbox -> schedule -> execute -> postprocess``. IO threads
(``Mailbox``) own the sockets; the loop only drains queues, and sleeps on the
inbox queue (not a socket) when it has nothing to compute.
"""

from __future__ import annotations

import logging
import signal

import msgspec
import threading
import time

from pdserve.common.config import WorkerConfig
from pdserve.common.protocol import FinishReason, Heartbeat, RegisterWorker, RequestDelta, WorkerRole, WorkerStats
from pdserve.common.transport import Mailbox
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request
from pdserve.engine.scheduler import Scheduler, SchedulerConfig

logger = logging.getLogger(__name__)

_REGISTER_EVERY_S = 5.0
_IDLE_WAIT_S = 0.05


class WorkerBase:
    """A worker process: engine + mailbox + the step loop.

    Subclasses implement ``handle(msg)`` for inbound messages and events, and
    ``step() -> bool`` (True if it did any work).
    """

    role: WorkerRole

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig):
        self.engine_config = engine_config
        self.config = worker_config
        self.worker_id = worker_config.worker_id
        self.runner = ModelRunner(engine_config)
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          enable_prefix_caching=engine_config.enable_prefix_caching,
                                          salt=self.runner.model_fingerprint)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=engine_config.max_num_seqs,
                            max_num_batched_tokens=engine_config.max_num_batched_tokens,
                            max_model_len=self.runner.max_model_len,
                            remote_prefill_threshold=engine_config.remote_prefill_threshold),
            self.block_manager,
        )
        self.stats = WorkerStats()  # transfer and token counters; scheduler counters are merged in heartbeat()
        self.mailbox = Mailbox(worker_config.host, worker_config.port)
        self.model_name = engine_config.model.rstrip("/").split("/")[-1]
        self.max_step_batch_size = 0
        self.num_steps = 0
        self._stop = threading.Event()
        self._last_heartbeat = 0.0
        self._last_register = 0.0

    # ---- hooks ------------------------------------------------------------------

    def handle(self, msg) -> None:
        raise NotImplementedError

    def step(self) -> bool:
        raise NotImplementedError

    def registration(self) -> RegisterWorker:
        return RegisterWorker(worker_id=self.worker_id, role=self.role, input_addr=self.mailbox.address,
                              model_name=self.model_name, num_blocks=self.runner.num_blocks,
                              block_size=self.runner.block_size, max_model_len=self.runner.max_model_len)

    def close(self) -> None:
        self.mailbox.close()

    # ---- loop -------------------------------------------------------------------

    def stop(self, *_args) -> None:
        self._stop.set()

    def run(self) -> None:
        """Serve until SIGTERM/SIGINT or ``stop()``."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)
        logger.info("%s %s listening on %s", self.role.name.lower(), self.worker_id, self.mailbox.address)
        try:
            while not self._stop.is_set():
                self._periodic()
                self._drain_inbox(wait=_IDLE_WAIT_S if not self.scheduler.has_unfinished() else 0)
                if not self.step() and self.scheduler.has_unfinished():
                    time.sleep(0.001)  # waiting on remote KV / peers only
        finally:
            self.close()

    def _drain_inbox(self, wait: float) -> None:
        msg = self.mailbox.get(timeout=wait) if wait else self.mailbox.get_nowait()
        while msg is not None:
            try:
                self.handle(msg)
            except Exception:  # a bad message must not kill the worker
                logger.exception("error handling %s", type(msg).__name__)
            msg = self.mailbox.get_nowait()

    def _periodic(self) -> None:
        now = time.monotonic()
        if now - self._last_register >= _REGISTER_EVERY_S:
            self._last_register = now
            self.mailbox.put(self.config.router_addr, self.registration())
        if now - self._last_heartbeat >= self.config.heartbeat_interval_s:
            self._last_heartbeat = now
            self.mailbox.put(self.config.router_addr, self.heartbeat())
        self.periodic(now)

    def periodic(self, now: float) -> None:
        """Subclass hook, called every loop iteration before the inbox is drained."""

    def heartbeat(self) -> Heartbeat:
        return Heartbeat(worker_id=self.worker_id, role=self.role, num_running=self.scheduler.num_running,
                         num_waiting=self.scheduler.num_waiting, num_free_blocks=self.block_manager.num_free_blocks,
                         num_blocks=self.block_manager.num_blocks, max_step_batch_size=self.max_step_batch_size,
                         num_steps=self.num_steps, stats=self.worker_stats())

    def worker_stats(self) -> WorkerStats:
        s = self.scheduler.stats
        return msgspec.structs.replace(
            self.stats, num_preemptions=s.num_preemptions, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_prompt_tokens=s.num_prompt_tokens,
            num_local_prefills=s.num_local_prefills)

    def new_request(self, request_id: str, prompt_token_ids: list[int], params, **kw) -> Request:
        """Build a Request, checking what the router cannot know about this worker's model.

        Raises:
            ValueError: empty prompt or a token id outside the model's vocabulary.
        """
        vocab_size = self.runner.model.config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"request {request_id}: token ids {bad[:5]} are outside the model's vocabulary "
                             f"(size {vocab_size})")
        return Request(request_id, prompt_token_ids, params, eos_token_ids=self.runner.eos_token_ids,
                       max_model_len=self.runner.max_model_len, **kw)

    def record_step(self, batch_size: int) -> None:
        self.num_steps += 1
        self.max_step_batch_size = max(self.max_step_batch_size, batch_size)


def error_delta(request_id: str, error: str) -> RequestDelta:
    return RequestDelta(request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR, error=error)
