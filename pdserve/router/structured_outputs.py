"""The OpenAI/vLLM request fields that ask for structured outputs -> wire ``StructuredOutputsParams``.

Four spellings, one constraint per request (vLLM's rule):

* ``response_format`` (OpenAI): ``{"type": "text"}`` (none), ``{"type": "json_object"}``,
  ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
* ``structured_outputs`` (vLLM): ``{"json": schema object or text, "regex": ..., "choice": [...],
  "grammar": ..., "json_object": true, "disable_any_whitespace": ...}``;
* vLLM's older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``.

The result is validated with llguidance here (``structured_output.check_structured_outputs``), so an
invalid schema, regex or grammar, or two constraints at once, is a 400 naming the request field
before any worker is involved.
"""

from __future__ import annotations

import json
from typing import Any

from pdserve.common.protocol import StructuredOutputsParams
from pdserve.common.validation import ValidationError
from pdserve.engine.execution.structured_output import check_structured_outputs
from pdserve.router.errors import bad_request, not_supported
from pdserve.router.openai_protocol import SamplingRequest

_RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")


def _schema_text(schema: Any, param: str) -> str:
    """A JSON schema given as an object or as JSON text -> its text. Raises APIError (400)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad_request(f"{param}: the JSON schema is not valid JSON: {e}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise bad_request(f"{param}: a JSON schema must be an object", param)
    return json.dumps(schema)


def _from_response_format(response_format: dict[str, Any]) -> StructuredOutputsParams | None:
    kind = response_format.get("type")
    if kind not in _RESPONSE_FORMAT_TYPES:
        raise not_supported("response_format", f"`response_format` of type `{kind}`")
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if schema is None:
            raise bad_request("response_format of type json_schema needs json_schema.schema", "response_format")
        return StructuredOutputsParams(json=_schema_text(schema, "response_format"))
    return None


def _from_structured_outputs(fields: dict[str, Any]) -> StructuredOutputsParams:
    param = "structured_outputs"
    schema = fields.get("json")
    choice = fields.get("choice")
    if choice is not None and not (isinstance(choice, list) and all(isinstance(c, str) for c in choice)):
        raise bad_request("structured_outputs.choice must be a list of strings", param)
    for name in ("regex", "grammar"):
        if fields.get(name) is not None and not isinstance(fields[name], str):
            raise bad_request(f"structured_outputs.{name} must be a string", param)
    return StructuredOutputsParams(
        json=None if schema is None else _schema_text(schema, param), json_object=bool(fields.get("json_object")),
        regex=fields.get("regex"), choice=choice, grammar=fields.get("grammar"),
        disable_any_whitespace=bool(fields.get("disable_any_whitespace")))


def _from_guided(req: SamplingRequest) -> list[tuple[str, StructuredOutputsParams]]:
    found = []
    if req.guided_json is not None:
        found.append(("guided_json", StructuredOutputsParams(json=_schema_text(req.guided_json, "guided_json"))))
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutputsParams(regex=req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", StructuredOutputsParams(choice=list(req.guided_choice))))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutputsParams(grammar=req.guided_grammar)))
    return found


def structured_outputs_of(req: SamplingRequest) -> StructuredOutputsParams | None:
    """The request's structured outputs constraint, checked with llguidance, or None.

    Raises:
        APIError: 400 naming the field: an invalid schema / regex / grammar, an unknown
            ``response_format`` type, or constraints in two fields (or two in one field).
    """
    found: list[tuple[str, StructuredOutputsParams]] = []
    response_format = getattr(req, "response_format", None)
    if response_format:
        params = _from_response_format(response_format)
        if params is not None:
            found.append(("response_format", params))
    if req.structured_outputs is not None:
        found.append(("structured_outputs", _from_structured_outputs(req.structured_outputs)))
    found += _from_guided(req)
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(f"only one kind of structured outputs constraint may be given; got "
                          f"{', '.join(name for name, _ in found)}", found[1][0])
    param, params = found[0]
    try:
        check_structured_outputs(params)
    except ValidationError as e:
        raise bad_request(e.message, param) from None
    return params

