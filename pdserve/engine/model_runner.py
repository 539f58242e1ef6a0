"""Owns the model, the KV cache tensor and the sampler; runs one step's forward.

``prepare_inputs`` is the one place where scheduled requests become tensors:
their ``block_table`` lists become ``slot_mapping`` (where each new token's K/V
is written) and ``block_tables`` (where attention reads each sequence's context).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from dataclasses import dataclass

import torch

from pdserve.common.utils import resolve_device, resolve_dtype
from pdserve.engine.attention import AttentionMetadata
from pdserve.engine.config import EngineConfig
from pdserve.engine.kv_cache import allocate_kv_cache, copy_blocks, kv_cache_block_bytes, num_blocks_for_budget
from pdserve.engine.loader import load_model
from pdserve.engine.outputs import ModelRunnerOutput
from pdserve.engine.request import Request
from pdserve.engine.sampler import Sampler, SamplingRow

logger = logging.getLogger(__name__)


@dataclass
class ModelInput:
    """Flattened inputs of one forward.

    input_ids, positions: [num_tokens] int64. ``sample_indices[i]`` is the row of
    the hidden states whose logits sample ``sample_requests[i]``'s next token.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_indices: torch.Tensor
    sample_requests: list[Request]


def read_eos_token_ids(model_dir: str, hf_config) -> frozenset[int]:
    """EOS ids from generation_config.json (int or list) and config.json."""
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), _generation_config(model_dir).get("eos_token_id")):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _generation_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


class ModelRunner:
    """Loads the model and allocates the KV cache from the memory budget.

    Attributes:
        kv_cache: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        num_blocks, block_size, max_model_len, vocab_size, eos_token_ids.
    """

    def __init__(self, config: EngineConfig, tp_group=None):
        self.config = config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.num_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.num_threads)
        self.model = load_model(config.model, dtype=self.dtype, device=self.device, tp_group=tp_group)
        hf_config = self.model.config
        self.max_model_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
        self.vocab_size = int(hf_config.vocab_size)
        self.eos_token_ids = read_eos_token_ids(config.model, hf_config)
        # Salts prefix-cache hashes: KV from another model or dtype must never be a hit.
        self.model_fingerprint = zlib.crc32(f"{os.path.abspath(config.model)}|{self.dtype}|{hf_config.to_json_string()}"
                                            .encode())
        self.block_size = config.block_size
        self.num_layers = self.model.num_layers
        self.num_kv_heads = self.model.num_kv_heads
        self.head_dim = self.model.head_dim
        block_bytes = kv_cache_block_bytes(self.num_layers, self.block_size, self.num_kv_heads, self.head_dim, self.dtype)
        self.num_blocks = num_blocks_for_budget(config.kv_cache_memory, block_bytes)
        self.kv_cache = allocate_kv_cache(self.num_layers, self.num_blocks, self.block_size, self.num_kv_heads,
                                          self.head_dim, self.dtype, self.device)
        self.kv_cache_bytes = self.num_blocks * block_bytes
        self.sampler = Sampler(config.seed)
        logger.info("KV cache: %d blocks x %d tokens = %d tokens, %.1f MiB (%s on %s)", self.num_blocks,
                    self.block_size, self.num_blocks * self.block_size, self.kv_cache_bytes / 2**20, self.dtype,
                    self.device)

    def prepare_inputs(self, scheduled: list[tuple[Request, int]]) -> ModelInput:
        """Build the flattened batch for ``(request, num_new_tokens)`` pairs."""
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        seq_lens: list[int] = []
        query_start_loc = [0]
        sample_indices: list[int] = []
        sample_requests: list[Request] = []
        for request, num_new in scheduled:
            start = request.num_computed_tokens
            end = start + num_new
            input_ids.extend(request.all_token_ids[start:end])
            positions.extend(range(start, end))
            table = request.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_start_loc.append(query_start_loc[-1] + num_new)
            if end == request.num_tokens:  # caught up: this step samples its next token
                sample_indices.append(query_start_loc[-1] - 1)
                sample_requests.append(request)
        max_blocks = max(len(r.block_table) for r, _ in scheduled)
        block_tables = [r.block_table + [0] * (max_blocks - len(r.block_table)) for r, _ in scheduled]

        def as_tensor(values):
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        metadata = AttentionMetadata(
            slot_mapping=as_tensor(slot_mapping),
            block_tables=as_tensor(block_tables),
            seq_lens=as_tensor(seq_lens),
            query_start_loc=as_tensor(query_start_loc),
            max_query_len=max(n for _, n in scheduled),
            max_seq_len=max(seq_lens),
        )
        return ModelInput(as_tensor(input_ids), as_tensor(positions), metadata, as_tensor(sample_indices),
                          sample_requests)

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], on_layer_done=None,
                block_copies: list[tuple[int, int]] = ()) -> ModelRunnerOutput:
        """Run one forward over ``scheduled`` and sample.

        Args:
            scheduled: (request, num_new_tokens) pairs, as the scheduler gave them.
            on_layer_done: called with layer index once that layer's K/V are in the cache.
            block_copies: (src, dst) block pairs to copy first (the scheduler's copy-on-write).

        Returns:
            the sampled token (and, where asked, its logprobs) of every request whose
            last known token was computed this step.
        """
        if block_copies:
            copy_blocks(self.kv_cache, block_copies)
        if not scheduled:
            return ModelRunnerOutput()
        inp = self.prepare_inputs(scheduled)
        hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, inp.attn_metadata, on_layer_done)
        if not inp.sample_requests:
            return ModelRunnerOutput()
        logits = self.model.compute_logits(hidden[inp.sample_indices])  # (num_sampled, vocab)
        return self._sample(logits, inp.sample_requests)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> ModelRunnerOutput:
        """Sample one token per request, with logprobs for those that asked."""
        rows = [
            SamplingRow(r.sampling_params, r.num_output_tokens, self._banned(r), output_token_ids=r.output_token_ids,
                        sample_index=r.sample_index)
            for r in requests
        ]
        out = self.sampler(logits, rows)
        return ModelRunnerOutput(
            sampled_token_ids={r.request_id: t for r, t in zip(requests, out.token_ids)},
            logprobs={r.request_id: lp for r, lp in zip(requests, out.logprobs) if lp is not None})

    def _banned(self, request: Request) -> tuple[int, ...]:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            return ()
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= self.eos_token_ids
        return tuple(banned)
