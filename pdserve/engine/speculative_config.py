"""``--speculative-config``: which proposer, how many draft tokens (vLLM's JSON keys)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding settings, parsed from vLLM's ``--speculative-config`` JSON.

    Args:
        method: ``ngram`` (prompt lookup) or ``draft_model``; left out with ``model`` given,
            it is ``draft_model``.
        num_speculative_tokens: drafts proposed per request and step (k), 1..16.
        prompt_lookup_max, prompt_lookup_min: ngram: the longest and shortest suffix n-gram
            looked up, in tokens (1 <= min <= max).
        model: draft_model: a Hugging Face checkpoint directory with the target's vocabulary.

    Raises:
        ValueError: an unknown method or key, or a value out of range.
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 1
    model: str | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if self.method == "ngram" and not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({self.prompt_lookup_min}) <= prompt_lookup_max "
                             f"({self.prompt_lookup_max})")
        if self.method == "draft_model":
            if not self.model:
                raise ValueError("speculative method draft_model needs \"model\": a checkpoint directory")
            if not os.path.isfile(os.path.join(self.model, "config.json")):
                raise ValueError(f"draft model {self.model!r} is not a checkpoint directory (no config.json)")

    @classmethod
    def from_json(cls, text: str | dict) -> "SpeculativeConfig":
        """Parse ``--speculative-config`` (a JSON object, or the dict itself).

        Raises:
            ValueError: not a JSON object, an unknown key, or a bad value.
        """
        try:
            raw = json.loads(text) if isinstance(text, str) else dict(text)
        except ValueError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model"}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown --speculative-config keys {sorted(unknown)}; known: {sorted(known)}")
        method = raw.get("method") or ("draft_model" if raw.get("model") else None)
        if method is None:
            raise ValueError("--speculative-config needs \"method\" (ngram or draft_model)")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs \"num_speculative_tokens\"")
        lookup_max = raw.get("prompt_lookup_max")
        lookup_min = raw.get("prompt_lookup_min")
        return cls(method=method, num_speculative_tokens=int(raw["num_speculative_tokens"]),
                   prompt_lookup_max=int(lookup_max if lookup_max is not None else max(5, lookup_min or 1)),
                   prompt_lookup_min=int(lookup_min if lookup_min is not None else 1),
                   model=raw.get("model"))
