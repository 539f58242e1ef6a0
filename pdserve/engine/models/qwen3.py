"""Qwen3 (dense): the pre-norm decoder (decoder.py) with an RMSNorm on each query and key head before RoPE.

Qwen team, "Qwen3 Technical Report" (2025). The q/k norms (``self_attn.q_norm`` /
``self_attn.k_norm``, one weight of ``head_dim`` shared by every head) are per head, so
they need nothing from other tensor-parallel ranks. Biases follow ``attention_bias``
(none in the released models); windows follow ``layer_types``.
"""

from __future__ import annotations

from typing import Any

import torch

from pdserve.engine.layers.base import RMSNorm
from pdserve.engine.models.decoder import DecoderAttention, DecoderLayer, DecoderForCausalLM


class Qwen3Attention(DecoderAttention):
    """``DecoderAttention`` with q_norm / k_norm: RMSNorm over each head's ``head_dim`` features.

    q (N, H, D), k (N, H_kv, D) -> the same shapes, normalized per (token, head). ``qk_norm_cls``:
    the norm's kind (Gemma 3 subclasses this with its ``(1 + w)`` norm)."""

    qk_norm_cls: type[RMSNorm] = RMSNorm

    def __init__(self, config, layer_idx: int, tp_group: Any | None, dtype, device):
        super().__init__(config, layer_idx, tp_group, dtype, device)
        self.q_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)
        self.k_norm = self.qk_norm_cls(self.head_dim, config.rms_norm_eps, dtype=dtype, device=device)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q_norm(q), self.k_norm(k)


class Qwen3DecoderLayer(DecoderLayer):
    """The decoder's pre-norm block with ``Qwen3Attention``."""

    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(DecoderForCausalLM):
    """Qwen3 dense causal LM over the paged cache (see ``DecoderForCausalLM`` for sharding)."""

    decoder_layer_cls = Qwen3DecoderLayer
