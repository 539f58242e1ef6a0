"""Qwen3-MoE: Qwen3's attention (per-head q/k norms) with sparse MoE feed-forward layers.

Qwen team, "Qwen3 Technical Report" (2025). Layer i is sparse (``SparseMoeBlock``: softmax
top-``num_experts_per_tok`` over ``num_experts`` experts of ``moe_intermediate_size``,
renormalized when ``norm_topk_prob``) unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``, in which case it is a dense SwiGLU MLP of
``intermediate_size``. Checkpoint names: ``mlp.gate.weight`` (router) and
``mlp.experts.E.{gate,up,down}_proj.weight`` (``pdserve.engine.models.moe.map_expert_name``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pdserve.engine.models.decoder import DecoderForCausalLM, GatedMLP
from pdserve.engine.models.moe import SparseMoeBlock, map_expert_name
from pdserve.engine.models.qwen3 import Qwen3DecoderLayer


def is_sparse_layer(config, layer_idx: int) -> bool:
    """Whether Qwen3-MoE's layer ``layer_idx`` routes to experts (HF's rule)."""
    return (layer_idx not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_idx + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """Qwen3's block whose feed-forward is a ``SparseMoeBlock`` on sparse layers (``is_sparse_layer``)."""

    def make_mlp(self, config, layer_idx: int, tp_group: Any | None, dtype, device) -> nn.Module:
        if not is_sparse_layer(config, layer_idx):
            return GatedMLP(config, tp_group, dtype, device)
        return SparseMoeBlock(config.hidden_size, config.moe_intermediate_size, config.num_experts,
                              config.num_experts_per_tok, bool(config.norm_topk_prob), tp_group, dtype, device,
                              weights_dtype_of_x=True, expert_parallel=self.expert_parallel)


class Qwen3MoeForCausalLM(DecoderForCausalLM):
    """Qwen3-MoE causal LM over the paged cache (see ``DecoderForCausalLM`` for sharding)."""

    decoder_layer_cls = Qwen3MoeDecoderLayer
    map_checkpoint_name = staticmethod(map_expert_name)
