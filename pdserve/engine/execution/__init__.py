"""Model execution: one step's forward pass over the paged KV cache, and what it produces.

- ``model_runner``: builds the model and its KV cache, runs a step (prefill chunks and decodes
  together), samples; ``compiled_step``: the decode step compiled once per batch class.
- ``sampler``, ``logits_processors``, ``prompt_logprobs``, ``structured_output``: from logits to tokens.
- ``kv_cache``: the cache tensors; ``parallel``, ``ranks``: tensor/pipeline-parallel rank groups.
- ``spec_decode``: speculative decoding (n-gram and draft-model proposers, rejection sampling).
"""
