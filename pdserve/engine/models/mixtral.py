"""Mixtral: Mistral's attention with a sparse MoE feed-forward in every layer.

Jiang et al., "Mixtral of Experts" (2024). Each layer routes every token to the top
``num_experts_per_tok`` of ``num_local_experts`` SwiGLU experts (float32 softmax, the
chosen probabilities renormalized, the experts' outputs scaled in float32). Checkpoint
names: ``block_sparse_moe.gate.weight`` (router) and
``block_sparse_moe.experts.E.w{1,3,2}.weight`` (gate, up, down), which we hold under
``mlp`` (``pdserve.engine.models.moe.map_expert_name``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pdserve.engine.models.decoder import DecoderLayer, DecoderForCausalLM
from pdserve.engine.models.moe import SparseMoeBlock, map_expert_name


class MixtralDecoderLayer(DecoderLayer):
    """The decoder's pre-norm block with a ``SparseMoeBlock`` (Mixtral's routing) as its feed-forward."""

    def make_mlp(self, config, layer_idx: int, tp_group: Any | None, dtype, device) -> nn.Module:
        return SparseMoeBlock(config.hidden_size, config.intermediate_size, config.num_local_experts,
                              config.num_experts_per_tok, True, tp_group, dtype, device, weights_dtype_of_x=False,
                              expert_parallel=self.expert_parallel)


class MixtralForCausalLM(DecoderForCausalLM):
    """Mixtral causal LM over the paged cache (see ``DecoderForCausalLM`` for sharding)."""

    decoder_layer_cls = MixtralDecoderLayer
    map_checkpoint_name = staticmethod(map_expert_name)
