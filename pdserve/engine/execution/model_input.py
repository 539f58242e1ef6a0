"""What one forward pass takes: the step's tokens, positions and attention metadata as tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.layers.attention import AttentionMetadata


@dataclass
class ModelInput:
    """Flattened inputs of one forward, as tensors.

    input_ids, positions: [num_tokens] int64. ``sample_indices[i]``: the row of the
    hidden states whose logits sample the i-th sampled request's next token.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor
