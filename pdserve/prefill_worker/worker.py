"""The prefill worker: batched (chunked) prefill, first token, KV sent to decode.

For each ``RemotePrefillRequest``:

1. Make sure the two-rank process group with that decode worker (and pair
   generation) is connected; the request waits in ``pending_pair`` meanwhile.
2. The scheduler batches prompts under the token budget (long prompts in
   chunks). In the step that computes a prompt's last chunk we first send the
   ``KVTransferHeader``, then, from the model's per-layer hook, start sending
   each layer's blocks as soon as that layer has written them, so sending layer
   i overlaps computing layer i+1 (DistServe / Mooncake style layer-wise transfer).
3. The first token is sampled here; the request's blocks are freed at once (the
   sends read from gathered copies). A ``SendCompleter`` thread waits for the
   sends and we then tell the decode worker ``RemotePrefillDone`` with the
   first token, byte count and checksum, or the error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass


from pdserve.common.config import WorkerConfig
from pdserve.common.validation import prefill_sampling_params
from pdserve.common.protocol import (AbortRequest, KVTransferHeader, RemotePrefillDone, RemotePrefillRequest,
                                     TokenLogprob, WorkerRole)
from pdserve.engine.config import EngineConfig
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.worker_base import WorkerBase
from pdserve.kvtransfer.sender import OutgoingKV, PrefillPairs, SendCompleter

logger = logging.getLogger(__name__)


@dataclass
class _SendDone:
    """Event from the SendCompleter thread into the step loop."""

    request_id: str
    num_bytes: int
    checksum: int
    error: str | None
    finished_at: float = 0.0


class PrefillWorker(WorkerBase):
    role = WorkerRole.PREFILL

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig):
        if engine_config.parallel.world_size > 1:
            raise ValueError("a prefill worker runs on one rank for now: sending KV from several ranks (each its "
                             "own layers and KV heads) is not built yet; use --tensor-parallel-size 1 "
                             "--pipeline-parallel-size 1 for prefill workers")
        super().__init__(engine_config, worker_config)
        self.pairs = PrefillPairs(self.worker_id, self.runner.device, worker_config.transfer_timeout_s)
        self.completer = SendCompleter(
            worker_config.transfer_timeout_s,
            on_done=lambda rid, nbytes, checksum, err: self.mailbox.inject(
                _SendDone(rid, nbytes, checksum, err, time.monotonic())))
        self.pending_pair: dict[str, RemotePrefillRequest] = {}  # waiting for the pair to connect
        self.origin: dict[str, RemotePrefillRequest] = {}  # admitted, by request_id
        self.first_token: dict[str, tuple[int, TokenLogprob | None]] = {}  # sampled, send in flight
        self.send_started: dict[str, float] = {}

    def close(self) -> None:
        self.completer.close()
        self.pairs.close()
        super().close()

    # ---- inbound ------------------------------------------------------------------

    def handle(self, msg) -> None:
        if isinstance(msg, RemotePrefillRequest):
            self.pending_pair[msg.request_id] = msg
            self.pairs.request_pair(msg.decode_worker_id, msg.transfer_host, msg.transfer_port, msg.pair_generation)
        elif isinstance(msg, AbortRequest):
            self.pending_pair.pop(msg.request_id, None)
            if self.core.abort(msg.request_id):
                self.origin.pop(msg.request_id, None)
        elif isinstance(msg, _SendDone):
            self._send_done(msg)
        else:
            logger.warning("prefill worker ignores %s", type(msg).__name__)

    def _send_done(self, event: _SendDone) -> None:
        origin = self.origin.pop(event.request_id)
        first_token, first_logprob = self.first_token.pop(event.request_id)
        started = self.send_started.pop(event.request_id)
        if event.error is not None:
            self.stats.kv_transfer_failures += 1
            self.pairs.close_pair(origin.decode_worker_id, origin.pair_generation)
        else:  # count successes only, as the decode worker does
            self.stats.num_kv_transfers += 1
            self.stats.kv_transfer_seconds += event.finished_at - started
            self.stats.kv_transfer_bytes += event.num_bytes
        self._reply(origin, RemotePrefillDone(
            request_id=event.request_id, prefill_worker_id=self.worker_id, first_token_id=first_token,
            num_tokens=len(origin.prompt_token_ids), num_bytes=event.num_bytes, checksum=event.checksum,
            error=event.error, first_logprob=first_logprob))

    def _reply(self, origin: RemotePrefillRequest, msg) -> None:
        self.mailbox.put(origin.decode_addr, msg)

    def _fail(self, origin: RemotePrefillRequest, error: str) -> None:
        self._reply(origin, RemotePrefillDone(request_id=origin.request_id, prefill_worker_id=self.worker_id,
                                              error=error))

    def _admit_connected(self) -> None:
        """Move requests whose pair is ready into the scheduler."""
        for request_id, origin in list(self.pending_pair.items()):
            pair = self.pairs.get(origin.decode_worker_id, origin.pair_generation)
            failure = None if pair is not None else self.pairs.failure(origin.decode_worker_id,
                                                                       origin.pair_generation)
            if pair is None and failure is None:
                continue  # still connecting
            del self.pending_pair[request_id]
            if failure is not None:
                self._fail(origin, failure)
                continue
            # Only the first token is sampled here; the decode worker produces the rest.
            try:
                self.core.add_request(request_id, origin.prompt_token_ids,
                                      prefill_sampling_params(origin.sampling_params))
            except ValueError as e:  # ValidationError included: D then recomputes or fails it
                self._fail(origin, str(e))
                continue
            self.origin[request_id] = origin

    # ---- step ---------------------------------------------------------------------

    def step(self) -> bool:
        self._admit_connected()
        scheduler_output = self.core.schedule()
        if not scheduler_output.scheduled:
            return False
        outgoing = self._start_transfers(scheduler_output.scheduled)
        scheduler_output.scheduled = [(r, n) for r, n in scheduler_output.scheduled
                                      if not r.status.is_finished]  # dropped by a broken pair
        if not scheduler_output.scheduled:
            return True

        def on_layer_done(layer_idx: int) -> None:
            kv_layer = self.runner.kv_cache[layer_idx]
            for request, send, first_block in outgoing:
                send.send_layer(layer_idx, kv_layer, request.block_table[first_block:])

        try:
            runner_output = self.core.execute(scheduler_output, on_layer_done=on_layer_done if outgoing else None)
        except Exception as e:
            for _, send, _ in outgoing:  # unblock the pair: its queued sends will never complete
                send.abort(f"prefill forward failed: {e}")
            raise
        for request, send, _ in outgoing:
            self.first_token[request.request_id] = (runner_output.sampled_token_ids[request.request_id],
                                                    runner_output.logprobs.get(request.request_id))
            self.completer.submit(send)
        self.core.update(scheduler_output, runner_output)  # max_tokens=1: finished, blocks freed
        return True

    def _start_transfers(self, scheduled: list[tuple[Request, int]]) -> list[tuple[Request, OutgoingKV, int]]:
        """Header + OutgoingKV (+ first block to send) for each request whose prompt completes in this step.

        Blocks the decode worker already holds (its prefix-cache hits) are not sent.
        """
        outgoing = []
        runner = self.runner
        for request, num_new in scheduled:
            if request.num_computed_tokens + num_new != request.num_tokens:
                continue  # an earlier chunk: nothing to send yet
            origin = self.origin[request.request_id]
            pair = self.pairs.get(origin.decode_worker_id, origin.pair_generation)
            if pair is None:  # the pair broke since admission
                self.core.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
                self.origin.pop(request.request_id)
                self._fail(origin, "KV transfer pair to the decode worker was closed")
                continue
            first_block = origin.num_cached_tokens // runner.block_size
            self._reply(origin, KVTransferHeader(
                request_id=request.request_id, prefill_worker_id=self.worker_id,
                pair_generation=origin.pair_generation, num_layers=runner.num_layers,
                num_blocks=len(request.block_table) - first_block, block_size=runner.block_size,
                num_kv_heads=runner.num_kv_heads, head_dim=runner.head_dim,
                dtype=str(runner.dtype).removeprefix("torch."), num_tokens=request.num_tokens,
                first_block=first_block))
            self.send_started[request.request_id] = time.monotonic()
            outgoing.append((request, OutgoingKV(pair, request.request_id, runner.num_layers), first_block))
        return outgoing
