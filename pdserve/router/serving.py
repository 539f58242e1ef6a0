"""The OpenAI endpoints' logic: check, tokenize, route, detokenize, respond.

A request's life in the router:

    check + tokenize (preprocess) -> submit to a decode worker (engine)
        -> RequestDelta tokens -> IncrementalDetokenizer -> text deltas
        -> one JSON response, or SSE chunks ending with ``data: [DONE]``

The request is aborted at its decode worker whenever the router stops caring
before the worker finished it: a stop string matched, the client went away, or
the handler failed. ``RouterEngine.abort`` is a no-op for finished requests,
so every path simply calls it on the way out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator, Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from pdserve.common.protocol import FinishReason, SamplingParams, WorkerRole
from pdserve.router.config import RouterConfig
from pdserve.router.detokenizer import IncrementalDetokenizer
from pdserve.router.engine import NoDecodeWorker, RequestFailed, RequestHandle, RouterEngine
from pdserve.router.errors import APIError, bad_request, unavailable
from pdserve.router.openai_protocol import (ChatCompletionChoice, ChatCompletionChunk,
                                            ChatCompletionRequest, ChatCompletionResponse,
                                            ChatCompletionStreamChoice, ChatResponseMessage,
                                            CompletionChoice, CompletionRequest, CompletionResponse,
                                            DeltaMessage, SamplingRequest, UsageInfo)
from pdserve.router import preprocess

logger = logging.getLogger(__name__)

_CLIENT_GONE = object()  # put in a request's queue by the disconnect watcher
_NO_DECODE_WORKER = "No decode worker is available; start one or wait for it to register."


class ClientDisconnected(Exception):
    pass


@dataclasses.dataclass
class _Run:
    """One submitted request as the HTTP handler sees it."""

    response_id: str
    handle: RequestHandle
    detokenizer: IncrementalDetokenizer
    num_prompt_tokens: int
    created: int

    @property
    def request_id(self) -> str:
        return self.handle.request_id

    def usage(self) -> UsageInfo:
        return UsageInfo.of(self.num_prompt_tokens, self.detokenizer.num_output_tokens)


def _sse(obj: BaseModel) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


class OpenAIServing:
    def __init__(self, config: RouterConfig, tokenizer, engine: RouterEngine):
        self.config = config
        self.model_name = config.served_model_name
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.engine = engine

    # --- endpoints ------------------------------------------------------------------------

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        preprocess.check_model(req, self.model_name)
        preprocess.check_completion_supported(req)
        prompt_ids = preprocess.completion_prompt_ids(req, self.tokenizer)
        run = self._submit(req, prompt_ids, "cmpl")

        def chunk(text: str, reason: str | None) -> CompletionResponse:
            return CompletionResponse(id=run.response_id, created=run.created, model=self.model_name,
                                      choices=[CompletionChoice(text=text, finish_reason=reason)])

        def usage_chunk() -> CompletionResponse:
            return CompletionResponse(id=run.response_id, created=run.created, model=self.model_name,
                                      choices=[], usage=run.usage())

        if req.stream:
            return self._stream(run, None, chunk, usage_chunk if req.include_usage() else None)
        reason = await self._collect(run, raw)
        if reason is None:
            return Response(status_code=499)
        body = chunk(run.detokenizer.text, reason)
        body.usage = run.usage()
        return JSONResponse(body.model_dump())

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        preprocess.check_model(req, self.model_name)
        preprocess.check_chat_supported(req)
        prompt_ids = preprocess.chat_prompt_ids(req, self.tokenizer)
        run = self._submit(req, prompt_ids, "chatcmpl")

        def chunk(text: str | None, reason: str | None, role: str | None = None) -> ChatCompletionChunk:
            delta = DeltaMessage(role=role, content=text if role is not None else (text or None))
            return ChatCompletionChunk(
                id=run.response_id, created=run.created, model=self.model_name,
                choices=[ChatCompletionStreamChoice(delta=delta, finish_reason=reason)])

        def usage_chunk() -> ChatCompletionChunk:
            return ChatCompletionChunk(id=run.response_id, created=run.created, model=self.model_name,
                                       choices=[], usage=run.usage())

        if req.stream:
            first = chunk("", None, role="assistant")
            return self._stream(run, first, chunk, usage_chunk if req.include_usage() else None)
        reason = await self._collect(run, raw)
        if reason is None:
            return Response(status_code=499)
        body = ChatCompletionResponse(
            id=run.response_id, created=run.created, model=self.model_name, usage=run.usage(),
            choices=[ChatCompletionChoice(message=ChatResponseMessage(content=run.detokenizer.text),
                                          finish_reason=reason)])
        return JSONResponse(body.model_dump())

    # --- shared steps ---------------------------------------------------------------------

    def _submit(self, req: SamplingRequest, prompt_ids: list[int], id_prefix: str) -> _Run:
        """Check lengths and sampling fields, pick workers, send the request."""
        requested = preprocess.requested_max_tokens(req)
        max_tokens = preprocess.resolve_max_tokens(requested, len(prompt_ids), self.config.max_model_len)
        params = preprocess.build_sampling_params(req, max_tokens, self.vocab_size)
        params = self._fit_kv_cache(params, len(prompt_ids), fill_to_limit=requested is None)
        request_id = uuid.uuid4().hex
        try:
            handle = self.engine.submit(request_id, prompt_ids, params)
        except NoDecodeWorker:
            raise unavailable(_NO_DECODE_WORKER) from None
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids, params.stop,
                                             skip_special_tokens=req.skip_special_tokens,
                                             min_tokens=params.min_tokens)
        logger.debug("request %s: %d prompt tokens, max_tokens=%d -> decode worker %s",
                     request_id, len(prompt_ids), params.max_tokens, handle.decode_worker_id)
        return _Run(f"{id_prefix}-{request_id}", handle, detokenizer, len(prompt_ids), int(time.time()))

    def _fit_kv_cache(self, params: SamplingParams, num_prompt_tokens: int,
                      fill_to_limit: bool) -> SamplingParams:
        """503 without decode workers; 400 if no decode worker's KV cache can hold the request.

        A max_tokens the client left out shrinks to what the largest KV cache holds instead.
        """
        decode_workers = self.engine.registry.live(WorkerRole.DECODE)
        if not decode_workers:
            raise unavailable(_NO_DECODE_WORKER)
        num_tokens = num_prompt_tokens + params.max_tokens
        if any(w.fits(num_tokens) for w in decode_workers):
            return params
        largest = self.engine.registry.largest_decode()
        assert largest is not None and largest.num_kv_tokens is not None
        if fill_to_limit and largest.num_kv_tokens > num_prompt_tokens:
            max_tokens = largest.num_kv_tokens - num_prompt_tokens
            return msgspec.structs.replace(params, max_tokens=max_tokens,
                                           min_tokens=min(params.min_tokens, max_tokens))
        num_needed = -(-num_tokens // largest.block_size)
        raise bad_request(
            f"This request needs {num_needed} KV cache blocks of {largest.block_size} tokens "
            f"({num_prompt_tokens} in the prompt, {params.max_tokens} for the completion), but the "
            f"largest live decode worker has only {largest.num_blocks} blocks "
            f"({largest.num_kv_tokens} tokens). Please reduce the length of the prompt or of the "
            f"completion.", "max_tokens")

    async def _outputs(self, run: _Run) -> AsyncIterator[tuple[str, str | None]]:
        """Yield ``(text_delta, finish_reason)`` until the request finishes.

        Raises:
            APIError: the worker failed the request or went away.
            ClientDisconnected: the disconnect watcher fired.
        """
        detok = run.detokenizer
        while True:
            item = await run.handle.queue.get()
            if item is _CLIENT_GONE:
                raise ClientDisconnected()
            if isinstance(item, RequestFailed):
                raise APIError(item.status_code, item.message)
            if item.error is not None or item.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                raise APIError(500, f"request {run.request_id} failed on decode worker "
                                    f"{run.handle.decode_worker_id}: {item.error or 'aborted'}")
            text = detok.add_tokens(item.new_token_ids)
            if detok.stopped:
                self.engine.abort(run.request_id)  # free the worker's KV blocks now
                yield text, "stop"
                return
            if item.finish_reason is not None:
                yield text + detok.flush(), item.finish_reason.to_openai()
                return
            if text:
                yield text, None

    async def _collect(self, run: _Run, raw: Request) -> str | None:
        """Run a non-stream request to the end; its finish reason, or None if the client left."""
        watcher = asyncio.create_task(_watch_disconnect(raw, run.handle.queue))
        reason = None
        try:
            async for _, reason in self._outputs(run):
                pass
            return reason
        except ClientDisconnected:
            logger.info("request %s: client disconnected; aborted", run.request_id)
            return None
        finally:
            watcher.cancel()
            self.engine.abort(run.request_id)

    def _stream(self, run: _Run, first: BaseModel | None,
                chunk: Callable[[str, str | None], BaseModel],
                usage_chunk: Callable[[], BaseModel] | None) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                if first is not None:
                    yield _sse(first)
                async for text, reason in self._outputs(run):
                    yield _sse(chunk(text, reason))
                if usage_chunk is not None:
                    yield _sse(usage_chunk())
                yield "data: [DONE]\n\n"
            except APIError as e:
                logger.warning("request %s failed mid-stream: %s", run.request_id, e.message)
                yield _sse(e.to_response())
            finally:  # also runs when the client went away and the stream was cancelled
                self.engine.abort(run.request_id)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _watch_disconnect(raw: Request, queue: asyncio.Queue) -> None:
    """Wait for the client to disconnect (body already read), then wake the handler."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait(_CLIENT_GONE)
            return

