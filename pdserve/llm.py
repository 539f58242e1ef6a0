"""Offline (in-process) generation: one engine in this process, no router, no workers.

    llm = LLM(model="/path/to/checkpoint", kv_cache_memory="1GiB")
    outputs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=32, temperature=0))
    print(outputs[0].outputs[0].text)

The engine is the same ``EngineCore`` the prefill and decode workers wrap,
with every prefill local; requests pass the same checks as at the router
(``pdserve.common.validation``). All prompts of one call are
queued at once and run with continuous batching, chunked prefill, prefix
caching and preemption as in the server. Text is made as the router makes it:
one ``IncrementalDetokenizer`` per choice, so stop strings cut the text exactly
as they do over HTTP, and a choice that hits one is finished in the scheduler
at once (its KV blocks are freed).

Life of one ``generate`` call::

    prompts --tokenize/check--> core.add_request per prompt --> step loop
      step: core.step() (schedule -> execute -> update) -> detokenize per choice
    every choice finished --> RequestOutput per prompt, in input order
"""

from __future__ import annotations

import concurrent.futures
import itertools
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
from tqdm.auto import tqdm
from transformers import AutoTokenizer

from pdserve.beam_search import (BeamSearch, BeamSearchOutput, BeamSearchParams, check_beam_search_params,
                                 engine_step_runner, run_beam_search)
from pdserve.common.protocol import LoRARequest, SamplingParams, TokenLogprob
from pdserve.common.utils import parse_size
from pdserve.common.validation import ValidationError, check_context_length, check_prompt_ids, check_request
from pdserve.engine.config import EngineConfig, parse_kv_cache_memory
from pdserve.engine.core import EngineCore
from pdserve.engine.scheduling.outputs import EngineCoreOutput
from pdserve.engine.execution.structured_output import check_structured_outputs
from pdserve.engine.scheduling.request import RequestStatus
from pdserve.tokenizer.chat import render_chat_prompt
from pdserve.tokenizer.detokenizer import IncrementalDetokenizer

__all__ = ["LLM", "RequestOutput", "CompletionOutput", "Logprob", "SamplingParams", "BeamSearchParams",
           "BeamSearchOutput"]

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
class Logprob:
    """One token's entry in ``RequestOutput.prompt_logprobs`` (vLLM's ``Logprob``).

    ``rank``: 1 + how many ids the model ranks above this one; ``decoded_token``: the id decoded alone.
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class RequestOutput:
    """Everything generated for one prompt. ``prompt`` is None for token-id prompts.

    ``prompt_logprobs`` (when ``SamplingParams.prompt_logprobs`` is set), as vLLM gives it: one
    entry per prompt token, None for the first, else ``{token_id: Logprob}`` holding the prompt
    token itself first, then the top ``prompt_logprobs`` alternatives (ranks 1..k).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    finished: bool = True
    prompt_logprobs: PromptLogprobs | None = None


def prompt_logprob_dicts(entries: Sequence[TokenLogprob], decode) -> PromptLogprobs:
    """vLLM's prompt-logprobs list from the engine's entries of prompt tokens 1..N-1.

    Args:
        entries: one ``TokenLogprob`` per prompt token after the first (``rank`` set).
        decode: token id -> its text alone.
    """
    out: PromptLogprobs = [None]
    for entry in entries:
        step = {entry.token_id: Logprob(entry.logprob, entry.rank, decode(entry.token_id))}
        for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1):
            step.setdefault(token_id, Logprob(logprob, rank, decode(token_id)))
        out.append(step)
    return out


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
    prompt_logprobs: PromptLogprobs | None = None
    lora: LoRARequest | None = None

    def result(self) -> RequestOutput:
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids,
                             [c.result() for c in self.choices], self.num_cached_tokens or 0,
                             prompt_logprobs=self.prompt_logprobs)


class LLM:
    """A whole engine in this process, for batch generation from Python.

    Args:
        model: Hugging Face checkpoint directory (weights, config and tokenizer); None uses
            the built-in default model (``pdserve.default_model.train.shipped_model_dir()``, a small
            Llama trained on Python's standard library).
        tokenizer: tokenizer directory; None uses ``model``.
        **engine_kwargs: ``EngineConfig`` fields: dtype, device, block_size (tokens),
            kv_cache_memory (bytes, a size such as ``"1GiB"``, or ``"auto"``, the default: from the host's
            memory, see ``EngineConfig``), memory_utilization, max_num_seqs,
            max_num_batched_tokens (tokens per step), max_model_len (tokens), seed,
            enable_prefix_caching, num_threads, tensor_parallel_size, pipeline_parallel_size
            (the other ranks run as local processes; ``close()`` or exit stops them),
            batch_invariant (bit-identical results whatever the batch; see ``EngineConfig``),
            enable_lora, max_loras, max_lora_rank, max_cpu_loras (LoRA adapters; see ``generate``).

    Attributes:
        core: the ``EngineCore`` (``core.runner``, ``core.scheduler``, ``core.block_manager``).
        tokenizer: the Hugging Face tokenizer.
    """

    def __init__(self, model: str | None = None, tokenizer: str | None = None, **engine_kwargs):
        if model is None:
            from pdserve.default_model.train import shipped_model_dir

            model = str(shipped_model_dir())
        if engine_kwargs.get("kv_cache_memory") is not None:
            engine_kwargs["kv_cache_memory"] = parse_kv_cache_memory(engine_kwargs["kv_cache_memory"])
        if "kv_offload_memory" in engine_kwargs:
            engine_kwargs["kv_offload_memory"] = parse_size(engine_kwargs["kv_offload_memory"])
        # Every prefill is local here: no threshold for handing prompts to a prefill worker.
        engine_kwargs.setdefault("remote_prefill_threshold", 0)
        self.config = EngineConfig(model=model, **engine_kwargs)
        self.core = EngineCore(self.config)
        self._finalizer = weakref.finalize(self, self.core.close)  # stops the other ranks, if any
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or model)
        self.max_model_len = self.core.limits.max_model_len
        self._ids = itertools.count()

    def close(self) -> None:
        """Stop the engine's other ranks (tensor/pipeline parallel); also done at exit."""
        self._finalizer()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @property
    def vocab_size(self) -> int:
        return self.core.limits.vocab_size

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def block_manager(self):
        return self.core.block_manager

    # ---- public API -------------------------------------------------------------

    def generate(self, prompts: str | Sequence[Prompt], sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; return one ``RequestOutput`` per prompt, in input order.

        Args:
            prompts: a string, a list of strings, a list of token-id lists (or one token-id list), or
                vLLM's prompt dicts (``{"prompt_token_ids": [...]}`` or ``{"prompt": "..."}``).
            sampling_params: one for all prompts, or one per prompt; None = ``SamplingParams()``.
            use_tqdm: show a progress bar over finished prompts with the output rate (tokens/s).
            priority: one per prompt (vLLM's argument), with ``scheduling_policy="priority"``:
                lower runs sooner; it sets each prompt's ``SamplingParams.priority``.
            lora_request: a LoRA adapter for all prompts or one per prompt (None: the base model),
                as vLLM's ``LoRARequest(lora_name, lora_int_id, lora_path)``; needs
                ``enable_lora=True``. Prompts of different adapters run in the same batches.

        Raises:
            ValueError: bad sampling values, an empty or out-of-vocabulary prompt, a request
                longer than max_model_len or than the whole KV cache, or an adapter that cannot
                serve this model; raised before any work.
        """
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [(p["prompt_token_ids"] if "prompt_token_ids" in p else p["prompt"]) if isinstance(p, dict) else p
                   for p in prompts]  # vLLM's TokensPrompt / TextPrompt dicts
        encoded = [(p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, list(p)) for p in prompts]
        if priority is not None:
            if len(priority) != len(encoded):
                raise ValueError(f"got {len(priority)} priorities for {len(encoded)} prompts")
            base = sampling_params or SamplingParams()
            per_prompt = [base] * len(encoded) if isinstance(base, SamplingParams) else list(base)
            sampling_params = [msgspec.structs.replace(p, priority=int(v)) for p, v in zip(per_prompt, priority)]
        return self._generate(encoded, sampling_params, use_tqdm, lora_request)

    def chat(self, messages: Sequence[Message] | Sequence[Sequence[Message]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True,
             lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
             continue_final_message: bool = False,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of ``{"role", "content"}``) or a list of them.

        Each conversation goes through the tokenizer's chat template, as the router's
        /v1/chat/completions does. ``RequestOutput.prompt`` is the templated text.
        ``lora_request``: as ``generate``'s. ``continue_final_message`` and ``chat_template_kwargs``
        (e.g. ``{"enable_thinking": False}``): as vLLM's (``pdserve.tokenizer.chat.render_chat_prompt``;
        ValueError for a reserved key or both flags set).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        encoded = [render_chat_prompt(self.tokenizer, conversation, add_generation_prompt, continue_final_message,
                                      chat_template_kwargs)
                   for conversation in conversations]
        return self._generate(encoded, sampling_params, use_tqdm, lora_request)

    def beam_search(self, prompts: Sequence[Prompt | dict], params: BeamSearchParams,
                    lora_request: LoRARequest | None = None) -> list[BeamSearchOutput]:
        """Beam-search every prompt (vLLM's ``LLM.beam_search``; rules: ``pdserve.beam_search``).

        Each step runs every running beam of every prompt as one batch of one-token requests;
        the beams' common prefixes come from the prefix cache. Hypotheses stop at
        ``params.max_tokens`` or where ``max_model_len`` leaves no room.

        Args:
            prompts: strings, token-id lists, or vLLM-style dicts (``{"prompt": ...}`` /
                ``{"prompt_token_ids": [...]}``), or one of these.
            params: ``BeamSearchParams`` (beam_width, max_tokens, ignore_eos, temperature,
                length_penalty, early_stopping).
            lora_request: a LoRA adapter for every beam (needs ``enable_lora=True``).

        Returns:
            One ``BeamSearchOutput`` per prompt, in input order: ``beam_width`` sequences, best
            score first, ``tokens`` = prompt + generated, ``text`` = the generated text.

        Raises:
            ValueError: bad params, an empty or out-of-vocabulary prompt, or one with no room
                left under max_model_len; raised before any work.
        """
        eos = self.core.runner.eos_token_ids
        check_beam_search_params(params, len(eos))
        if lora_request is not None:
            self.core.check_lora(lora_request)
        if isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        searches = []
        for i, prompt in enumerate(prompts):
            if isinstance(prompt, dict):
                prompt = prompt["prompt_token_ids"] if "prompt_token_ids" in prompt else prompt["prompt"]
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            try:
                check_prompt_ids(ids, self.vocab_size)
                check_context_length(len(ids), None, self.max_model_len)
            except ValidationError as e:
                raise ValidationError(f"prompt {i}: {e.message}", e.param) from None
            searches.append(BeamSearch(ids, params, eos, min(params.max_tokens, self.max_model_len - len(ids))))
        run_beam_search(searches, engine_step_runner(self.core, lambda: f"beam-{next(self._ids)}", lora_request))
        outputs = [s.output() for s in searches]
        for output in outputs:
            for sequence in output.sequences:
                sequence.text = self.tokenizer.decode(sequence.text_token_ids, skip_special_tokens=True)
        return outputs

    # ---- internals ----------------------------------------------------------------

    def _generate(self, encoded: list[tuple[str | None, list[int]]], sampling_params, use_tqdm: bool,
                  lora_request=None) -> list[RequestOutput]:
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(encoded)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(encoded):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(encoded)} prompts")
        loras = [lora_request] * len(encoded) if lora_request is None or isinstance(lora_request, LoRARequest) \
            else list(lora_request)
        if len(loras) != len(encoded):
            raise ValueError(f"got {len(loras)} lora_requests for {len(encoded)} prompts")
        groups: list[_Group] = []
        for i, ((prompt, ids), params, lora) in enumerate(zip(encoded, params_list, loras)):
            try:
                check_request(ids, params, self.core.limits, stop_at_max_model_len=True)
                check_structured_outputs(params.structured_outputs)  # an invalid grammar: before any work
                if lora is not None:
                    self.core.check_lora(lora)
            except ValidationError as e:  # checked before any work: nothing to undo
                raise ValidationError(f"prompt {i}: {e.message}", e.param) from None
            choices = [_Choice(k, IncrementalDetokenizer(self.tokenizer, ids, params.stop,
                                                         min_tokens=params.min_tokens), params.logprobs is not None)
                       for k in range(params.n)]
            groups.append(_Group(str(next(self._ids)), prompt, ids, params, choices, lora=lora))
        self._run({g.request_id: g for g in groups}, use_tqdm)
        return [g.result() for g in groups]

    def _run(self, groups: dict[str, _Group], use_tqdm: bool) -> None:
        """Queue every group and step the engine until all choices are done."""
        pbar = tqdm(total=len(groups), desc="Processed prompts", unit="prompt", disable=not use_tqdm)
        start = time.perf_counter()
        num_output_tokens = 0
        try:
            for g in groups.values():
                self.core.add_request(g.request_id, g.prompt_token_ids, g.params, stop_at_max_model_len=True,
                                      lora=g.lora)
            while self.core.has_unfinished():
                num_new, done = self._step(groups)
                num_output_tokens += num_new
                if done:
                    rate = num_output_tokens / max(time.perf_counter() - start, 1e-9)
                    pbar.set_postfix_str(f"output {rate:.1f} tok/s", refresh=False)
                    pbar.update(len(done))
        finally:
            pbar.close()
            for group_id in list(self.core.scheduler.groups):  # interrupted: free every block
                self.core.abort(group_id)

    def _step(self, groups: dict[str, _Group]) -> tuple[int, list[_Group]]:
        """One engine step; return (tokens sampled, groups that finished)."""
        scheduler_output, outputs = self.core.step()
        if scheduler_output.is_empty() and (pending := self.core.pending_grammars()):
            concurrent.futures.wait(pending, return_when=concurrent.futures.FIRST_COMPLETED)
            return 0, []
        if scheduler_output.is_empty() and self.core.block_manager.num_prefetching:
            return 0, []  # its requests wait for their disk-tier blocks (core.step waited a little)
        if scheduler_output.is_empty():
            raise RuntimeError(f"the scheduler made no progress with {self.core.scheduler.num_waiting} "
                               f"requests waiting")
        for request, _ in scheduler_output.scheduled:
            group = groups[request.group_id]
            if request.sample_index == 0 and group.num_cached_tokens is None:  # first admission
                group.num_cached_tokens = request.num_cached_tokens
        done = [group for output in outputs if (group := self._take(groups[output.request.group_id], output))]
        return len(outputs), done

    def _take(self, group: _Group, output: EngineCoreOutput) -> _Group | None:
        """Give one output to its choice; return the group if that finished its last choice.

        A choice that a stop string ended is finished in the engine here (the engine did not know).
        """
        request = output.request
        if output.prompt_logprobs is not None and group.prompt_logprobs is None:
            group.prompt_logprobs = prompt_logprob_dicts(output.prompt_logprobs, self._decode_token)
        choice = group.choices[request.sample_index]
        last = len(output.new_token_ids) - 1  # several tokens: accepted drafts (speculative decoding)
        for i, token_id in enumerate(output.new_token_ids):
            logprob = output.logprobs[i] if output.logprobs else None
            if choice.add(token_id, logprob, output.finished if i == last else None):
                break
        else:
            return None
        if output.finished is None:
            self.core.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
        group.num_finished += 1
        return group if group.num_finished == len(group.choices) else None
