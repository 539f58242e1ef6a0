"""Gemma 3 (text): interleaved sliding-window and global attention layers.

Gemma Team, "Gemma 3 Technical Report" (Google DeepMind, 2025). Against Llama:

* ``layer_types`` interleaves ``sliding_attention`` layers (a window of ``sliding_window``
  tokens, RoPE from ``rope_parameters["sliding_attention"]``, base 10k) with
  ``full_attention`` ones (``rope_parameters["full_attention"]``, base 1M, ``linear`` scaling
  in the long-context models);
* RMSNorm scales by ``(1 + w)`` in float32 before casting back; four norms per block
  (input, post-attention, pre-feed-forward, post-feed-forward), and per-head q/k norms;
* the embedding is multiplied by ``sqrt(hidden_size)`` (in the model's dtype); the softmax
  scale is ``query_pre_attn_scalar ** -0.5``; the MLP is GeGLU with tanh-approximated GELU;
* ``final_logit_softcapping`` (Gemma 2; None in Gemma 3), where set, is applied by
  ``DecoderForCausalLM.compute_logits``. Attention logit soft-capping (Gemma 2) is refused:
  the paged attention kernel does not cap scores.

Sliding and full layers fall into separate KV cache groups, each with its own block table per
request, so the sliding layers free the blocks that leave their window
(``pdserve.common.kv_cache_groups``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers.base import RMSNorm
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.decoder import DecoderLayer, DecoderForCausalLM, GatedMLP, select_rows
from pdserve.engine.models.qwen3 import Qwen3Attention


class GemmaRMSNorm(RMSNorm):
    """RMSNorm scaling by ``(1 + weight)`` in float32, then cast: x [..., D] -> [..., D]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GeluTanhAndMul(nn.Module):
    """GeGLU: [..., 2I] -> gelu_tanh(first half) * second half, [..., I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up


class Gemma3MLP(GatedMLP):
    """GeGLU feed-forward: down(gelu_tanh(gate(x)) * up(x)); [N, hidden] -> [N, hidden]."""

    def __init__(self, config, tp_group: Any | None, dtype, device):
        act = getattr(config, "hidden_activation", None) or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {act!r} for Gemma 3 (only gelu_pytorch_tanh)")
        super().__init__(config, tp_group, dtype, device)
        self.act_fn = GeluTanhAndMul()


def _layer_rope(config, layer_type: str) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) of a layer of ``layer_type``."""
    params = (getattr(config, "rope_parameters", None) or {}).get(layer_type) or {}
    theta = params.get("rope_theta")
    if theta is None:  # older configs: rope_theta (global) and rope_local_base_freq (sliding)
        theta = getattr(config, "rope_local_base_freq", 10000.0) if layer_type == "sliding_attention" \
            else getattr(config, "rope_theta", 1000000.0)
    rope_type = params.get("rope_type", params.get("type"))
    return float(theta), (params if rope_type not in (None, "default") else None)


class Gemma3Attention(Qwen3Attention):
    """``Qwen3Attention`` (per-head q/k norms) with Gemma's ``(1 + w)`` norms, scale and per-layer-type RoPE."""

    qk_norm_cls = GemmaRMSNorm

    def __init__(self, config, layer_idx: int, tp_group: Any | None, dtype, device):
        super().__init__(config, layer_idx, tp_group, dtype, device)
        if getattr(config, "attn_logit_softcapping", None):
            raise NotImplementedError("attention logit soft-capping (attn_logit_softcapping) is not supported: "
                                      "the paged attention kernel does not cap scores")
        self.scale = float(config.query_pre_attn_scalar) ** -0.5
        theta, scaling = _layer_rope(config, config.layer_types[layer_idx])
        self.rotary_emb = RotaryEmbedding(self.head_dim, theta, scaling, device=device,
                                          max_position_embeddings=getattr(config, "max_position_embeddings", None))


class Gemma3DecoderLayer(DecoderLayer):
    """Sandwich block: h = x + norm(attn(norm(x))); out = h + norm(mlp(norm(h)))."""

    attention_cls = Gemma3Attention
    mlp_cls = Gemma3MLP
    norm_cls = GemmaRMSNorm

    def __init__(self, config, layer_idx: int, tp_group: Any | None, dtype, device, expert_parallel: bool = False):
        super().__init__(config, layer_idx, tp_group, dtype, device, expert_parallel)
        eps, h = config.rms_norm_eps, config.hidden_size
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, device=device)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype=dtype, device=device)

    def forward(self, positions, hidden, kv_cache_layer, attn_metadata, layer: int | None = None,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache_layer, attn_metadata, layer,
                              out_rows)
        hidden = select_rows(hidden, out_rows) + self.post_attention_layernorm(attn)
        return hidden + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden)))


class ScaledEmbedding(nn.Embedding):
    """An embedding whose rows are multiplied by ``scale`` (cast to the weight's dtype, as HF does)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float, weight: torch.Tensor):
        super().__init__(num_embeddings, embedding_dim, _weight=weight)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


class Gemma3ForCausalLM(DecoderForCausalLM):
    """Gemma 3 text causal LM over the paged cache (see ``DecoderForCausalLM`` for sharding)."""

    decoder_layer_cls = Gemma3DecoderLayer
    final_norm_cls = GemmaRMSNorm

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if self.has_embedding:  # the same weight, read through sqrt(hidden_size)
            old = self.model.embed_tokens
            self.model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size,
                                                      config.hidden_size**0.5, old.weight)
            if self.lm_head is old:
                self.lm_head = self.model.embed_tokens
