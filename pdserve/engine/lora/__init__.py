"""Multi-LoRA serving: many adapters of one base model, mixed in one batch.

LoRA (Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models", 2021) adds to a
linear layer ``y = x W^T`` a low-rank term ``scaling * (x A^T) B^T`` with A [r, in] and
B [out, r]. Serving many adapters at once follows Punica (Chen et al., 2023) and S-LoRA
(Sheng et al., 2023), as vLLM does: the base model's matmuls run once for the whole batch,
and each token adds the term of its own request's adapter.

* ``adapter``: reads and checks a PEFT adapter directory (``adapter_config.json`` +
  ``adapter_model.safetensors``) against the base model.
* ``layers``: ``LoRASlots``, one linear layer's adapters held in ``max_loras`` slots, and
  the batched term for a step whose tokens belong to different slots.
* ``manager``: ``LoRAManager``, the model runner's side: which adapter sits in which slot,
  the adapters read into host memory, and the step's token-to-slot mapping.

Adapters are named by a ``LoRARequest`` (``pdserve.common.protocol``) that travels with each
request to both workers: the prefill worker builds the prompt's KV with the adapter applied,
and the decode worker continues with it.
"""

from pdserve.engine.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter

__all__ = ["LoRAAdapter", "LoRAAdapterError", "load_adapter"]
