"""The scheduler's limits (``SchedulerConfig``), counters (``SchedulerStats``) and one step's
schedule (``SchedulerOutput``); the algorithm is ``pdserve.engine.scheduling.scheduler``'s (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.scheduling.request import Request
from pdserve.engine.scheduling.request_queue import SCHEDULING_POLICIES


PREFILL_ADMISSIONS = ("fill", "whole")


@dataclass
class SchedulerConfig:
    """Limits of one worker's scheduler.

    Args:
        max_num_seqs: most requests in flight (running or awaiting remote KV).
        max_num_batched_tokens: most new tokens computed in one step.
        max_model_len: longest sequence (prompt + output) in tokens.
        remote_prefill_threshold: prompts with fewer uncached tokens are prefilled locally.
        policy: ``fcfs`` or ``priority`` (the waiting order and the preemption victim).
        max_loras: most distinct LoRA adapters among the requests in flight (each step's batch
            must fit the model runner's LoRA slots); 0: no LoRA.
        recompute_past_len: a decoding request whose cached tokens are at most this many while its
            sequence has grown past it drops its KV and recomputes every token, once (transformers'
            Phi-3 ``generate`` at LongRoPE's switch from short to long factors); None: never.
        long_prefill_token_threshold: most prompt tokens a long prompt computes in a step (vLLM's
            ``--long-prefill-token-threshold``), so prompts queued behind it share each step; 0: no
            cap. Unlike vLLM, "long" means more tokens left than ``max_num_batched_tokens``: a prompt
            that fits one step is never split by it.
        prefill_admission: how a waiting prompt takes what a step's budget leaves. ``fill``: it
            starts in it, chunked if it must be (vLLM's chunked prefill). ``whole``: a prompt that
            fits one step but not what is left waits for the next step, unless a long prompt's
            chunk shares this one. Compute-bound prefill gains no throughput from a bigger batch,
            so splitting a second prompt over two steps only delays its first token by a whole
            step: run to completion gives every prompt of a queue its first token sooner
            (DistServe, OSDI'24, on prefill batching). A prefill worker's default.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    remote_prefill_threshold: int = 0
    policy: str = "fcfs"
    max_loras: int = 0
    recompute_past_len: int | None = None
    long_prefill_token_threshold: int = 0
    prefill_admission: str = "fill"

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.remote_prefill_threshold < 0:
            raise ValueError("remote_prefill_threshold must be >= 0")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        if self.prefill_admission not in PREFILL_ADMISSIONS:
            raise ValueError(f"prefill_admission must be one of {PREFILL_ADMISSIONS}, got {self.prefill_admission!r}")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be one of {SCHEDULING_POLICIES}, got {self.policy!r}")


@dataclass
class SchedulerStats:
    """Cumulative counters (tokens unless named otherwise)."""

    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_prompt_tokens: int = 0
    num_local_prefills: int = 0
    spec_decode_num_drafts: int = 0  # verification steps of a request with at least one draft
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0


@dataclass
class SchedulerOutput:
    """What one step computes.

    ``scheduled`` pairs each request with its ``num_new_tokens``, in batch order.
    ``block_copies`` are (src, dst) block copies to do before the forward.
    ``remote_prefills`` were just parked in ``WAITING_FOR_REMOTE_KVS`` and must
    be sent to their prefill worker. ``preempted`` lost their blocks this step.
    """

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    remote_prefills: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    def is_empty(self) -> bool:
        return not (self.scheduled or self.remote_prefills)
