"""The engine core: one model runner, KV cache, block manager and scheduler, and the step.

Every way pdserve runs a model wraps this one class and adds only its own IO
(vLLM v1 calls it ``EngineCore`` too). With tensor/pipeline parallelism it runs
on the driver rank and starts the other ranks (``pdserve.engine.execution.ranks``); the
runner broadcasts each step to them, so nothing above the runner changes::

    prefill worker  ──┐                    ┌── ModelRunner (model, KV cache tensor, sampler)
    decode worker   ──┼──▶ EngineCore ─────┼── Scheduler ── KVCacheManager ── BlockManager
    offline LLM     ──┘                    └── EngineLimits (what requests may ask, advertised)

A step is three calls, so a wrapper can act between them (the prefill worker
starts its KV sends after ``schedule`` and hooks each layer of ``execute``; the
decode worker sends remote-prefill requests after ``schedule``)::

    scheduler_output = core.schedule()
    runner_output = core.execute(scheduler_output, on_layer_done=None)
    outputs = core.update(scheduler_output, runner_output)   # list[EngineCoreOutput]

``step()`` runs the three for wrappers with nothing to add in between.
Requests enter only through ``add_request``, which applies the shared rules of
``pdserve.common.validation`` against this engine's limits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future

import msgspec

from pdserve.common import faults
from pdserve.common.protocol import (KVStepOps, LoRARequest, ResumedChoice, SamplingParams, TierOpKind,
                                     TokenLogprob, WorkerStats)
from pdserve.common.validation import EngineLimits, ValidationError, check_request
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.kv_offload import OffloadTier
from pdserve.engine.config import EngineConfig
from pdserve.engine.execution.model_runner import ModelRunner
from pdserve.engine.scheduling.outputs import EngineCoreOutput, ModelRunnerOutput
from pdserve.engine.execution.ranks import start_ranks, stop_processes
from pdserve.engine.scheduling.request import Request, RequestStatus
from pdserve.engine.scheduling.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from pdserve.engine.execution.structured_output import StructuredOutputManager
from pdserve.engine.lora.adapter import LoRAAdapterError

logger = logging.getLogger(__name__)

_LOAD_MEDIUM = {TierOpKind.ONLOAD: "host", TierOpKind.LOAD: "disk"}  # the copies that bring a hit back, by tier


class EngineCore:
    """Model runner + KV cache + block manager + scheduler, and the step that drives them.

    Args:
        config: the engine's configuration (model, KV budget, scheduler limits).

    Attributes:
        runner: ``ModelRunner``; its ``kv_cache`` is
            ``[num_layers, kv_slots, num_blocks, block_size, num_kv_heads, head_dim]``
            (kv_slots 2: K and V; 1: a latent).
        block_manager, scheduler: the pure-Python halves.
        limits: ``EngineLimits`` (max_model_len, vocab_size, num_blocks, block_size),
            what workers advertise to the router.
        num_steps, max_step_batch_size: steps that ran a forward, and the most
            sequences one of them held.
        num_generation_tokens: tokens sampled here (and first tokens received with remote KV).
    """

    def __init__(self, config: EngineConfig):
        if config.rank != 0:
            raise ValueError("an EngineCore runs on rank 0 (the driver); other ranks run pdserve.engine.execution.ranks")
        self.config = config
        self.ranks, self._rank_procs = start_ranks(config)
        try:
            self.runner = ModelRunner(config, self.ranks)
        except BaseException:
            self.close()
            raise
        prefix_caching = config.enable_prefix_caching
        if prefix_caching and self.runner.rope_needs_lengths:
            # a block's K then depends on the length of the request that computed it, not only on its tokens
            logger.info("prefix caching is off: the model's RoPE (longrope / dynamic) scales with each request's "
                        "length, so equal tokens do not mean equal KV")
            prefix_caching = False
        offload = OffloadTier(self.runner.num_offload_blocks) if self.runner.num_offload_blocks else None
        disk = None
        if self.runner.disk_store is not None:  # what an earlier process left on disk (warm restart)
            disk = OffloadTier(self.runner.disk_store.capacity, medium="disk")
            for slot, key, tokens in self.runner.disk_entries:
                disk.adopt(key, tokens, slot)
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          enable_prefix_caching=prefix_caching,
                                          salt=self.runner.model_fingerprint, offload=offload, disk=disk)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=config.max_num_seqs,
                            max_num_batched_tokens=config.max_num_batched_tokens,
                            max_model_len=self.runner.max_model_len,
                            remote_prefill_threshold=config.remote_prefill_threshold,
                            long_prefill_token_threshold=config.long_prefill_token_threshold,
                            prefill_admission=config.prefill_admission,
                            policy=config.scheduling_policy,
                            max_loras=config.max_loras if config.enable_lora else 0,
                            recompute_past_len=self.runner.recompute_past_len),
            self.block_manager, kv_groups=self.runner.kv_groups)
        self.scheduler.prefetch = self.runner.prefetcher is not None
        self.proposer = None
        spec = config.speculative
        if spec is not None:
            self.proposer = self._make_proposer(spec)
            self.scheduler.proposer = self.proposer
        self.limits = EngineLimits(max_model_len=self.runner.max_model_len, vocab_size=self.runner.vocab_size,
                                   num_blocks=self.runner.num_blocks, block_size=self.runner.block_size,
                                   kv_group_caps=self.scheduler.kv.group_caps(config.max_num_batched_tokens))
        # Structured outputs: grammars compiled against the model's tokenizer (loaded on first use).
        self.structured_output = StructuredOutputManager(config.model, self.runner.eos_token_ids)
        self.num_steps = 0
        self.max_step_batch_size = 0
        self.num_generation_tokens = 0
        # Prompt tokens computed here and the wall time of the steps that computed them: this worker's
        # measured prefill speed, which the router's load-aware prefill placement reads from heartbeats.
        self.prefill_compute_tokens = 0
        self.prefill_compute_seconds = 0.0

    def _make_proposer(self, spec):
        """The speculative decoding proposer of ``spec`` (``pdserve.engine.execution.spec_decode``)."""
        if spec.method == "ngram":
            from pdserve.engine.execution.spec_decode.ngram import NgramProposer

            proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:
            from pdserve.engine.execution.spec_decode.draft_model import DraftModelProposer

            try:
                proposer = DraftModelProposer(spec.model, spec.num_speculative_tokens, self.runner)
            except BaseException:
                self.close()
                raise
        logger.info("speculative decoding: %s, %d tokens per step", spec.method, spec.num_speculative_tokens)
        return proposer

    # ---- requests -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    remote_prefill: bool = False, stop_at_max_model_len: bool = False,
                    resume: list[ResumedChoice] | None = None, lora: LoRARequest | None = None) -> Request:
        """Check a request against this engine's limits and queue it.

        Args:
            request_id: the router's request_id (also the group id of its ``n`` samples).
            prompt_token_ids: [num_prompt_tokens] token ids.
            params: sampling parameters.
            remote_prefill: decode worker: the prompt's KV comes from a prefill worker.
            stop_at_max_model_len: accept prompt + max_tokens > max_model_len and stop
                there (the offline API's rule); servers reject such requests.
            resume: a migrated request: only these choices, each continuing after its
                ``output_token_ids`` (recomputed here, counted as output). Prefilled locally.
            lora: the LoRA adapter to apply (None: the base model); read now, so a bad adapter
                fails here and not in a step.

        Raises:
            ValidationError: the request breaks a rule (``pdserve.common.validation``), or its
                structured outputs grammar is invalid (``pdserve.engine.execution.structured_output``).
            ValueError: a duplicate request_id.
        """
        check_request(prompt_token_ids, params, self.limits, stop_at_max_model_len)
        if params.priority != 0 and self.config.scheduling_policy != "priority":
            raise ValidationError(f"priority {params.priority} was given, but priority scheduling is not enabled "
                                  f"(--scheduling-policy priority)", "priority")
        if lora is not None:
            self.check_lora(lora)
        if resume is not None:
            return self._resume(request_id, prompt_token_ids, params, resume, lora)
        request = Request(request_id, prompt_token_ids, params, eos_token_ids=self.runner.eos_token_ids,
                          max_model_len=self.runner.max_model_len, group_id=request_id, lora=lora)
        if params.structured_outputs is not None:  # structured outputs: checked now, compiled off the loop
            state = self.structured_output.submit(params.structured_outputs)
            if isinstance(state, Future):
                request.grammar_future = state  # the scheduler admits it once compiled
            else:
                request.structured_output = state
        self.scheduler.add_request(request, remote_prefill=remote_prefill)
        return request

    def check_lora(self, lora: LoRARequest) -> None:
        """Raise ValidationError unless this engine serves LoRA and ``lora``'s adapter fits the model."""
        if self.runner.lora is None:
            raise ValidationError(f"the request names LoRA adapter {lora.lora_name!r}, but LoRA is not enabled on "
                                  f"this engine (--enable-lora)", "model")
        try:
            self.runner.lora.get_adapter(lora)
        except LoRAAdapterError as e:
            raise ValidationError(str(e), "model") from e

    def _resume(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                resume: list[ResumedChoice], lora: LoRARequest | None = None) -> Request:
        """Queue each resumed choice as its own sample (no forking), its tokens so far already output."""
        if not resume or len({c.index for c in resume}) != len(resume) or \
                not all(0 <= c.index < params.n and len(c.output_token_ids) < params.max_tokens for c in resume):
            raise ValidationError(f"resume must name distinct unfinished choices in [0, {params.n})", "resume")
        requests = []
        for choice in resume:
            request = Request(request_id if choice.index == 0 else f"{request_id}#{choice.index}", prompt_token_ids,
                              params, eos_token_ids=self.runner.eos_token_ids,
                              max_model_len=self.runner.max_model_len, group_id=request_id, sample_index=choice.index,
                              lora=lora)
            request.output_token_ids = list(choice.output_token_ids)
            request.forked = True  # its siblings come with the resume list, or finished already
            if params.structured_outputs is not None:  # structured outputs: replay the tokens so far
                request.structured_output = self.structured_output.new_request(params.structured_outputs)
                if not request.structured_output.accept_tokens(request.output_token_ids):
                    raise ValidationError(f"resumed choice {choice.index} does not match its structured outputs "
                                          f"grammar: {request.structured_output.error}", "resume")
            requests.append(request)
        for request in requests:  # all checked first: a bad choice leaves nothing queued
            self.scheduler.add_request(request)
        return requests[0]

    def abort(self, group_id: str) -> list[Request]:
        """Finish every sample of a router request as aborted and free its blocks (idempotent)."""
        return self.scheduler.finish_group(group_id, RequestStatus.FINISHED_ABORTED)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Finish one engine request (one sample) with ``status`` and free its blocks (idempotent)."""
        return self.scheduler.finish_request(request_id, status)

    def free_delayed(self, request_id: str) -> None:
        """Free the blocks a finished request kept for its KV sends (``Scheduler.free_delayed``)."""
        self.scheduler.free_delayed(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def pending_grammars(self) -> list[Future]:
        """Structured outputs: the compiles that waiting requests wait for (none: nothing to wait on)."""
        return [r.grammar_future for r in self.scheduler.waiting if r.grammar_future is not None]

    # ---- the step -------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch (never raises for lack of blocks: it preempts or waits)."""
        self._collect_prefetches()
        out = self.scheduler.schedule()
        if not out.scheduled and not out.block_copies and self.block_manager.num_prefetching:
            self._start_prefetches()  # no step to run first: their tier copies run now
        return out

    # ---- prefetch (disk-tier hits read off the step loop; kv_prefetch.py) --------------------

    def _start_prefetches(self) -> None:
        """Hand the prefetches started this step to the reader, after the step's own tier copies."""
        starts = self.block_manager.take_prefetch_starts()
        if not starts:
            return
        ops = self.block_manager.take_tier_copies()
        if ops:  # (in a step, execute took them already)
            self.runner.execute([], tier_ops=ops)
        for prefetch_id, copies in starts:
            self.runner.prefetcher.start(prefetch_id, copies)

    def _collect_prefetches(self, timeout_s: float = 0.0) -> None:
        """Cache the blocks of every prefetch the reader finished and let their requests be admitted."""
        prefetcher = self.runner.prefetcher
        if prefetcher is None or not prefetcher.in_flight:
            return
        costs = self.block_manager.tier_costs
        for prefetch_id, ok, timings in prefetcher.finished(timeout_s):
            self.block_manager.finish_prefetch(prefetch_id, ok)  # (time saved: at the speeds known when it began)
            self.scheduler.prefetch_done(prefetch_id)
            for kind, (blocks, seconds) in timings.items():
                entry = self.runner.tier_copy_stats.setdefault(kind, [0, 0.0])
                entry[0] += blocks
                entry[1] += seconds
                costs.observe_load(_LOAD_MEDIUM[kind], blocks, seconds)

    def execute(self, scheduler_output: SchedulerOutput, on_layer_done: Callable[[int], None] | None = None,
                kv_ops: KVStepOps | None = None) -> ModelRunnerOutput:
        """Run the forward of ``scheduler_output`` (copy-on-write copies first) and sample.

        ``on_layer_done(layer_idx)`` is called once each layer's K/V are in the cache; ``kv_ops``
        is the step's KV transfer work for every rank's agent (``pdserve.kvtransfer.agent``).
        """
        faults.check_forward(scheduler_output.scheduled)
        if self.proposer is not None and self.proposer.drafts_at_execute:  # a draft model drafts now
            self.proposer.propose(scheduler_output.scheduled, scheduler_output.block_copies)
            _cut_drafts_to_grammar(scheduler_output)
        tier_ops = self.block_manager.take_tier_copies()
        copies = self.runner.tier_copy_stats
        copied = {kind: tuple(entry) for kind, entry in copies.items()} if tier_ops else None
        start = time.perf_counter()
        output = self.runner.execute(scheduler_output.scheduled, on_layer_done=on_layer_done,
                                     block_copies=scheduler_output.block_copies, kv_ops=kv_ops, tier_ops=tier_ops)
        elapsed = time.perf_counter() - start
        self._start_prefetches()
        costs = self.block_manager.tier_costs
        if copied is not None:  # this step's tier copies, measured: loads priced, and not prefill time
            for kind, (blocks, seconds) in copies.items():
                blocks_before, seconds_before = copied.get(kind, (0, 0.0))
                elapsed -= seconds - seconds_before
                if kind in _LOAD_MEDIUM and blocks > blocks_before:
                    costs.observe_load(_LOAD_MEDIUM[kind], blocks - blocks_before, seconds - seconds_before)
        num_prompt_tokens = sum(max(0, min(n, r.num_prompt_tokens - r.num_computed_tokens))
                                for r, n in scheduler_output.scheduled)
        if num_prompt_tokens:  # a step that computed prompt tokens (decode rows mixed in count as its cost)
            self.prefill_compute_tokens += num_prompt_tokens
            self.prefill_compute_seconds += elapsed
            costs.observe_prefill(num_prompt_tokens, elapsed)
        _collect_prompt_logprobs(scheduler_output, output)
        if scheduler_output.scheduled:
            self.num_steps += 1
            self.max_step_batch_size = max(self.max_step_batch_size, len(scheduler_output.scheduled))
        return output

    def fail_step(self, scheduler_output: SchedulerOutput) -> list[str]:
        """A step's forward or sampling raised: finish its requests as errors, freeing their blocks.

        Returns the router request ids (groups) failed. Every sample of a group fails with it.
        """
        group_ids = list(dict.fromkeys(request.group_id for request, _ in scheduler_output.scheduled))
        for group_id in group_ids:
            self.scheduler.finish_group(group_id, RequestStatus.FINISHED_ERROR)
        return group_ids

    def update(self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance every scheduled request; finished ones are freed. One output per sampled token."""
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        self.num_generation_tokens += sum(len(o.new_token_ids) for o in outputs)
        for output in outputs:
            _attach_prompt_logprobs(output)
        return outputs

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """``schedule -> execute -> update`` with nothing in between."""
        scheduler_output = self.schedule()
        if not scheduler_output.scheduled and not scheduler_output.block_copies and self.block_manager.num_prefetching:
            self._collect_prefetches(timeout_s=0.05)  # nothing to run but prefetches: wait for one
            scheduler_output = self.schedule()
        if not scheduler_output.scheduled and not scheduler_output.block_copies:
            return scheduler_output, []
        return scheduler_output, self.update(scheduler_output, self.execute(scheduler_output))

    # ---- remote prefill (decode side) -------------------------------------------------

    def remote_kv_arrived(self, request_id: str, first_token_id: int,
                          first_logprob: TokenLogprob | None = None,
                          prompt_logprobs: list[TokenLogprob] | None = None) -> EngineCoreOutput | None:
        """The prompt's KV is in the request's blocks: it decodes from its first token on.

        ``prompt_logprobs``: the prefill worker's entries of prompt tokens 1..N-1, when asked.
        Returns the first token's output, or None if the request no longer waits for KV.
        """
        request = self.scheduler.waiting_for_remote_kvs.get(request_id)
        if request is not None and prompt_logprobs:
            request.prompt_logprobs = list(prompt_logprobs)
        output = self.scheduler.remote_kv_arrived(request_id, first_token_id, first_logprob)
        if output is not None:
            self.num_generation_tokens += 1
            _attach_prompt_logprobs(output)
        return output

    def prompt_logprobs_of(self, request_id: str) -> list[TokenLogprob]:
        """The prompt-logprob entries a live request has so far (prefill worker: all of them once its
        last chunk ran); empty for a request that did not ask or is gone."""
        request = self.scheduler.requests.get(request_id)
        return list(request.prompt_logprobs) if request is not None else []

    def recompute_locally(self, request_id: str) -> bool:
        """A remote prefill failed: prefill here instead, keeping the reserved blocks."""
        return self.scheduler.recompute_locally(request_id)

    # ---- ranks ---------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return self.config.parallel.world_size

    def ping_ranks(self) -> None:
        """Check that every rank still answers (an empty step); raises if one is gone."""
        self.runner.ping_ranks()

    def close(self) -> None:
        """Stop the other ranks (a multi-rank engine); idempotent."""
        runner = getattr(self, "runner", None)
        if runner is not None:
            runner.shutdown_ranks()
            if runner.prefetcher is not None:
                runner.prefetcher.close()
            if runner.disk_store is not None:
                runner.disk_store.close()
        stop_processes(self._rank_procs)
        self._rank_procs = []
        if self.ranks is not None:
            self.ranks.close()
            self.ranks = None

    # ---- figures ------------------------------------------------------------------------

    def stats(self, transfer_stats: WorkerStats) -> WorkerStats:
        """``transfer_stats`` (a worker's KV transfer counters) with the engine's cumulative
        counters filled in, as a new struct; safe to call from another thread (reads ints)."""
        s = self.scheduler.stats
        return msgspec.structs.replace(
            transfer_stats, num_preemptions=s.num_preemptions, prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits, num_prompt_tokens=s.num_prompt_tokens,
            num_local_prefills=s.num_local_prefills, num_generation_tokens=self.num_generation_tokens,
            spec_decode_num_drafts=s.spec_decode_num_drafts,
            spec_decode_num_draft_tokens=s.spec_decode_num_draft_tokens,
            spec_decode_num_accepted_tokens=s.spec_decode_num_accepted_tokens,
            prefill_compute_tokens=self.prefill_compute_tokens, prefill_compute_seconds=self.prefill_compute_seconds,
            kv_offload_blocks=self.block_manager.num_offloaded, kv_onload_blocks=self.block_manager.num_onloaded,
            kv_offload_copy_seconds=self.runner.tier_copy_seconds,
            kv_disk_write_blocks=self.block_manager.num_spilled, kv_disk_read_blocks=self.block_manager.num_loaded,
            **self._tier_stats())

    def _tier_stats(self) -> dict:
        """``WorkerStats``' per-tier fields: the runner's copy timings, the block manager's hit counts."""
        bm, runner = self.block_manager, self.runner
        seconds = {kind: entry[1] for kind, entry in runner.tier_copy_stats.items()}
        return dict(
            kv_block_bytes=runner.block_bytes * self.world_size,
            kv_offload_seconds=seconds.get(TierOpKind.OFFLOAD, 0.0),
            kv_onload_seconds=seconds.get(TierOpKind.ONLOAD, 0.0),
            kv_disk_write_seconds=(runner.disk_store.write_seconds if runner.disk_store is not None  # off the loop
                                   else seconds.get(TierOpKind.SPILL, 0.0)),
            kv_disk_read_seconds=seconds.get(TierOpKind.LOAD, 0.0),
            kv_host_recomputed_hits=bm.num_declined["host"], kv_disk_recomputed_hits=bm.num_declined["disk"],
            kv_host_saved_seconds=bm.tier_saved_s["host"], kv_disk_saved_seconds=bm.tier_saved_s["disk"])


def _collect_prompt_logprobs(scheduler_output: SchedulerOutput, output: ModelRunnerOutput) -> None:
    """Append the step's prompt-logprob entries to their requests (they accumulate over chunks)."""
    if not output.prompt_logprobs:
        return
    for request, _ in scheduler_output.scheduled:
        entries = output.prompt_logprobs.get(request.request_id)
        if entries:
            request.prompt_logprobs.extend(entries)


def _attach_prompt_logprobs(output: EngineCoreOutput) -> None:
    """Give a request's first output (choice 0, prompt_logprobs asked) its prompt's entries."""
    request = output.request
    if (request.sampling_params.prompt_logprobs is not None and request.sample_index == 0
            and request.num_output_tokens == len(output.new_token_ids)):
        output.prompt_logprobs = list(request.prompt_logprobs)


def _cut_drafts_to_grammar(scheduler_output: SchedulerOutput) -> None:
    """Structured outputs: keep only the drafts a request's grammar allows (their leading run),
    and schedule one target row per kept draft."""
    scheduled = scheduler_output.scheduled
    for i, (request, num_new) in enumerate(scheduled):
        if request.structured_output is not None and request.spec_token_ids:
            valid = request.structured_output.validate_tokens(request.spec_token_ids)
            if valid < len(request.spec_token_ids):
                request.spec_token_ids = request.spec_token_ids[:valid]
                if request.spec_draft_probs is not None:
                    request.spec_draft_probs = request.spec_draft_probs[:valid]
                scheduled[i] = (request, 1 + valid)
