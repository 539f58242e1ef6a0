"""The decode worker: continuous batching over a paged KV cache.

Life of a request here (DESIGN.md, "decode-first"):

1. ``GenerateRequest`` from the router. With a prefill worker named, the
   scheduler reserves blocks for the prompt and parks the request in
   ``WAITING_FOR_REMOTE_KVS``; we send ``RemotePrefillRequest`` to the prefill
   worker with our KV store address and the pair's generation.
2. The prefill worker sends ``KVTransferHeader`` (ZMQ), the KV layer by layer
   (torch.distributed, received by ``DecodePairs`` into a staging tensor) and
   ``RemotePrefillDone`` (first token, checksum).
3. With both the KV and the done message in hand we check sizes and checksum,
   copy the staging tensor into the reserved blocks, and the request joins the
   running batch. Any failure or a missed deadline recomputes the prompt here
   (policy ``recompute``) or fails the request (policy ``fail``).
4. Every step decodes all running requests as one batch; new ones join and
   finished ones leave between steps; token deltas go to the router.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from pdserve.common.config import WorkerConfig
from pdserve.common.protocol import (AbortRequest, ErrorKind, GenerateRequest, KVTransferHeader, RegisterWorker,
                                     RemotePrefillDone, RemotePrefillRequest, RequestDelta, RequestOutputs,
                                     WorkerRole)
from pdserve.engine.config import EngineConfig
from pdserve.engine.outputs import EngineCoreOutput
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.worker_base import WorkerBase, error_delta, rejection_delta
from pdserve.kvtransfer.receiver import DecodePairs, ReceivedKV, TransferFailed, check_transfer

logger = logging.getLogger(__name__)


@dataclass
class _RemotePrefill:
    """A request whose prompt KV is being computed by a prefill worker."""

    prefill_worker_id: str
    prefill_addr: str
    deadline: float | None = None  # set when the RemotePrefillRequest is sent (time.monotonic())
    sent_at: float | None = None
    pair_generation: int | None = None
    received: ReceivedKV | None = None
    done: RemotePrefillDone | None = None


class DecodeWorker(WorkerBase):
    role = WorkerRole.DECODE

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig):
        super().__init__(engine_config, worker_config)
        self.pairs = DecodePairs(self.worker_id, worker_config.host, self.runner.device,
                                 worker_config.transfer_timeout_s, on_received=self.mailbox.inject)
        self.remote: dict[str, _RemotePrefill] = {}
        self._deltas: list[RequestDelta] = []

    def registration(self) -> RegisterWorker:
        reg = super().registration()
        reg.transfer_host = self.pairs.store_host
        reg.transfer_port = self.pairs.store_port
        return reg

    def close(self) -> None:
        self.pairs.close()
        super().close()

    # ---- inbound ------------------------------------------------------------------

    def handle(self, msg) -> None:
        if isinstance(msg, GenerateRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            self._abort(msg.request_id)
        elif isinstance(msg, KVTransferHeader):
            self.pairs.submit(msg)
        elif isinstance(msg, RemotePrefillDone):
            self._remote_progress(msg.request_id, done=msg)
        elif isinstance(msg, ReceivedKV):
            self._remote_progress(msg.request_id, received=msg)
        elif isinstance(msg, TransferFailed):
            self._remote_failed(msg.request_id, f"KV transfer failed: {msg.reason}")
        else:
            logger.warning("decode worker ignores %s", type(msg).__name__)

    def _add(self, msg: GenerateRequest) -> None:
        remote = msg.prefill_worker_id is not None and msg.prefill_addr is not None
        if remote and self.core.world_size > 1:
            # KV transfer into a tensor/pipeline-parallel decode worker (each rank receiving its own
            # slice) is not built yet: such a worker prefills its prompts itself.
            remote = False
            self.core.scheduler.stats.num_local_prefills += 1
        try:
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.sampling_params, remote_prefill=remote)
        except ValueError as e:  # ValidationError included: a request sent past the router's checks
            self._deltas.append(rejection_delta(msg.request_id, e))
            return
        if remote:
            self.remote[msg.request_id] = _RemotePrefill(msg.prefill_worker_id, msg.prefill_addr)

    def _abort(self, request_id: str) -> None:
        state = self.remote.pop(request_id, None)
        if state is not None:
            self.mailbox.put(state.prefill_addr, AbortRequest(request_id=request_id))
        self.core.abort(request_id)

    # ---- remote prefill -----------------------------------------------------------

    def _send_remote_prefill(self, request: Request) -> None:
        state = self.remote[request.request_id]
        state.sent_at = time.monotonic()
        state.deadline = state.sent_at + self.config.remote_prefill_timeout_s
        first_block = request.num_cached_tokens // self.runner.block_size
        state.pair_generation = self.pairs.generation_for(state.prefill_worker_id)
        self.mailbox.put(state.prefill_addr, RemotePrefillRequest(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling_params=request.sampling_params, decode_worker_id=self.worker_id, decode_addr=self.mailbox.address,
            transfer_host=self.pairs.store_host, transfer_port=self.pairs.store_port,
            pair_generation=state.pair_generation,
            dest_block_ids=request.block_table[first_block:], num_cached_tokens=request.num_cached_tokens))

    def _remote_progress(self, request_id: str, received: ReceivedKV | None = None,
                         done: RemotePrefillDone | None = None) -> None:
        state = self.remote.get(request_id)
        if state is None:
            return  # aborted or already failed over; a late transfer is dropped
        if done is not None:
            if done.error is not None:
                self._remote_failed(request_id, f"prefill worker {done.prefill_worker_id}: {done.error}")
                return
            state.done = done
        if received is not None:
            state.received = received
        if state.done is None or state.received is None:
            return
        error = self._install_kv(request_id, state)
        if error is not None:
            # the stream of that pair generation can no longer be trusted (a newer one is left alone)
            self.pairs.reset(state.prefill_worker_id, error, generation=state.pair_generation)
            self._remote_failed(request_id, error)
            return
        del self.remote[request_id]
        self.stats.num_kv_transfers += 1
        self.stats.kv_transfer_bytes += state.received.num_bytes
        self.stats.kv_transfer_seconds += time.monotonic() - state.sent_at
        output = self.core.remote_kv_arrived(request_id, state.done.first_token_id, state.done.first_logprob)
        if output is not None:
            self._emit(output)

    def _install_kv(self, request_id: str, state: _RemotePrefill) -> str | None:
        """Check the received KV and copy it into the request's reserved blocks."""
        request = self.core.scheduler.waiting_for_remote_kvs.get(request_id)
        if request is None:
            return "request is no longer waiting for KV"
        done, kv = state.done, state.received.kv  # kv: [num_layers, 2, n, block_size, num_kv_heads, head_dim]
        error = check_transfer(state.received, done)
        if error is not None:
            return error
        if done.first_token_id is None:
            return f"request {request_id}: prefill worker {done.prefill_worker_id} sent no first token"
        first_block = request.num_cached_tokens // self.runner.block_size  # blocks before it were cache hits
        dest = request.block_table[first_block:]
        expected = (self.runner.num_layers, 2, len(dest), self.runner.block_size,
                    self.runner.num_kv_heads, self.runner.head_dim)
        if tuple(kv.shape) != expected or kv.dtype != self.runner.dtype:
            return f"KV shape {tuple(kv.shape)} {kv.dtype} does not match this worker's {expected} {self.runner.dtype}"
        index = torch.tensor(dest, dtype=torch.int64, device=self.runner.device)
        self.runner.kv_cache.index_copy_(2, index, kv.to(self.runner.device))
        return None

    def _remote_failed(self, request_id: str, reason: str) -> None:
        state = self.remote.pop(request_id, None)
        if state is None:
            return
        self.stats.kv_transfer_failures += 1
        self.mailbox.put(state.prefill_addr, AbortRequest(request_id=request_id))
        if self.config.prefill_failure_policy == "recompute":
            logger.warning("request %s: %s; recomputing the prefill locally", request_id, reason)
            self.core.recompute_locally(request_id)
        else:
            logger.warning("request %s failed: %s", request_id, reason)
            self.core.finish_request(request_id, RequestStatus.FINISHED_ERROR)
            self._deltas.append(error_delta(request_id, reason, ErrorKind.UNAVAILABLE))

    def periodic(self, now: float) -> None:
        expired = [rid for rid, s in self.remote.items() if s.deadline is not None and now > s.deadline]
        for request_id in expired:
            self._remote_failed(request_id, f"no KV from the prefill worker within "
                                            f"{self.config.remote_prefill_timeout_s:.0f} s")

    # ---- step ---------------------------------------------------------------------

    def step(self) -> bool:
        scheduler_output = self.core.schedule()
        for request in scheduler_output.remote_prefills:
            self._send_remote_prefill(request)
        if scheduler_output.scheduled:
            runner_output = self.core.execute(scheduler_output)
            for output in self.core.update(scheduler_output, runner_output):
                self._emit(output)
        self._flush()
        return not scheduler_output.is_empty()

    def _emit(self, output: EngineCoreOutput) -> None:
        request, finished = output.request, output.finished
        if finished is not None:  # a request routed to a prefill worker but prefilled here leaves its entry
            self.remote.pop(request.group_id, None)
        self._deltas.append(RequestDelta(
            request_id=request.group_id, new_token_ids=output.new_token_ids,
            finish_reason=finished.finish_reason() if finished else None,
            num_prompt_tokens=request.num_prompt_tokens, index=request.sample_index, logprobs=output.logprobs,
            num_cached_tokens=request.num_cached_tokens))

    def _flush(self) -> None:
        if self._deltas:
            self.mailbox.put(self.config.router_addr, RequestOutputs(worker_id=self.worker_id, deltas=self._deltas))
            self._deltas = []
