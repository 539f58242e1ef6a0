"""``use_beam_search`` requests at the router: beam search over one-token requests to a decode worker.

As in vLLM's OpenAI server, beam search runs above the engine (the rules are
``pdserve.beam_search``'s, i.e. transformers'): every step each running beam
becomes a ``GenerateRequest`` of ``prompt + beam tokens`` with ``max_tokens=1``
and ``logprobs=K``, and the router turns the returned top-K logprobs into the
next beams::

    step 1: prompt            --> decode worker D (prefilled by a prefill worker P, KV sent to D)
    step t: prompt + beam_i   --> the same D, prefilled there: the full blocks of every
                                  beam's prefix are prefix-cache hits, only the tail is computed
    done  : beam_width hypotheses --> one JSON response (choices best score first)

Only non-streaming requests (a beam's text is not final until the search ends);
``stream`` with ``use_beam_search`` is a 400. Sampling fields that beam search
would silently ignore in a way that changes results (logprobs, stop strings, stop
token ids, min_tokens, penalties) are 400 too; ``temperature``, ``top_p``,
``top_k`` and ``seed`` are accepted and ignored (beam search is deterministic).
"""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pdserve.beam_search import BeamSearch, BeamSearchParams, beam_step_params, check_beam_search_params
from pdserve.common.checkpoint import read_eos_token_ids
from pdserve.common.protocol import FinishReason, TokenLogprob
from pdserve.common.validation import ValidationError
from pdserve.router.engine import RequestFailed
from pdserve.router.errors import APIError, bad_request, not_supported
from pdserve.router.structured_outputs import structured_outputs_of
from pdserve.router.openai_protocol import (ChatCompletionChoice, ChatCompletionRequest, ChatCompletionResponse,
                                            ChatResponseMessage, CompletionChoice, CompletionResponse,
                                            SamplingRequest, UsageInfo)

_WORKER_POLL_S = 0.1


def check_beam_request(req: SamplingRequest, max_tokens: int, num_eos_token_ids: int) -> BeamSearchParams:
    """The request's ``BeamSearchParams``, or APIError 400 for what beam search does not take.

    ``max_tokens`` is the resolved completion length.
    """
    if req.stream:
        raise not_supported("stream", "`stream` with `use_beam_search`")
    logprobs = req.logprobs if isinstance(req, ChatCompletionRequest) else getattr(req, "logprobs", None) is not None
    unsupported = {"logprobs": logprobs, "stop": bool(req.stop_list()), "stop_token_ids": bool(req.stop_token_ids),
                   "min_tokens": req.min_tokens > 0, "frequency_penalty": bool(req.frequency_penalty),
                   "presence_penalty": bool(req.presence_penalty),
                   # Beams are ranked by raw logprobs: logits processors and constraints would not apply.
                   "repetition_penalty": req.repetition_penalty not in (None, 1),
                   "logit_bias": bool(req.logit_bias), "bad_words": bool(req.bad_words),
                   "prompt_logprobs": req.prompt_logprobs is not None, "echo": bool(getattr(req, "echo", False)),
                   "structured_outputs": structured_outputs_of(req) is not None}
    for param, present in unsupported.items():
        if present:
            raise not_supported(param, f"`{param}` with `use_beam_search`")
    params = BeamSearchParams(beam_width=1 if req.n is None else req.n, max_tokens=max_tokens,
                              ignore_eos=req.ignore_eos, temperature=req.temperature or 0.0,
                              length_penalty=req.length_penalty, early_stopping=req.early_stopping)
    try:
        check_beam_search_params(params, num_eos_token_ids)
    except ValidationError as e:
        raise bad_request(e.message, e.param) from None
    return params


async def serve_beam_search(serving, req: SamplingRequest, prompt_ids: list[int], id_prefix: str,
                            arrival: float, raw: Request) -> Response:
    """Run a ``use_beam_search`` request to its end and answer it (completions or chat shape).

    ``serving`` is the router's ``OpenAIServing`` (registry, engine, tokenizer, config, metrics).

    Raises:
        APIError: 400 for a request beam search does not take, 503 without a decode worker,
            5xx if a worker fails a step, 504 past ``--request-timeout``.
    """
    if serving.draining:
        raise APIError(503, "The router is shutting down; send the request to another replica.")
    # Route as a one-choice request: the same checks (lengths, KV capacity) and worker choice.
    eos = read_eos_token_ids(serving.config.model)
    check_beam_request(req, 1, len(eos))  # a 400 comes before any wait for a worker
    serving._admit(len(prompt_ids))  # the waiting-queue bound, as for any request
    plain = req.model_copy(update={"n": 1, "use_beam_search": False})
    lora = serving.resolve_model(req.model)  # a LoRA adapter's beams run with it
    deadline = time.monotonic() + serving.config.worker_wait_s
    while True:
        try:
            routed, decode_worker, prefill_worker = serving._route(plain, prompt_ids, lora)
            break
        except APIError as e:
            if e.status_code != 503 or time.monotonic() >= deadline:
                raise
            await asyncio.sleep(_WORKER_POLL_S)
    params = check_beam_request(req, routed.max_tokens, len(eos))
    search = BeamSearch(prompt_ids, params, eos)
    timeout_s = serving.config.request_timeout_s
    step_deadline = None if timeout_s is None else arrival + timeout_s
    request_ids: list[str] = []
    gone = asyncio.Event()
    watcher = asyncio.create_task(_watch_disconnect(raw, gone))
    try:
        while not search.done:
            beams = search.beam_token_ids()
            handles = [serving.engine.submit(uuid.uuid4().hex, ids, beam_step_params(search.num_logprobs),
                                             decode_worker, prefill_worker if search.num_generated == 0 else None,
                                             lora=lora)
                       for ids in beams]
            request_ids = [h.request_id for h in handles]
            rows = await _gather_step(handles, step_deadline, gone)
            search.step(rows)
    except _ClientGone:
        return Response(status_code=499)
    finally:
        watcher.cancel()
        for request_id in request_ids:
            serving.engine.abort(request_id)  # no-op for the finished ones
    sequences = search.output().sequences
    texts = [serving.tokenizer.decode(s.text_token_ids, skip_special_tokens=req.skip_special_tokens)
             for s in sequences]
    num_output_tokens = sum(len(s.output_token_ids) for s in sequences)
    serving.metrics.observe_request(decode_worker.worker_id, time.monotonic() - arrival, len(prompt_ids),
                                    num_output_tokens, [s.finish_reason for s in sequences])
    usage = UsageInfo.of(len(prompt_ids), num_output_tokens)
    response_id = f"{id_prefix}-{uuid.uuid4().hex}"
    if isinstance(req, ChatCompletionRequest):
        body = ChatCompletionResponse(id=response_id, model=serving.model_name, usage=usage, choices=[
            ChatCompletionChoice(index=i, message=ChatResponseMessage(content=text), finish_reason=s.finish_reason)
            for i, (s, text) in enumerate(zip(sequences, texts))])
    else:
        body = CompletionResponse(id=response_id, model=serving.model_name, usage=usage, choices=[
            CompletionChoice(index=i, text=text, finish_reason=s.finish_reason)
            for i, (s, text) in enumerate(zip(sequences, texts))])
    return JSONResponse(body.model_dump())


class _ClientGone(Exception):
    pass


async def _gather_step(handles, deadline: float | None, gone: asyncio.Event) -> list[TokenLogprob]:
    """Each one-token request's top logprobs, in order; raises APIError for a failed step."""
    async def one(handle) -> TokenLogprob:
        while True:
            item = await handle.queue.get()
            if isinstance(item, RequestFailed):
                raise APIError(item.status_code, item.message)
            if item.error is not None or item.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                status = item.error_kind.http_status if item.error_kind is not None else 500
                raise APIError(status, f"beam step {handle.request_id} failed on decode worker "
                                       f"{handle.worker_label}: {item.error or 'aborted'}")
            if item.new_token_ids:
                if not item.logprobs:
                    raise APIError(500, f"beam step {handle.request_id}: the worker sent no logprobs")
                return item.logprobs[0]

    step = asyncio.gather(*(one(h) for h in handles))
    waiter = asyncio.create_task(gone.wait())
    timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
    try:
        done, _ = await asyncio.wait({step, waiter}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if step in done:
            return step.result()
        if waiter in done:
            raise _ClientGone()
        raise APIError(504, "a beam search request did not finish within --request-timeout; it was aborted")
    finally:
        waiter.cancel()
        if not step.done():
            step.cancel()
            await asyncio.gather(step, return_exceptions=True)


async def _watch_disconnect(raw: Request, gone: asyncio.Event) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            gone.set()
            return
