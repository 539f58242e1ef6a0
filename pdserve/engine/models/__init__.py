"""Model families, one file each, and the registry that picks one for a checkpoint.

``decoder.py`` (the pre-norm decoder's parts most families are made of), ``llama.py`` (Llama,
Mistral, Qwen2), ``qwen3.py``,
``phi3.py``, ``olmo2.py``, ``gemma3.py``, ``deepseek_v3.py`` (MLA), ``gpt_oss.py`` (sinks), ``qwen3_moe.py``, ``mixtral.py`` (with ``moe.py``, the shared sparse
MoE block);
``registry.py`` maps a config's ``architectures`` / ``model_type`` to a class.
"""

from pdserve.engine.models.registry import (
    SUPPORTED_MODEL_TYPES,
    UnsupportedArchitecture,
    check_model_dir,
    check_supported,
    model_class,
)

__all__ = ["SUPPORTED_MODEL_TYPES", "UnsupportedArchitecture", "check_model_dir", "check_supported", "model_class"]
