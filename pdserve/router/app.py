"""The router's FastAPI application: routes, error bodies, and ZMQ lifecycle.

Endpoints:
    POST /v1/completions, POST /v1/chat/completions   OpenAI-compatible, stream or not
    GET  /v1/models                                   the served model (with the live workers' max_model_len)
                                                      and its LoRA adapters (``parent``: the base model)
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   LoRA adapters at runtime (with --enable-lora)
    GET  /health                                      {"status": "ok", "num_prefill", "num_decode"} (liveness)
    GET  /ready                                       200 once a request can be served end to end, else 503
    GET  /workers                                     live workers and their latest heartbeat figures
    GET  /info                                        model, limits, and the bound ZMQ address
    GET  /metrics                                     Prometheus text format (see ``metrics.py``)
    GET  /admin/pools, POST /admin/scale, POST /admin/workers/{id}/drain   pools (see ``admin.py``)

Both generation endpoints take ``n`` (1..16 choices; ``best_of`` only if equal
to ``n``), ``temperature``, ``top_p``, ``top_k``, ``seed``, ``max_tokens``,
``stop``, ``frequency_penalty`` and ``presence_penalty`` (each in [-2, 2]),
``min_tokens``, ``ignore_eos``, ``stop_token_ids`` and ``skip_special_tokens``.
Log-probabilities: completions ``logprobs: 0..20`` (legacy
``{tokens, token_logprobs, top_logprobs, text_offset}``), chat ``logprobs: true``
with ``top_logprobs: 0..20`` (``{content: [{token, logprob, bytes, top_logprobs}]}``).
With ``n > 1`` the response has one choice per index; stream chunks carry one
choice each (``choices[0].index``) and usage sums the tokens of all choices.

Every error is an OpenAI error body ``{"error": {"message", "type", "param", "code"}}``;
request validation errors are 400 (not FastAPI's 422).
"""

from __future__ import annotations

import contextlib
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.datastructures import Headers
from transformers import AutoTokenizer

from pdserve.common.auth import bearer_matches
from pdserve.common.protocol import WorkerRole
from pdserve.router.admin import add_admin_routes
from pdserve.router.openapi import install_openapi
from pdserve.router.config import RouterConfig, parse_lora_modules
from pdserve.router.engine import RouterEngine
from pdserve.router.errors import APIError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.openai_protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest,
                                            ModelCard, ModelList, UnloadLoRAAdapterRequest)
from pdserve.router.registry import WorkerRegistry
from pdserve.router.kv_index import KVIndex
from pdserve.router.routing import make_policy
from pdserve.router.serving import OpenAIServing
from pdserve.router.tracing import RequestTracer

logger = logging.getLogger(__name__)


class _BoundedBody:
    """ASGI middleware: 413 before reading a body larger than ``limit`` bytes (``--max-request-body-bytes``)."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            length = Headers(scope=scope).get("content-length")
            if length is not None and length.isdigit() and int(length) > self.limit:
                response = _error_json(APIError(413, f"the request body is {length} bytes; this server accepts at "
                                                     f"most {self.limit}"))
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _RequireAPIKey:
    """ASGI middleware: ``/v1/*`` and ``/admin/*`` need ``Authorization: Bearer <api key>`` (401 otherwise);
    /health, /ready and /metrics stay open."""

    def __init__(self, app, api_key: str):
        self.app, self.api_key = app, api_key

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith(("/v1/", "/admin/")) and not bearer_matches(
                self.api_key, Headers(scope=scope).get("authorization")):
            err = APIError(401, "Incorrect or missing API key: send Authorization: Bearer <key>.",
                           type="invalid_request_error")
            response = JSONResponse(err.to_response().model_dump(), status_code=401,
                                    headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _error_json(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_response().model_dump(), status_code=err.status_code, headers=err.headers or None)


def _validation_error(exc: RequestValidationError) -> APIError:
    """Turn pydantic's error list into one 400 naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return APIError(400, "invalid request")
    messages, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        if e.get("type") == "json_invalid":
            detail = (e.get("ctx") or {}).get("error", "")
            messages.append(f"malformed JSON body{': ' + detail if detail else ''}")
            continue
        field = ".".join(loc)
        if not field and e.get("type") == "missing":
            messages.append("the request body is missing; expected a JSON object")
            continue
        param = param or field or None
        messages.append(f"{field or 'body'}: {e.get('msg', 'invalid value')}")
    return APIError(400, "; ".join(messages[:5]), param)


def build_app(config: RouterConfig, tokenizer=None) -> FastAPI:
    """The router application. ZMQ is bound when the app's lifespan starts
    (``uvicorn`` or ``TestClient`` as a context manager) and closed when it ends.

    ``tokenizer`` defaults to ``AutoTokenizer.from_pretrained(config.model)``.
    """
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(config.model)
    registry = WorkerRegistry(config.worker_timeout_s, config.step_timeout_s)
    metrics = RouterMetrics(config.served_model_name, registry, config.max_model_len)
    kv_index = KVIndex()
    engine = RouterEngine(config.zmq_host or config.host, config.zmq_port, registry, metrics.workers,
                          config.cluster_secret,
                          worker_wait_s=config.worker_wait_s, on_migration=metrics.observe_migration,
                          policy=make_policy(config.routing_policy, config.routing_prefix_blocks,
                                             config.routing_balance_factor, kv_index),
                          on_route=metrics.observe_route, router_id=config.router_id, kv_index=kv_index)
    tracer = RequestTracer(config.otlp_traces_endpoint) if config.otlp_traces_endpoint else None
    serving = OpenAIServing(config, tokenizer, engine, metrics, tracer)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        direct = f" (this router alone: port {config.direct_port})" if config.direct_port else ""
        print(f"pdserve router {config.router_id}: workers push to {engine.address}; "
              f"HTTP on http://{config.host}:{config.port}{direct}", flush=True)
        if tracer is not None:
            logger.info("exporting one OpenTelemetry trace per request to %s", tracer.endpoint)
        try:
            yield
        finally:
            await engine.stop()
            if tracer is not None:
                tracer.shutdown()  # send the traces still queued

    app = FastAPI(title="pdserve router", lifespan=lifespan)
    app.state.config = config
    app.state.engine = engine
    app.state.registry = registry
    app.state.serving = serving
    app.state.metrics = metrics

    # Plain ASGI middlewares, not ``@app.middleware("http")``: Starlette's BaseHTTPMiddleware runs the
    # app in a task of its own and moves every chunk of a streamed response through an anyio memory
    # stream; these look at the request's headers and pass the response through untouched.
    app.add_middleware(_BoundedBody, limit=config.max_request_body_bytes)
    if config.api_key is not None:
        app.add_middleware(_RequireAPIKey, api_key=config.api_key)  # added last: runs first

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_json(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return _error_json(_validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        """404, 405 (with its ``Allow`` header) and the like, in OpenAI's error shape."""
        return _error_json(APIError(exc.status_code, str(exc.detail), headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        logger.exception("unhandled error in %s %s", request.method, request.url.path)
        return _error_json(APIError(500, f"internal error: {type(exc).__name__}: {exc}"))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        """OpenAI completions: one prompt, ``n`` choices, optional legacy ``logprobs``."""
        return await serving.create_completion(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        """OpenAI chat completions: ``n`` choices, optional ``logprobs``/``top_logprobs``."""
        return await serving.create_chat_completion(body, request)

    @app.get("/v1/models")
    async def models():
        """The base model, then each LoRA adapter (``parent``: the base model)."""
        max_model_len = serving.max_model_len()
        cards = [ModelCard(id=config.served_model_name, root=config.model, max_model_len=max_model_len)]
        if serving.loras is not None:
            cards += serving.loras.cards(max_model_len)
        return ModelList(data=cards).model_dump()

    if serving.loras is not None:
        for name, path in parse_lora_modules(config.lora_modules):
            serving.loras.load(name, path)  # a bad adapter stops the router here, with the reason

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest):
            """vLLM's runtime load: serve the PEFT adapter at ``lora_path`` as model ``lora_name``."""
            serving.loras.load(body.lora_name, body.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
            """vLLM's runtime unload: stop serving ``lora_name`` (running requests finish with it)."""
            serving.loras.unload(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.get("/health")
    async def health():
        """200 ``{"status": "ok", ...}``; 503 ``"draining"`` once SIGTERM started the router's drain."""
        body = {"status": "draining" if serving.draining else "ok",
                "num_prefill": registry.num_live(WorkerRole.PREFILL),
                "num_decode": registry.num_live(WorkerRole.DECODE)}
        return JSONResponse(body, status_code=503 if serving.draining else 200)

    @app.get("/ready")
    async def ready():
        """Readiness (for load balancers and Kubernetes probes; ``/health`` is liveness): 200 only when
        a request can be served end to end now: a decode worker is live, and a prefill worker too
        where the deployment starts some (``--expect-prefill-workers``); 503 with what is missing
        otherwise, and while the router drains."""
        num_prefill, num_decode = registry.num_live(WorkerRole.PREFILL), registry.num_live(WorkerRole.DECODE)
        missing = []
        if serving.draining:
            missing.append("the router is draining")
        if num_decode == 0:
            missing.append("no decode worker is live")
        if config.expect_prefill_workers > 0 and num_prefill == 0:
            missing.append("no prefill worker is live")
        body = {"status": "not ready" if missing else "ready", "num_prefill": num_prefill, "num_decode": num_decode}
        if missing:
            body["missing"] = missing
        return JSONResponse(body, status_code=503 if missing else 200)

    @app.get("/workers")
    async def workers():
        live = registry.snapshot()
        for w in live:  # what its KV events say it caches (the kv_aware policy's view)
            w["kv_index_blocks"] = kv_index.num_blocks(w["id"])
        return live

    add_admin_routes(app, engine, pool_owner=config.pool_owner, api_key=config.api_key)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        """vLLM-named gauges, counters and histograms of the router and its workers."""
        body, content_type = metrics.render(request.headers.get("accept"))
        return Response(body, media_type=content_type)

    @app.get("/info")
    async def info():
        return {"model": config.model, "served_model_name": config.served_model_name,
                "max_model_len": serving.max_model_len(), "zmq_address": engine.address,
                "worker_timeout_s": config.worker_timeout_s, "num_inflight": engine.num_inflight,
                "routing_policy": config.routing_policy, "router_id": config.router_id,
                "pool_owner": config.pool_owner,
                "kv_index": {"entries": kv_index.num_entries, "batches": kv_index.num_batches,
                             "gaps": kv_index.num_gaps, "replays_asked": kv_index.num_replays_asked,
                             "snapshots": kv_index.num_snapshots, "overflows": kv_index.num_overflows}}

    install_openapi(app, api_key_required=config.api_key is not None)
    return app
