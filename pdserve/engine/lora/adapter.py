"""Read a PEFT LoRA adapter directory and check it against the base model.

A PEFT adapter (Hugging Face ``peft``, ``save_pretrained``) is a directory with
``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``, ``use_rslora``, ...)
and ``adapter_model.safetensors`` holding, for each adapted linear layer ``M``,

    base_model.model.<M>.lora_A.weight   [r, in_features]
    base_model.model.<M>.lora_B.weight   [out_features, r]

PEFT adds ``scaling * lora_B(lora_A(x))`` to the layer's output, with ``scaling =
lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``; ``alpha_pattern`` and
``rank_pattern`` may set other values per module). pdserve adapts the decoder's seven
projections (q, k, v, o, gate, up, down); adapters of the embedding or the LM head, DoRA,
trained biases and ``modules_to_save`` are refused with a ``LoRAAdapterError`` naming the
reason, never applied partly.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from pdserve.engine.models.loader import map_hf_name

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_KEY = re.compile(r"^(?:base_model\.model\.)?(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight$")
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoRAAdapterError(ValueError):
    """The adapter directory cannot serve this base model (missing files, unsupported options,
    shapes that do not fit, a rank over ``max_lora_rank``)."""


@dataclass
class LoRAAdapter:
    """One adapter's weights, ready for ``LoRASlots.set_slot``.

    ``weights[(layer, module, shard_id)] = (A, B)``: ``layer`` the global layer index,
    ``module`` our parameter owner's name (``self_attn.qkv_proj``, ``self_attn.o_proj``,
    ``mlp.gate_up_proj``, ``mlp.down_proj``), ``shard_id`` the fused part (q/k/v = 0/1/2,
    gate/up = 0/1) or None; A [r, in_features] and B [out_features, r] float32, unsharded,
    with the scaling already folded into B.
    """

    name: str
    path: str
    rank: int  # the largest rank of any module
    weights: dict[tuple[int, str, int | None], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.weights.values())


def _module_shapes(hf_config) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each adaptable projection of the base model."""
    hidden = hf_config.hidden_size
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    inter = hf_config.intermediate_size
    return {"q_proj": (hidden, heads * head_dim), "k_proj": (hidden, kv_heads * head_dim),
            "v_proj": (hidden, kv_heads * head_dim), "o_proj": (heads * head_dim, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}


def _pattern_value(patterns: dict, module_key: str, default):
    """PEFT's ``rank_pattern``/``alpha_pattern``: the value of the first pattern that names
    ``module_key`` as a whole dotted suffix (a plain name or a regular expression)."""
    for pattern, value in (patterns or {}).items():
        if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", module_key):
            return value
    return default


def read_adapter_config(path: str) -> dict:
    """``adapter_config.json`` of the adapter at ``path``, checked for options pdserve cannot serve.

    Raises:
        LoRAAdapterError: no such directory or files, not a LoRA adapter, or DoRA, trained biases,
            ``modules_to_save``, ``fan_in_fan_out``.
    """
    if not os.path.isdir(path):
        raise LoRAAdapterError(f"LoRA adapter path {path!r} is not a directory")
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.exists(config_path):
        raise LoRAAdapterError(f"{path!r} has no {ADAPTER_CONFIG}: not a PEFT adapter")
    if not os.path.exists(os.path.join(path, ADAPTER_WEIGHTS)):
        raise LoRAAdapterError(f"{path!r} has no {ADAPTER_WEIGHTS} (only safetensors adapters are read)")
    try:
        with open(config_path) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise LoRAAdapterError(f"cannot read {config_path}: {e}") from e
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRAAdapterError(f"{path!r} is a {peft_type} adapter; only LoRA adapters are served")
    for option, why in (("use_dora", "DoRA"), ("modules_to_save", "modules_to_save"),
                        ("fan_in_fan_out", "fan_in_fan_out (Conv1D layers)"), ("lora_bias", "a bias on lora_B"),
                        ("layer_replication", "layer_replication"),
                        ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens)")):
        if config.get(option):
            raise LoRAAdapterError(f"{path!r} uses {why}, which pdserve does not serve")
    if config.get("bias", "none") != "none":
        raise LoRAAdapterError(f"{path!r} trains biases (bias={config['bias']!r}); only bias='none' is served")
    return config


def load_adapter(name: str, path: str, hf_config, max_lora_rank: int) -> LoRAAdapter:
    """Read the PEFT adapter at ``path`` for the base model of ``hf_config``.

    Args:
        name: the adapter's served name (for messages).
        path: the adapter directory.
        hf_config: the base model's transformers config.
        max_lora_rank: the largest rank accepted (``--max-lora-rank``).

    Returns:
        the adapter's (A, B) per adapted projection, scaling folded into B, float32.

    Raises:
        LoRAAdapterError: see ``read_adapter_config``; a module other than the seven decoder
            projections, a layer the model does not have, shapes that do not match the base
            model, a rank over ``max_lora_rank``, a lora_A without its lora_B (or the reverse).
    """
    config = read_adapter_config(path)
    shapes = _module_shapes(hf_config)
    num_layers = hf_config.num_hidden_layers
    halves: dict[str, dict[str, torch.Tensor]] = {}
    try:
        with safe_open(os.path.join(path, ADAPTER_WEIGHTS), framework="pt", device="cpu") as f:
            for key in f.keys():
                m = _KEY.match(key)
                if m is None or m.group(3) not in SUPPORTED_MODULES:
                    raise LoRAAdapterError(f"adapter {name!r} has weight {key!r}; pdserve adapts only the decoder "
                                           f"projections ({', '.join(SUPPORTED_MODULES)})")
                halves.setdefault(m.group(1), {})[m.group(4)] = f.get_tensor(key)
    except LoRAAdapterError:
        raise
    except Exception as e:  # noqa: BLE001  safetensors' own errors: a corrupt or truncated file
        raise LoRAAdapterError(f"cannot read {ADAPTER_WEIGHTS} of adapter {name!r}: {e}") from e
    if not halves:
        raise LoRAAdapterError(f"adapter {name!r} at {path!r} has no LoRA weights")
    adapter = LoRAAdapter(name=name, path=path, rank=0)
    for module_key, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoRAAdapterError(f"adapter {name!r}: {module_key} has lora_{'A' if 'A' in pair else 'B'} only")
        a, b = pair["A"].float(), pair["B"].float()
        parts = module_key.split(".")  # model.layers.<i>.<self_attn|mlp>.<proj>
        layer, proj = int(parts[2]), parts[-1]
        if layer >= num_layers:
            raise LoRAAdapterError(f"adapter {name!r} adapts layer {layer}; the base model has {num_layers}")
        in_features, out_features = shapes[proj]
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, rank):
            raise LoRAAdapterError(
                f"adapter {name!r}: {module_key} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; the base "
                f"model needs [r, {in_features}] and [{out_features}, r]: was it trained on another model?")
        if rank > max_lora_rank:
            raise LoRAAdapterError(f"adapter {name!r} has rank {rank} > --max-lora-rank {max_lora_rank}")
        alpha = _pattern_value(config.get("alpha_pattern"), module_key, config.get("lora_alpha", 8))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        hf_name, shard_id = map_hf_name(module_key + ".weight")
        module = hf_name.removesuffix(".weight").split(".", 3)[3]  # "self_attn.qkv_proj"
        adapter.weights[(layer, module, shard_id)] = (a.contiguous(), (b * scaling).contiguous())
        adapter.rank = max(adapter.rank, rank)
    return adapter
