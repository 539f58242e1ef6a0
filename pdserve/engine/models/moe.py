"""Sparse mixture-of-experts feed-forward: a router picks ``top_k`` experts per token.

Shazeer et al., "Outrageously Large Neural Networks: The Sparsely-Gated Mixture-of-Experts
Layer" (2017); the softmax top-k router and SwiGLU experts of Mixtral (Jiang et al., 2024)
and Qwen3-MoE. ``SparseMoeBlock``: hidden [N, hidden_size] -> [N, hidden_size].

The experts' weights are stacked: ``w13_weight`` [E, 2 * I, hidden] (each expert's gate rows,
then its up rows) and ``w2_weight`` [E, hidden, I]. A forward sorts the N * top_k (token,
expert) pairs by expert, runs one SwiGLU GEMM pair per expert that got tokens over that
expert's contiguous run of rows, scales each row by its routing weight, and adds the rows
back into their tokens (``index_add_``): no per-token loop and no dense all-experts compute
(vLLM's fused_moe and SGLang's grouped GEMM work the same way on GPUs, in one kernel).

Tensor parallelism splits every expert's intermediate size I across the ranks, as the dense
MLP does (gate/up rows, down columns), and all-reduces the output; the router is replicated.
Expert parallelism (``--enable-expert-parallel``, vLLM's flag) instead gives each of the TP
group's ranks ``E / tp`` whole experts: every rank routes all tokens (attention leaves the
hidden states replicated on the TP ranks), computes the pairs of its own experts, and the same
all-reduce adds the ranks' partial outputs. On gloo that all-reduce is the dispatch and combine
in one collective (the all-to-all of GPU EP kernels moves fewer bytes but needs token
counts exchanged first); it moves the same [N, hidden] as TP's.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pdserve.kernels import ops
from pdserve.engine.layers.base import _divide, batch_invariant_linear, linear, tp_rank_and_size
from pdserve.kernels.op_handles import OpHandles

GATE, UP, DOWN = 0, 1, 2  # an expert tensor's part: the shard_id's second item

# HF checkpoint names of one expert's tensors (Qwen3-MoE / DeepSeek: mlp.experts.E.{gate,up,down}_proj;
# Mixtral: block_sparse_moe.experts.E.{w1,w3,w2}) and of the router.
_EXPERT_NAME = re.compile(r"^(.*)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w3|w2)"
                          r"\.weight$")
_ROUTER_NAME = re.compile(r"^(.*)\.block_sparse_moe\.gate\.weight$")
_PARTS = {"gate_proj": GATE, "w1": GATE, "up_proj": UP, "w3": UP, "down_proj": DOWN, "w2": DOWN}


def map_expert_name(hf_name: str) -> tuple[str, tuple[int, int] | None] | None:
    """An expert or router tensor's HF name -> (our parameter name, shard_id); None for any other
    name. shard_id is (expert, GATE | UP | DOWN) for expert weights, None for the router."""
    if m := _EXPERT_NAME.match(hf_name):
        prefix, expert, part = m.group(1), int(m.group(2)), _PARTS[m.group(3)]
        param = "w2_weight" if part == DOWN else "w13_weight"
        return f"{prefix}.mlp.experts.{param}", (expert, part)
    if m := _ROUTER_NAME.match(hf_name):
        return f"{m.group(1)}.mlp.gate.weight", None
    return None


def _matmul(x: torch.Tensor, weight: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
    """x [M, in] @ weight [out, in]^T; batch-invariant (a row's bits independent of M) when asked."""
    return batch_invariant_linear(x, weight) if batch_invariant else linear(x, weight)


class FusedExperts(nn.Module):
    """E SwiGLU experts, stacked; this TP rank holds I / tp of each expert's intermediate features.

    forward(x [N, H], topk_ids [N, k] int64, topk_weights [N, k]) -> [N, H] (all-reduced over TP):
    sum over j of topk_weights[n, j] * expert_{topk_ids[n, j]}(x[n]).

    ``batch_invariant`` (``DecoderForCausalLM.set_batch_invariant``): each expert's GEMMs go
    through ``batch_invariant_linear``, so a token's output does not depend on how many other
    tokens chose its experts; the scatter-add sums a token's experts in expert order either way.
    """

    batch_invariant: bool = False

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp_group: Any | None,
                 dtype: torch.dtype, device, expert_parallel: bool = False):
        super().__init__()
        self.num_experts = num_experts
        self.tp_group = tp_group
        self.tp_rank, self.tp_size = tp_rank_and_size(tp_group)
        self.intermediate_size = intermediate_size
        self.expert_parallel = expert_parallel and self.tp_size > 1
        if self.expert_parallel:  # whole experts [expert_start, expert_start + num_local_experts) on this rank
            self.num_local_experts = _divide(num_experts, self.tp_size, "num_experts (expert parallel)")
            self.expert_start = self.tp_rank * self.num_local_experts
            self.local_intermediate = intermediate_size
        else:  # every expert, I / tp of its intermediate features
            self.num_local_experts, self.expert_start = num_experts, 0
            self.local_intermediate = _divide(intermediate_size, self.tp_size, "moe intermediate size")
        e, i = self.num_local_experts, self.local_intermediate
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, hidden_size, dtype=dtype, device=device),
                                       requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, hidden_size, i, dtype=dtype, device=device),
                                      requires_grad=False)
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        self.op_key = _EXPERT_MODULES.register(self)  # how the opaque operator finds this module (moe_experts)

    def expected_shards(self, param_name: str) -> list[tuple[int, int]]:
        """The checkpoint tensors ``param_name`` (``w13_weight`` / ``w2_weight``) is filled from."""
        parts = (DOWN,) if param_name == "w2_weight" else (GATE, UP)
        experts = range(self.expert_start, self.expert_start + self.num_local_experts)
        return [(e, p) for e in experts for p in parts]

    def holds_shard(self, shard_id: tuple[int, int] | None) -> bool:
        """Whether checkpoint tensor ``shard_id`` (expert, part) belongs on this rank (False: another
        rank's expert under expert parallelism)."""
        return not isinstance(shard_id, tuple) or \
            self.expert_start <= shard_id[0] < self.expert_start + self.num_local_experts

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int] | None) -> None:
        """Copy this rank's slice of one expert's HF tensor: gate/up [I, H] rows, down [H, I] columns."""
        if not isinstance(shard_id, tuple):
            raise ValueError("an expert weight needs its (expert, part) shard_id")
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} out of range (the config has {self.num_experts})")
        if not self.holds_shard(shard_id):
            raise ValueError(f"expert {expert} lives on another expert-parallel rank")
        i, r = self.local_intermediate, 0 if self.expert_parallel else self.tp_rank
        local = expert - self.expert_start
        if part == DOWN:
            if loaded.shape != (param.shape[1], self.intermediate_size):
                raise ValueError(f"down_proj of expert {expert} is {tuple(loaded.shape)}, expected "
                                 f"{(param.shape[1], self.intermediate_size)}")
            param.data[local].copy_(loaded.narrow(1, r * i, i))
            return
        if loaded.shape != (self.intermediate_size, param.shape[2]):
            raise ValueError(f"{'gate' if part == GATE else 'up'}_proj of expert {expert} is {tuple(loaded.shape)}, "
                             f"expected {(self.intermediate_size, param.shape[2])}")
        param.data[local].narrow(0, part * i, i).copy_(loaded.narrow(0, r * i, i))

    def expert_forward(self, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``expert`` on its rows x [M, H] -> [M, H] (this rank's share under TP)."""
        i = self.local_intermediate
        gate_up = _matmul(x, self.w13_weight[expert], self.batch_invariant)  # (M, 2I)
        return _matmul(F.silu(gate_up[:, :i]) * gate_up[:, i:], self.w2_weight[expert], self.batch_invariant)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        y = torch.ops.pdserve.moe_experts(x, topk_ids, topk_weights, self.op_key)
        if self.tp_size > 1:
            dist.all_reduce(y, group=self.tp_group)
        return y

    def grouped_forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """This rank's share of ``forward`` (no all-reduce): the pairs grouped by expert, one GEMM pair
        per expert with tokens. The group sizes come to the host, so it runs inside the opaque
        operator ``pdserve::moe_experts``."""
        n, k = topk_ids.shape
        flat = topk_ids.reshape(-1)  # (N*k,) pair p = token p // k, its (p % k)-th choice
        if self.expert_parallel:  # this rank's experts as 0..E_local-1; every other expert as E_local (dropped)
            flat = flat - self.expert_start
            flat = torch.where((flat >= 0) & (flat < self.num_local_experts), flat, self.num_local_experts)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending in each group
        counts = torch.bincount(flat, minlength=self.num_local_experts + 1).tolist()  # host: the group sizes
        order = order[:sum(counts[:self.num_local_experts])]  # this rank's pairs (all of them without EP)
        token_of = order // k  # the token of each grouped pair
        xs = x.index_select(0, token_of)  # (N*k, H), one contiguous run of rows per expert
        out = torch.empty_like(xs)
        start = 0
        for expert, count in enumerate(counts[:self.num_local_experts]):
            if count == 0:
                continue
            rows = slice(start, start + count)
            out[rows] = self.expert_forward(expert, xs[rows])
            start += count
        scaled = out * topk_weights.reshape(-1, 1).index_select(0, order)  # each row by its routing weight
        y = torch.zeros_like(x)
        y.index_add_(0, token_of, scaled.to(x.dtype))
        return y


# The grouped experts as one opaque operator, as the decode attention is: the compiled decode step
# (torch.compile) calls it as one node. Traced, its host-side group sizes (``bincount(...).tolist()``,
# a shape that depends on data) broke the graph at every MoE layer, and the step fell back to eager
# layer by layer after dynamo's recompile limit. The operator takes the module's ``op_key`` (an int),
# not its weights: the weights are the module's, read inside, never graph inputs.
_EXPERT_MODULES: "OpHandles[FusedExperts]" = OpHandles()


def moe_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, op_key: int) -> torch.Tensor:
    """``torch.ops.pdserve.moe_experts``: ``FusedExperts.grouped_forward`` of the module ``op_key`` names:
    x [N, H], topk_ids [N, k] int64, topk_weights [N, k] -> [N, H] (this rank's experts' sum)."""
    return _EXPERT_MODULES[op_key].grouped_forward(x, topk_ids, topk_weights)


ops.implement("moe_experts", moe_experts, ("CPU", "CUDA"))


@torch.library.register_fake("pdserve::moe_experts")
def _(x, topk_ids, topk_weights, op_key):
    return torch.empty_like(x)


class MoeRouter(nn.Module):
    """The router's linear ``weight`` [E, H], replicated on every rank (HF's ``mlp.gate``):
    x [N, H] -> logits [N, E]."""

    batch_invariant: bool = False

    def __init__(self, num_experts: int, hidden_size: int, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _matmul(x, self.weight, self.batch_invariant)


class SparseMoeBlock(nn.Module):
    """Softmax top-k routing over SwiGLU experts: hidden [N, H] -> [N, H].

    Router probabilities are a float32 softmax of the router logits; the ``top_k`` largest are
    renormalized to sum to one when ``norm_topk_prob`` (Mixtral always; Qwen3-MoE per config).
    ``expert_parallel``: the experts split whole across the TP ranks (see the module doc).
    ``weights_dtype_of_x``: cast the routing weights to the activations' dtype before scaling
    (Qwen3-MoE) rather than scaling in float32 (Mixtral); the same in a float32 model.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 tp_group: Any | None, dtype, device, weights_dtype_of_x: bool = True, expert_parallel: bool = False):
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
        self.top_k, self.norm_topk_prob, self.weights_dtype_of_x = top_k, norm_topk_prob, weights_dtype_of_x
        self.gate = MoeRouter(num_experts, hidden_size, dtype, device)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, tp_group, dtype, device,
                                    expert_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)  # (N, E)
        probs = torch.softmax(logits.float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)  # (N, k) each
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if self.weights_dtype_of_x:
            weights = weights.to(x.dtype)
        return self.experts(x, ids, weights)
