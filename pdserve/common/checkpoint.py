"""What a checkpoint directory says of itself, read without torch: its EOS tokens and its dtype.

The router (beam search stops on EOS) and every model runner read them here, the same way."""

from __future__ import annotations

import json
import os


def _json(model_dir: str, name: str) -> dict:
    path = os.path.join(model_dir, name)
    if not os.path.exists(path):
        return {}
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def read_eos_token_ids(model_dir: str, hf_config=None) -> frozenset[int]:
    """The EOS token ids of ``generation_config.json`` and of the model's config (an int or a list each):
    ``hf_config.eos_token_id`` where a transformers config is given (it fills in the family's default),
    else ``config.json``'s."""
    ids: set[int] = set()
    own = getattr(hf_config, "eos_token_id", None) if hf_config is not None else \
        _json(model_dir, "config.json").get("eos_token_id")
    for value in (own, _json(model_dir, "generation_config.json").get("eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def checkpoint_dtype(model_dir: str) -> str | None:
    """``config.json``'s ``torch_dtype`` (``dtype`` in transformers 5), or None."""
    cfg = _json(model_dir, "config.json")
    return cfg.get("torch_dtype") or cfg.get("dtype")
