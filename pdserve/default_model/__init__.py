"""Built-in checkpoints: the deterministic random-weight toy Llamas (``tiny_model``, for tests
and benchmarks), the synthetic corpus their tokenizer is trained on (``corpus``), and the
trained default model (``train``: trains ``weights/stdlib-llama-v1`` on the Python standard
library; ``pdserve up`` and ``LLM()`` serve it when no model is given). Nothing here is
imported by the engine; the CLI, tests and benchmarks use it."""
