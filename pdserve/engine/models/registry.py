"""Which of our model classes serves a Hugging Face checkpoint.

A checkpoint's ``config.json`` names its class (``architectures``, e.g.
``["Qwen3ForCausalLM"]``) and its ``model_type`` (``"qwen3"``). Each supported family has
one file in this package; ``_FAMILIES`` maps the names to ``(module, class)`` and the
module is imported only when a checkpoint needs it. vLLM's ``ModelRegistry`` does the same
keyed by architecture name; we also accept the ``model_type`` alone, since configs written
by hand often leave ``architectures`` out.
"""

from __future__ import annotations

import importlib
import json
import os
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the registry itself is torch-free: `pdserve up` checks a model before starting anything
    from torch import nn


@dataclass(frozen=True)
class ModelFamily:
    """One supported family: its ``model_type``, the HF architecture names it serves, and
    our class (``pdserve.engine.models.<module>.<class_name>``)."""

    model_type: str
    architectures: tuple[str, ...]
    module: str
    class_name: str


_FAMILIES = (
    ModelFamily("llama", ("LlamaForCausalLM",), "llama", "LlamaForCausalLM"),
    ModelFamily("mistral", ("MistralForCausalLM",), "llama", "LlamaForCausalLM"),
    ModelFamily("qwen2", ("Qwen2ForCausalLM",), "llama", "LlamaForCausalLM"),
    ModelFamily("qwen3", ("Qwen3ForCausalLM",), "qwen3", "Qwen3ForCausalLM"),
    ModelFamily("phi3", ("Phi3ForCausalLM",), "phi3", "Phi3ForCausalLM"),
    ModelFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), "qwen3_moe", "Qwen3MoeForCausalLM"),
    ModelFamily("mixtral", ("MixtralForCausalLM",), "mixtral", "MixtralForCausalLM"),
    ModelFamily("olmo2", ("Olmo2ForCausalLM",), "olmo2", "Olmo2ForCausalLM"),
    ModelFamily("gemma3_text", ("Gemma3ForCausalLM",), "gemma3", "Gemma3ForCausalLM"),
    ModelFamily("deepseek_v3", ("DeepseekV3ForCausalLM",), "deepseek_v3", "DeepseekV3ForCausalLM"),
    ModelFamily("gpt_oss", ("GptOssForCausalLM",), "gpt_oss", "GptOssForCausalLM"),
)
SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(f.model_type for f in _FAMILIES)


class UnsupportedArchitecture(ValueError):
    """A checkpoint whose architecture pdserve has no model for; the message is one line naming
    the supported ones."""


def _family(config) -> ModelFamily | None:
    by_arch = {a: f for f in _FAMILIES for a in f.architectures}
    for arch in getattr(config, "architectures", None) or ():
        if arch in by_arch:
            return by_arch[arch]
    model_type = getattr(config, "model_type", None)
    return next((f for f in _FAMILIES if f.model_type == model_type), None)


def check_supported(config, where: str = "") -> ModelFamily:
    """The family serving ``config`` (a transformers ``PretrainedConfig`` or anything with
    ``architectures`` / ``model_type``). Raises UnsupportedArchitecture otherwise; ``where``
    (e.g. the checkpoint directory) goes into the message."""
    family = _family(config)
    if family is None:
        arch = ", ".join(getattr(config, "architectures", None) or ()) or "none given"
        place = f" in {where}" if where else ""
        raise UnsupportedArchitecture(
            f"unsupported architecture{place}: model_type={getattr(config, 'model_type', None)!r} "
            f"(architectures: {arch}); pdserve serves model_type {', '.join(SUPPORTED_MODEL_TYPES)}")
    return family


def model_class(config, where: str = "") -> type[nn.Module]:
    """Our model class for ``config`` (see ``check_supported`` for the error)."""
    family = check_supported(config, where)
    module = importlib.import_module(f"pdserve.engine.models.{family.module}")
    return getattr(module, family.class_name)


def check_model_dir(model_dir: str) -> None:
    """Refuse, before anything starts, a checkpoint directory whose ``config.json`` names an
    architecture we do not serve (UnsupportedArchitecture). Reads only the JSON; a directory
    without one is left for the loader to report."""
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        raw = json.load(f)
    check_supported(SimpleNamespace(architectures=raw.get("architectures"), model_type=raw.get("model_type")),
                    model_dir)
