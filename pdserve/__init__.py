"""pdserve: a disaggregated prefill/decode LLM serving cluster.

See docs/architecture.md for the process map and the life of a request.
"""

__version__ = "0.1.0"
