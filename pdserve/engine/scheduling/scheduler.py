"""Iteration-level scheduler shared by the prefill and decode workers (no torch).

Continuous batching (Orca, Yu et al., OSDI 2022) as vLLM v1 does it: there is
no separate "prefill phase" and "decode phase". Every request has
``num_computed_tokens`` (tokens whose K/V are cached) and ``num_tokens``
(prompt + outputs); each step gives some requests ``num_new_tokens`` to compute
under a token budget of ``max_num_batched_tokens``:

* a decoding request needs 1 token (its last sampled token);
* a prefilling request needs the rest of its prompt, cut to what the budget
  leaves (chunked prefill) and, for a prompt longer than a step's budget, to at
  most ``long_prefill_token_threshold`` tokens per step (vLLM's flag), so a long
  prompt leaves the rest of the budget to the prompts queued behind it;
* a preempted request needs everything again (recompute), minus prefix hits.

Running requests are served first, in admission order, then waiting ones in
the order of the scheduling policy (``pdserve.engine.scheduling.request_queue``): arrival
order (``fcfs``), or ``(priority, arrival)`` (``priority``: lower runs sooner).
When blocks run out, a running request is preempted: under ``fcfs`` the most
recently admitted, under ``priority`` the one with the largest
``(priority, arrival)``. Its blocks are freed (full ones stay in the prefix
cache) and it goes back to the waiting queue (``fcfs``: to its head).

On the decode worker, a waiting request marked ``remote_prefill`` is admitted by
reserving blocks for its whole prompt (prefix hits shared) and parking it in
``WAITING_FOR_REMOTE_KVS``; ``remote_kv_arrived`` later makes it a running
decode request whose first token was sampled by the prefill worker. A prompt
with fewer than ``remote_prefill_threshold`` uncached tokens, or whose every
full block is cached, is prefilled locally instead (conditional disaggregation).

Parallel sampling: a request with ``n > 1`` runs as sample 0 until its prompt
is computed; then samples 1..n-1 fork from it, sharing its prompt blocks, and
each recomputes the last prompt token to draw its own first token (that write
lands in a shared block, so it is copied first: copy-on-write).

Speculative decoding (``pdserve.engine.execution.spec_decode``): with a ``proposer``, a
decoding request is scheduled ``1 + k`` tokens (its last token and ``k`` drafts,
within the budget, ``max_tokens`` and ``max_model_len``) when its blocks can
grow without preempting anyone; otherwise it decodes one token as usual. After
verification only the accepted tokens count as computed.
"""

from __future__ import annotations

from pdserve.common.validation import num_kv_tokens_needed
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.common.kv_cache_groups import KVCacheGroups
from pdserve.engine.scheduling.kv_cache_manager import NULL_BLOCK, KVCacheManager
from pdserve.engine.scheduling.outputs import EngineCoreOutput, ModelRunnerOutput
from pdserve.engine.scheduling.request import Request, RequestStatus
from pdserve.engine.scheduling.request_queue import make_waiting_queue, priority_key
from pdserve.engine.scheduling.scheduler_config import (  # noqa: F401  re-exported: the scheduler's public types
    PREFILL_ADMISSIONS, SchedulerConfig, SchedulerOutput, SchedulerStats)


class Scheduler:
    """Decides, step by step, which requests compute how many tokens."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, kv_groups: KVCacheGroups | None = None):
        self.config = config
        self.block_manager = block_manager
        self.kv = KVCacheManager(block_manager, kv_groups)  # one block table per group; windows free blocks
        self.waiting = make_waiting_queue(config.policy)
        self.running: list[Request] = []
        self.waiting_for_remote_kvs: dict[str, Request] = {}
        self.requests: dict[str, Request] = {}
        self.groups: dict[str, list[str]] = {}  # group_id (router request_id) -> request ids
        # finished requests with ``delay_free_blocks``: their blocks are freed by ``free_delayed``
        self.delayed_frees: dict[str, Request] = {}
        self.stats = SchedulerStats()
        # Speculative decoding: ``num_lookahead(request, max_k) -> k`` drafts to schedule (it may
        # set ``request.spec_token_ids`` now; a draft model fills them in at execute). None: off.
        self.proposer = None
        # Disk-tier hits read off the step loop (``BlockManager.start_prefetch``): the engine turns this on
        # where the runner can (one rank). prefetch id -> the request waiting for it.
        self.prefetch = False
        self._prefetching: dict[int, Request] = {}

    @property
    def num_preemptions(self) -> int:
        return self.stats.num_preemptions

    # ---- queues -------------------------------------------------------------

    def add_request(self, request: Request, remote_prefill: bool = False) -> None:
        """Queue a new request; ``remote_prefill`` asks for its prompt KV from a prefill worker.

        The request's lengths were checked against this engine's limits by
        ``pdserve.common.validation`` (``EngineCore.add_request``); this only
        guards the invariants the scheduler itself relies on.

        Raises:
            ValueError: duplicate request_id, or a request that can never run to
                its end here (longer than max_model_len, or one sequence larger
                than the whole KV cache: it would preempt itself forever).
        """
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request_id {request.request_id}")
        if request.num_tokens > self.config.max_model_len:
            raise ValueError(f"request {request.group_id} has {request.num_tokens} tokens; "
                             f"max_model_len is {self.config.max_model_len}")
        num_tokens = num_kv_tokens_needed(request.num_tokens, request.sampling_params.max_tokens,
                                          self.config.max_model_len)
        needed = self.kv.blocks_needed(num_tokens, self.config.max_num_batched_tokens)  # windows free the rest
        if needed > self.block_manager.num_blocks:
            raise ValueError(f"request {request.group_id} needs {needed} KV blocks; "
                             f"the cache has {self.block_manager.num_blocks}")
        request.remote_prefill = remote_prefill
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.groups.setdefault(request.group_id, []).append(request.request_id)
        self.waiting.add(request)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_running(self) -> int:
        return len(self.running) + len(self.waiting_for_remote_kvs)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ---- step ---------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick this step's batch. Never raises for lack of blocks: it preempts or waits."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if self.config.recompute_past_len is not None:
                self._recompute_past_switch(request)
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            num_new += self._schedule_drafts(request, num_new, budget, out)
            num_preempted = len(out.preempted)
            if not self._allocate_or_preempt(request, request.num_computed_tokens + num_new, out):
                break  # ``request`` itself was the victim: nothing after it gets blocks either
            out.scheduled.append((request, num_new))
            if len(out.preempted) == num_preempted:
                budget -= num_new
                i += 1
            else:  # a priority victim may have been scheduled already: its tokens went back to the budget
                budget = self.config.max_num_batched_tokens - out.num_scheduled_tokens
                i = self.running.index(request) + 1
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _chunk(self, num_left: int, budget: int) -> int:
        """Tokens a request with ``num_left`` tokens to compute gets this step: what the budget
        leaves, and for a long prompt (more tokens left than a whole step's budget, so it is
        chunked anyway) at most ``long_prefill_token_threshold``. A prompt that fits one step is
        computed whole: splitting it too would turn first-come-first-served into processor sharing,
        which delays every prompt's first token (a decode's 1 token is never cut either)."""
        cap = self.config.long_prefill_token_threshold
        if cap and num_left > self.config.max_num_batched_tokens:
            return min(cap, budget)
        return min(num_left, budget)

    def _recompute_past_switch(self, request: Request) -> None:
        """``recompute_past_len``: the first time a decoding request's sequence grows past it with at most
        that many tokens cached, drop its KV; this step then recomputes the whole sequence (chunked under
        the budget), whose RoPE now takes the long factor everywhere."""
        limit = self.config.recompute_past_len
        if (request.rope_recomputed or request.num_output_tokens == 0
                or not 0 < request.num_computed_tokens <= limit < request.num_tokens):
            return
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_draft_computed_tokens = 0
        request.rope_recomputed = True

    def _schedule_drafts(self, request: Request, num_new: int, budget: int, out: SchedulerOutput) -> int:
        """Draft tokens to verify with a decoding request this step (0: none), their slots allocated."""
        request.spec_token_ids = []
        request.spec_draft_probs = None
        if self.proposer is None or num_new != 1 or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        params = request.sampling_params
        # This step emits up to 1 + k tokens: never past max_tokens or max_model_len.
        max_k = min(budget - 1, params.max_tokens - request.num_output_tokens - 1,
                    self.config.max_model_len - request.num_tokens - 1)
        if max_k < 1:
            return 0
        k = self.proposer.num_lookahead(request, max_k)
        if k and request.structured_output is not None and not self.proposer.drafts_at_execute:
            k = request.structured_output.validate_tokens(request.spec_token_ids)  # drafts the grammar allows
            request.spec_token_ids = request.spec_token_ids[:k]
        if k and not self.kv.allocate_slots(request, request.num_tokens + k, out.block_copies):
            k = 0  # drafts never preempt anyone
        if not k:
            request.spec_token_ids = []
        return k

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and self.num_running < self.config.max_num_seqs:
            request = self._next_ready()
            if request is None:
                return
            hit = self.kv.find_prefix(request)
            if self._prefetch(request, hit):
                continue  # it waits (in ``waiting``) for its blocks; the next one may go
            num_cached = hit.num_blocks * self.kv.block_size
            if request.remote_prefill and self._prefill_locally(request, hit):
                request.remote_prefill = False
                self.stats.num_local_prefills += 1
            if request.remote_prefill:  # the KV lands in the blocks its first decode query can read
                if not self.kv.allocate_slots(request, request.num_tokens, out.block_copies, hit,
                                              next_position=request.num_tokens):
                    return
                self.kv.free_out_of_window(request, request.num_tokens)  # hits that lie before the window
                request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
                self.waiting_for_remote_kvs[request.request_id] = request
                out.remote_prefills.append(request)
            else:
                if budget <= 0 or self._defer_whole(out, request.num_tokens - num_cached, budget):
                    return
                num_new = self._chunk(request.num_tokens - num_cached, budget)
                if not self.kv.allocate_slots(request, num_cached + num_new, out.block_copies, hit):
                    return
                request.num_computed_tokens = num_cached
                self.kv.free_out_of_window(request)  # hits that lie before the window
                request.status = RequestStatus.RUNNING
                self.running.append(request)
                out.scheduled.append((request, num_new))
                budget -= num_new
            self.waiting.remove(request)
            request.num_cached_tokens = num_cached
            if request.num_preemptions == 0 and request.sample_index == 0:
                self.stats.prefix_cache_queries += request.num_prompt_tokens
                self.stats.prefix_cache_hits += num_cached
                self.stats.num_prompt_tokens += request.num_prompt_tokens

    def _prefetch(self, request: Request, hit) -> bool:
        """Start reading ``request``'s hit from the tiers off the step loop, if it reaches the disk tier
        (a host-tier copy back is a memory copy: it runs in the step). True: it waits for it."""
        if not self.prefetch or request.prefetched or not any(slot < 0 for slot in hit.offload_slots):
            return False
        first = len(hit.group_block_ids[0])
        parent = hit.block_hashes[first - 1] if first else request.cache_root
        prefetch_id = self.block_manager.start_prefetch(hit.offload_slots, hit.block_hashes[first:hit.num_blocks],
                                                        parent, hit.group_block_ids[0])
        if prefetch_id is None:
            return False
        request.prefetching = True
        self._prefetching[prefetch_id] = request
        return True

    def prefetch_done(self, prefetch_id: int) -> None:
        """Prefetch ``prefetch_id`` ended (its blocks are in the prefix cache): its request may be admitted,
        its hit now the KV cache's own (read in the step if the blocks were lost meanwhile)."""
        request = self._prefetching.pop(prefetch_id, None)
        if request is not None:
            request.prefetching = False
            request.prefetched = True

    def _next_ready(self) -> Request | None:
        """The first waiting request (in the policy's order) not waiting for its grammar to compile
        (structured outputs; vLLM's WAITING_FOR_FSM) and whose LoRA adapter fits the slots, or None.

        LoRA: the requests in flight may use at most ``max_loras`` distinct adapters (every one
        of them is in each step's batch); a request for another adapter waits, and later
        requests for adapters already in flight (or for the base model) go before it, as in vLLM."""
        in_flight = None
        if self.config.max_loras:
            in_flight = {r.lora.lora_int_id for r in (*self.running, *self.waiting_for_remote_kvs.values())
                         if r.lora is not None}
        for request in self.waiting:
            if request.prefetching:
                continue
            if in_flight is not None and request.lora is not None and request.lora.lora_int_id not in in_flight \
                    and len(in_flight) >= self.config.max_loras:
                continue
            future = request.grammar_future
            if future is None:
                return request
            if future.done():
                request.structured_output = future.result()  # the compile job never raises
                request.grammar_future = None
                return request
        return None

    def _defer_whole(self, out: SchedulerOutput, num_left: int, budget: int) -> bool:
        """``prefill_admission="whole"``: does a prompt with ``num_left`` tokens wait for the next step
        rather than start as a chunk of what this one leaves? Only a prompt that would fit a whole
        step, and only when no long prompt is being chunked in this step (the tokens that chunk's cap
        leaves are there for the prompts queued behind it)."""
        if self.config.prefill_admission != "whole" or num_left <= budget or not out.scheduled:
            return False
        if num_left > self.config.max_num_batched_tokens:
            return False
        return not any(n < r.num_tokens - r.num_computed_tokens for r, n in out.scheduled)

    def _prefill_locally(self, request: Request, hit) -> bool:
        """Conditional disaggregation: is a round trip to a prefill worker not worth it?"""
        num_uncached = request.num_tokens - hit.num_blocks * self.kv.block_size
        fully_cached = hit.num_blocks > 0 and hit.num_blocks == (request.num_tokens - 1) // self.kv.block_size
        return fully_cached or num_uncached < self.config.remote_prefill_threshold

    def _allocate_or_preempt(self, request: Request, num_tokens: int, out: SchedulerOutput) -> bool:
        while not self.kv.allocate_slots(request, num_tokens, out.block_copies):
            victim = self._pick_victim()
            self._preempt(victim)
            out.preempted.append(victim)
            out.scheduled = [(r, n) for r, n in out.scheduled if r is not victim]
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.num_draft_computed_tokens = 0
        request.spec_token_ids = []
        request.remote_prefill = False  # recompute locally
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.prepend(request)

    def _pick_victim(self) -> Request:
        """Take the running request to preempt out of ``running``: the most recently admitted
        (``fcfs``), or the largest ``(priority, arrival)`` (``priority``; vLLM v1's choice)."""
        if self.config.policy == "fcfs":
            return self.running.pop()
        victim = max(self.running, key=priority_key)
        self.running.remove(victim)
        return victim

    def update_from_output(self, out: SchedulerOutput, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance progress after the forward pass.

        Args:
            out: the step's schedule.
            runner_output: tokens (and logprobs) sampled for requests that reached
                the end of their known tokens this step (partial prefill chunks sample nothing).

        Returns:
            an ``EngineCoreOutput`` for every request that produced a token.
            Finished requests have already been freed.
        """
        results = []
        sampled = runner_output.sampled_token_ids
        window = self.kv.frees_blocks
        for request, num_new in out.scheduled:
            if request.status.is_finished:  # aborted while the step ran
                continue
            num_drafts = len(request.spec_token_ids)
            accepted = runner_output.accepted_draft_ids.get(request.request_id, [])
            # Rejected drafts' K/V stay in their slots, uncounted: later tokens overwrite them.
            request.num_computed_tokens += num_new - (num_drafts - len(accepted))
            request.num_draft_computed_tokens = min(request.num_draft_computed_tokens, request.num_computed_tokens)
            request.spec_token_ids = []
            request.spec_draft_probs = None
            self.kv.cache_full_blocks(request)  # up to the tokens known before this step's (drafts: next step)
            if num_drafts:
                self.stats.spec_decode_num_drafts += 1
                self.stats.spec_decode_num_draft_tokens += num_drafts
                self.stats.spec_decode_num_accepted_tokens += len(accepted)
            token_id = sampled.get(request.request_id)
            if token_id is not None:
                logprobs = runner_output.spec_logprobs.get(request.request_id)
                if logprobs is None and request.request_id in runner_output.logprobs:
                    logprobs = [runner_output.logprobs[request.request_id]]
                results.append(self._append(request, [*accepted, token_id], logprobs))
            if window and not request.status.is_finished:
                self.kv.free_out_of_window(request)  # after caching and forking: both still saw every block
        return results

    def _append(self, request: Request, token_ids: list[int], logprobs=None) -> EngineCoreOutput:
        """Append this step's tokens (one, or accepted drafts + one) until one finishes the request."""
        finished = None
        for n, token_id in enumerate(token_ids, 1):
            finished = request.append_token(token_id)
            if finished is not None:
                token_ids, logprobs = token_ids[:n], logprobs[:n] if logprobs is not None else None
                break
        if not request.forked:
            self._fork(request)
        if finished is not None:
            self.finish_request(request.request_id, finished)
        return EngineCoreOutput(request, list(token_ids), logprobs, finished)

    def _fork(self, parent: Request) -> None:
        """Start samples 1..n-1 of ``parent``'s group, sharing its prompt blocks."""
        parent.forked = True
        num_prompt = parent.num_prompt_tokens
        for index in range(1, parent.sampling_params.n):
            child = Request(f"{parent.group_id}#{index}", parent.prompt_token_ids, parent.sampling_params,
                            eos_token_ids=parent.eos_token_ids, max_model_len=parent.max_model_len,
                            group_id=parent.group_id, sample_index=index, lora=parent.lora)
            if parent.structured_output is not None:  # structured outputs: its own grammar state, from the start
                child.structured_output = parent.structured_output.fresh()
            self.kv.fork(parent, child, num_prompt)
            child.num_computed_tokens = num_prompt - 1  # recompute the last prompt token: own first sample
            child.status = RequestStatus.RUNNING
            self.requests[child.request_id] = child
            self.groups[parent.group_id].append(child.request_id)
            self.running.append(child)

    # ---- remote KV (decode worker) --------------------------------------------

    def remote_kv_arrived(self, request_id: str, first_token_id: int, first_logprob=None) -> EngineCoreOutput | None:
        """The prompt's KV is now in this request's blocks: make it a running decode.

        Returns the first token's output, or None if the request is no longer waiting.
        """
        request = self.waiting_for_remote_kvs.pop(request_id, None)
        if request is None:
            return None
        request.num_computed_tokens = request.num_prompt_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        self.kv.cache_full_blocks(request)
        return self._append(request, [first_token_id], [first_logprob] if first_logprob is not None else None)

    def recompute_locally(self, request_id: str) -> bool:
        """Remote prefill failed: prefill in this worker instead, keeping the reserved blocks."""
        request = self.waiting_for_remote_kvs.pop(request_id, None)
        if request is None:
            return False
        request.remote_prefill = False
        request.num_computed_tokens = request.num_cached_tokens  # prefix hits are still valid
        if any(NULL_BLOCK in table for table in request.block_tables):  # never reserved before a window: afresh
            self.kv.free(request)
            request.num_computed_tokens = request.num_cached_tokens = 0
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    # ---- finishing ------------------------------------------------------------

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Remove a request from every queue and free its blocks. Idempotent."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            # Safe: transfers land in a staging buffer, never in these blocks.
            del self.waiting_for_remote_kvs[request_id]
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        members = self.groups.get(request.group_id)
        if members is not None:
            members.remove(request_id)
            if not members:
                del self.groups[request.group_id]
        if request.delay_free_blocks:
            self.delayed_frees[request_id] = request
        else:
            self.kv.free(request)
        request.status = status
        return request

    def free_delayed(self, request_id: str) -> None:
        """Nothing reads ``request_id``'s blocks any more (its KV sends are done): free them once it
        finishes, or now if it has finished already (``Request.delay_free_blocks``). Idempotent; an
        unknown id is ignored."""
        request = self.delayed_frees.pop(request_id, None)
        if request is not None:
            self.kv.free(request)
        elif (request := self.requests.get(request_id)) is not None:
            request.delay_free_blocks = False

    def finish_group(self, group_id: str, status: RequestStatus) -> list[Request]:
        """Finish every sample of a router request (e.g. on abort)."""
        return [r for rid in list(self.groups.get(group_id, ())) if (r := self.finish_request(rid, status))]
