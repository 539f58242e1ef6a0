"""Request checks, prompt building and tokenizing, and sampling parameters.

Everything here raises ``APIError`` (400/404) for requests we cannot serve,
before any worker is involved.
"""

from __future__ import annotations

import math

import jinja2

from pdserve.common.protocol import SamplingParams
from pdserve.router.errors import APIError, bad_request, model_not_found, not_supported
from pdserve.router.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                            SamplingRequest)


_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


def check_model(req: SamplingRequest, served_model_name: str) -> None:
    if req.model != served_model_name:
        raise model_not_found(req.model)


MAX_N = 16  # most choices (parallel samples) of one request
MAX_LOGPROBS = 20  # most top alternatives per position (OpenAI's limit)
_PENALTY_RANGE = 2.0  # frequency_penalty / presence_penalty lie in [-2, 2]


def _check_sampling_supported(req: SamplingRequest) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(req, name)
        if value is not None and not (math.isfinite(value) and abs(value) <= _PENALTY_RANGE):
            raise bad_request(f"{name} must be in [-{_PENALTY_RANGE:g}, {_PENALTY_RANGE:g}], "
                              f"got {value}", name)
    if req.repetition_penalty not in (None, 1):
        raise not_supported("repetition_penalty", "`repetition_penalty` other than 1")
    if req.logit_bias:
        raise not_supported("logit_bias")


def _check_num_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise bad_request(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param)


def check_completion_supported(req: CompletionRequest) -> None:
    _check_sampling_supported(req)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise not_supported("best_of", "`best_of` other than `n`")
    _check_num_logprobs(req.logprobs, "logprobs")
    if req.echo:
        raise not_supported("echo")
    if req.suffix:
        raise not_supported("suffix")


def check_chat_supported(req: ChatCompletionRequest) -> None:
    _check_sampling_supported(req)
    _check_num_logprobs(req.top_logprobs, "top_logprobs")
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.tools or req.functions:
        raise not_supported("tools", "tool calling")
    if req.tool_choice not in (None, "none", "auto"):
        raise not_supported("tool_choice", "tool calling")
    if req.response_format and req.response_format.get("type") not in (None, "text"):
        raise not_supported("response_format", "`response_format` other than text")
    for i, message in enumerate(req.messages):
        if isinstance(message.content, list):
            for part in message.content:
                if part.type != "text" or part.text is None:
                    raise not_supported(f"messages.{i}.content",
                                        f"content part of type `{part.type}`")


def requested_logprobs(req: SamplingRequest) -> int | None:
    """How many top alternatives per position the client wants, or None for no logprobs.

    Completions: ``logprobs`` (an int). Chat: ``top_logprobs`` (0 if absent) when
    ``logprobs`` is true. Either way the sampled token's logprob comes too.
    """
    if isinstance(req, ChatCompletionRequest):
        return (req.top_logprobs or 0) if req.logprobs else None
    return getattr(req, "logprobs", None)


def completion_prompt_ids(req: CompletionRequest, tokenizer) -> list[int]:
    """Token ids of a completion prompt (a string or a list of token ids)."""
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise not_supported("prompt", "a batch of several prompts")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        ids = tokenizer.encode(prompt)
    else:
        ids = list(prompt)
        vocab_size = len(tokenizer)
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise bad_request(f"prompt token id {bad[0]} is out of range [0, {vocab_size})", "prompt")
    if not ids:
        raise bad_request("prompt must not be empty", "prompt")
    return ids


def chat_prompt_ids(req: ChatCompletionRequest, tokenizer) -> list[int]:
    """Apply the tokenizer's chat template to the messages and tokenize the result."""
    messages = []
    for message in req.messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        entry = {"role": message.role, "content": content}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt,
                                             tokenize=False)
    except (ValueError, jinja2.TemplateError) as e:
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from e
    # The template already wrote any BOS/special tokens as text: do not add them again.
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not ids:
        raise bad_request("the chat prompt is empty", "messages")
    return ids


def requested_max_tokens(req: SamplingRequest) -> int | None:
    """The client's max_tokens (chat: max_completion_tokens wins), or None for the context limit."""
    value = getattr(req, "max_completion_tokens", None)
    param = "max_completion_tokens"
    if value is None:
        value, param = req.max_tokens, "max_tokens"
    if value is not None and value < 1:
        raise bad_request(f"{param} must be at least 1, got {value}", param)
    return value


def resolve_max_tokens(max_tokens: int | None, num_prompt_tokens: int, max_model_len: int) -> int:
    """Check prompt + max_tokens against ``max_model_len``; fill in a missing max_tokens."""
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"prompt has {num_prompt_tokens} tokens, which leaves no room for the completion. "
                f"Please shorten the prompt.", "messages")
        return max_model_len - num_prompt_tokens
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the length of the prompt or of the completion.", "max_tokens")
    return max_tokens


def build_sampling_params(req: SamplingRequest, max_tokens: int, vocab_size: int) -> SamplingParams:
    """Validate the sampling fields and pack them into the wire ``SamplingParams``.

    ``n``, the penalties and the logprob counts were range-checked by
    ``check_*_supported`` already.
    """
    temperature = 1.0 if req.temperature is None else req.temperature
    if not (math.isfinite(temperature) and temperature >= 0):
        raise bad_request(f"temperature must be >= 0, got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not 0 < top_p <= 1:
        raise bad_request(f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = req.top_k
    if top_k is not None and top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (disabled) or >= 1, got {top_k}", "top_k")
    if top_k is not None:
        top_k = None if top_k <= 0 else min(top_k, vocab_size)
    if req.seed is not None and not _INT64_MIN <= req.seed <= _INT64_MAX:
        raise bad_request(f"seed must fit in a signed 64-bit integer, got {req.seed}", "seed")
    if req.min_tokens < 0:
        raise bad_request(f"min_tokens must be >= 0, got {req.min_tokens}", "min_tokens")
    if req.min_tokens > max_tokens:
        raise bad_request(f"min_tokens ({req.min_tokens}) must not exceed max_tokens ({max_tokens})",
                          "min_tokens")
    stop_token_ids = list(req.stop_token_ids or [])
    bad = [t for t in stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"stop token id {bad[0]} is out of range [0, {vocab_size})", "stop_token_ids")
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=req.seed,
        stop=[s for s in req.stop_list() if s], stop_token_ids=stop_token_ids,
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, n=req.n or 1,
        logprobs=requested_logprobs(req), frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0)
