"""The OpenAI endpoints' logic: check, tokenize, route, detokenize, respond.

A request's life in the router:

    check + tokenize (preprocess) -> submit to a decode worker (engine)
        -> RequestDelta tokens, per choice (delta.index)
        -> ChoiceOutput (IncrementalDetokenizer + logprob alignment) -> ChoiceDelta
        -> one JSON response, or SSE chunks ending with ``data: [DONE]``

Routing: the rules of ``pdserve.common.validation`` are applied against the
limits each live decode worker advertised (``max_model_len``, vocabulary, KV
blocks; the router's own ``max_model_len`` caps them). The request goes only
to a worker that accepts it; if none does, the reason the most capable worker
gives is the 400. A prefill worker is named only if it can hold the prompt.

A request with ``n`` choices is one request at the worker; each choice
finishes on its own (its finish_reason, its stop strings), the request when
all have. The request is aborted at its decode worker whenever the router
stops caring before the worker finished it: every choice ended from the
router's view (some by a stop string while the worker still generates them),
the client went away, or the handler failed. ``RouterEngine.abort`` is a no-op
for requests the worker finished, so every path simply calls it on the way out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import AsyncIterator, Callable

import msgspec

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from pdserve.common.protocol import (FinishReason, LoRARequest, RequestDelta, SamplingParams,
                                     WorkerRole)
from pdserve.common.validation import (EngineLimits, ValidationError, check_context_length, check_prompt_ids,
                                       check_request, prefill_sampling_params)
from pdserve.engine.scheduling.request import lora_cache_root
from pdserve.router import preprocess
from pdserve.router.routing import prefers_local_prefill, pull_source
from pdserve.router.beam import serve_beam_search
from pdserve.router.config import RouterConfig
from pdserve.router.engine import RequestFailed, RouterEngine
from pdserve.router.errors import APIError, bad_request
from pdserve.router.registry import WorkerInfo
from pdserve.router.lora import LoRARegistry
from pdserve.router.logprobs import (TokenTexts)
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                            SamplingRequest)
from pdserve.router.outputs import ChoiceDelta, ChoiceOutput, MissingLogprobs
from pdserve.router.responses import ChatFormat, CompletionFormat, ResponseFormat, Run
from pdserve.router.tracing import RequestTracer, request_phases
from pdserve.tokenizer.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

_CLIENT_GONE = object()  # put in a request's queue by the disconnect watcher
_WORKER_POLL_S = 0.1


class NoDecodeWorker(APIError):
    """503: the decode pool is empty."""

    def __init__(self):
        super().__init__(503, "No decode worker is available; start one or wait for it to register.")


class ClientDisconnected(Exception):
    pass


def _sse(obj: BaseModel) -> str:
    return f"data: {obj.model_dump_json()}\n\n"


class OpenAIServing:
    def __init__(self, config: RouterConfig, tokenizer, engine: RouterEngine,
                 metrics: RouterMetrics, tracer: RequestTracer | None = None):
        self.config = config
        self.tracer = tracer  # --otlp-traces-endpoint: one trace per finished request
        self.model_name = config.served_model_name
        self.tokenizer = tokenizer
        self.vocab_size = len(tokenizer)
        self.engine = engine
        self.metrics = metrics
        self.token_texts = TokenTexts(tokenizer)
        self.draining = False  # SIGTERM: refuse new requests, let in-flight ones finish
        self.loras = LoRARegistry(config.model, config.served_model_name, config.max_lora_rank) \
            if config.enable_lora else None  # served LoRA adapters (--enable-lora)

    def resolve_model(self, model: str) -> LoRARequest | None:
        """The LoRA adapter a request's ``model`` names, None for the base model.

        Raises:
            APIError: 404 for a model this router does not serve.
        """
        if self.loras is not None:
            return self.loras.resolve(model)
        preprocess.check_model(model, self.model_name)
        return None

    # --- endpoints ------------------------------------------------------------------------

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        """``POST /v1/completions``."""
        return await self._serve(req, raw, "cmpl", preprocess.check_completion_supported,
                                 preprocess.completion_prompt_ids, CompletionFormat)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        """``POST /v1/chat/completions``."""
        return await self._serve(req, raw, "chatcmpl", preprocess.check_chat_supported,
                                 preprocess.chat_prompt_ids, ChatFormat)

    async def _serve(self, req: SamplingRequest, raw: Request, id_prefix: str, check: Callable,
                     prompt_ids_of: Callable, response_format: type[ResponseFormat]) -> Response:
        """The one serving path of both endpoints: check, tokenize, submit (or beam search), then stream
        SSE chunks or collect one JSON body, in ``response_format``'s shapes."""
        arrival = time.monotonic()
        self.resolve_model(req.model)  # 404 before any work
        check(req)
        prompt_ids = prompt_ids_of(req, self.tokenizer)
        if req.use_beam_search:
            return await serve_beam_search(self, req, prompt_ids, id_prefix, arrival, raw)
        run = await self._submit(req, prompt_ids, id_prefix, arrival)
        run.traceparent = raw.headers.get("traceparent")
        fmt = response_format(req, run, prompt_ids, self.model_name, self.tokenizer, self.token_texts)
        if req.stream:
            return self._stream(run, fmt.stream_head(), fmt.chunk, fmt.usage_chunk if req.include_usage() else None)
        if not await self._collect(run, raw):
            return Response(status_code=499)
        return JSONResponse(fmt.body().model_dump())

    # --- shared steps ---------------------------------------------------------------------

    async def _submit(self, req: SamplingRequest, prompt_ids: list[int], id_prefix: str,
                      arrival: float) -> Run:
        """Check the request against the live workers' limits, pick workers, send it.

        With no decode worker live (a pool being scaled or restarted), wait up to
        ``config.worker_wait_s`` for one before the 503.
        """
        if self.draining:
            raise APIError(503, "The router is shutting down; send the request to another replica.")
        self._admit(len(prompt_ids))
        lora = self.resolve_model(req.model)  # once: routing and the workers use the same adapter
        deadline = time.monotonic() + self.config.worker_wait_s
        while True:
            try:
                params, decode_worker, prefill_worker = self._route(req, prompt_ids, lora)
                break
            except NoDecodeWorker:
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(_WORKER_POLL_S)
        request_id = self.engine.new_request_id()
        handle = self.engine.submit(request_id, prompt_ids, params, decode_worker, prefill_worker,
                                    lora=lora)
        choices = [ChoiceOutput(i, IncrementalDetokenizer(
            self.tokenizer, prompt_ids, params.stop, skip_special_tokens=req.skip_special_tokens,
            min_tokens=params.min_tokens), logprobs=params.logprobs is not None)
            for i in range(params.n)]
        logger.debug("request %s: %d prompt tokens, n=%d, max_tokens=%d -> decode worker %s",
                     request_id, len(prompt_ids), params.n, params.max_tokens, handle.decode_worker_id)
        return Run(f"{id_prefix}-{request_id}", handle, choices, len(prompt_ids), params.logprobs,
                    arrival, wants_prompt_logprobs=params.prompt_logprobs is not None,
                    arrival_wall=time.time() - (time.monotonic() - arrival))

    def _admit(self, num_prompt_tokens: int) -> None:
        """Bounded admission: 503 with ``Retry-After`` at once when the waiting queue is full.

        Waiting = sent to a worker and no token back yet (queued for prefill, prefilling, or
        waiting for its KV): what more load would only lengthen.
        """
        cfg = self.config
        if cfg.max_num_waiting_requests is None and cfg.max_num_waiting_tokens is None:
            return
        num_requests, num_tokens = self.engine.waiting_load()
        if (cfg.max_num_waiting_requests is not None and num_requests >= cfg.max_num_waiting_requests) or \
                (cfg.max_num_waiting_tokens is not None and num_tokens + num_prompt_tokens > cfg.max_num_waiting_tokens
                 and num_requests > 0):
            self.metrics.num_rejected.labels(self.model_name).inc()
            raise APIError(503, f"The server is overloaded: {num_requests} requests ({num_tokens} prompt tokens) "
                                "are waiting for their first token; retry shortly.", headers={"Retry-After": "1"})

    def worker_limits(self, worker: WorkerInfo) -> EngineLimits:
        """What ``worker`` advertised, capped by the router's own ``max_model_len`` and by the
        tokenizer (a token id the model embeds but the tokenizer cannot decode is refused, as vLLM does)."""
        limits = worker.limits(fallback_vocab_size=self.vocab_size)
        max_model_len = limits.max_model_len if 0 < limits.max_model_len <= self.config.max_model_len \
            else self.config.max_model_len
        return dataclasses.replace(limits, max_model_len=max_model_len,
                                   vocab_size=min(limits.vocab_size, self.vocab_size))

    def max_model_len(self) -> int:
        """The longest request any live decode worker accepts (the router's limit without workers)."""
        limits = [self.worker_limits(w).max_model_len for w in self.engine.registry.live(WorkerRole.DECODE)]
        return max(limits, default=self.config.max_model_len)

    def _route(self, req: SamplingRequest, prompt_ids: list[int], lora: LoRARequest | None
               ) -> tuple[SamplingParams, WorkerInfo, WorkerInfo | None]:
        """Resolve max_tokens, build the params, and pick the workers that accept the request
        (under LoRA adapter ``lora``, None for the base model: prefix-aware routing keys by it).

        A max_tokens the client left out becomes what the most capable decode worker
        holds (its max_model_len and KV cache), as vLLM fills it from max_model_len.

        Raises:
            APIError: 503 without a live decode worker; 400 if none accepts the request.
        """
        registry = self.engine.registry
        num_prompt_tokens = len(prompt_ids)
        requested = preprocess.requested_max_tokens(req)
        try:
            # What no worker can change first (the router's own length cap, the sampling ranges): a 400
            # for those comes before a 503 for an empty pool.
            check_prompt_ids(prompt_ids, self.vocab_size)
            check_context_length(num_prompt_tokens, requested, self.config.max_model_len)
            max_tokens = self.config.max_model_len - num_prompt_tokens if requested is None else requested
            params = preprocess.build_sampling_params(req, max_tokens, self.vocab_size, self.tokenizer)
            decode_workers = registry.live(WorkerRole.DECODE)
            if not decode_workers:
                raise NoDecodeWorker()
            limits = {w.worker_id: self.worker_limits(w) for w in decode_workers}
            best = max(limits.values(), key=_capacity)
            if requested is None:
                check_context_length(num_prompt_tokens, None, best.max_model_len)
                room = min(best.max_model_len, best.num_kv_tokens or best.max_model_len)
                params = msgspec.structs.replace(params, max_tokens=max(1, room - num_prompt_tokens))

            def accepts(worker: WorkerInfo) -> bool:
                return _accepts(prompt_ids, params, limits[worker.worker_id])

            decode_worker = self.engine.route(WorkerRole.DECODE, prompt_ids, accepts, lora)
            if decode_worker is None:
                check_request(prompt_ids, params, best)  # raises the most capable worker's reason
                raise ValidationError("No live decode worker can hold this request; please reduce the "
                                      "length of the prompt or of the completion.", "max_tokens")
        except ValidationError as e:
            raise bad_request(e.message, e.param) from None
        first_token = prefill_sampling_params(params)
        prefill_worker = self.engine.route(  # only a prefill worker whose KV the decode worker can take
            WorkerRole.PREFILL, prompt_ids, lambda w: w.kv_compatible(decode_worker) and
            _accepts(prompt_ids, first_token, self.worker_limits(w)), lora)
        salt = lora_cache_root(lora) if lora is not None else b""
        if prefill_worker is not None and prefers_local_prefill(
                decode_worker, prefill_worker, num_prompt_tokens, self.config.local_prefill_margin_s,
                self.config.local_prefill_margin_per_request_s,
                self.engine.policy.cached_tokens(decode_worker, prompt_ids, salt),
                self.engine.policy.cached_tokens(prefill_worker, prompt_ids, salt)):
            self.engine.observe_route(WorkerRole.PREFILL, "local_prefill")  # the prefill pool is behind
            prefill_worker = None
        peer = self._pull_source(decode_worker, prefill_worker, prompt_ids, first_token, lora)
        if peer is not None:  # another decode worker holds more of the prompt: it serves the prefill
            self.engine.observe_route(WorkerRole.PREFILL, "kv_pull")
            prefill_worker = peer
        return params, decode_worker, prefill_worker

    def _pull_source(self, decode_worker: WorkerInfo, prefill_worker: WorkerInfo | None, prompt_ids: list[int],
                     first_token: SamplingParams, lora: LoRARequest | None) -> WorkerInfo | None:
        """The decode worker to pull the prompt's cached KV from instead of computing it
        (``routing.pull_source``), among the live ones that could prefill it for ``decode_worker``."""
        peers = [w for w in self.engine.registry.candidates(WorkerRole.DECODE, None)
                 if w.worker_id != decode_worker.worker_id and w.prefix_cache_salt is not None]
        if not peers:
            return None
        peers = [w for w in peers if w.kv_compatible(decode_worker)
                 and _accepts(prompt_ids, first_token, self.worker_limits(w))]
        salt = lora_cache_root(lora) if lora is not None else b""
        prices = self.engine.kv_prices

        def held(worker: WorkerInfo) -> float:
            return prices.matched_tokens([worker], prompt_ids, salt)[0]

        return pull_source(decode_worker, prefill_worker, peers, len(prompt_ids), held,
                           self.config.local_prefill_margin_s, self.config.local_prefill_margin_per_request_s)

    async def _outputs(self, run: Run) -> AsyncIterator[ChoiceDelta]:
        """Yield each choice's deltas until every choice finished.

        Raises:
            APIError: the worker failed the request or went away (5xx), or ``request_timeout_s`` passed (504).
            ClientDisconnected: the disconnect watcher fired.
        """
        timeout_s = self.config.request_timeout_s
        while not run.done:
            if timeout_s is None:
                item = await run.handle.queue.get()
            else:
                try:
                    item = await asyncio.wait_for(run.handle.queue.get(),
                                                  max(0.0, run.arrival + timeout_s - time.monotonic()))
                except asyncio.TimeoutError:
                    run.failure = "abort"
                    raise APIError(504, f"request {run.request_id} did not finish within --request-timeout "
                                        f"({timeout_s:g} s); it was aborted") from None
            if item is _CLIENT_GONE:
                run.failure = "abort"
                raise ClientDisconnected()
            if isinstance(item, RequestFailed):
                run.failure = "error"
                raise APIError(item.status_code, item.message)
            if item.error is not None or item.finish_reason in (FinishReason.ERROR, FinishReason.ABORT):
                run.failure = "abort" if item.finish_reason == FinishReason.ABORT else "error"
                status = item.error_kind.http_status if item.error_kind is not None else 500
                raise self._worker_error(run, item.error or "aborted", status)
            if item.prompt_logprobs is not None and run.prompt_logprobs is None:
                run.prompt_logprobs = item.prompt_logprobs
            if item.timing is not None and run.timing is None:
                run.timing = item.timing
            choice = run.choices[item.index]  # the engine checked the index
            if choice.finished:
                continue  # stopped by a stop string; the worker goes on until all choices end
            self._observe_timing(run, item)
            try:
                out = choice.add(item)
            except MissingLogprobs as e:
                run.failure = "error"
                raise self._worker_error(run, f"logprobs were requested: {e}") from None
            if run.done:  # free the worker's KV blocks before the client reads the last chunk
                self.engine.abort(run.request_id)
            if out is not None:
                yield out

    def _worker_error(self, run: Run, message: str, status: int = 500) -> APIError:
        """The error a worker reported: a 400 keeps the worker's words (it is about the request)."""
        if status == 400:
            return bad_request(message)
        return APIError(status, f"request {run.request_id} failed on decode worker "
                                f"{run.handle.worker_label}: {message}")

    def _observe_timing(self, run: Run, delta: RequestDelta) -> None:
        if not delta.new_token_ids:
            return
        now, worker_id = time.monotonic(), run.handle.worker_label
        if run.first_token_at is None:
            run.first_token_at, run.first_token_wall = now, time.time()
            self.metrics.observe_first_token(worker_id, now - run.arrival)
            if run.handle.num_migrations == 0 and run.handle.sent_at is not None:
                run.phases = request_phases(run.arrival_wall, run.handle.sent_at, run.timing, run.first_token_wall)
                self.metrics.observe_phases(run.phases)
        last = run.last_delta_at.get(delta.index)
        if last is not None:
            self.metrics.observe_inter_token(worker_id, now - last)
        run.last_delta_at[delta.index] = now

    def _close(self, run: Run) -> None:
        """The handler is done with the request: abort it at the worker (no-op if finished
        there) and record its end; choices cut short count as ``run.failure`` or abort."""
        self.engine.abort(run.request_id)
        finish_reasons = [c.finish_reason or run.failure or "abort" for c in run.choices]
        self.metrics.observe_request(
            run.handle.worker_label, time.monotonic() - run.arrival, run.num_prompt_tokens,
            run.num_output_tokens, finish_reasons)
        if self.tracer is not None:
            self._export_trace(run, finish_reasons)

    def _export_trace(self, run: Run, finish_reasons: list[str]) -> None:
        """Hand the finished request's trace to the exporter (``tracing.RequestTracer``); never raises."""
        handle, timing = run.handle, run.timing  # the workers' stamps become events of the request span
        try:
            self.tracer.export(
                run.request_id, run.arrival_wall, time.time(), run.phases, first_token=run.first_token_wall,
                attributes={"gen_ai.response.model": self.model_name,
                            "gen_ai.usage.prompt_tokens": run.num_prompt_tokens,
                            "gen_ai.usage.completion_tokens": run.num_output_tokens,
                            "gen_ai.request.n": len(run.choices),
                            "gen_ai.response.finish_reasons": finish_reasons,
                            "pdserve.decode_worker": handle.worker_label,
                            "pdserve.prefill_worker": handle.prefill_worker_id,
                            "pdserve.num_migrations": handle.num_migrations},
                events=msgspec.structs.asdict(timing) if timing is not None else None,
                error=run.failure if run.failure == "error" else None, traceparent=run.traceparent)
        except Exception:  # noqa: BLE001  tracing must never fail a request
            logger.exception("request %s: building its trace failed", run.request_id)

    async def _collect(self, run: Run, raw: Request) -> bool:
        """Run a non-stream request to the end; False if the client left first."""
        watcher = asyncio.create_task(_watch_disconnect(raw, run.handle.queue))
        try:
            async for _ in self._outputs(run):
                pass
            return True
        except ClientDisconnected:
            logger.info("request %s: client disconnected; aborted", run.request_id)
            return False
        finally:
            watcher.cancel()
            self._close(run)

    def _stream(self, run: Run, first: list[BaseModel], chunk: Callable[[ChoiceDelta], BaseModel],
                usage_chunk: Callable[[], BaseModel] | None) -> StreamingResponse:
        async def events() -> AsyncIterator[str]:
            try:
                for obj in first:
                    yield _sse(obj)
                async for out in self._outputs(run):
                    yield _sse(chunk(out))
                if usage_chunk is not None:
                    yield _sse(usage_chunk())
                yield "data: [DONE]\n\n"
            except APIError as e:
                logger.warning("request %s failed mid-stream: %s", run.request_id, e.message)
                yield _sse(e.to_response())
            finally:  # also runs when the client went away and the stream was cancelled
                self._close(run)

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _capacity(limits: EngineLimits) -> tuple[int, int]:
    """Orders workers by how large a request they hold: max_model_len, then KV tokens."""
    return limits.max_model_len, limits.num_kv_tokens if limits.num_kv_tokens is not None else 2 ** 62


def _accepts(prompt_ids: list[int], params: SamplingParams, limits: EngineLimits) -> bool:
    try:
        check_request(prompt_ids, params, limits)
    except ValidationError:
        return False
    return True


async def _watch_disconnect(raw: Request, queue: asyncio.Queue) -> None:
    """Wait for the client to disconnect (body already read), then wake the handler."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            queue.put_nowait(_CLIENT_GONE)
            return
