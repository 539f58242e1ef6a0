"""One set of rules for what a request may ask, used by the router, the workers and ``LLM``.

No torch, no sockets: plain checks on token ids and ``SamplingParams`` against
an ``EngineLimits`` (what one engine can hold: ``max_model_len``, vocabulary
size, KV blocks). Every check raises ``ValidationError`` naming the offending
field (``param``), so the router can answer HTTP 400 with OpenAI's error body
and ``LLM`` can raise it as the ``ValueError`` it is. Messages about lengths use
vLLM's wording, which clients already parse.

Who calls what:

    router : check_sampling_params, check_prompt_ids, check_request_fits (per decode worker)
    worker : check_prompt_ids + check_sampling_params + check_request_fits on every
             GenerateRequest / RemotePrefillRequest (a request sent past the router)
    LLM    : the same three, before any work starts
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec

from pdserve.common.protocol import SamplingParams

MAX_N = 16  # most choices (parallel samples) of one request
MAX_LOGPROBS = 20  # most top alternatives per position (OpenAI's limit)
PENALTY_RANGE = 2.0  # frequency_penalty / presence_penalty lie in [-2, 2]
LOGIT_BIAS_RANGE = 100.0  # logit_bias values lie in [-100, 100] (OpenAI's range; the router clamps to it)
_INT64_MIN, _INT64_MAX = -(2 ** 63), 2 ** 63 - 1


class ValidationError(ValueError):
    """A request the engine cannot serve as asked.

    Attributes:
        param: the request field at fault (OpenAI's ``error.param``), or None.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class EngineLimits:
    """What one engine can hold; workers advertise it in ``RegisterWorker``.

    Args:
        max_model_len: longest sequence, prompt + output, in tokens.
        vocab_size: rows of the model's embedding; token ids lie in [0, vocab_size).
        num_blocks: KV cache blocks (None: unknown, no capacity check).
        block_size: tokens per KV block.
        kv_group_caps: per KV cache group (``pdserve.common.kv_cache_groups``), the most blocks
            one sequence ever holds there (a sliding window frees the rest as it moves;
            ``KVCacheManager``), or None: its whole length. One sequence needs a block per
            group for each block of its tokens, up to each group's cap.
    """

    max_model_len: int
    vocab_size: int
    num_blocks: int | None = None
    block_size: int = 16
    kv_group_caps: tuple[int | None, ...] = (None,)

    @property
    def num_kv_tokens(self) -> int | None:
        """Tokens the whole KV cache holds, or None if unknown."""
        return None if self.num_blocks is None else self.num_blocks * self.block_size


def num_kv_tokens_needed(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> int:
    """KV slots one sequence of the request needs to run to its end, in tokens.

    A sequence never grows past ``max_model_len``. The ``n`` choices of a request
    share the prompt's blocks and may take turns (preemption), so it is enough
    that one choice fits the whole cache; this is the one formula the router's
    routing, the scheduler's admission and ``LLM`` use.
    """
    return min(num_prompt_tokens + max_tokens, max_model_len)


def num_blocks_needed(num_tokens: int, block_size: int) -> int:
    """KV blocks that hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


def check_prompt_ids(prompt_token_ids: list[int], vocab_size: int, param: str = "prompt") -> None:
    """Raise ValidationError for an empty prompt or a token id outside [0, vocab_size)."""
    if not prompt_token_ids:
        raise ValidationError(f"{param} must not be empty", param)
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:  # C loops; the router runs this per worker
        bad = next(t for t in prompt_token_ids if not 0 <= t < vocab_size)
        raise ValidationError(f"prompt token id {bad} is out of range [0, {vocab_size})", param)


def check_sampling_params(params: SamplingParams, vocab_size: int | None = None) -> None:
    """Raise ValidationError unless every field of ``params`` is in its range.

    ``vocab_size`` (when given) bounds ``stop_token_ids``.
    """
    if params.max_tokens < 1:
        raise ValidationError(f"max_tokens must be at least 1, got {params.max_tokens}", "max_tokens")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise ValidationError(f"temperature must be >= 0, got {params.temperature}", "temperature")
    if not (math.isfinite(params.top_p) and 0 < params.top_p <= 1):
        raise ValidationError(f"top_p must be in (0, 1], got {params.top_p}", "top_p")
    if params.top_k is not None and params.top_k < 1:
        raise ValidationError(f"top_k must be None (disabled) or >= 1, got {params.top_k}", "top_k")
    if not 1 <= params.n <= MAX_N:
        raise ValidationError(f"n must be in [1, {MAX_N}], got {params.n}", "n")
    if params.seed is not None and not _INT64_MIN <= params.seed <= _INT64_MAX:
        raise ValidationError(f"seed must fit in a signed 64-bit integer, got {params.seed}", "seed")
    if not _INT64_MIN <= params.priority <= _INT64_MAX:
        raise ValidationError(f"priority must fit in a signed 64-bit integer, got {params.priority}", "priority")
    if params.min_tokens < 0:
        raise ValidationError(f"min_tokens must be >= 0, got {params.min_tokens}", "min_tokens")
    if params.min_tokens > params.max_tokens:
        raise ValidationError(f"min_tokens ({params.min_tokens}) must not exceed max_tokens "
                              f"({params.max_tokens})", "min_tokens")
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise ValidationError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {params.logprobs}", "logprobs")
    for name in ("frequency_penalty", "presence_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and abs(value) <= PENALTY_RANGE):
            raise ValidationError(f"{name} must be in [-{PENALTY_RANGE:g}, {PENALTY_RANGE:g}], got {value}", name)
    if vocab_size is not None:
        for t in params.stop_token_ids:
            if not 0 <= t < vocab_size:
                raise ValidationError(f"stop token id {t} is out of range [0, {vocab_size})", "stop_token_ids")
    check_logits_params(params, vocab_size)


def check_logits_params(params: SamplingParams, vocab_size: int | None = None) -> None:
    """Ranges of ``repetition_penalty``, ``logit_bias``, ``bad_words_token_ids`` and ``prompt_logprobs``.

    vLLM's rules: repetition_penalty > 0 and finite (1 is off); prompt_logprobs in
    [0, 20]; logit_bias values in [-100, 100]; with ``vocab_size``, every logit_bias
    and bad-word token id in [0, vocab_size).

    Raises:
        ValidationError: naming the field at fault.
    """
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        raise ValidationError(f"repetition_penalty must be > 0, got {params.repetition_penalty}",
                              "repetition_penalty")
    if params.prompt_logprobs is not None and not 0 <= params.prompt_logprobs <= MAX_LOGPROBS:
        raise ValidationError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {params.prompt_logprobs}",
                              "prompt_logprobs")
    for token_id, bias in (params.logit_bias or {}).items():
        if not (math.isfinite(bias) and abs(bias) <= LOGIT_BIAS_RANGE):
            raise ValidationError(f"logit_bias values must be in [-{LOGIT_BIAS_RANGE:g}, {LOGIT_BIAS_RANGE:g}], "
                                  f"got {bias} for token {token_id}", "logit_bias")
        if vocab_size is not None and not 0 <= token_id < vocab_size:
            raise ValidationError(f"logit_bias token id {token_id} is out of range [0, {vocab_size})", "logit_bias")
    for word in params.bad_words_token_ids:
        if not word:
            raise ValidationError("bad_words must not hold an empty word", "bad_words")
        if vocab_size is not None:
            for t in word:
                if not 0 <= t < vocab_size:
                    raise ValidationError(f"bad word token id {t} is out of range [0, {vocab_size})", "bad_words")


def check_context_length(num_prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Raise ValidationError unless prompt + max_tokens fits ``max_model_len`` (vLLM's wording).

    ``max_tokens`` None (the client left it out) only needs room for one output token.
    """
    if max_tokens is None:
        if num_prompt_tokens >= max_model_len:
            raise ValidationError(
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
                f"{num_prompt_tokens} tokens, which leaves no room for the completion. Please shorten the "
                f"prompt.", "prompt")
        return
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise ValidationError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{total} tokens ({num_prompt_tokens} in the prompt, {max_tokens} for the completion). "
            f"Please reduce the length of the prompt or of the completion.", "max_tokens")


def check_kv_capacity(num_prompt_tokens: int, max_tokens: int, limits: EngineLimits) -> None:
    """Raise ValidationError if one sequence of the request cannot fit the whole KV cache."""
    if limits.num_blocks is None:
        return
    num_tokens = num_kv_tokens_needed(num_prompt_tokens, max_tokens, limits.max_model_len)
    num_blocks = num_blocks_needed(num_tokens, limits.block_size)
    needed = sum(num_blocks if cap is None else min(num_blocks, cap) for cap in limits.kv_group_caps)
    if needed > limits.num_blocks:
        raise ValidationError(
            f"This request needs {needed} KV cache blocks of {limits.block_size} tokens ({num_prompt_tokens} "
            f"in the prompt, {max_tokens} for the completion), but the KV cache has only {limits.num_blocks} "
            f"blocks ({limits.num_kv_tokens} tokens). Please reduce the length of the prompt or of the "
            f"completion.", "max_tokens")


def prefill_sampling_params(params: SamplingParams) -> SamplingParams:
    """The params a prefill worker samples a request's first token with (``n`` and the
    output length are the decode worker's business; ``structured_outputs`` stays, so the
    first token obeys the grammar the decode worker then replays it into)."""
    return msgspec.structs.replace(params, max_tokens=1, n=1, min_tokens=min(params.min_tokens, 1))


def check_request(prompt_token_ids: list[int], params: SamplingParams, limits: EngineLimits,
                  stop_at_max_model_len: bool = False) -> None:
    """Every check an engine makes before it accepts a request.

    Args:
        stop_at_max_model_len: the offline ``LLM``'s rule (vLLM's too): prompt + max_tokens
            may exceed max_model_len and the output then stops there (``length``); only the
            prompt must leave room. The servers' rule (False) rejects such a request, as
            vLLM's OpenAI server does.

    Raises:
        ValidationError: the first rule the request breaks.
    """
    check_prompt_ids(prompt_token_ids, limits.vocab_size)
    check_sampling_params(params, limits.vocab_size)
    check_context_length(len(prompt_token_ids), None if stop_at_max_model_len else params.max_tokens,
                         limits.max_model_len)
    check_kv_capacity(len(prompt_token_ids), params.max_tokens, limits)
