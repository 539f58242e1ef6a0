"""Built-in checkpoints: the deterministic toy Llama (``tiny_model``) and the
synthetic corpus its tokenizer is trained on (``corpus``). Nothing here is
imported by the engine; the CLI, tests and benchmarks use it."""
