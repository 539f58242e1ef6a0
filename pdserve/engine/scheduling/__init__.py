"""The scheduling core, torch-free: requests, their queues, the scheduler and the paged KV bookkeeping.

- ``request``, ``request_queue``: a request's state and the waiting queue's policies (FCFS, priority).
- ``scheduler``, ``scheduler_config``: iteration-level scheduling under a token budget, chunked
  prefill, preemption (vLLM's continuous batching).
- ``block_manager``: PagedAttention's block pool (free block queue, reference counts, prefix-cache
  hashes, copy-on-write); ``kv_cache_manager``: each request's block tables over it, per KV cache group.
- ``outputs``, ``step_inputs``: what one step hands the model runner and gets back.

It imports nothing else of the engine and no torch (``tests/test_import_layers.py``).
"""
