"""What a step returns, layer by layer (no torch here).

    ModelRunner.execute  -> ModelRunnerOutput   sampled token and logprobs per request id
    Scheduler.update     -> list[EngineCoreOutput]  per request: new tokens, their logprobs, finished?

The names follow vLLM v1 (``ModelRunnerOutput``, ``EngineCoreOutput``). Logprobs
travel inside these structs, never in a side attribute of the runner.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pdserve.common.protocol import TokenLogprob

if TYPE_CHECKING:
    from pdserve.engine.scheduling.request import Request, RequestStatus


@dataclass
class ModelRunnerOutput:
    """One forward's samples.

    Attributes:
        sampled_token_ids: request_id -> token sampled this step, for requests whose
            last known token was computed (a partial prefill chunk samples nothing).
        logprobs: request_id -> logprobs of that token, only for requests whose
            ``sampling_params.logprobs`` is set.
        accepted_draft_ids: speculative decoding: request_id -> the draft tokens verification
            accepted, which come before ``sampled_token_ids[request_id]`` (absent: none).
        spec_logprobs: with drafts: request_id -> one TokenLogprob per emitted token
            (accepted drafts, then the sampled token), for requests that ask.
    """

    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    accepted_draft_ids: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request_id -> entries of the prompt tokens whose logits this step computed (prompt_logprobs set)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """New tokens of one request (one of a group's ``n`` samples) after a step.

    Attributes:
        request: the engine's request (``group_id`` is the router's request_id,
            ``sample_index`` the choice).
        new_token_ids: tokens appended this step (one, or more with speculative decoding).
        logprobs: one ``TokenLogprob`` per new token when the request asked, else None.
        finished: the request's final status if it finished (its blocks are freed), else None.
    """

    request: Request
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finished: RequestStatus | None = None
    # With a request's first token (choice 0) when it asked for prompt_logprobs: prompt tokens 1..N-1
    prompt_logprobs: list[TokenLogprob] | None = None
