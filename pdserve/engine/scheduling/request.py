"""A request as the workers' schedulers see it."""

from __future__ import annotations

import enum
import hashlib
import time

from pdserve.common.protocol import FinishReason, LoRARequest, SamplingParams, TokenLogprob
from pdserve.engine.scheduling.block_manager import ROOT_HASH


class RequestStatus(enum.IntEnum):
    """Life cycle of a request inside one worker (names follow vLLM v1)."""

    WAITING = 1  # queued; no KV blocks yet
    WAITING_FOR_REMOTE_KVS = 2  # decode worker: blocks reserved, a prefill worker is computing the prompt's KV
    RUNNING = 3  # scheduled each step (prefill chunks, then one decode token per step)
    PREEMPTED = 4  # blocks taken back under memory pressure; will be recomputed
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    def finish_reason(self) -> FinishReason | None:
        return {
            RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
            RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
            RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
            RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
        }.get(self)


class Request:
    """One generation request: its tokens, KV blocks and progress.

    ``num_computed_tokens`` counts the tokens whose K/V are in this worker's
    cache. The tokens still to compute are ``all_token_ids[num_computed_tokens:]``;
    for a decoding request that is exactly the last sampled token.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        max_model_len: int | None = None,
        group_id: str | None = None,
        sample_index: int = 0,
        lora: LoRARequest | None = None,
    ):
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: empty prompt")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.output_token_ids: list[int] = []
        # One block table per KV cache group (pdserve.common.kv_cache_groups): logical block i of the
        # sequence is block_tables[g][i] in group g. One group unless the model mixes attention kinds.
        self.block_tables: list[list[int]] = [[]]
        self.rope_recomputed = False  # SchedulerConfig.recompute_past_len: done once for this request
        # prefill worker: per KV cache group, blocks from here on are sent, so a sliding window never frees
        # them (KVCacheManager.free_out_of_window); None: nothing to keep
        self.keep_blocks_from: list[int] | None = None
        # prefill worker: its KV leaves from these very blocks (sent from the cache), so when it finishes
        # they stay its own until the sends are done (Scheduler.free_delayed; vLLM's delay_free_blocks)
        self.delay_free_blocks = False
        self.num_computed_tokens = 0
        self.status = RequestStatus.WAITING
        self.arrival_time = time.monotonic()
        self.error: str | None = None
        self.num_preemptions = 0
        self.remote_prefill = False  # decode worker: the prompt's KV comes from a prefill worker
        self.group_id = group_id or request_id  # the router's request_id, shared by the n samples
        self.sample_index = sample_index  # which of the n samples (choices) this is
        self.block_hashes: list[bytes] = []  # prefix-cache hash of each full, computed block
        # ((block size, salt, cache root), the chained hashes of the prompt's full blocks): computed once by
        # KVCacheManager.prompt_hashes, read by the prefix lookup and by the caching of computed blocks
        self.prompt_hashes: tuple[tuple, list[bytes]] | None = None
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        # Its prefix hit's disk-tier blocks are being read into the KV cache off the step loop (not
        # admitted meanwhile); once read, it is admitted with them as device hits (``prefetched``).
        self.prefetching = False
        self.prefetched = False
        self.forked = sample_index > 0  # sample 0 forks samples 1..n-1 after its prompt is computed
        # Speculative decoding (pdserve.engine.execution.spec_decode): this step's draft tokens, the
        # distributions they were drawn from ([k, vocab] or None: point masses), and how many
        # tokens the draft model's own KV cache holds (draft_model method).
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs = None
        self.num_draft_computed_tokens = 0
        # sampling_params.prompt_logprobs: entries of prompt tokens 1.. so far (pdserve.engine.execution.prompt_logprobs)
        self.prompt_logprobs: list[TokenLogprob] = []
        # Structured outputs: this sample's grammar state (pdserve.engine.execution.structured_output), or None.
        self.structured_output = None
        self.grammar_future = None  # its grammar still compiling (a Future of the state): not yet admitted
        # The LoRA adapter applied to it (pdserve.engine.lora), or None. Its KV differs from the base model's,
        # so its prefix-cache hash chain starts from the adapter's own root.
        self.lora = lora
        self.cache_root = ROOT_HASH if lora is None else lora_cache_root(lora)

    @property
    def block_table(self) -> list[int]:
        """Group 0's block table: every layer's when the cache has one group, else the full-attention
        layers' (the one table that holds every token the request keeps)."""
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output + this step's drafts, copying only those."""
        num_prompt = len(self.prompt_token_ids)
        num_known = num_prompt + len(self.output_token_ids)
        tokens = self.prompt_token_ids[start:min(end, num_prompt)] if start < num_prompt else []
        if end > num_prompt and start < num_known:
            tokens += self.output_token_ids[max(start - num_prompt, 0):min(end, num_known) - num_prompt]
        if end > num_known:
            tokens += self.spec_token_ids[max(start - num_known, 0):end - num_known]
        return tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Record a sampled token; return the finished status if it ends the request."""
        self.output_token_ids.append(token_id)
        if self.structured_output is not None and (status := self._advance_grammar(token_id)) is not None:
            return status
        params = self.sampling_params
        n_out = len(self.output_token_ids)
        if n_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if n_out >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if self.max_model_len is not None and self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _advance_grammar(self, token_id: int) -> RequestStatus | None:
        """Structured outputs: feed the token to the grammar; a complete grammar ends the request ("stop")."""
        if not self.structured_output.accept_tokens([token_id]):
            self.error = f"token {token_id} breaks the structured output grammar: {self.structured_output.error}"
            return RequestStatus.FINISHED_ERROR
        return RequestStatus.FINISHED_STOPPED if self.structured_output.is_terminated() else None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens}, blocks={len(self.block_table)})"
        )


def lora_cache_root(lora: LoRARequest) -> bytes:
    """The prefix-cache "previous block" of a request's first block under adapter ``lora``: KV built
    with one adapter (or the base model, ``ROOT_HASH``) is never a hit for another."""
    return hashlib.sha256(f"lora|{lora.lora_int_id}|{lora.lora_name}|{lora.lora_path}".encode()).digest()
