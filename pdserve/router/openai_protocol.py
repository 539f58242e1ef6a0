"""OpenAI-compatible request and response bodies (pydantic 2).

Requests ignore unknown fields (as vLLM does). Fields we parse but cannot honour
yet (``best_of`` other than ``n``, ``suffix``, tools, ...) are
rejected with 400 by ``preprocess.check_*_supported`` rather than silently
ignored. Extension fields beyond OpenAI's (``top_k``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``repetition_penalty``,
``bad_words``, ``prompt_logprobs``) follow vLLM's names.

Log-probabilities come in OpenAI's two shapes: the legacy completions one
(``CompletionLogprobs``: parallel lists, ``top_logprobs`` as one
``{token: logprob}`` dict per position) and the chat one (``ChatLogprobs``:
one ``ChatLogprobToken`` per position with ``bytes`` and a ``top_logprobs`` list).
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

MAX_STOP_STRINGS = 64  # stop strings per request (each is matched against every choice's text)
MAX_STOP_TOKEN_IDS = 1024


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- errors -------------------------------------------------------------------------------

class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: int | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


# --- requests ------------------------------------------------------------------------------

class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None  # None = 1.0; 0 = greedy
    top_p: float | None = None
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # extensions (vLLM names)
    top_k: int | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[int], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    skip_special_tokens: bool = True
    repetition_penalty: float | None = None
    priority: int = 0  # vLLM: with --scheduling-policy priority, lower runs sooner
    bad_words: list[str] | None = None  # never generated (tokenized by the router, as vLLM does)
    prompt_logprobs: int | None = None  # logprobs of each prompt token and this many alternatives
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids in the response
    # beam search (vLLM's names; early_stopping as transformers': true, false or "never")
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # checked with use_beam_search (400 naming the field)
    # structured outputs (pdserve.router.structured_outputs): vLLM's field and its older guided_* fields
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # None = up to the context limit
    logprobs: int | None = None
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None
    response_format: dict[str, Any] | None = None  # structured outputs, as chat's (vLLM accepts it here too)


class TextPart(_Request):
    type: str
    text: str | None = None


class ChatMessage(_Request):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None = up to the context limit
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # extensions (vLLM's): how the chat template is applied
    continue_final_message: bool = False  # the reply continues the last (assistant) message
    chat_template_kwargs: dict[str, Any] | None = None  # more template variables, e.g. {"enable_thinking": false}


# --- responses -----------------------------------------------------------------------------

class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, num_prompt_tokens: int, num_completion_tokens: int) -> "UsageInfo":
        return cls(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                   total_tokens=num_prompt_tokens + num_completion_tokens)


class CompletionLogprobs(_Response):
    """Legacy (completions) log-probabilities of a choice's tokens, one entry per token.

    ``text_offset[i]`` is where token i's text starts in the choice's text;
    ``top_logprobs[i]`` holds the top alternatives and the sampled token. With ``echo``
    the prompt's tokens come first, the very first with null logprob and top_logprobs.
    """

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChatTopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None  # the token's UTF-8 bytes (a token may hold part of a character)


class ChatLogprobToken(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    """Chat log-probabilities of a choice's (or a chunk's) tokens."""

    content: list[ChatLogprobToken] | None = None


class PromptLogprob(_Response):
    """vLLM's ``Logprob``: one token's entry at one prompt position."""

    logprob: float
    rank: int | None = None  # 1 + how many ids the model ranks above this one
    decoded_token: str | None = None  # the token decoded on its own


# vLLM's ``prompt_logprobs``: None for the first prompt token, then {token_id: PromptLogprob}
# (the prompt token itself and the top alternatives); token ids become JSON object keys.
PromptLogprobs = list[dict[int, PromptLogprob] | None]


_UNASKED = ("prompt_logprobs", "prompt_token_ids", "token_ids")  # vLLM's fields left out unless asked for


class _OmitsUnaskedFields(_Response):
    """A response or choice with some of vLLM's optional fields (``_UNASKED``: ``prompt_logprobs``, and
    ``prompt_token_ids`` / ``token_ids`` of ``return_token_ids``; declared by the subclass, where they sit
    in the JSON): each key is in the JSON only when the request asked."""

    @model_serializer(mode="wrap")
    def _drop_unasked_fields(self, handler) -> dict[str, Any]:
        data = handler(self)
        for name in _UNASKED:
            if name in data and data[name] is None:
                del data[name]
        return data


class CompletionChoice(_OmitsUnaskedFields):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    prompt_logprobs: PromptLogprobs | None = None  # only in the JSON when the request asked
    prompt_token_ids: list[int] | None = None  # with return_token_ids (vLLM's), else left out
    token_ids: list[int] | None = None  # with return_token_ids: the choice's output token ids


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatCompletionChoice(_OmitsUnaskedFields):
    index: int = 0
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None
    token_ids: list[int] | None = None  # with return_token_ids (vLLM's): the choice's output token ids


class ChatCompletionResponse(_OmitsUnaskedFields):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None  # vLLM's extension; only in the JSON when asked
    prompt_token_ids: list[int] | None = None  # with return_token_ids (vLLM's), else left out


class DeltaMessage(_Response):
    """A chat stream delta; absent fields are left out of the JSON, not sent as null."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="plain")
    def _drop_none(self) -> dict[str, str]:
        return {k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None}


class ChatCompletionStreamChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length"] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# A completion stream chunk has the same shape as a completion response.
CompletionChunk = CompletionResponse


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pdserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter: the base model it adapts (vLLM's field)
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(BaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's body)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(BaseModel):
    """``POST /v1/unload_lora_adapter`` (vLLM's body; ``lora_int_id`` is accepted and ignored)."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
