"""The prefill worker: batched (chunked) prefill, first token, KV sent to decode.

It serves ``RemotePrefillRequest``s and nothing else; how (pairs, layer-wise sends, the first token,
``RemotePrefillDone``) is ``pdserve.cluster.kv_source.KVSource``, which a decode worker also runs for
peers that pull a prefix from it.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from pdserve.common.config import WorkerConfig
from pdserve.common.protocol import (AbortRequest, ConnectKVPair, KVStepOps, RankReport, RemotePrefillRequest,
                                     WorkerRole)
from pdserve.engine.config import EngineConfig
from pdserve.cluster.kv_source import KVSource
from pdserve.cluster.worker_base import WorkerBase, stamp_prefill

logger = logging.getLogger(__name__)


class PrefillWorker(WorkerBase):
    role = WorkerRole.PREFILL

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig):
        # A prefill worker never runs a decode-only step: nothing to compile for one.
        super().__init__(dataclasses.replace(engine_config, enforce_eager=True, speculative_config=None), worker_config)
        self.attach_kv_agent()
        self.source = KVSource(self)

    # ---- inbound ------------------------------------------------------------------

    def handle(self, msg) -> None:
        if isinstance(msg, RemotePrefillRequest):
            self.source.receive(msg)
        elif isinstance(msg, AbortRequest):
            self.source.drop(msg.request_id)
        elif isinstance(msg, RankReport):
            self.source.report(msg)
        elif isinstance(msg, ConnectKVPair):  # a decode worker warms our pair ahead of its first request
            self.source.connect(msg)
        else:
            logger.warning("prefill worker ignores %s", type(msg).__name__)

    def idle(self) -> bool:
        return super().idle() and self.source.idle()

    def abandon_all(self, reason: str) -> int:
        return self.source.abandon_all(reason)

    def abandon_router(self, router_addr: str) -> int:
        """Drop the requests the router at ``router_addr`` took (it is gone; their decode workers drop
        them too); returns how many."""
        return self.source.abandon_router(router_addr)

    # ---- step ---------------------------------------------------------------------

    def step(self) -> bool:
        self.source.admit_connected()
        scheduler_output = self.core.schedule()
        if not scheduler_output.scheduled:
            return False
        started = time.time()
        sends = self.source.start_transfers(scheduler_output.scheduled)
        try:
            runner_output = self.core.execute(scheduler_output, kv_ops=KVStepOps(sends=sends) if sends else None)
        except Exception as e:  # noqa: BLE001  one failing batch must not take the worker down
            if self.core.world_size > 1:
                raise  # the ranks may be mid-collective: leave; decode workers recompute the prompts
            logger.exception("prefill step over %d requests failed; handing them back",
                             len(scheduler_output.scheduled))
            self.source.step_failed(self.core.fail_step(scheduler_output), e)
            return True
        stamp_prefill(self.source.timings, scheduler_output.scheduled, started, time.time())
        self.source.step_done(sends, runner_output)
        self.core.update(scheduler_output, runner_output)  # max_tokens=1: finished, blocks freed
        return True
