"""OpenAI request -> prompt token ids and wire ``SamplingParams``.

What is particular to the OpenAI API lives here: which fields we do not support
yet, chat message flattening, top_k's -1/0 spelling, ``max_completion_tokens``.
The rules every engine shares (ranges of the sampling fields, prompt lengths,
vocabulary) are ``pdserve.common.validation``'s, applied by ``serving`` against
the limits the workers advertise. Everything here raises ``APIError`` (400/404),
before any worker is involved.
"""

from __future__ import annotations

import msgspec

from pdserve.common.protocol import SamplingParams
from pdserve.common.validation import LOGIT_BIAS_RANGE, ValidationError, check_sampling_params
from pdserve.router.errors import bad_request, model_not_found, not_supported
from pdserve.router.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                            SamplingRequest)
from pdserve.tokenizer.bad_words import bad_words_token_ids
from pdserve.router.structured_outputs import structured_outputs_of
from pdserve.tokenizer.chat import render_chat_prompt


def check_model(model: str, served_model_name: str) -> None:
    """404 unless ``model`` is the served model's name (LoRA adapters: ``pdserve.router.lora``)."""
    if model != served_model_name:
        raise model_not_found(model)


def _check_return_token_ids(req: SamplingRequest) -> None:
    if req.return_token_ids and (req.stream or req.use_beam_search):
        raise not_supported("return_token_ids", "`return_token_ids` with `stream` or `use_beam_search`")


def check_completion_supported(req: CompletionRequest) -> None:
    _check_return_token_ids(req)
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise not_supported("best_of", "`best_of` other than `n`")
    if req.suffix:
        raise not_supported("suffix")


def check_chat_supported(req: ChatCompletionRequest) -> None:
    _check_return_token_ids(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs set to true", "top_logprobs")
    if req.tools or req.functions:
        raise not_supported("tools", "tool calling")
    if req.tool_choice not in (None, "none", "auto"):
        raise not_supported("tool_choice", "tool calling")
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
        ids = list(prompt)  # checked against the workers' vocabulary when routed
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
    param = ("chat_template_kwargs" if req.chat_template_kwargs else "messages")
    if req.continue_final_message and req.add_generation_prompt:
        param = "continue_final_message"
    try:
        _, ids = render_chat_prompt(tokenizer, messages, req.add_generation_prompt, req.continue_final_message,
                                    req.chat_template_kwargs)
    except ValueError as e:
        raise bad_request(str(e), param) from e
    return ids


def echo_only(req: SamplingRequest) -> bool:
    """Completions ``echo`` with ``max_tokens`` 0: the response is the prompt alone (vLLM's rule;
    the engine still samples one token, which is dropped)."""
    return bool(getattr(req, "echo", False)) and req.max_tokens == 0


def requested_max_tokens(req: SamplingRequest) -> int | None:
    """The client's max_tokens (chat: max_completion_tokens wins), or None for the context limit.

    0 is allowed only with completions ``echo`` (``echo_only``), and then means 1 for the engine.
    """
    value = getattr(req, "max_completion_tokens", None)
    param = "max_completion_tokens"
    if value is None:
        value, param = req.max_tokens, "max_tokens"
    if echo_only(req):
        return 1
    if value is not None and value < 1:
        raise bad_request(f"{param} must be at least 1, got {value}", param)
    return value


def requested_prompt_logprobs(req: SamplingRequest) -> int | None:
    """``prompt_logprobs``; completions with ``echo`` and ``logprobs`` default it to ``logprobs`` (vLLM)."""
    if req.prompt_logprobs is None and getattr(req, "echo", False):
        return getattr(req, "logprobs", None)
    return req.prompt_logprobs


def parse_logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's ``logit_bias`` (token-id strings -> bias) as ids; biases clamped to [-100, 100] (vLLM).

    Raises:
        APIError: 400 (param ``logit_bias``) for a key that is not an integer or a value that is not finite.
    """
    if not logit_bias:
        return None
    out = {}
    for key, bias in logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise bad_request(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
        if bias != bias or bias in (float("inf"), float("-inf")):
            raise bad_request(f"logit_bias values must be finite, got {bias} for token {key}", "logit_bias")
        out[token_id] = max(-LOGIT_BIAS_RANGE, min(LOGIT_BIAS_RANGE, float(bias)))
    return out


def logits_params_fields(req: SamplingRequest, tokenizer=None) -> dict:
    """The ``SamplingParams`` fields of ``repetition_penalty``, ``logit_bias``, ``bad_words`` (tokenized
    with ``tokenizer``, as vLLM does) and ``prompt_logprobs``."""
    fields = {"repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
              "logit_bias": parse_logit_bias(req.logit_bias),
              "prompt_logprobs": requested_prompt_logprobs(req)}
    if req.bad_words and tokenizer is not None:
        fields["bad_words_token_ids"] = bad_words_token_ids(tokenizer, req.bad_words)
    return fields


def build_sampling_params(req: SamplingRequest, max_tokens: int, vocab_size: int | None = None,
                          tokenizer=None) -> SamplingParams:
    """Pack the OpenAI sampling fields into the wire ``SamplingParams`` and check their ranges.

    ``max_tokens`` is the resolved completion length. Range errors name the OpenAI
    field (chat's ``top_logprobs`` for the logprob count). ``tokenizer`` tokenizes ``bad_words``.

    Raises:
        APIError: 400 for a value out of range.
    """
    if req.top_k is not None and req.top_k < -1:
        raise bad_request(f"top_k must be -1 or 0 (disabled) or >= 1, got {req.top_k}", "top_k")
    top_k = None if req.top_k is None or req.top_k <= 0 else req.top_k
    if top_k is not None and vocab_size is not None:
        top_k = min(top_k, vocab_size)
    params = SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k, seed=req.seed,
        stop=[s for s in req.stop_list() if s], stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos, min_tokens=req.min_tokens, n=1 if req.n is None else req.n,
        logprobs=requested_logprobs(req), frequency_penalty=req.frequency_penalty or 0.0,
        presence_penalty=req.presence_penalty or 0.0, priority=req.priority,
        structured_outputs=structured_outputs_of(req))  # response_format, structured_outputs, guided_*
    params = msgspec.structs.replace(params, **logits_params_fields(req, tokenizer))
    try:
        check_sampling_params(params, vocab_size)
    except ValidationError as e:
        param = "top_logprobs" if e.param == "logprobs" and isinstance(req, ChatCompletionRequest) else e.param
        raise bad_request(e.message.replace("logprobs", param, 1) if param != e.param else e.message,
                          param) from None
    return params
