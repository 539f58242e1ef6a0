"""Configuration of one worker's engine (model, KV cache, scheduler limits)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from pdserve.common.utils import parse_size


@dataclass
class EngineConfig:
    """What a worker's engine needs to load the model and size its KV cache.

    Args:
        model: Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer).
        dtype: ``auto`` (float32 on CPU, bfloat16 on CUDA), ``float32``, ``bfloat16``, ``float16``.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``.
        block_size: token slots per KV block.
        kv_cache_memory: KV cache budget in bytes (``--kv-cache-memory 2GiB``).
        max_num_seqs: most requests in flight per worker.
        max_num_batched_tokens: token budget of one step.
        max_model_len: longest sequence; None = the model's max_position_embeddings.
        seed: seeds sampling for requests that give no seed.
        num_threads: torch intra-op CPU threads; None leaves torch's default.
        enable_prefix_caching: reuse the KV of full blocks whose tokens (and all before) match.
        remote_prefill_threshold: decode worker: prompts with fewer uncached tokens than this are
            prefilled locally instead of by a prefill worker (conditional disaggregation).
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int = 512 * 2**20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    remote_prefill_threshold: int = 16

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
        g.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
        g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
        g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        g.add_argument("--kv-cache-memory", type=parse_size, default="512MiB", help="KV cache budget, e.g. 2GiB")
        g.add_argument("--max-num-seqs", type=int, default=64)
        g.add_argument("--max-num-batched-tokens", type=int, default=2048)
        g.add_argument("--max-model-len", type=int, default=None)
        g.add_argument("--seed", type=int, default=0)
        g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads")
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="turn prefix caching off (on by default)")
        g.add_argument("--remote-prefill-threshold", type=int, default=16,
                       help="decode worker: prefill prompts with fewer uncached tokens locally")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineConfig":
        return cls(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                   kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                   seed=args.seed, num_threads=args.num_threads, enable_prefix_caching=args.enable_prefix_caching,
                   remote_prefill_threshold=args.remote_prefill_threshold)
