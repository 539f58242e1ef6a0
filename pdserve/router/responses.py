"""What differs between ``/v1/completions`` and ``/v1/chat/completions``: the shapes of their answers.

Both endpoints take one serving path (``OpenAIServing._serve``: check, tokenize, submit, then stream
or collect a ``Run``); a ``ResponseFormat`` turns the run's choices into that endpoint's JSON body or
SSE chunks, as OpenAI (and vLLM) give them: ``CompletionFormat`` with ``echo``, prompt logprobs and
text offsets; ``ChatFormat`` with a first chunk per choice that carries the assistant role.
"""

from __future__ import annotations

import dataclasses
import time

from pydantic import BaseModel

from pdserve.common.protocol import RequestTiming, TokenLogprob
from pdserve.router import preprocess
from pdserve.router.engine import RequestHandle
from pdserve.router.logprobs import (TokenEntry, TokenTexts, chat_logprobs, completion_logprobs,
                                     echo_completion_logprobs, prompt_logprobs_json)
from pdserve.router.openai_protocol import (ChatCompletionChoice, ChatCompletionChunk, ChatCompletionRequest,
                                            ChatCompletionResponse, ChatCompletionStreamChoice, ChatLogprobs,
                                            ChatResponseMessage, CompletionChoice, CompletionLogprobs,
                                            CompletionRequest, CompletionResponse, DeltaMessage, SamplingRequest,
                                            UsageInfo)
from pdserve.router.outputs import ChoiceDelta, ChoiceOutput
from pdserve.router.tracing import Phase


@dataclasses.dataclass
class Run:
    """One submitted request as the HTTP handler sees it."""

    response_id: str
    handle: RequestHandle
    choices: list[ChoiceOutput]
    num_prompt_tokens: int
    num_logprobs: int | None  # top alternatives per position; None = no logprobs
    arrival: float  # time.monotonic() when the HTTP request came in
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))
    first_token_at: float | None = None
    last_delta_at: dict[int, float] = dataclasses.field(default_factory=dict)  # per choice
    failure: str | None = None  # finish reason of choices cut short: "abort" / "error"
    wants_prompt_logprobs: bool = False  # sampling_params.prompt_logprobs is set
    prompt_logprobs: list[TokenLogprob] | None = None  # entries of prompt tokens 1..N-1, from the first delta
    # Where its time went (``tracing.py``): wall-clock (time.time()) arrival and first token, the workers'
    # stamps from the first delta, the hops built from them, and the client's W3C traceparent header.
    arrival_wall: float = 0.0
    first_token_wall: float | None = None
    timing: RequestTiming | None = None
    phases: list[Phase] = dataclasses.field(default_factory=list)
    traceparent: str | None = None

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    @property
    def done(self) -> bool:
        return all(c.finished for c in self.choices)

    @property
    def num_output_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.num_prompt_tokens, self.num_output_tokens)


class ResponseFormat:
    """One request's answer in its endpoint's shapes (a subclass per endpoint).

    Args:
        req: the validated request; run: it, submitted; prompt_ids: its prompt's token ids;
        model_name: the ``model`` field answers carry; tokenizer, token_texts: for echo and logprobs.
    """

    def __init__(self, req: SamplingRequest, run: Run, prompt_ids: list[int], model_name: str, tokenizer,
                 token_texts: TokenTexts):
        self.req, self.run, self.prompt_ids = req, run, prompt_ids
        self.model_name, self.tokenizer, self.token_texts = model_name, tokenizer, token_texts

    def stream_head(self) -> list[BaseModel]:
        """Chunks sent before any token (none by default)."""
        return []

    def chunk(self, out: ChoiceDelta) -> BaseModel:
        """One SSE chunk for a choice's new text."""
        raise NotImplementedError

    def usage_chunk(self) -> BaseModel:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage."""
        raise NotImplementedError

    def body(self) -> BaseModel:
        """The whole answer, once every choice finished (not streamed)."""
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    """``/v1/completions``: text choices, ``echo``, prompt logprobs, ``return_token_ids``."""

    req: CompletionRequest

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._started: set[int] = set()  # choices whose first chunk went out (stream)

    def _logprobs(self, tokens: list[TokenEntry], always: bool = False) -> CompletionLogprobs | None:
        if self.run.num_logprobs is None or not (tokens or always):
            return None
        return completion_logprobs(tokens, self.run.num_logprobs, self.token_texts)

    def _response(self, choices: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
        return CompletionResponse(id=self.run.response_id, created=self.run.created, model=self.model_name,
                                  choices=choices, usage=usage)

    def chunk(self, out: ChoiceDelta) -> CompletionResponse:
        first = out.index not in self._started
        self._started.add(out.index)
        return self._response([self.choice(out.index, out.text, self._logprobs(out.tokens, always=first and self.req.echo),
                                           out.finish_reason, first)])

    def usage_chunk(self) -> CompletionResponse:
        return self._response([], self.run.usage())

    def body(self) -> CompletionResponse:
        return self._response([self.choice(c.index, c.text, self._logprobs(c.entries, always=True), c.finish_reason,
                                           True, c.token_ids if self.req.return_token_ids else None)
                               for c in self.run.choices], self.run.usage())

    def choice(self, index: int, text: str, logprobs: CompletionLogprobs | None, finish_reason: str | None,
               first: bool, token_ids: list[int] | None = None) -> CompletionChoice:
        """A completion choice (or a stream chunk of one), with ``echo`` and ``prompt_logprobs`` as vLLM
        gives them; ``token_ids``: the choice's output token ids, given with ``return_token_ids`` (then the
        prompt's go with them).

        With ``echo`` the choice's ``first`` piece starts with the prompt's text (and, with ``logprobs``,
        the prompt's tokens); later pieces' text offsets count the prompt too. Echo with ``max_tokens``
        0 answers the prompt alone. ``prompt_logprobs`` go out with the ``first`` piece.
        """
        req, run, prompt_ids = self.req, self.run, self.prompt_ids
        if req.echo:
            prompt = req.prompt[0] if isinstance(req.prompt, list) and len(req.prompt) == 1 and \
                isinstance(req.prompt[0], (str, list)) else req.prompt
            prompt_text = prompt if isinstance(prompt, str) else \
                self.tokenizer.decode(prompt_ids, skip_special_tokens=req.skip_special_tokens)
            echo_only = preprocess.echo_only(req)
            if echo_only:
                text, logprobs = "", None
                token_ids = None if token_ids is None else []  # the engine's one token is not an output
            elif logprobs is not None:
                logprobs = logprobs.model_copy(update={"text_offset": [o + len(prompt_text)
                                                                       for o in logprobs.text_offset]})
            if first:
                text = prompt_text + text
                if run.num_logprobs is not None:
                    logprobs = echo_completion_logprobs(prompt_ids, run.prompt_logprobs or [], run.num_logprobs,
                                                        self.token_texts, logprobs, 0)
        prompt_logprobs = None
        if run.wants_prompt_logprobs and first:
            prompt_logprobs = prompt_logprobs_json(run.prompt_logprobs or [], self.token_texts)
        return CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs, token_ids=token_ids,
                                prompt_token_ids=list(prompt_ids) if token_ids is not None else None)


class ChatFormat(ResponseFormat):
    """``/v1/chat/completions``: assistant messages; a stream opens each choice with its role."""

    req: ChatCompletionRequest

    def _logprobs(self, tokens: list[TokenEntry], always: bool = False) -> ChatLogprobs | None:
        if self.run.num_logprobs is None or not (tokens or always):
            return None
        return chat_logprobs(tokens, self.run.num_logprobs, self.token_texts)

    def _stream_chunk(self, choice: ChatCompletionStreamChoice) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.run.response_id, created=self.run.created, model=self.model_name,
                                   choices=[choice])

    def stream_head(self) -> list[BaseModel]:
        return [self._stream_chunk(ChatCompletionStreamChoice(index=c.index, delta=DeltaMessage(role="assistant",
                                                                                                  content="")))
                for c in self.run.choices]

    def chunk(self, out: ChoiceDelta) -> ChatCompletionChunk:
        return self._stream_chunk(ChatCompletionStreamChoice(
            index=out.index, delta=DeltaMessage(content=out.text or None),
            logprobs=self._logprobs(out.tokens), finish_reason=out.finish_reason))

    def usage_chunk(self) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.run.response_id, created=self.run.created, model=self.model_name,
                                   choices=[], usage=self.run.usage())

    def body(self) -> ChatCompletionResponse:
        run, req = self.run, self.req
        return ChatCompletionResponse(
            id=run.response_id, created=run.created, model=self.model_name, usage=run.usage(),
            choices=[ChatCompletionChoice(index=c.index, message=ChatResponseMessage(content=c.text),
                                          logprobs=self._logprobs(c.entries, always=True),
                                          finish_reason=c.finish_reason,
                                          token_ids=c.token_ids if req.return_token_ids else None)
                     for c in run.choices],
            prompt_token_ids=list(self.prompt_ids) if req.return_token_ids else None,
            prompt_logprobs=prompt_logprobs_json(run.prompt_logprobs or [], self.token_texts)
            if run.wants_prompt_logprobs else None)
