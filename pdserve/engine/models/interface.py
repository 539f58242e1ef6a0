"""The model interface: what the runner, the compiled decode step, the loader and LoRA use of a family.

A family is free in how it builds its layers (``decoder.py`` holds the parts most families are made of,
``llama.py`` takes them as they are, ``deepseek_v3.py`` swaps in MLA, the MoE families their experts);
what the engine may touch is
this protocol, checked for every registered family by ``tests/test_model_families.py``. The KV cache
it sizes from the attributes below is ``[num_layers, kv_slots, num_blocks, block_size, num_kv_heads,
head_dim]`` (one rank's share), whose value rows are ``kv_v_dim`` wide.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, runtime_checkable

import torch
from torch import nn

from pdserve.common.kv_cache_groups import KVCacheGroups
from pdserve.engine.layers.attention_metadata import AttentionMetadata


@runtime_checkable
class CausalLM(Protocol):
    """One rank's share of a causal LM over a paged KV cache (an ``nn.Module``).

    Attributes:
        config: the checkpoint's transformers config.
        layer_range: (start, end) global decoder layers this rank holds (pipeline parallelism).
        num_layers: end - start. num_kv_heads: KV heads per TP rank; total_kv_heads: over all ranks
            (MLA: 1, the latent). head_dim: a cache row's width; kv_slots: 2 (K and V) or 1 (a latent);
            kv_v_dim: the value's width within a row. vocab_size: the LM head's rows.
        tie_word_embeddings: the LM head is the embedding (the loader skips ``lm_head.*``).
        kv_cache_groups: set by the runner when layers of several kinds share the cache, else None.
        batch_invariant: every matmul gives a row the same bits whatever the batch (``set_batch_invariant``).
        decoder_layers: every global decoder layer's module, indexed by global layer (absent ones are
            placeholders); a layer is called ``(positions, hidden, kv_cache_layer, metadata, layer=i)``.
    """

    config: Any
    layer_range: tuple[int, int]
    num_layers: int
    num_kv_heads: int
    total_kv_heads: int
    head_dim: int
    kv_slots: int
    kv_v_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    kv_cache_groups: KVCacheGroups | None
    batch_invariant: bool

    @property
    def decoder_layers(self) -> nn.ModuleList: ...

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] int64 -> [num_tokens, hidden_size] (first pipeline stage only)."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: AttentionMetadata, on_layer_done: Callable[[int], None] | None = None,
                hidden: torch.Tensor | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's layers over one step's tokens -> [num_tokens or len(out_rows), hidden_size]."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] after the last layer -> [n, vocab_size] float32 (the driver only)."""

    def set_batch_invariant(self, enabled: bool = True) -> None:
        """Route every matmul through its batch-invariant path (or back)."""

    def holds(self, hf_name: str) -> bool:
        """Whether checkpoint tensor ``hf_name`` has a place on this rank."""
