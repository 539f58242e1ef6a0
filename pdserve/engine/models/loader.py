"""Load a Hugging Face checkpoint directory (config.json + *.safetensors) into our model.

The class comes from the registry (``pdserve.engine.models.registry``) by the config's
``architectures`` / ``model_type``. Names, for the Llama family and those built on it:

HF name                                         -> ours (shard_id)
model.embed_tokens.weight                       -> model.embed_tokens.weight
model.layers.N.self_attn.{q,k,v}_proj.{weight,bias} -> model.layers.N.self_attn.qkv_proj.* (0, 1, 2)
model.layers.N.self_attn.o_proj.{weight,bias}   -> same name
model.layers.N.mlp.{gate,up}_proj.{weight,bias} -> model.layers.N.mlp.gate_up_proj.* (0, 1)
model.layers.N.mlp.down_proj.{weight,bias}      -> same name
model.layers.N.{input,post_attention}_layernorm.weight, model.norm.weight -> same name
lm_head.weight                                  -> lm_head.weight (skipped when embeddings are tied)

A family whose checkpoint already stores a fused tensor (Phi-3's ``qkv_proj`` and
``gate_up_proj``) names it in ``split_fused``: the tensor is cut along its rows into our
layer's parts (``output_sizes``) and each part is loaded as above.

Each tensor is handed unsharded to its parameter's ``weight_loader``, which takes this
TP rank's shard, so the same files serve every TP size.

A compressed-tensors checkpoint (W8A16 / W4A16, ``pdserve.engine.layers.compressed_tensors``) stores a
quantized linear as ``weight_packed`` / ``weight_scale`` / ``weight_shape``: it is dequantized and
loaded as above, and its scale, sharded the same way, stays on the layer as
``checkpoint_weight_scale`` for ``quantization.quantize_model``.

An MXFP4 checkpoint (gpt-oss as released, ``pdserve.engine.layers.mxfp4``) stores each MoE expert tensor
as ``<name>_blocks`` / ``<name>_scales``: once both halves are read, the pair is dequantized to
the model dtype in transformers' float layout and loaded as ``<name>`` (whole, before the
family's weight loader takes this rank's TP slice or EP experts). No MXFP4 kernel runs here.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from typing import Any

import torch
from safetensors import safe_open
from transformers import AutoConfig

from pdserve.engine.layers.compressed_tensors import CHECKPOINT_SCALE
from pdserve.engine.layers.base import ColumnParallelLinear, RowParallelLinear
from pdserve.engine.layers.weight_format import place_in_arenas
from pdserve.engine.models.formats import Decoded, readers_for
from pdserve.engine.models.interface import CausalLM
from pdserve.engine.models.registry import model_class

logger = logging.getLogger(__name__)

# HF sub-name -> (our fused sub-name, shard_id)
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
# Checkpoint entries that carry no weights we need (old HF files store the RoPE table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def map_hf_name(hf_name: str) -> tuple[str, int | None]:
    """HF parameter name -> (our parameter name, shard_id or None)."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in _FUSED:
        fused, shard_id = _FUSED[parts[-2]]
        return ".".join(parts[:-2] + [fused, parts[-1]]), shard_id
    return hf_name, None


def _default_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None) -> None:
    if shard_id is not None or loaded.shape != param.shape:
        raise ValueError(f"shape mismatch: checkpoint {tuple(loaded.shape)} vs param {tuple(param.shape)}")
    param.data.copy_(loaded)


def _checkpoint_files(model_dir: str) -> list[str]:
    """The safetensors files of the HF checkpoint: those its index names when there is one
    (some repos also ship other formats' files, e.g. Mistral's consolidated.safetensors),
    otherwise every *.safetensors in the directory."""
    index_path = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index_path):
        with open(index_path) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, n) for n in names]
    return sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))


def _expected_keys(model: CausalLM) -> set[tuple[str, int | None]]:
    """Every (parameter name, shard_id) the checkpoint must provide."""
    expected: set[tuple[str, int | None]] = set()
    modules = dict(model.named_modules())
    for name, _ in model.named_parameters():
        owner = modules[name.rsplit(".", 1)[0]]
        num_parts = len(getattr(owner, "output_sizes", [None]))
        if hasattr(owner, "expected_shards"):  # e.g. stacked MoE experts: one checkpoint tensor per expert
            expected.update((name, shard) for shard in owner.expected_shards(name.rsplit(".", 1)[1]))
        elif num_parts > 1:
            expected.update((name, i) for i in range(num_parts))
        else:
            expected.add((name, None))
    return expected


def _place_scale(module: ColumnParallelLinear | RowParallelLinear, scale: torch.Tensor, shard_id: int | None) -> None:
    """Keep this rank's rows (column-parallel) or groups (row-parallel) of a compressed-tensors scale
    [out_features, num_groups] as ``module.checkpoint_weight_scale`` for ``quantize_model``."""
    num_groups = scale.shape[1]
    if isinstance(module, RowParallelLinear):
        if num_groups > 1:  # groups run along in_features, which TP splits
            if num_groups % module.tp_size:
                raise ValueError(f"{num_groups} quantization groups per row cannot be split over {module.tp_size} "
                                 "TP ranks")
            local = num_groups // module.tp_size
            scale = scale.narrow(1, module.tp_rank * local, local)
        setattr(module, CHECKPOINT_SCALE, scale.contiguous())
        return
    held = getattr(module, CHECKPOINT_SCALE, None)
    if held is None:
        held = torch.zeros(module.weight.shape[0], num_groups, dtype=torch.float32)
        setattr(module, CHECKPOINT_SCALE, held)
    module.weight_loader(held, scale, shard_id)  # the same rows the weight got


def load_model(
    model_dir: str,
    dtype: torch.dtype,
    device: str | torch.device,
    tp_group: Any | None = None,
    layer_range: tuple[int, int] | None = None,
    has_embedding: bool = True,
    has_lm_head: bool = True,
    expert_parallel: bool = False,
) -> CausalLM:
    """Build the registry's model for ``model_dir`` and fill it from every *.safetensors file.

    ``tp_group``, ``layer_range``, ``has_embedding`` and ``has_lm_head`` pick this rank's share
    (see ``CausalLM``); tensors of other ranks' shares are skipped. ``expert_parallel``:
    a MoE model's experts are split whole across the TP ranks (``pdserve.engine.models.moe``); a
    model without experts ignores it (logged).

    Raises UnsupportedArchitecture (a ValueError) for an architecture pdserve has no model for,
    ValueError when the checkpoint has missing or unexpected weights, a quantization_config
    whose quant_method is neither compressed-tensors nor mxfp4 (or mxfp4 on a model other than
    gpt-oss), or malformed MXFP4 tensors, FileNotFoundError when there are no safetensors files.
    """
    config = AutoConfig.from_pretrained(model_dir)
    model_type = getattr(config, "model_type", None)
    cls = model_class(config, model_dir)
    readers = readers_for(model_dir, config, dtype)  # quantized formats (formats.py); raises for unsupported ones
    files = _checkpoint_files(model_dir)
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_dir}")

    model = cls(config, tp_group=tp_group, dtype=dtype, device=device, layer_range=layer_range,
                has_embedding=has_embedding, has_lm_head=has_lm_head, expert_parallel=expert_parallel)
    if torch.device(device).type == "cpu":  # before any weight is read: its pages are 2 MiB ones
        place_in_arenas(model)
    if expert_parallel and not any(hasattr(m, "expected_shards") for m in model.modules()):
        logger.warning("--enable-expert-parallel: %s has no routed experts; the flag changes nothing", model_type)
    params = dict(model.named_parameters())
    expected = _expected_keys(model)
    loaded: set[tuple[str, int | None]] = set()
    unexpected: list[str] = []

    split_fused = tuple(f".{m}." for m in getattr(model, "split_fused", ()))
    modules = dict(model.named_modules())

    family_names = getattr(model, "map_checkpoint_name", None)  # a family's own names (e.g. MoE experts)

    def mapped(hf_name: str) -> tuple[str, Any]:
        return (family_names(hf_name) if family_names is not None else None) or map_hf_name(hf_name)

    def load(hf_name: str, tensor: torch.Tensor, path: str) -> None:
        name, shard_id = mapped(hf_name)
        owner = modules.get(name.rsplit(".", 1)[0])
        sizes = getattr(owner, "output_sizes", [])
        if shard_id is None and len(sizes) > 1 and any(m in hf_name for m in split_fused):
            if tensor.shape[0] != sum(sizes):
                raise ValueError(f"cannot load {hf_name} from {path}: {tensor.shape[0]} rows, expected the "
                                 f"parts {sizes} fused ({sum(sizes)})")
            for part, piece in enumerate(tensor.split(sizes, dim=0)):  # e.g. q, k, v of a fused qkv_proj
                load_part(hf_name, name, part, piece, path)
            return
        load_part(hf_name, name, shard_id, tensor, path)

    def load_part(hf_name: str, name: str, shard_id: Any, tensor: torch.Tensor, path: str) -> None:
        param = params.get(name)
        owner = modules.get(name.rsplit(".", 1)[0])
        if param is not None and not getattr(owner, "holds_shard", lambda _: True)(shard_id):
            return  # another rank's expert (expert parallelism)
        if param is None or (name, shard_id) not in expected:
            unexpected.append(hf_name)
            return
        loader = getattr(param, "weight_loader", _default_loader)
        try:
            loader(param, tensor, shard_id)
        except ValueError as e:
            raise ValueError(f"cannot load {hf_name} from {path}: {e}") from e
        loaded.add((name, shard_id))

    def load_decoded(weight: Decoded) -> None:
        load(weight.hf_name, weight.tensor, weight.source)
        if weight.scale is None:
            return
        name, shard_id = mapped(weight.hf_name)  # a compressed-tensors scale, kept beside its linear
        module = modules.get(name.rsplit(".", 1)[0])
        if shard_id is None and len(getattr(module, "output_sizes", [])) > 1:
            raise ValueError(f"{weight.hf_name.removesuffix('.weight')} in {model_dir}: a compressed-tensors scale "
                             "for a fused checkpoint tensor is not supported")
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            _place_scale(module, weight.scale, shard_id)

    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for hf_name in f.keys():
                if hf_name.endswith(_IGNORED_SUFFIXES):
                    continue
                if hf_name.startswith("lm_head.") and model.tie_word_embeddings:
                    continue  # tied: the embedding matrix is the output projection
                if not model.holds(hf_name):
                    continue  # another pipeline stage's layer, or the driver's head
                tensor = f.get_tensor(hf_name)
                reader = next((r for r in readers if r.claims(hf_name, tensor)), None)
                if reader is None:
                    load(hf_name, tensor, path)
                    continue
                for weight in reader.take(hf_name, tensor, path):
                    load_decoded(weight)
    for reader in readers:
        for weight in reader.finish():
            load_decoded(weight)
        unexpected.extend(reader.leftovers())
        if (line := reader.summary(model)) is not None:
            logger.info("%s", line)
    missing = sorted(f"{n}" + ("" if s is None else f"[part {s}]") for n, s in expected - loaded)
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_dir} does not match the {model_type} model: "
            f"missing weights {missing[:10]}{' ...' if len(missing) > 10 else ''}; "
            f"unexpected weights {sorted(unexpected)[:10]}{' ...' if len(unexpected) > 10 else ''}"
        )
    logger.info("loaded %s (%d tensors from %d files) as %s on %s", model_dir, len(loaded), len(files), dtype, device)
    return model.eval()
