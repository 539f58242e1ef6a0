"""DeepSeek-V3 (and models of its architecture, e.g. Kimi K2): MLA attention and a routed MoE
with shared experts.

Multi-head latent attention (DeepSeek-AI, "DeepSeek-V2", 2024): each token's keys and values
come from one latent ``c`` of ``kv_lora_rank`` values (``kv_a_proj_with_mqa`` then
``kv_a_layernorm``) plus one rotary key ``k_pe`` of ``qk_rope_head_dim`` shared by all heads;
``kv_b_proj`` [H * (nope + v), kv_lora_rank] expands c into each head's key (W_UK) and value
(W_UV). We run it in its absorbed form, as vLLM and SGLang do for decode: the query's
non-rotary part is folded into latent space (q_nope @ W_UK), so attention is multi-query
attention over one "KV head" per token whose key is [c, k_pe] and whose value is c, the key's
first ``kv_lora_rank`` values; each head's output latent is then expanded by W_UV. The paged
cache is a latent cache (``kv_slots = 1``, as vLLM's and SGLang's MLA): one row of
``kv_lora_rank + qk_rope_head_dim`` values per token and layer, for every head at once, and
attention reads the value from that same row (``kv_v_dim = kv_lora_rank``). The KV transfer ships
those rows like any cache with one KV head: replicated over TP ranks, each decode rank gets them once.

The MoE (DeepSeek-V3, 2024): sigmoid router scores; experts chosen by score plus
``e_score_correction_bias``, only within the ``topk_group`` of ``n_group`` expert groups whose
two best scores sum highest; weights are the chosen raw scores, renormalized when
``norm_topk_prob``, times ``routed_scaling_factor``; ``n_shared_experts`` dense experts (one
SwiGLU of ``moe_intermediate_size * n_shared_experts``) add to every token. The first
``first_k_dense_replace`` layers are dense.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.engine.layers.attention import AttentionMetadata, paged_attention
from pdserve.engine.layers.base import ColumnParallelLinear, RMSNorm, RowParallelLinear, _divide, tp_rank_and_size
from pdserve.engine.layers.rotary import RotaryEmbedding
from pdserve.engine.models.decoder import DecoderLayer, DecoderForCausalLM, GatedMLP, rope_settings, select_rows
from pdserve.engine.models.moe import FusedExperts, _matmul, map_expert_name


def _mscale(scale: float, m: float) -> float:
    import math

    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


class HeadShardedWeight(nn.Module):
    """``kv_b_proj``'s weight [H * (nope + v), kv_lora_rank], this TP rank's heads' rows; read as W_UK
    and W_UV, never called as a linear (so int8 quantization and LoRA leave it alone)."""

    def __init__(self, num_heads: int, rows_per_head: int, in_features: int, tp_group: Any | None, dtype, device):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
        self.local_rows = _divide(num_heads, self.tp_size, "num_attention_heads") * rows_per_head
        self.weight = nn.Parameter(torch.empty(self.local_rows, in_features, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is not None or loaded.shape[0] != self.local_rows * self.tp_size:
            raise ValueError(f"kv_b_proj: expected {self.local_rows * self.tp_size} rows, got {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.tp_rank * self.local_rows, self.local_rows))


class MLAttention(nn.Module):
    """Multi-head latent attention over the paged cache, absorbed (see the module doc).

    hidden [N, hidden_size] -> [N, hidden_size]. This TP rank holds num_heads / tp query heads;
    the latent projections and norms are replicated. The cache holds one row per token
    (``kv_slots = 1``, ``num_kv_heads = 1``) of ``head_dim = kv_lora_rank + qk_rope_head_dim``
    values: [c, k_pe], the key, whose first ``kv_v_dim = kv_lora_rank`` values are the value.
    """

    def __init__(self, config, layer_idx: int, tp_group: Any | None, dtype, device):
        super().__init__()
        _, tp_size = tp_rank_and_size(tp_group)
        hidden, heads = config.hidden_size, config.num_attention_heads
        self.nope, self.rope = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim, self.kv_lora_rank = config.v_head_dim, config.kv_lora_rank
        self.qk_head_dim = self.nope + self.rope
        self.num_heads = _divide(heads, tp_size, "num_attention_heads")
        self.num_kv_heads, self.total_kv_heads = 1, 1
        self.head_dim = self.kv_lora_rank + self.rope
        self.kv_slots, self.kv_v_dim = 1, self.kv_lora_rank  # one latent row: V is K's first kv_lora_rank values
        self.sliding_window = None
        bias = bool(getattr(config, "attention_bias", False))
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        if self.q_lora_rank:
            self.q_a_proj = ColumnParallelLinear(hidden, [self.q_lora_rank], bias=bias, tp_group=tp_group, dtype=dtype,
                                                 device=device, num_shards=[1])  # replicated
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps, dtype=dtype, device=device)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, [heads * self.qk_head_dim], tp_group=tp_group,
                                                 dtype=dtype, device=device)
        else:
            self.q_proj = ColumnParallelLinear(hidden, [heads * self.qk_head_dim], tp_group=tp_group, dtype=dtype,
                                               device=device)
        self.kv_a_proj_with_mqa = ColumnParallelLinear(hidden, [self.kv_lora_rank + self.rope], bias=bias,
                                                       tp_group=tp_group, dtype=dtype, device=device, num_shards=[1])
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps, dtype=dtype, device=device)
        self.kv_b_proj = HeadShardedWeight(heads, self.nope + self.v_head_dim, self.kv_lora_rank, tp_group, dtype,
                                           device)
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, hidden, bias=bias, tp_group=tp_group, dtype=dtype,
                                        device=device)
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(self.rope, theta, scaling, device=device,
                                          interleaved=bool(getattr(config, "rope_interleave", True)),
                                          max_position_embeddings=getattr(config, "max_position_embeddings", None))
        self.scale = self.qk_head_dim**-0.5
        if scaling and scaling.get("mscale_all_dim"):  # YaRN's softmax temperature, applied twice (q and k)
            self.scale *= _mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache_layer: torch.Tensor,
                attn_metadata: AttentionMetadata, layer: int | None = None,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """As ``DecoderAttention.forward``: [N, hidden] -> [N, hidden], or [n, hidden] for ``out_rows`` [n]."""
        n, h, c = hidden.shape[0], self.num_heads, self.kv_lora_rank
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden))) if self.q_lora_rank else self.q_proj(hidden)
        q_nope, q_pe = q.view(n, h, self.qk_head_dim).split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([c, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).view(n, 1, c)  # (N, 1, C)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.reshape(n, 1, self.rope), attn_metadata)
        w = self.kv_b_proj.weight.view(h, self.nope + self.v_head_dim, c)
        q_latent = torch.einsum("nhd,hdc->nhc", q_nope, w[:, :self.nope])  # (N, H, C): q_nope folded by W_UK
        query = torch.cat([q_latent, q_pe], dim=-1)  # (N, H, C + R)
        key = torch.cat([latent, k_pe], dim=-1)  # (N, 1, C + R)
        # (N, H, C): the value is the latent, the key row's first C values (the cache stores the key row only)
        out = paged_attention(query, key, latent, kv_cache_layer, attn_metadata, self.scale, None, layer)
        out = select_rows(out, out_rows)  # (n, H, C)
        o = torch.einsum("nhc,hvc->nhv", out, w[:, self.nope:])  # (n, H, V): expanded by W_UV
        return self.o_proj(o.reshape(out.shape[0], h * self.v_head_dim))


class GroupLimitedRouter(nn.Module):
    """DeepSeek-V3's router: x [N, H] -> (weights [N, k] float32, expert ids [N, k]) (see the module doc).

    ``weight`` [E, H] and ``e_score_correction_bias`` [E] are applied in float32."""

    batch_invariant: bool = False

    def __init__(self, config, dtype, device):
        super().__init__()
        self.num_experts, self.top_k = config.n_routed_experts, config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"n_routed_experts={self.num_experts} must split into n_group={self.n_group} groups, "
                             f"topk_group={self.topk_group} of them")
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(self.num_experts, dtype=torch.float32, device=device),
                                                    requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = _matmul(x.float(), self.weight.float(), self.batch_invariant).sigmoid()  # (N, E)
        choice = scores + self.e_score_correction_bias
        n = x.shape[0]
        groups = choice.view(n, self.n_group, -1)
        group_scores = groups.topk(min(2, groups.shape[-1]), dim=-1)[0].sum(dim=-1)  # (N, G)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(self.topk_group, dim=-1)[1], 1.0)
        choice = choice.masked_fill(~keep.bool().repeat_interleave(self.num_experts // self.n_group, dim=1),
                                    float("-inf"))
        ids = choice.topk(self.top_k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, ids


class DeepseekV3MoE(nn.Module):
    """Routed experts (``FusedExperts``, TP or EP) plus always-on shared experts: [N, H] -> [N, H]."""

    def __init__(self, config, tp_group: Any | None, dtype, device, expert_parallel: bool):
        super().__init__()
        self.gate = GroupLimitedRouter(config, dtype, device)
        self.experts = FusedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size,
                                    tp_group, dtype, device, expert_parallel)
        self.shared_experts = GatedMLP(config, tp_group, dtype, device,
                                       intermediate_size=config.moe_intermediate_size * config.n_shared_experts) \
            if config.n_shared_experts else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = self.experts(x, ids, weights)
        return y if self.shared_experts is None else y + self.shared_experts(x)


class DeepseekV3DecoderLayer(DecoderLayer):
    """The decoder's pre-norm block with MLA and, from ``first_k_dense_replace`` on, the MoE."""

    attention_cls = MLAttention

    def make_mlp(self, config, layer_idx: int, tp_group: Any | None, dtype, device) -> nn.Module:
        if layer_idx < config.first_k_dense_replace:
            return GatedMLP(config, tp_group, dtype, device)
        return DeepseekV3MoE(config, tp_group, dtype, device, self.expert_parallel)


def _map_name(hf_name: str):
    """Expert tensors as ``map_expert_name``; ``self_attn.q_proj`` (no q LoRA) keeps its name (it is not
    Llama's fused q/k/v)."""
    if ".self_attn.q_proj." in hf_name:
        return hf_name, None
    return map_expert_name(hf_name)


class DeepseekV3ForCausalLM(DecoderForCausalLM):
    """DeepSeek-V3 causal LM over the paged cache (see ``DecoderForCausalLM`` for sharding)."""

    decoder_layer_cls = DeepseekV3DecoderLayer
    map_checkpoint_name = staticmethod(_map_name)
