"""The KV cache dtypes by name, without torch: what ``--kv-cache-dtype`` and ``EngineConfig`` accept.

``pdserve.common.kv_quant`` gives each name its format (and checks at import that the two agree);
this module exists so that parsing flags does not import torch (2-3 s of a small machine's start-up).
"""

KV_CACHE_DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_DTYPE_CHOICES = ("auto", *KV_CACHE_DTYPES)
