"""Which workers are alive, and which one gets the next request.

Pure Python, no sockets: the router's ZMQ task feeds it ``RegisterWorker`` and
``Heartbeat`` messages; the HTTP handlers ask it for a worker. Times come from
``time.monotonic`` unless the caller passes ``now`` (tests do).

Liveness: a worker is live from its ``RegisterWorker`` until
``worker_timeout_s`` passes without a register or heartbeat from it; then
``expire`` drops it and returns it so the caller can fail its requests. A
heartbeat from a worker the registry does not know is ignored (workers re-send
``RegisterWorker`` every few seconds, which re-adds them).

Routing: round-robin per role over the live workers in registration order,
skipping decode workers whose KV cache cannot hold the request.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from pdserve.common.protocol import Heartbeat, RegisterWorker, WorkerRole

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class WorkerInfo:
    """A live worker as the router sees it."""

    worker_id: str
    role: WorkerRole
    input_addr: str
    model_name: str
    num_blocks: int
    block_size: int
    max_model_len: int
    registered_at: float
    last_seen: float
    heartbeat: Heartbeat | None = None
    num_inflight: int = 0  # requests routed here and not yet finished (decode workers)
    num_routed: int = 0  # requests ever routed here

    @property
    def num_kv_tokens(self) -> int | None:
        """Tokens the KV cache holds, or None if the worker did not say."""
        if self.num_blocks <= 0 or self.block_size <= 0:
            return None
        return self.num_blocks * self.block_size

    def fits(self, num_tokens: int) -> bool:
        """Whether ``num_tokens`` tokens of one request fit this worker's KV cache."""
        if self.num_kv_tokens is None:
            return True
        return -(-num_tokens // self.block_size) <= self.num_blocks

    def to_json(self, now: float) -> dict:
        hb = self.heartbeat
        return {
            "id": self.worker_id,
            "role": self.role.name.lower(),
            "address": self.input_addr,
            "model_name": self.model_name,
            "num_blocks": hb.num_blocks if hb and hb.num_blocks else self.num_blocks,
            "block_size": self.block_size,
            "max_model_len": self.max_model_len,
            "last_seen_s_ago": round(now - self.last_seen, 3),
            "num_inflight": self.num_inflight,
            "num_routed": self.num_routed,
            "num_running": hb.num_running if hb else 0,
            "num_waiting": hb.num_waiting if hb else 0,
            "num_free_blocks": hb.num_free_blocks if hb else 0,
            "max_step_batch_size": hb.max_step_batch_size if hb else 0,
            "num_steps": hb.num_steps if hb else 0,
            "heartbeat_received": hb is not None,
        }


class WorkerRegistry:
    """Live workers per role, liveness by timeout, round-robin picking."""

    def __init__(self, worker_timeout_s: float, clock=time.monotonic):
        self.worker_timeout_s = worker_timeout_s
        self._clock = clock
        self._workers: dict[str, WorkerInfo] = {}  # insertion order = registration order
        self._next: dict[WorkerRole, int] = {WorkerRole.PREFILL: 0, WorkerRole.DECODE: 0}

    def _now(self, now: float | None) -> float:
        return self._clock() if now is None else now

    def register(self, msg: RegisterWorker, now: float | None = None) -> WorkerInfo | None:
        """Add or refresh a worker.

        Returns the *replaced* WorkerInfo if ``msg`` re-registers a known
        worker_id under a new address or role (a restarted worker: its old
        requests are gone), else None.
        """
        now = self._now(now)
        old = self._workers.get(msg.worker_id)
        if old is not None and old.input_addr == msg.input_addr and old.role == msg.role:
            old.last_seen = now
            old.num_blocks, old.block_size = msg.num_blocks, msg.block_size
            old.max_model_len = msg.max_model_len
            return None
        if old is not None:
            del self._workers[msg.worker_id]
        self._workers[msg.worker_id] = WorkerInfo(
            worker_id=msg.worker_id, role=WorkerRole(msg.role), input_addr=msg.input_addr,
            model_name=msg.model_name, num_blocks=msg.num_blocks, block_size=msg.block_size,
            max_model_len=msg.max_model_len, registered_at=now, last_seen=now)
        logger.info("worker %s registered: %s at %s (num_blocks=%d, block_size=%d)", msg.worker_id,
                    WorkerRole(msg.role).name.lower(), msg.input_addr, msg.num_blocks, msg.block_size)
        return old

    def heartbeat(self, msg: Heartbeat, now: float | None = None) -> bool:
        """Record a heartbeat; False (and ignored) if the worker is not registered."""
        info = self._workers.get(msg.worker_id)
        if info is None:
            return False
        info.last_seen = self._now(now)
        info.heartbeat = msg
        return True

    def touch(self, worker_id: str, now: float | None = None) -> None:
        """Any message from a worker proves it is alive."""
        info = self._workers.get(worker_id)
        if info is not None:
            info.last_seen = self._now(now)

    def expire(self, now: float | None = None) -> list[WorkerInfo]:
        """Drop and return every worker silent for longer than ``worker_timeout_s``."""
        now = self._now(now)
        dead = [w for w in self._workers.values() if now - w.last_seen > self.worker_timeout_s]
        for w in dead:
            del self._workers[w.worker_id]
            logger.warning("worker %s (%s) timed out: nothing heard for %.1fs", w.worker_id,
                           w.role.name.lower(), now - w.last_seen)
        return dead

    def remove(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.pop(worker_id, None)

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def live(self, role: WorkerRole | None = None) -> list[WorkerInfo]:
        return [w for w in self._workers.values() if role is None or w.role == role]

    def num_live(self, role: WorkerRole) -> int:
        return sum(1 for w in self._workers.values() if w.role == role)

    def pick(self, role: WorkerRole, num_tokens: int = 0) -> WorkerInfo | None:
        """Round-robin over live workers of ``role`` whose KV cache fits ``num_tokens``."""
        candidates = [w for w in self.live(role) if w.fits(num_tokens)]
        if not candidates:
            return None
        i = self._next[role] % len(candidates)
        self._next[role] = i + 1
        return candidates[i]

    def largest_decode(self) -> WorkerInfo | None:
        """The live decode worker whose KV cache holds the most tokens (None if none says)."""
        sized = [w for w in self.live(WorkerRole.DECODE) if w.num_kv_tokens is not None]
        return max(sized, key=lambda w: w.num_kv_tokens, default=None)

    def snapshot(self, now: float | None = None) -> list[dict]:
        now = self._now(now)
        return [w.to_json(now) for w in self._workers.values()]
