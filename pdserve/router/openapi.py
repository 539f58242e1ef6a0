"""The router's OpenAPI schema, made to say what the router really answers.

FastAPI documents a 422 for every route with a body or parameters, but the
router answers 400 in OpenAI's error shape instead (``app._invalid``), and it
knows nothing of the other errors. ``install_openapi`` post-processes the
generated schema once: it drops the 422s and documents, per route, the error
statuses the handlers return, each with the ``ErrorResponse`` body; the SSE
content type of the generation endpoints; ``/metrics``' Prometheus text; and
``/health``'s 503 while draining. Schema-driven fuzzers (schemathesis) then
check the responses against it (``tests/faults/test_fuzz.py``).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pdserve.router.openai_protocol import ErrorResponse

_GENERATION = ("/v1/completions", "/v1/chat/completions")
_DESCRIPTIONS = {
    "400": "The request breaks a rule (OpenAI error body; `param` names the field).",
    "401": "Missing or wrong API key (`Authorization: Bearer KEY`).",
    "404": "No such model (generation endpoints) or worker (admin).",
    "413": "The request body is larger than `--max-request-body-bytes`.",
    "500": "Internal error.",
    "503": "No decode worker available, the server overloaded (`Retry-After`), the router draining, or the "
           "request's workers lost.",
    "504": "The request did not finish within `--request-timeout`.",
}


def _errors_of(path: str, method: str, api_key_required: bool) -> list[str]:
    codes = ["500"]
    if method in ("post", "put", "patch"):
        codes += ["400", "413"]
    if api_key_required and path.startswith(("/v1/", "/admin/")):
        codes.append("401")
    if path.startswith("/admin/workers/"):
        codes.append("404")
    if path in _GENERATION:
        codes += ["404", "503", "504"]
    return sorted(codes)


def describe(schema: dict, api_key_required: bool) -> dict:
    """Rewrite a FastAPI-generated OpenAPI ``schema`` in place (see the module docstring); returns it."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    components.update(error_schema.pop("$defs", {}))
    components["ErrorResponse"] = error_schema
    for key in ("HTTPValidationError", "ValidationError"):
        components.pop(key, None)
    error_body = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    for path, operations in schema.get("paths", {}).items():
        for method, op in operations.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for code in _errors_of(path, method, api_key_required):
                responses[code] = {"description": _DESCRIPTIONS[code], "content": error_body}
            ok = responses.setdefault("200", {"description": "OK"})
            if path in _GENERATION:
                ok.setdefault("content", {})["text/event-stream"] = {
                    "schema": {"type": "string", "description": "with `stream: true`: server-sent events"}}
            elif path == "/metrics":
                ok["content"] = {"text/plain": {"schema": {"type": "string"}},
                                 "application/openmetrics-text": {"schema": {"type": "string"}}}
            elif path == "/health":
                responses["503"] = {"description": "The router is draining (SIGTERM).",
                                    "content": {"application/json": {"schema": {"type": "object"}}}}
    return schema


def install_openapi(app: FastAPI, api_key_required: bool) -> None:
    """Serve ``describe``'s schema at ``/openapi.json`` (built once, on first request)."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            app.openapi_schema = describe(get_openapi(title=app.title, version=app.version, routes=app.routes),
                                          api_key_required)
        return app.openapi_schema

    app.openapi = openapi
