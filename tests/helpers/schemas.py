"""Structured-output schemas shared by the LLM and router tests."""

from __future__ import annotations

# Every string, array and number is bounded and no other key may appear, so the grammar itself
# ends every output well within max_tokens (compact JSON: no free whitespace).
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "name": {"type": "string", "maxLength": 6},
        "active": {"type": "boolean"},
        "owner": {
            "type": "object",
            "properties": {"role": {"enum": ["admin", "user", "guest"]},
                           "level": {"type": "integer", "minimum": -5, "maximum": 5}},
            "required": ["role", "level"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
    },
    "required": ["id", "name", "active", "owner", "tags"],
    "additionalProperties": False,
}
