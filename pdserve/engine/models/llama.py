"""Llama, Mistral and Qwen2: the pre-norm decoder of ``decoder.py`` with nothing swapped.

Llama (Touvron et al., "LLaMA", 2023; Llama 2 and 3 add grouped-query attention and rope scaling),
Mistral (Jiang et al., 2023: a sliding attention window) and Qwen2 (biases on the q/k/v projections, a
window on the layers past ``max_window_layers`` when ``use_sliding_window``) differ only in what their
configs say, which the decoder reads (``decoder.sliding_window_of``, ``DecoderAttention``'s biases).
"""

from __future__ import annotations

from pdserve.engine.models.decoder import DecoderForCausalLM


class LlamaForCausalLM(DecoderForCausalLM):
    """A Llama, Mistral or Qwen2 checkpoint over the paged cache (see ``DecoderForCausalLM``)."""
