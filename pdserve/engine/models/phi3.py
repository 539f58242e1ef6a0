"""Phi-3 (mini, small context and 128k variants): the pre-norm decoder (decoder.py) with fused projections.

Abdin et al., "Phi-3 Technical Report" (Microsoft, 2024). The checkpoint stores q/k/v as one
``self_attn.qkv_proj`` and gate/up as one ``mlp.gate_up_proj`` tensor (our layers' own
fused names); the loader cuts each into its parts (``split_fused``) so every TP rank takes
its rows of q, k and v, or of gate and up, as for Llama. ``partial_rotary_factor`` rotates
only the first features of each head (Phi-4-mini); ``sliding_window`` applies to every
layer, as in Mistral. LongRoPE scaling (the 128k models: Phi-3-mini-128k, Phi-3.5, Phi-4-mini)
is ``RotaryEmbedding``'s ``longrope``: short or long factors per request, by its length in the step.
transformers' Phi-3 ``generate`` also drops its KV cache and recomputes the whole sequence on the
step that first exceeds ``original_max_position_embeddings`` (its keys cached with the short factor
would otherwise stay); pdserve's scheduler does the same (``SchedulerConfig.recompute_past_len``),
so its tokens are ``generate``'s on both sides of the switch.
"""

from __future__ import annotations

from pdserve.engine.models.decoder import DecoderForCausalLM


class Phi3ForCausalLM(DecoderForCausalLM):
    """Phi-3 causal LM over the paged cache (see ``DecoderForCausalLM`` for sharding).

    ``split_fused``: the checkpoint's fused tensors, cut along rows into the parts our fused
    layers load one by one (``pdserve.engine.models.loader``)."""

    split_fused = ("self_attn.qkv_proj", "mlp.gate_up_proj")
    recompute_at_longrope_switch = True  # see the module docstring
