"""Which workers are alive, and which one gets the next request.

Pure Python, no sockets: the router's ZMQ task feeds it ``RegisterWorker`` and
``Heartbeat`` messages; the HTTP handlers ask it for a worker. Times come from
``time.monotonic`` unless the caller passes ``now`` (tests do).

Liveness: a worker is live from its ``RegisterWorker`` until
``worker_timeout_s`` passes without a register or heartbeat from it; then
``expire`` drops it and returns it so the caller can fail its requests. A
heartbeat from a worker the registry does not know is ignored (workers re-send
``RegisterWorker`` every few seconds, which re-adds them). Heartbeats come from
a worker's IO thread, so a long step does not silence them; each says how long
the worker's step loop has gone without finishing an iteration
(``loop_stall_s``). A worker stalled past ``step_timeout_s`` is kept but
*stalled*: nothing is routed to it, and ``expire`` returns it once so its
requests fail; it serves again when its loop moves.

Routing: ``live`` lists the workers that take new requests (not stalled, not
draining) in registration order; the router's policy (``routing.py``) picks
among those that accept a request. ``pick`` is round-robin over them.

Pools: ``desired`` holds each pool's target size once someone scaled it
(``pdserve scale``, ``POST /admin/scale``); launchers start workers up to it,
and ``surplus`` picks which serving workers to drain when it shrinks. A
*draining* worker stays registered (its requests finish) but gets nothing new.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from pdserve.common.protocol import Heartbeat, KVLayout, RegisterWorker, WorkerRole
from pdserve.common.validation import EngineLimits
from pdserve.engine.scheduling.kv_offload import MIN_MEASURED_LOAD_BLOCKS

logger = logging.getLogger(__name__)


# A worker's measured prefill speed counts once it has prefilled this many prompt tokens.
MIN_MEASURED_PREFILL_TOKENS = 256


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
    vocab_size: int | None = None
    kv_group_caps: list[int | None] | None = None  # per KV cache group, a window's cap on a sequence's blocks
    kv_layout: KVLayout | None = None  # how its KV cache is split over its ranks (None: one rank)
    heartbeat: Heartbeat | None = None
    num_inflight: int = 0  # requests routed here and not yet finished (decode workers)
    num_routed: int = 0  # requests ever routed here
    stalled: bool = False  # its step loop stopped moving (heartbeat.loop_stall_s > step_timeout_s)
    stall_reported: bool = False  # ``expire`` returned it for this stall already
    draining: bool = False  # leaving: nothing new is routed to it
    drain_reason: str = ""
    drain_sent_at: float | None = None  # when the router last sent it DrainWorker
    num_prefill_pending: int = 0  # prefill workers: requests naming it whose KV has not arrived yet
    # Prompt tokens routed here to prefill (a prefill worker's, or a decode worker's own local prefills)
    # whose first token has not come back yet: this worker's prefill queue, for load-aware placement.
    prefill_pending_tokens: int = 0
    # How this worker reaches this router (``RegisterWorker.router_addr``): named in every request sent
    # to it so its outputs come back here and not to another router of the tier. None: a worker that
    # did not say (it sends everything to its one router).
    router_addr: str | None = None
    kernels: dict[str, str] = dataclasses.field(default_factory=dict)  # native kernel -> "native" / "torch"
    linear_weight_format: str | None = None  # plain, onednn or panel, as the worker chose at load
    plan: dict[str, str] = dataclasses.field(default_factory=dict)  # the runner's start-up choices (RunnerPlan)
    prefix_cache_salt: int | None = None  # its block hashes' salt (None: no prefix cache, no KV events)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """The prefill speed this worker measured (prompt tokens per second of the steps computing them,
        from its heartbeats), or None before it has prefilled ``MIN_MEASURED_PREFILL_TOKENS``."""
        stats = self.heartbeat.stats if self.heartbeat is not None else None
        if stats is None or stats.prefill_compute_tokens < MIN_MEASURED_PREFILL_TOKENS \
                or stats.prefill_compute_seconds <= 0:
            return None
        return stats.prefill_compute_tokens / stats.prefill_compute_seconds

    def tier_load_cost(self, medium: str) -> float | None:
        """What bringing a block back from offload tier ``medium`` (host, disk) costs this worker, as a
        fraction of recomputing it: its measured seconds per block loaded over its measured seconds per
        block prefilled (heartbeat figures), or None before both are measured. At 1 or more the worker
        recomputes such hits (``kv_offload.TierCosts``)."""
        stats = self.heartbeat.stats if self.heartbeat is not None else None
        speed = self.prefill_tokens_per_s
        if stats is None or speed is None or self.block_size <= 0:
            return None
        blocks, seconds = ((stats.kv_onload_blocks, stats.kv_onload_seconds) if medium == "host"
                           else (stats.kv_disk_read_blocks, stats.kv_disk_read_seconds))
        if blocks < MIN_MEASURED_LOAD_BLOCKS:
            return None
        return seconds / blocks / (self.block_size / speed)

    @property
    def state(self) -> str:
        """``draining``, ``stalled`` or ``serving``."""
        return "draining" if self.draining else "stalled" if self.stalled else "serving"

    @property
    def num_outstanding(self) -> int:
        """Requests that still need this worker (decode: routed here; prefill: waiting for its KV)."""
        return self.num_inflight if self.role == WorkerRole.DECODE else self.num_prefill_pending

    def limits(self, fallback_vocab_size: int) -> EngineLimits:
        """What this worker advertised it can hold (``fallback_vocab_size`` if it named no vocabulary)."""
        return EngineLimits(max_model_len=self.max_model_len,
                            vocab_size=self.vocab_size or fallback_vocab_size,
                            num_blocks=self.num_blocks if self.num_kv_tokens is not None else None,
                            block_size=self.block_size if self.block_size > 0 else 16,
                            kv_group_caps=tuple(self.kv_group_caps or (None,)))

    @property
    def kv_cache_dtype(self) -> str | None:
        """The KV cache dtype the worker advertised (``KVLayout.kv_cache_dtype``), or None."""
        return self.kv_layout.kv_cache_dtype if self.kv_layout is not None else None

    @property
    def quantization(self) -> str | None:
        """The weights' quantization the worker advertised (``KVLayout.quantization``), or None."""
        return self.kv_layout.quantization if self.kv_layout is not None else None

    def kv_compatible(self, other: "WorkerInfo") -> bool:
        """Whether KV can move between this worker and ``other``: equal KV cache dtypes (KV is
        shipped as the cache holds it) and equal weight quantizations (KV of an int8 model is not a
        float model's), each unless one of them did not say."""
        return all(mine is None or theirs is None or mine == theirs
                   for mine, theirs in ((self.kv_cache_dtype, other.kv_cache_dtype),
                                        (self.quantization, other.quantization)))

    @property
    def num_kv_tokens(self) -> int | None:
        """Tokens the KV cache holds, or None if the worker did not say."""
        if self.num_blocks <= 0 or self.block_size <= 0:
            return None
        return self.num_blocks * self.block_size

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
            "kv_cache_dtype": self.kv_cache_dtype,
            "quantization": self.quantization,
            "last_seen_s_ago": round(now - self.last_seen, 3),
            "num_inflight": self.num_inflight,
            "num_routed": self.num_routed,
            "num_running": hb.num_running if hb else 0,
            "num_waiting": hb.num_waiting if hb else 0,
            "num_free_blocks": hb.num_free_blocks if hb else 0,
            "max_step_batch_size": hb.max_step_batch_size if hb else 0,
            "num_steps": hb.num_steps if hb else 0,
            "loop_stall_s": round(hb.loop_stall_s, 3) if hb else 0.0,
            "stalled": self.stalled,
            "state": self.state,
            "num_outstanding": self.num_outstanding,
            "prefill_pending_tokens": self.prefill_pending_tokens,
            "prefill_tokens_per_s": None if (speed := self.prefill_tokens_per_s) is None else round(speed, 1),
            "vocab_size": self.vocab_size,
            "kernels": self.kernels,
            "linear_weight_format": self.linear_weight_format,
            "plan": self.plan,
            "decode_step": hb.decode_step if hb else "",
            "heartbeat_received": hb is not None,
        }


class WorkerRegistry:
    """Live workers per role, liveness by timeout, stalls by the loop's own report, round-robin picking.

    Args:
        worker_timeout_s: a worker silent (no register, heartbeat or output) this long is dead.
        step_timeout_s: a worker whose heartbeats say its step loop has not moved for this long is stalled.
    """

    def __init__(self, worker_timeout_s: float, step_timeout_s: float = 300.0, clock=time.monotonic):
        self.worker_timeout_s = worker_timeout_s
        self.step_timeout_s = step_timeout_s
        self._clock = clock
        self._workers: dict[str, WorkerInfo] = {}  # insertion order = registration order
        self.desired: dict[WorkerRole, int | None] = {WorkerRole.PREFILL: None, WorkerRole.DECODE: None}

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
            old.num_blocks, old.block_size, old.kv_group_caps = msg.num_blocks, msg.block_size, msg.kv_group_caps
            old.max_model_len, old.vocab_size, old.kv_layout = msg.max_model_len, msg.vocab_size, msg.kv_layout
            old.router_addr, old.prefix_cache_salt = msg.router_addr, msg.prefix_cache_salt
            return None
        if old is not None:
            del self._workers[msg.worker_id]
        self._workers[msg.worker_id] = WorkerInfo(
            worker_id=msg.worker_id, role=WorkerRole(msg.role), input_addr=msg.input_addr,
            model_name=msg.model_name, num_blocks=msg.num_blocks, block_size=msg.block_size,
            max_model_len=msg.max_model_len, registered_at=now, last_seen=now, vocab_size=msg.vocab_size,
            kv_layout=msg.kv_layout, router_addr=msg.router_addr, kv_group_caps=msg.kv_group_caps,
            kernels=dict(msg.kernels), linear_weight_format=msg.linear_weight_format, plan=dict(msg.plan),
            prefix_cache_salt=msg.prefix_cache_salt)
        logger.info("worker %s registered: %s at %s (num_blocks=%d, block_size=%d)", msg.worker_id,
                    WorkerRole(msg.role).name.lower(), msg.input_addr, msg.num_blocks, msg.block_size)
        self._warn_kv_mismatch(self._workers[msg.worker_id])
        return old

    def _warn_kv_mismatch(self, info: WorkerInfo) -> None:
        """Say, at registration, which workers of the other role this one will never pair with."""
        other = WorkerRole.DECODE if info.role == WorkerRole.PREFILL else WorkerRole.PREFILL
        clash = [w for w in self._workers.values() if w.role == other and not info.kv_compatible(w)]
        if clash:
            logger.warning("worker %s (%s) holds a %s KV cache (weights: %s), but %s worker(s) %s hold %s: KV moves "
                           "as the cache holds it, so these pairs are refused and such requests prefill on the "
                           "decode worker (start every worker with the same --kv-cache-dtype and --quantization)",
                           info.worker_id, info.role.name.lower(), info.kv_cache_dtype, info.quantization,
                           other.name.lower(), ", ".join(w.worker_id for w in clash),
                           ", ".join(sorted({f"{w.kv_cache_dtype} (weights: {w.quantization})" for w in clash})))

    def heartbeat(self, msg: Heartbeat, now: float | None = None) -> bool:
        """Record a heartbeat; False (and ignored) if the worker is not registered."""
        info = self._workers.get(msg.worker_id)
        if info is None:
            return False
        info.last_seen = self._now(now)
        info.heartbeat = msg
        stalled = msg.loop_stall_s > self.step_timeout_s
        if stalled and not info.stalled:
            logger.warning("worker %s (%s): its step loop has not moved for %.1fs; routing nothing to it",
                           info.worker_id, info.role.name.lower(), msg.loop_stall_s)
        elif info.stalled and not stalled:
            logger.info("worker %s (%s): step loop moving again", info.worker_id, info.role.name.lower())
            info.stall_reported = False
        info.stalled = stalled
        return True

    def touch(self, worker_id: str, now: float | None = None) -> None:
        """Any message from a worker proves it is alive."""
        info = self._workers.get(worker_id)
        if info is not None:
            info.last_seen = self._now(now)

    def expire(self, now: float | None = None) -> list[tuple[WorkerInfo, str]]:
        """Workers whose requests must fail now, each with the reason.

        Drops every worker silent for longer than ``worker_timeout_s``, and returns
        (once per stall) every worker newly stalled, which stays registered.
        """
        now = self._now(now)
        failed = []
        for w in list(self._workers.values()):
            if now - w.last_seen > self.worker_timeout_s:
                del self._workers[w.worker_id]
                logger.warning("worker %s (%s) timed out: nothing heard for %.1fs", w.worker_id,
                               w.role.name.lower(), now - w.last_seen)
                failed.append((w, f"{w.role.name.lower()} worker {w.worker_id} stopped responding "
                                  f"(nothing heard for over {self.worker_timeout_s:g}s)"))
            elif w.stalled and not w.stall_reported:
                w.stall_reported = True
                failed.append((w, f"{w.role.name.lower()} worker {w.worker_id} is stuck (its step loop has not "
                                  f"moved for over {self.step_timeout_s:g}s)"))
        return failed

    def remove(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.pop(worker_id, None)

    def get(self, worker_id: str) -> WorkerInfo | None:
        return self._workers.get(worker_id)

    def live(self, role: WorkerRole | None = None) -> list[WorkerInfo]:
        """Registered workers of ``role`` that take new requests (not stalled, not draining), in order."""
        return [w for w in self._workers.values()
                if (role is None or w.role == role) and not w.stalled and not w.draining]

    def all(self, role: WorkerRole | None = None) -> list[WorkerInfo]:
        """Every registered worker of ``role`` (draining and stalled ones included)."""
        return [w for w in self._workers.values() if role is None or w.role == role]

    def surplus(self, role: WorkerRole) -> list[WorkerInfo]:
        """Workers to drain so that ``role``'s pool shrinks to ``desired`` (empty if not above it).

        Stalled workers go first (they serve nothing), then those holding the fewest requests,
        the most recently registered first among equals.
        """
        target = self.desired[role]
        pool = [w for w in self._workers.values() if w.role == role and not w.draining]
        if target is None or len(pool) <= target:
            return []
        order = sorted(pool, key=lambda w: (not w.stalled, w.num_outstanding, -w.registered_at))
        return order[:len(pool) - target]

    def pools(self, now: float | None = None) -> dict:
        """Each pool's target size and workers (``GET /admin/pools``)."""
        now = self._now(now)
        out = {}
        for role in (WorkerRole.PREFILL, WorkerRole.DECODE):
            workers = self.all(role)
            out[role.name.lower()] = {
                "desired": self.desired[role],
                "num_serving": sum(w.state == "serving" for w in workers),
                "num_draining": sum(w.draining for w in workers),
                "workers": [w.to_json(now) for w in workers],
            }
        return out

    def num_live(self, role: WorkerRole) -> int:
        return len(self.live(role))

    def candidates(self, role: WorkerRole, accepts: Callable[[WorkerInfo], bool] | None = None) -> list[WorkerInfo]:
        """Live workers of ``role`` for which ``accepts`` (if given) is true, in registration order."""
        return [w for w in self.live(role) if accepts is None or accepts(w)]

    def snapshot(self, now: float | None = None) -> list[dict]:
        now = self._now(now)
        return [w.to_json(now) for w in self._workers.values()]
