"""pdserve: a disaggregated prefill/decode LLM serving cluster.

See docs/architecture.md for the process map and the life of a request.

The offline API is exported lazily, so ``import pdserve`` stays light (no torch)::

    from pdserve import LLM, SamplingParams
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "BeamSearchParams", "BeamSearchOutput", "LoRARequest"]

_LAZY = {  # name -> module that defines it, imported on first access
    "LLM": "pdserve.llm",
    "RequestOutput": "pdserve.llm",
    "CompletionOutput": "pdserve.llm",
    "SamplingParams": "pdserve.common.protocol",
    "BeamSearchParams": "pdserve.beam_search",
    "BeamSearchOutput": "pdserve.beam_search",
    "StructuredOutputsParams": "pdserve.common.protocol",
    "LoRARequest": "pdserve.common.protocol",
}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_LAZY))
