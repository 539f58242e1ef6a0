"""The pre-norm decoder-only transformer over a paged KV cache: the parts most families are made of.

RMSNorm before attention and MLP, rotary embeddings (any transformers rope type, partial rotary
dims), grouped-query attention (Ainslie et al., 2023) with optional q/k/v biases and sliding windows,
a gated MLP (SwiGLU), tensor- and pipeline-parallel sharding, packed weights, and an LM head computed
in slices; the shape Touvron et al.'s LLaMA (2023) made common. No family lives here: Llama, Mistral
and Qwen2 take these parts as they are (``llama.py``), the others swap some (``qwen3.py``,
``gemma3.py``, ``deepseek_v3.py``, ...); the engine sees any of them only through
``interface.CausalLM``. Parameter names mirror
the Hugging Face checkpoints except that q/k/v are fused into ``qkv_proj`` and gate/up
into ``gate_up_proj`` (see loader.py for the mapping).

The batch is flattened: one forward takes ``num_tokens`` tokens from any number of
sequences, described by an ``AttentionMetadata``.

Other families subclass these modules and swap a part through class attributes:
``DecoderForCausalLM.decoder_layer_cls``, ``DecoderLayer.attention_cls`` / ``mlp_cls``,
and ``DecoderAttention.normalize_qk`` (per-head q/k norms). Every decoder layer keeps the
call ``layer(positions, hidden, kv_cache_layer, attn_metadata, layer=None)``, which the
compiled decode step (``CompiledDecodeStep._forward``) relies on.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from pdserve.engine.layers import decode_linear
from pdserve.engine.layers.attention import AttentionMetadata, paged_attention
from pdserve.common.sharding import kv_head_layout
from pdserve.engine.layers.base import (
    ColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
    SiluAndMul,
    packed_linear,
    pad_rows,
    tp_rank_and_size,
)
from pdserve.engine.layers.rotary import RotaryEmbedding

LOGITS_CHUNK = 1024  # vocabulary rows per LM-head slice on CPU (see compute_logits)


def rope_settings(config) -> tuple[float, dict | None]:
    """(rope_theta, scaling dict or None) from a config of either transformers generation.

    transformers < 5 keeps ``rope_theta`` and ``rope_scaling`` as separate fields; 5.x puts
    both into ``rope_parameters`` (with ``rope_scaling`` as an alias)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = getattr(config, "rope_theta", None) or params.get("rope_theta") or 10000.0
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type == "longrope" and getattr(config, "original_max_position_embeddings", None) is not None:
        # Phi-3 keeps the pretraining length as a config field, which transformers prefers to the dict's
        params = {**params, "original_max_position_embeddings": config.original_max_position_embeddings}
    return float(theta), (params if rope_type not in (None, "default") else None)


def rotary_dim(config, head_dim: int) -> int:
    """How many features of each head rotate: ``partial_rotary_factor`` (a config field, or in
    transformers 5's ``rope_parameters``) times head_dim; all of them by default."""
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    return head_dim if factor is None else int(head_dim * float(factor))


def sliding_window_of(config, layer_idx: int) -> int | None:
    """The attention window of layer ``layer_idx``, or None for full attention."""
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else None
    if config.model_type == "qwen2":
        use = getattr(config, "use_sliding_window", False)
        return window if use and layer_idx >= getattr(config, "max_window_layers", 0) else None
    return window


class DecoderAttention(nn.Module):
    """Grouped-query self-attention over the paged cache.

    hidden [num_tokens, hidden_size] -> [num_tokens, hidden_size]. Heads are split across
    TP ranks: this rank holds num_heads / tp query heads and max(1, num_kv_heads / tp) KV
    heads (``kv_head_layout``).

    What it caches per token (read by the KV cache, the admission checks and the transfer):
    ``kv_slots`` = 2 rows per KV head, K and V, each ``head_dim`` wide (``kv_v_dim = head_dim``).
    """

    def __init__(self, config, layer_idx: int, tp_group: Any | None, dtype, device):
        super().__init__()
        _, tp_size = tp_rank_and_size(tp_group)
        hidden = config.hidden_size
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        self.head_dim = getattr(config, "head_dim", None) or hidden // total_heads
        self.kv_slots, self.kv_v_dim = 2, self.head_dim  # per-head K and V rows
        if total_heads % tp_size:
            raise ValueError(f"num_attention_heads={total_heads} must be divisible by the TP size {tp_size}")
        self.num_heads = total_heads // tp_size
        self.num_kv_heads, _ = kv_head_layout(total_kv_heads, tp_size)
        self.total_kv_heads = total_kv_heads  # KV heads of the cache over all TP ranks (the transfer's layout)
        kv_shards = min(total_kv_heads, tp_size)
        self.scale = self.head_dim**-0.5
        self.sliding_window = sliding_window_of(config, layer_idx)

        qkv_bias = config.model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = config.model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        q_size, kv_size = total_heads * self.head_dim, total_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            hidden, [q_size, kv_size, kv_size], bias=qkv_bias, tp_group=tp_group, dtype=dtype, device=device,
            num_shards=[tp_size, kv_shards, kv_shards],
        )
        self.o_proj = RowParallelLinear(q_size, hidden, bias=o_bias, tp_group=tp_group, dtype=dtype, device=device)
        theta, scaling = rope_settings(config)
        self.rotary_emb = RotaryEmbedding(self.head_dim, theta, scaling, device=device,
                                          rotary_dim=rotary_dim(config, self.head_dim),
                                          max_position_embeddings=getattr(config, "max_position_embeddings", None))

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        layer: int | None = None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """kv_cache_layer: this layer's cache, or the whole cache with ``layer`` its index (see
        ``paged_attention``). ``out_rows`` [n] int64: only these rows' outputs are wanted ([n, hidden]
        returned; every row's K/V is still cached), or None for all."""
        q_local = self.num_heads * self.head_dim
        kv_local = self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden).split([q_local, kv_local, kv_local], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)  # (N, H, D)
        k = k.view(-1, self.num_kv_heads, self.head_dim)  # (N, H_kv, D)
        v = v.view(-1, self.num_kv_heads, self.head_dim)  # (N, H_kv, D)
        q, k = self.normalize_qk(q, k)
        q, k = self.rotary_emb(positions, q, k, attn_metadata)  # metadata: read by length-dependent RoPE only
        out = paged_attention(q, k, v, kv_cache_layer, attn_metadata, self.scale, self.sliding_window, layer,
                              getattr(self, "sinks", None))  # per-head attention-sink logits (gpt-oss's)
        return self.o_proj(select_rows(out, out_rows).reshape(-1, q_local))  # (n, H*D) -> (n, hidden)

    def normalize_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Norms on q (N, H, D) and k (N, H_kv, D) before rotary embedding: none in Llama."""
        return q, k


class GatedMLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x)); [N, hidden] -> [N, hidden].
    ``intermediate_size`` defaults to the config's (a MoE model's shared experts pass theirs)."""

    def __init__(self, config, tp_group: Any | None, dtype, device, intermediate_size: int | None = None):
        super().__init__()
        hidden, inter = config.hidden_size, intermediate_size or config.intermediate_size
        bias = bool(getattr(config, "mlp_bias", False))
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r} (only silu)")
        self.gate_up_proj = ColumnParallelLinear(
            hidden, [inter, inter], bias=bias, tp_group=tp_group, dtype=dtype, device=device
        )
        self.act_fn = SiluAndMul()
        self.down_proj = RowParallelLinear(inter, hidden, bias=bias, tp_group=tp_group, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    """Pre-norm block: h = x + attn(norm(x)); out = h + mlp(norm(h))."""

    attention_cls: type[DecoderAttention] = DecoderAttention
    mlp_cls: type[nn.Module] = GatedMLP
    norm_cls: type[RMSNorm] = RMSNorm  # the block's norms (Gemma: (1 + w); OLMo 2, gpt-oss: float32 scaling)

    def __init__(self, config, layer_idx: int, tp_group: Any | None, dtype, device, expert_parallel: bool = False):
        super().__init__()
        eps = config.rms_norm_eps
        self.expert_parallel = expert_parallel  # read by a MoE family's make_mlp
        self.self_attn = self.attention_cls(config, layer_idx, tp_group, dtype, device)
        self.mlp = self.make_mlp(config, layer_idx, tp_group, dtype, device)
        self.input_layernorm = self.norm_cls(config.hidden_size, eps, dtype=dtype, device=device)
        self.post_attention_layernorm = self.norm_cls(config.hidden_size, eps, dtype=dtype, device=device)

    def make_mlp(self, config, layer_idx: int, tp_group: Any | None, dtype, device) -> nn.Module:
        """Layer ``layer_idx``'s feed-forward: ``mlp_cls`` (a MoE family picks per layer)."""
        return self.mlp_cls(config, tp_group, dtype, device)

    def forward(self, positions, hidden, kv_cache_layer, attn_metadata, layer: int | None = None,
                out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [N, hidden_size] -> [N, hidden_size], or [n, hidden_size] for ``out_rows`` [n] (the rows
        whose output is wanted: every row's K/V is cached, only those rows go on past attention)."""
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache_layer, attn_metadata, layer,
                              out_rows)
        hidden = select_rows(hidden, out_rows) + attn
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


def select_rows(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """x [N, ...] -> x[rows] [n, ...] for ``rows`` [n] int64, or x itself for None."""
    return x if rows is None else x.index_select(0, rows)


class AbsentModule(nn.Module):
    """Stands in for a module this rank does not hold (another pipeline stage's layer, or
    the sampling head off the driver): no weights, and calling it is a bug."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("this module lives on another rank")


class DecoderModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.*`` submodule).

    Layers outside ``layer_range`` (other pipeline stages), and the embedding or final
    norm when this rank does not need them, are ``AbsentModule``s.
    """

    def __init__(self, config, tp_group: Any | None, dtype, device, layer_range: tuple[int, int],
                 has_embedding: bool, has_norm: bool, layer_cls: type[nn.Module] = DecoderLayer,
                 expert_parallel: bool = False, norm_cls: type[RMSNorm] = RMSNorm):
        super().__init__()
        if has_embedding:
            weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        else:
            self.embed_tokens = AbsentModule()
        start, end = layer_range
        self.layers = nn.ModuleList(
            layer_cls(config, i, tp_group, dtype, device, expert_parallel) if start <= i < end else AbsentModule()
            for i in range(config.num_hidden_layers)
        )
        self.norm = norm_cls(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device) \
            if has_norm else AbsentModule()


class DecoderForCausalLM(nn.Module):
    """A pre-norm decoder-only causal LM running over a paged KV cache: the base most families extend
    (a ``CausalLM``, ``pdserve.engine.models.interface``).

    One rank's share of the model: with tensor parallelism (``tp_group``) the decoder
    layers are sharded; with pipeline parallelism this rank holds only the layers in
    ``layer_range`` (default: all). The embedding and the sampling head (final norm +
    ``lm_head``) are replicated, not vocab-parallel: the embedding lives where the
    first stage runs, the head on the driver only (``has_lm_head``), which samples.

    Attributes num_layers (this rank's), kv_slots (2: K and V; 1: a latent), num_kv_heads (per TP
    rank; ``total_kv_heads`` over all ranks) and head_dim size the KV cache ``[num_layers, kv_slots,
    num_blocks, block_size, num_kv_heads, head_dim]``, whose value rows are kv_v_dim wide;
    ``layer_range`` says which global layers those are.

    ``expert_parallel``: a MoE family splits its routed experts whole across the TP ranks
    (``pdserve.engine.models.moe``) instead of slicing each one; others ignore it.

    ``batch_invariant`` (``set_batch_invariant``): every matmul, the LM head's included, gives
    each row the same bits whatever else is in the batch (see ``batch_invariant_linear``).
    """

    batch_invariant: bool = False
    decoder_layer_cls: type[nn.Module] = DecoderLayer
    final_norm_cls: type[RMSNorm] = RMSNorm  # the norm before the LM head

    def __init__(self, config, tp_group: Any | None = None, dtype: torch.dtype = torch.float32, device="cpu",
                 layer_range: tuple[int, int] | None = None, has_embedding: bool = True, has_lm_head: bool = True,
                 expert_parallel: bool = False):
        super().__init__()
        self.config = config
        self.tp_group = tp_group
        self.layer_range = layer_range or (0, config.num_hidden_layers)
        self.kv_cache_groups = None  # KVCacheGroups set by the runner when layers of several kinds share the cache
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        has_embedding = has_embedding or (has_lm_head and self.tie_word_embeddings)
        self.model = DecoderModel(config, tp_group, dtype, device, self.layer_range, has_embedding, has_lm_head,
                                self.decoder_layer_cls, expert_parallel, self.final_norm_cls)
        self.has_embedding, self.has_lm_head = has_embedding, has_lm_head
        if not has_lm_head:
            self.lm_head = AbsentModule()
        elif self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens  # shares .weight
        else:
            weight = torch.empty(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
            self.lm_head = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.requires_grad_(False)
        start, end = self.layer_range
        first_attn = self.model.layers[start].self_attn
        self.num_layers: int = end - start
        self.num_kv_heads: int = first_attn.num_kv_heads
        self.total_kv_heads: int = first_attn.total_kv_heads
        self.head_dim: int = first_attn.head_dim
        # What the cache holds per token and KV head: kv_slots rows (2: K and V; 1: an MLA latent) of
        # head_dim values, the value being the first kv_v_dim of them (= head_dim for K and V).
        self.kv_slots: int = first_attn.kv_slots
        self.kv_v_dim: int = first_attn.kv_v_dim
        self.vocab_size: int = config.vocab_size

    @property
    def decoder_layers(self) -> nn.ModuleList:
        """Every global decoder layer (this rank's hold weights; the others are placeholders)."""
        return self.model.layers

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 -> [num_tokens, hidden_size]: the token embedding (first pipeline stage)."""
        return self.model.embed_tokens(input_ids)

    def set_batch_invariant(self, enabled: bool = True) -> None:
        """Route every linear layer and the LM head through the batch-invariant matmul (or back).

        The other per-token ops (RMSNorm, RoPE, SiLU, residual adds, the embedding) already give
        a row the same bits at any batch size on CPU (checked in tests/test_batch_invariance.py);
        attention is made invariant by the metadata's ``batch_invariant`` (attention.py)."""
        self.batch_invariant = enabled
        for module in self.modules():
            if module is not self and hasattr(module, "batch_invariant"):  # linears, MoE experts and routers
                module.batch_invariant = enabled

    def holds(self, hf_name: str) -> bool:
        """Whether the checkpoint tensor ``hf_name`` has a place on this rank."""
        parts = hf_name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
            return self.layer_range[0] <= int(parts[2]) < self.layer_range[1]
        if hf_name.startswith("model.embed_tokens."):
            return self.has_embedding
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return self.has_lm_head
        return True

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: AttentionMetadata,
        on_layer_done: Callable[[int], None] | None = None,
        hidden: torch.Tensor | None = None,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this rank's layers.

        input_ids, positions: [num_tokens] int64 (input_ids are embedded when ``hidden`` is None,
        i.e. on the first pipeline stage); hidden: [num_tokens, hidden_size] from the previous stage.
        kv_cache: this rank's [num_layers, kv_slots, num_blocks, block_size, num_kv_heads, head_dim],
        updated in place (with KV cache groups, ``kv_cache_groups``, layer i is position
        ``layer_slots[i]`` and reads its group's tables: ``pdserve.common.kv_cache_groups``). Returns hidden states [num_tokens, hidden_size] after this rank's last
        layer (before the final norm, which ``compute_logits`` applies).

        ``on_layer_done(i)`` runs right after this rank's layer ``i`` (an index into ``kv_cache``)
        finishes. On CUDA the kernels may still be queued: the callback must order its reads
        after them (e.g. record an event on the current stream).

        ``out_rows`` [n] int64: the rows of the result the caller will use (the rows it samples), or None
        for all. The last layer then caches every row's K/V but runs the rest of the layer (output
        projection, residual, feed-forward) on those rows only, and [n, hidden_size] comes back in their
        order. In a prefill most rows only feed the cache: for the bench preset (12 layers) this skips
        ~7% of a prompt's FLOPs. Pass it only where no later pipeline stage needs the other rows."""
        if hidden is None:
            hidden = self.embed(input_ids)  # (N, hidden)
        start, end = self.layer_range
        groups = self.kv_cache_groups
        for i in range(end - start):
            rows = out_rows if i == end - start - 1 else None
            if groups is None:
                hidden = self.model.layers[start + i](positions, hidden, kv_cache[i], attn_metadata, out_rows=rows)
            else:  # its group's cache position and block tables
                hidden = self.model.layers[start + i](positions, hidden, kv_cache[groups.layer_slots[i]],
                                                      attn_metadata.for_group(groups.layer_groups[i]), out_rows=rows)
            if on_layer_done is not None:
                on_layer_done(i)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: [n, hidden_size] (the last layer's output) -> [n, vocab_size] float32.

        On CPU, with several rows, the vocabulary goes through in slices of ``LOGITS_CHUNK`` rows of
        the head: each slice of the weight stays in cache for every row of the batch. Same values
        bit for bit (each logit is the same dot product); measured 20 -> 15 ms at batch 32 on the
        bench preset (16k vocabulary, one AVX2 core, MKL).

        A config's ``final_logit_softcapping`` c (Gemma 2) maps each logit to c * tanh(logit / c).
        """
        logits = self._head(hidden_states)
        cap = getattr(self.config, "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _head(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``compute_logits`` before soft-capping."""
        x = self.model.norm(hidden_states)
        weight = self.lm_head.weight
        if self.batch_invariant:  # padded rows, always the same vocabulary slices
            padded = pad_rows(x)  # (n rounded up, hidden)
            parts = [F.linear(padded, weight[i:i + LOGITS_CHUNK]) for i in range(0, weight.shape[0], LOGITS_CHUNK)]
            return torch.cat(parts, dim=1)[: x.shape[0]].float()
        if (logits := packed_linear(self.lm_head, x)) is not None:  # weight_format.pack_lm_head
            return logits.float()
        if decode_linear.kernel_applies(x, weight):  # decode rows: the head streamed once (pdserve.engine.layers.decode_linear)
            return decode_linear.decode_linear_kernel(x, weight).float()
        if x.device.type == "cpu" and x.shape[0] >= 4 and weight.shape[0] > 2 * LOGITS_CHUNK:
            parts = [F.linear(x, weight[i:i + LOGITS_CHUNK]) for i in range(0, weight.shape[0], LOGITS_CHUNK)]
            return torch.cat(parts, dim=1).float()
        return F.linear(x, weight).float()
