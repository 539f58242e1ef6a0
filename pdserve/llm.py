"""Offline (in-process) generation: one engine in this process, no router, no workers.

    llm = LLM(model="/path/to/checkpoint", kv_cache_memory="1GiB")
    outputs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].outputs[0].text)

The engine is the same one a decode worker runs (``ModelRunner`` + ``Scheduler``
+ ``BlockManager``), with every prefill local. All prompts of one call are
queued at once and run with continuous batching, chunked prefill, prefix
caching and preemption as in the server. Text is made as the router makes it:
one ``IncrementalDetokenizer`` per choice, so stop strings cut the text exactly
as they do over HTTP, and a choice that hits one is finished in the scheduler
at once (its KV blocks are freed).

Life of one ``generate`` call::

    prompts --tokenize/check--> Request per prompt --scheduler--> step loop
      step: schedule -> runner.execute -> update_from_output -> detokenize per choice
    every choice finished --> RequestOutput per prompt, in input order
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from tqdm.auto import tqdm
from transformers import AutoTokenizer

from pdserve.common.protocol import SamplingParams, TokenLogprob
from pdserve.common.utils import parse_size
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.config import EngineConfig
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.router.detokenizer import IncrementalDetokenizer

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "SamplingParams", "check_sampling_params"]

Prompt = str | list[int]
Message = dict[str, str]


@dataclass
class CompletionOutput:
    """One choice (of ``n``) of a prompt.

    ``token_ids`` holds every sampled token, the EOS or stop-string token
    included; ``text`` is cut before a matched stop string. ``logprobs`` has
    one entry per token of ``token_ids`` when ``SamplingParams.logprobs`` is set.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop token id, stop string) or "length"
    logprobs: list[TokenLogprob] | None = None


@dataclass
class RequestOutput:
    """Everything generated for one prompt. ``prompt`` is None for token-id prompts."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    finished: bool = True


def check_sampling_params(params: SamplingParams) -> None:
    """Reject values the engine cannot honour.

    Raises:
        ValueError: naming the field and its allowed range.
    """
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {params.max_tokens}")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise ValueError(f"temperature must be >= 0, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k is not None and params.top_k < 1:
        raise ValueError(f"top_k must be None (disabled) or >= 1, got {params.top_k}")
    if params.n < 1:
        raise ValueError(f"n must be >= 1, got {params.n}")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens={params.max_tokens}], got {params.min_tokens}")
    if params.logprobs is not None and params.logprobs < 0:
        raise ValueError(f"logprobs must be None or >= 0, got {params.logprobs}")


class _Choice:
    """Tokens, logprobs and text of one choice, detokenized as the router does."""

    def __init__(self, index: int, detokenizer: IncrementalDetokenizer, want_logprobs: bool):
        self.index = index
        self.detokenizer = detokenizer
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] | None = [] if want_logprobs else None
        self.finish_reason: str | None = None

    def add(self, token_id: int, logprob: TokenLogprob | None, finished: RequestStatus | None) -> bool:
        """Take one sampled token; return True once the choice is done."""
        self.token_ids.append(token_id)
        if self.logprobs is not None and logprob is not None:
            self.logprobs.append(logprob)
        self.detokenizer.add_tokens([token_id])
        if self.detokenizer.stopped:
            self.finish_reason = "stop"
        elif finished is not None:
            self.detokenizer.flush()
            self.finish_reason = finished.finish_reason().to_openai()
        return self.finish_reason is not None

    def result(self) -> CompletionOutput:
        return CompletionOutput(self.index, self.detokenizer.text, self.token_ids, self.finish_reason, self.logprobs)


@dataclass
class _Group:
    """One prompt and its ``n`` choices while a call runs."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: list[_Choice]
    num_cached_tokens: int | None = None
    num_finished: int = 0

    def result(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.result() for c in self.choices], self.num_cached_tokens or 0)


class LLM:
    """A whole engine in this process, for batch generation from Python.

    Args:
        model: Hugging Face checkpoint directory (weights, config and tokenizer).
        tokenizer: tokenizer directory; None uses ``model``.
        **engine_kwargs: ``EngineConfig`` fields: dtype, device, block_size (tokens),
            kv_cache_memory (bytes, or a size such as ``"1GiB"``), max_num_seqs,
            max_num_batched_tokens (tokens per step), max_model_len (tokens), seed,
            enable_prefix_caching, num_threads.

    Attributes:
        runner, scheduler, block_manager, tokenizer: the engine's parts.
    """

    def __init__(self, model: str, tokenizer: str | None = None, **engine_kwargs):
        if "kv_cache_memory" in engine_kwargs:
            engine_kwargs["kv_cache_memory"] = parse_size(engine_kwargs["kv_cache_memory"])
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.runner = ModelRunner(self.config)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        self.block_manager = BlockManager(self.runner.num_blocks, self.runner.block_size,
                                          enable_prefix_caching=self.config.enable_prefix_caching,
                                          salt=self.runner.model_fingerprint)
        self.scheduler = Scheduler(SchedulerConfig(max_num_seqs=self.config.max_num_seqs,
                                                   max_num_batched_tokens=self.config.max_num_batched_tokens,
                                                   max_model_len=self.runner.max_model_len), self.block_manager)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = int(self.runner.model.config.vocab_size)
        self._ids = itertools.count()

    # ---- public API -------------------------------------------------------------

    def generate(self, prompts: str | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for every prompt; return one ``RequestOutput`` per prompt, in input order.

        Args:
            prompts: a string, a list of strings, a list of token-id lists (or one token-id list).
            sampling_params: one for all prompts, or one per prompt; None = ``SamplingParams()``.
            use_tqdm: show a progress bar over finished prompts with the output rate (tokens/s).

        Raises:
            ValueError: bad sampling values, an empty or out-of-vocabulary prompt, or a request
                longer than max_model_len or than the whole KV cache; raised before any work.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        encoded = [(p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p)) for p in prompts]
        return self._generate(encoded, sampling_params, use_tqdm)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or a list of them.

        Each conversation goes through the tokenizer's chat template, as the router's
        /v1/chat/completions does. ``RequestOutput.prompt`` is the templated text.
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = []
        for conversation in conversations:
            text = self.tokenizer.apply_chat_template(list(conversation), add_generation_prompt=add_generation_prompt,
                                                      tokenize=False)
            # The template wrote any special tokens as text: do not add them again.
            encoded.append((text, self.tokenizer.encode(text, add_special_tokens=False)))
        return self._generate(encoded, sampling_params, use_tqdm)

    # ---- internals ----------------------------------------------------------------

    def _generate(self, encoded: list[tuple[str | None, list[int]]], sampling_params, use_tqdm: bool
                  ) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(encoded)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(encoded):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(encoded)} prompts")
        groups: list[_Group] = []
        for i, ((prompt, ids), params) in enumerate(zip(encoded, params_list)):
            check_sampling_params(params)
            self._check_prompt(i, ids, params)
            choices = [_Choice(k, IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                                         min_tokens=params.min_tokens), params.logprobs is not None)
                       for k in range(params.n)]
            groups.append(_Group(str(next(self._ids)), prompt, ids, params, choices))
        self._run({g.request_id: g for g in groups}, use_tqdm)
        return [g.result() for g in groups]

    def _check_prompt(self, index: int, ids: list[int], params: SamplingParams) -> None:
        """Raise ValueError unless prompt ``index`` can run to completion in this engine."""
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt {index}: token id {bad[0]} is out of range [0, {self.vocab_size})")
        num_prompt = len(ids)
        if num_prompt >= self.max_model_len:
            raise ValueError(f"prompt {index} has {num_prompt} tokens; max_model_len is {self.max_model_len} "
                             f"tokens, which leaves no room for output")
        # One choice must fit alone (the others wait or are preempted); it stops at max_model_len.
        num_tokens = max(num_prompt + 1, min(num_prompt + params.max_tokens, self.max_model_len))
        bm = self.block_manager
        needed = bm.num_blocks_for_tokens(num_tokens)
        if needed > bm.num_blocks:
            raise ValueError(f"prompt {index} needs {needed} KV blocks ({num_prompt} prompt tokens + up to "
                             f"{params.max_tokens} max_tokens); the KV cache has {bm.num_blocks} blocks of "
                             f"{bm.block_size} tokens: raise kv_cache_memory or lower max_tokens")

    def _run(self, groups: dict[str, _Group], use_tqdm: bool) -> None:
        """Queue every group and step the engine until all choices are done."""
        for g in groups.values():
            self.scheduler.add_request(Request(g.request_id, g.prompt_token_ids, g.params,
                                               eos_token_ids=self.runner.eos_token_ids,
                                               max_model_len=self.max_model_len, group_id=g.request_id))
        pbar = tqdm(total=len(groups), desc="Processed prompts", unit="prompt", disable=not use_tqdm)
        start = time.perf_counter()
        num_output_tokens = 0
        try:
            while self.scheduler.has_unfinished():
                num_new, done = self._step(groups)
                num_output_tokens += num_new
                if done:
                    rate = num_output_tokens / max(time.perf_counter() - start, 1e-9)
                    pbar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                    pbar.update(len(done))
        finally:
            pbar.close()
            for group_id in list(self.scheduler.groups):  # interrupted: free every block
                self.scheduler.finish_group(group_id, RequestStatus.FINISHED_ABORTED)

    def _step(self, groups: dict[str, _Group]) -> tuple[int, list[_Group]]:
        """One engine step; return (tokens sampled, groups that finished)."""
        out = self.scheduler.schedule()
        if out.is_empty():
            raise RuntimeError(f"the scheduler made no progress with {self.scheduler.num_waiting} requests waiting")
        for request, _ in out.scheduled:
            group = groups[request.group_id]
            if request.sample_index == 0 and group.num_cached_tokens is None:  # first admission
                group.num_cached_tokens = request.num_cached_tokens
        sampled = self.runner.execute(out.scheduled, block_copies=out.block_copies)
        logprobs = self.runner.last_logprobs
        results = self.scheduler.update_from_output(out, sampled)
        done = []
        for request, token_ids, finished in results:
            group = groups[request.group_id]
            choice = group.choices[request.sample_index]
            if not choice.add(token_ids[0], logprobs.get(request.request_id), finished):
                continue
            if finished is None:  # a stop string matched: the scheduler did not know
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            group.num_finished += 1
            if group.num_finished == len(group.choices):
                done.append(group)
        return len(results), done
