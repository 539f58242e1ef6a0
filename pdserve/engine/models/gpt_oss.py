"""gpt-oss: alternating sliding-window and full attention with learned sinks, and a biased MoE.

OpenAI, "gpt-oss-120b & gpt-oss-20b Model Card" (2025). Against Llama:

* attention projections carry biases; each query head has a learned sink logit
  (``self_attn.sinks``) that joins its softmax denominator with no value (Xiao et al., 2023),
  which the paged kernel and the reference path both take (``paged_attention(sinks=...)``);
* ``layer_types`` alternates windows of ``sliding_window`` with full attention (two KV cache groups:
  the sliding half frees what leaves its window, ``pdserve.common.kv_cache_groups``); RoPE is YaRN;
* the norm scales in float32 before casting back (``Float32ScaleRMSNorm``);
* the MoE's router is a biased linear; its top-k *logits* are softmaxed into the weights; each
  expert is a biased, clamped SwiGLU: gate clamped above at ``swiglu_limit``, up clamped to
  +-limit, out = (up + 1) * gate * sigmoid(alpha * gate), alpha 1.702.

Checkpoints as transformers writes them hold the experts fused: ``mlp.experts.gate_up_proj``
[E, H, 2I] with gate and up interleaved column by column, its bias [E, 2I], ``down_proj``
[E, I, H] and its bias [E, H]; they are de-interleaved and transposed into ``FusedExperts``'
layout at load. MXFP4-quantized checkpoints (the released weights: ``*_blocks`` /
``*_scales``) are dequantized by the loader (``pdserve.engine.layers.mxfp4``) into that same fused
layout first, so they reach ``GptOssExperts.weight_loader`` as float tensors.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pdserve.engine.layers.base import Float32ScaleRMSNorm, tp_rank_and_size
from pdserve.engine.models.decoder import DecoderAttention, DecoderLayer, DecoderForCausalLM
from pdserve.engine.models.moe import FusedExperts, _matmul

_FUSED = {"gate_up_proj": "w13_weight", "gate_up_proj_bias": "w13_bias", "down_proj": "w2_weight",
          "down_proj_bias": "w2_bias"}


def _map_name(hf_name: str):
    """``mlp.experts.<fused tensor>`` -> (our parameter, ("all", kind)); the router keeps its name."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] == "experts" and parts[-1] in _FUSED:
        return ".".join(parts[:-1] + [_FUSED[parts[-1]]]), ("all", parts[-1])
    if ".self_attn.sinks" in hf_name or ".mlp.router." in hf_name:
        return hf_name, None
    return None


class SinkedAttention(DecoderAttention):
    """``DecoderAttention`` with one learned sink logit per query head (``sinks`` [local heads])."""

    def __init__(self, config, layer_idx: int, tp_group: Any | None, dtype, device):
        super().__init__(config, layer_idx, tp_group, dtype, device)
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
        self.sinks = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32, device=device),
                                  requires_grad=False)
        self.sinks.weight_loader = self._load_sinks

    def _load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        n = self.num_heads
        if shard_id is not None or loaded.shape != (n * self.tp_size,):
            raise ValueError(f"sinks: expected one logit per head ({n * self.tp_size}), got {tuple(loaded.shape)}")
        param.data.copy_(loaded.narrow(0, self.tp_rank * n, n))


class GptOssExperts(FusedExperts):
    """``FusedExperts`` with biases and gpt-oss's clamped SwiGLU (see the module doc), loaded from
    the fused checkpoint tensors. Under TP (experts sliced), the down bias is added on rank 0
    only, so the all-reduce counts it once."""

    def __init__(self, config, tp_group: Any | None, dtype, device, expert_parallel: bool):
        super().__init__(config.num_local_experts, config.hidden_size, config.intermediate_size, tp_group, dtype,
                         device, expert_parallel)
        self.alpha, self.limit = 1.702, float(config.swiglu_limit)
        e, i = self.num_local_experts, self.local_intermediate
        self.w13_bias = nn.Parameter(torch.zeros(e, 2 * i, dtype=dtype, device=device), requires_grad=False)
        self.w2_bias = nn.Parameter(torch.zeros(e, config.hidden_size, dtype=dtype, device=device),
                                    requires_grad=False)
        self.w13_bias.weight_loader = self.weight_loader
        self.w2_bias.weight_loader = self.weight_loader
        self.add_down_bias = self.expert_parallel or self.tp_rank == 0

    def expected_shards(self, param_name: str) -> list:
        kind = {v: k for k, v in _FUSED.items()}[param_name]
        return [("all", kind)]

    def holds_shard(self, shard_id) -> bool:
        return True  # one fused tensor holds every expert: each rank takes its own from it

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id) -> None:
        """This rank's experts and slice from a fused tensor: gate/up de-interleaved, weights transposed
        to [out, in]."""
        kind = shard_id[1]
        experts = loaded[self.expert_start:self.expert_start + self.num_local_experts]
        if experts.shape[0] != self.num_local_experts:
            raise ValueError(f"{kind}: {loaded.shape[0]} experts in the checkpoint, the config has {self.num_experts}")
        i = self.local_intermediate
        r = 0 if self.expert_parallel else self.tp_rank
        if kind in ("gate_up_proj", "gate_up_proj_bias"):
            full = experts if kind.endswith("bias") else experts.transpose(1, 2)  # (E, 2I[, H])
            gate, up = full[:, 0::2], full[:, 1::2]  # (E, I[, H]) each
            param.data.copy_(torch.cat([gate.narrow(1, r * i, i), up.narrow(1, r * i, i)], dim=1))
        elif kind == "down_proj":  # (E, I, H) -> (E, H, I), this rank's I columns
            param.data.copy_(experts.transpose(1, 2).narrow(2, r * i, i))
        else:  # down_proj_bias (E, H)
            param.data.copy_(experts)

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        i = self.local_intermediate
        gate_up = _matmul(x, self.w13_weight[expert], self.batch_invariant) + self.w13_bias[expert]
        gate = gate_up[:, :i].clamp(max=self.limit)
        up = gate_up[:, i:].clamp(min=-self.limit, max=self.limit)
        out = _matmul((up + 1) * (gate * torch.sigmoid(gate * self.alpha)), self.w2_weight[expert],
                      self.batch_invariant)
        return out + self.w2_bias[expert] if self.add_down_bias else out


class GptOssRouter(nn.Module):
    """x [N, H] -> (weights [N, k], ids [N, k]): a biased linear, its top-k logits softmaxed."""

    batch_invariant: bool = False

    def __init__(self, config, dtype, device):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.weight = nn.Parameter(torch.empty(config.num_local_experts, config.hidden_size, dtype=dtype,
                                               device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(config.num_local_experts, dtype=dtype, device=device),
                                 requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = _matmul(x, self.weight, self.batch_invariant) + self.bias  # (N, E)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids


class GptOssMoE(nn.Module):
    """Router and experts: [N, H] -> [N, H]."""

    def __init__(self, config, tp_group: Any | None, dtype, device, expert_parallel: bool):
        super().__init__()
        self.router = GptOssRouter(config, dtype, device)
        self.experts = GptOssExperts(config, tp_group, dtype, device, expert_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.router(x)
        return self.experts(x, ids, weights)


class GptOssDecoderLayer(DecoderLayer):
    """The decoder's pre-norm block with sinked attention, float32-scaled norms and the biased MoE."""

    attention_cls = SinkedAttention
    norm_cls = Float32ScaleRMSNorm

    def make_mlp(self, config, layer_idx: int, tp_group: Any | None, dtype, device) -> nn.Module:
        return GptOssMoE(config, tp_group, dtype, device, self.expert_parallel)


class GptOssForCausalLM(DecoderForCausalLM):
    """gpt-oss causal LM over the paged cache (see ``DecoderForCausalLM`` for sharding)."""

    decoder_layer_cls = GptOssDecoderLayer
    final_norm_cls = Float32ScaleRMSNorm
    map_checkpoint_name = staticmethod(_map_name)

