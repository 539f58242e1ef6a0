"""OLMo 2: post-norm blocks and q/k RMSNorm over all heads at once.

Team OLMo, "2 OLMo 2 Furious" (AI2, 2024). Each block normalizes the *outputs* of attention
and of the MLP before the residual add (``post_attention_layernorm``,
``post_feedforward_layernorm``; no input norm), and normalizes the whole q projection
(``num_heads * head_dim`` features) and the whole k projection before RoPE. Under tensor
parallelism a rank holds only its heads' slice of q and k, so ``ShardedRMSNorm`` all-reduces
the sum of squares over the TP group (dividing out KV heads replicated on several ranks).
OLMo 2's norm scales in float32 and then casts (``(w * x).to(dtype)``), unlike Llama's.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pdserve.engine.layers.base import Float32ScaleRMSNorm, _divide, tp_rank_and_size
from pdserve.engine.models.decoder import DecoderAttention, DecoderLayer, DecoderForCausalLM, select_rows


Olmo2RMSNorm = Float32ScaleRMSNorm  # OLMo 2's norm multiplies by its weight in float32, then casts


class ShardedRMSNorm(nn.Module):
    """OLMo 2's RMSNorm over ``full_size`` features of which this TP rank holds a slice.

    x [N, local_size] -> [N, local_size]. The features are cut into ``num_shards`` pieces, rank
    r holding piece ``r * num_shards // tp`` (as ``ColumnParallelLinear`` cuts that projection),
    so each piece sits on ``tp / num_shards`` ranks; the all-reduced sum of squares is divided by
    that count. ``weight`` [local_size] is loaded from the full HF weight [full_size].
    """

    def __init__(self, full_size: int, eps: float, tp_group: Any | None, num_shards: int, dtype, device):
        super().__init__()
        self.eps, self.full_size, self.tp_group = eps, full_size, tp_group
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
        self.num_shards = num_shards
        self.local_size = _divide(full_size, num_shards, "q/k norm size")
        self.weight = nn.Parameter(torch.ones(self.local_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None or loaded.shape != (self.full_size,):
            raise ValueError(f"expected a norm weight of {self.full_size}, got {tuple(loaded.shape)}")
        piece = self.tp_rank * self.num_shards // self.tp_size
        param.data.copy_(loaded.narrow(0, piece * self.local_size, self.local_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        sum_sq = x32.pow(2).sum(-1, keepdim=True)  # (N, 1)
        if self.tp_size > 1:
            dist.all_reduce(sum_sq, group=self.tp_group)
            sum_sq = sum_sq / (self.tp_size // self.num_shards)  # pieces held by several ranks count once
        x32 = x32 * torch.rsqrt(sum_sq / self.full_size + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class Olmo2Attention(DecoderAttention):
    """``DecoderAttention`` with q_norm / k_norm over the whole q and k projections."""

    def __init__(self, config, layer_idx: int, tp_group: Any | None, dtype, device):
        super().__init__(config, layer_idx, tp_group, dtype, device)
        _, tp_size = tp_rank_and_size(tp_group)
        total_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        eps = config.rms_norm_eps
        self.q_norm = ShardedRMSNorm(config.num_attention_heads * self.head_dim, eps, tp_group, tp_size, dtype, device)
        self.k_norm = ShardedRMSNorm(total_kv_heads * self.head_dim, eps, tp_group, min(total_kv_heads, tp_size),
                                     dtype, device)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = q.shape[0]
        return self.q_norm(q.reshape(n, -1)).view_as(q), self.k_norm(k.reshape(n, -1)).view_as(k)


class Olmo2DecoderLayer(DecoderLayer):
    """Post-norm block: h = x + norm(attn(x)); out = h + norm(mlp(h))."""

    attention_cls = Olmo2Attention
    norm_cls = Olmo2RMSNorm

    def __init__(self, config, layer_idx: int, tp_group: Any | None, dtype, device, expert_parallel: bool = False):
        super().__init__(config, layer_idx, tp_group, dtype, device, expert_parallel)
        del self.input_layernorm  # post-norm: nothing before attention
        eps = config.rms_norm_eps
        self.post_feedforward_layernorm = Olmo2RMSNorm(config.hidden_size, eps, dtype=dtype, device=device)

    def forward(self, positions, hidden, kv_cache_layer, attn_metadata, layer: int | None = None,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        hidden = select_rows(hidden, out_rows) + self.post_attention_layernorm(
            self.self_attn(positions, hidden, kv_cache_layer, attn_metadata, layer, out_rows))
        return hidden + self.post_feedforward_layernorm(self.mlp(hidden))


class Olmo2ForCausalLM(DecoderForCausalLM):
    """OLMo 2 causal LM over the paged cache (see ``DecoderForCausalLM`` for sharding)."""

    decoder_layer_cls = Olmo2DecoderLayer
    final_norm_cls = Olmo2RMSNorm
