"""Owns the model, the KV cache tensor and the sampler; runs one step's forward.

``prepare_inputs`` (with ``step_inputs.flatten_step``) is the one place where scheduled requests become step
inputs: their ``block_table`` lists become ``slot_mapping`` (where each new
token's K/V is written) and ``block_tables`` (where attention reads each
sequence's context), as an ``ExecuteModel`` the driver can broadcast to the
other ranks of a tensor/pipeline-parallel worker; ``run_step`` turns it into
tensors and runs this rank's part of the forward on every rank alike.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib

import msgspec
import torch
from transformers import AutoConfig

from pdserve.common.checkpoint import checkpoint_dtype, read_eos_token_ids
from pdserve.common.protocol import ExecuteModel, KVLayout, KVStepOps, RankAttach, TierOp, TierOpKind, WorkerRole
from pdserve.common.utils import format_cpu_list, keep_freed_memory, pin_to_cores, resolve_device, resolve_dtype
from pdserve.engine.layers.attention import AttentionMetadata, select_backend
from pdserve.engine.execution import measured_choices
from pdserve.engine.execution.compiled_step import CompiledDecodeStep
from pdserve.engine.execution.model_input import ModelInput
from pdserve.engine.config import EngineConfig
from pdserve.engine.config import parse_disk_spec
from pdserve.engine.execution.kv_disk import DiskKVStore, disk_fingerprint, weight_files_id
from pdserve.engine.execution.kv_prefetch import TierPrefetcher
from pdserve.engine.execution.kv_cache import (allocate_kv_cache, allocate_offload_cache, auto_kv_cache_budget,
                                               copy_blocks, copy_tier_blocks, kv_cache_block_bytes,
                                               num_blocks_for_budget, populate_when_idle)
from pdserve.common.kv_cache_groups import kv_cache_groups_for
from pdserve.engine.layers.kernel_choice import KernelChoice, choose_kernels
from pdserve.engine.layers.weight_format import PACKED_LAYOUTS, pack_model
from pdserve.common.kv_quant import resolve_kv_cache_format
from pdserve.engine.models.interface import CausalLM
from pdserve.engine.models.loader import load_model
from pdserve.common.sharding import KVLayoutSpec, stage_layer_range
from pdserve.engine.scheduling.outputs import ModelRunnerOutput
from pdserve.engine.execution.parallel import RankGroup
from pdserve.engine.layers import decode_linear
from pdserve.engine.layers.int8_linear import build_kernel
from pdserve.engine.layers.quantization import check_quantization_target, checkpoint_quantization, quantize_model
from pdserve.engine.execution.prompt_logprobs import add_prompt_logprob_rows, compute_prompt_logprobs
from pdserve.engine.scheduling.request import Request
from pdserve.engine.execution.sampler import Sampler, SamplingRow
from pdserve.engine.execution.runner_plan import RunnerPlan, decide_decode_step, decide_linear_weight_format
from pdserve.engine.execution.rejection_sampler import DraftGroup, RejectionSampler
from pdserve.engine.scheduling.step_inputs import flatten_step
from pdserve.engine.execution.structured_output import allocate_token_bitmask, build_token_bitmask

logger = logging.getLogger(__name__)


class ModelRunner:
    """This rank's model share and KV cache; builds step inputs and runs the forward.

    Args:
        config: the engine configuration.
        ranks: this process's place in a tensor/pipeline-parallel worker, or None for a
            single-rank worker. Only the driver (rank 0) samples.

    Attributes:
        kv_cache: this rank's [num_layers, kv_slots, num_blocks, block_size, num_kv_heads, head_dim]
            (its pipeline stage's layers, its TP rank's KV heads; with several KV cache groups the first
            axis is one group's positions, ``kv_groups.num_cache_layers``: ``pdserve.common.kv_cache_groups``);
            ``kv_slots`` is the model's: 2
            (K and V) or 1 (an MLA latent, whose value is its first ``kv_v_dim`` values); with a quantized
            ``--kv-cache-dtype``, uint8 rows of head_dim + 4 bytes (``pdserve.common.kv_quant``).
        kv_cache_format: the cache's ``KVCacheFormat``; ``kv_cache_format.name`` is the KV dtype
            name peers see (transfer headers, ``KVLayout``).
        kv_cache_dtype: the cache tensor's torch dtype (torch.uint8 for a quantized cache).
        num_blocks (the same on every rank), block_size, max_model_len, vocab_size, eos_token_ids.
    """

    def __init__(self, config: EngineConfig, ranks: RankGroup | None = None):
        self.config = config
        self.ranks = ranks
        # Every start-up choice, with its reason, is recorded in the plan (runner_plan) right before what it
        # builds; some need what the phase before built (the probes time the loaded model's own layers).
        self.plan = RunnerPlan()
        self.device = ranks.device if ranks is not None else resolve_device(config.device)
        self.plan.decide("device", self.device)
        hf_config = AutoConfig.from_pretrained(config.model)
        self._load_model(hf_config)  # device, dtype, KV format, cores, quantization, layers -> the model
        self._choose_weight_paths(hf_config)  # native kernels, linear weights' layout (timed) -> packed weights
        self._allocate_kv_cache(hf_config)  # KV cache groups and size -> the cache
        self._choose_step()  # attention backend, LoRA, decode-linear kernel, compiled or eager decode step
        logger.info("model runner for %s:\n%s", config.model, self.plan.describe())
        if self._compile_thread is not None:
            self._compile_thread.start()

    def _load_model(self, hf_config) -> None:
        """Decide the dtype, KV cache format, cores, quantization and this rank's layers; load the model."""
        config, ranks, plan = self.config, self.ranks, self.plan
        self.dtype, why = resolve_dtype(config.dtype, self.device, checkpoint_dtype(config.model))
        plan.decide("dtype", str(self.dtype).removeprefix("torch."), why)
        self.kv_cache_format = resolve_kv_cache_format(config.kv_cache_dtype, self.dtype)
        self.kv_cache_dtype = self.kv_cache_format.storage_dtype
        kv_name = self.kv_cache_format.name
        plan.decide("kv_cache_dtype", kv_name, "--kv-cache-dtype" if config.kv_cache_dtype != "auto" else
                    "auto: the model's dtype")
        if self.device.type == "cpu":
            keep_freed_memory()
            self.cpu_cores = pin_to_cores(config.cpu_cores, config.num_threads, config.rank, config.parallel.world_size)
            plan.decide("cpu_cores", format_cpu_list(self.cpu_cores), f"{torch.get_num_threads()} torch threads")
        # int8: quantized here; compressed-tensors: the checkpoint says so (None on a float checkpoint)
        self.quantization = checkpoint_quantization(config.model, config.quantization)
        plan.decide("quantization", self.quantization or "none")
        if self.quantization is not None:  # before any weight is read
            check_quantization_target(self.quantization, self.device, self.dtype)
        layer_range = None
        if ranks is not None:
            layer_range = stage_layer_range(hf_config.num_hidden_layers, ranks.parallel.pipeline_parallel_size,
                                            ranks.pp_rank)
        start, end = layer_range or (0, hf_config.num_hidden_layers)
        plan.decide("layers", f"{start}-{end - 1} of {hf_config.num_hidden_layers}",
                    f"TP {config.tensor_parallel_size} x PP {config.pipeline_parallel_size}" if ranks is not None
                    else "")
        self.model: CausalLM = load_model(config.model, dtype=self.dtype, device=self.device,
                                          tp_group=ranks.tp_group if ranks is not None else None,
                                          layer_range=layer_range, has_embedding=ranks is None or ranks.is_first_stage,
                                          has_lm_head=ranks is None or ranks.is_driver,
                                          expert_parallel=config.enable_expert_parallel)
        if self.quantization is not None:  # this rank's shards, as loaded
            quantize_model(self.model, self.quantization)
        if config.batch_invariant:
            self.model.set_batch_invariant(True)

    def _choose_weight_paths(self, hf_config) -> None:
        """Time each native kernel and the linear weights' layouts on the loaded model; pack the weights."""
        config, plan = self.config, self.plan
        max_keys = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
        # what the probes below chose at an earlier start of this model here, if kept (measured_choices)
        kept_at = kept = None
        if self.device.type == "cpu" and config.native_kernels == "auto":
            kept_at = measured_choices.choices_path(config.model, {
                "dtype": str(self.dtype), "quantization": self.quantization, "native_kernels": config.native_kernels,
                "linear_weight_format": config.linear_weight_format, "batch_invariant": config.batch_invariant,
                "max_keys": max_keys, "world_size": config.parallel.world_size, "role": config.role})
            kept = measured_choices.restore(kept_at)
        self.kernel_choices: dict[str, KernelChoice] = {}  # native kernel or torch, timed here (kernel_choice)
        if self.device.type == "cpu":
            self.kernel_choices = kept[0] if kept else choose_kernels(self.model, config.native_kernels, max_keys)
            plan.decide("native_kernels", ", ".join(f"{k}={c.path}" for k, c in self.kernel_choices.items()) or
                        "none built", f"--native-kernels {config.native_kernels}" +
                        (f"; measured at an earlier start ({kept_at})" if kept else ""))
        self.num_packed_linears = 0  # layers whose weights are packed (--linear-weight-format onednn or panel)
        self.lm_head_packed = False  # the LM head's too (weight_format.pack_lm_head: an untied head)
        if kept and kept[1] is not None:
            self.linear_weight_format, why = kept[1][0], f"{kept[1][1]}; measured at an earlier start"
        else:
            self.linear_weight_format, why = decide_linear_weight_format(
                config.linear_weight_format, self.device, config.parallel.world_size == 1, config.batch_invariant,
                self.quantization, self.model, config.role)
        if kept_at is not None and not kept:  # measured here now: keep it for the next start
            timed = (self.linear_weight_format, why) if why.startswith("timed") else None
            measured_choices.save(kept_at, self.kernel_choices, timed)
        if self.linear_weight_format in PACKED_LAYOUTS and self.device.type == "cpu":
            self.num_packed_linears, self.lm_head_packed = pack_model(self.model, self.linear_weight_format)
            why += f"; {self.num_packed_linears} layers packed in {PACKED_LAYOUTS[self.linear_weight_format]}" + (
                "" if self.num_packed_linears else " (none: its library or dtype is not available here)")
        plan.decide("linear_weight_format", self.linear_weight_format, why)

    def _allocate_kv_cache(self, hf_config) -> None:
        """Read the model's limits, group its layers' KV (windows), size the cache to the budget and allocate it."""
        config, ranks, plan = self.config, self.ranks, self.plan
        kv_name = self.kv_cache_format.name
        self.max_model_len = config.max_model_len or int(getattr(hf_config, "max_position_embeddings", 2048))
        self.vocab_size = int(hf_config.vocab_size)
        self.hidden_size = int(hf_config.hidden_size)
        self.eos_token_ids = read_eos_token_ids(config.model, hf_config)
        # Salts prefix-cache hashes: KV from another model, dtype or quantization must never be a hit.
        self.model_fingerprint = zlib.crc32(f"{os.path.abspath(config.model)}|{self.dtype}|{kv_name}|"
                                            f"{self.quantization}|{hf_config.to_json_string()}".encode())
        self.block_size = config.block_size
        # which layers share a block table; windows free blocks (pdserve.common.kv_cache_groups)
        self.kv_groups = kv_cache_groups_for(self.model, config)
        self.model.kv_cache_groups = None if self.kv_groups.is_single else self.kv_groups
        # longrope / dynamic NTK RoPE: frequencies follow each request's length (RotaryEmbedding.length_scaling)
        self.rope_needs_lengths = any(getattr(m, "length_scaling", None) for m in self.model.modules())
        # transformers' Phi-3 generate recomputes a sequence once at LongRoPE's switch (Phi3ForCausalLM)
        self.recompute_past_len = None
        if getattr(self.model, "recompute_at_longrope_switch", False):
            self.recompute_past_len = next((m.original_max_len for m in self.model.modules()
                                            if getattr(m, "length_scaling", None) == "longrope"), None)
        self.num_layers = self.model.num_layers
        self.num_kv_heads = self.model.num_kv_heads
        self.head_dim = self.model.head_dim
        self.kv_slots, self.kv_v_dim = self.model.kv_slots, self.model.kv_v_dim
        num_cache_layers = self.kv_groups.num_cache_layers  # the layers one block serves (all, or a group's)
        block_bytes = kv_cache_block_bytes(num_cache_layers, self.block_size, self.num_kv_heads, self.head_dim,
                                           kv_name, self.kv_slots)  # real bytes: scales included, one latent slot
        if config.kv_cache_memory is not None:
            budget, budget_why = config.kv_cache_memory, "--kv-cache-memory"
        else:  # every group's blocks for max_num_seqs sequences of max_model_len tokens at most
            per_seq = -(-self.max_model_len // self.block_size) * self.kv_groups.num_groups
            budget, budget_why = auto_kv_cache_budget(config.memory_utilization, config.parallel.world_size,
                                                      block_bytes, config.max_num_seqs * per_seq, self.device)
        self.num_blocks = num_blocks_for_budget(budget, block_bytes)
        if ranks is not None:  # block ids are the driver's: every rank must have every block
            self.num_blocks = ranks.min_over_ranks(self.num_blocks)
        self.kv_cache = allocate_kv_cache(num_cache_layers, self.num_blocks, self.block_size, self.num_kv_heads,
                                          self.head_dim, kv_name, self.device, self.kv_slots)
        populate_when_idle(self.kv_cache, "kv_cache")  # its pages, before the step loop has to fault them in
        self.kv_cache_bytes = self.num_blocks * block_bytes
        plan.decide("kv_cache", f"{self.num_blocks} blocks x {self.block_size} tokens = "
                    f"{self.num_blocks * self.block_size} tokens, {self.kv_cache_bytes / 2**20:.1f} MiB",
                    f"{budget_why}; {self.num_layers} layers, {self.num_kv_heads} KV heads, "
                    + ("K and V" if self.kv_slots == 2 else "one latent row")
                    + ("" if self.kv_groups.is_single else f"; a block holds {num_cache_layers} layers of one of "
                       f"{self.kv_groups.num_groups} groups"))
        self._allocate_offload_tier(block_bytes)

    def _allocate_offload_tier(self, block_bytes: int) -> None:
        """The host-memory tier evicted prefix blocks go to (``--kv-offload-memory``), if asked and usable."""
        config, plan = self.config, self.plan
        self.num_offload_blocks = config.kv_offload_memory // block_bytes
        self.tier_copy_seconds = 0.0  # wall time of this rank's offload tier copies
        self.tier_copy_stats: dict[TierOpKind, list] = {}  # kind -> [blocks, seconds] of this rank's copies
        self.block_bytes = block_bytes  # one block of this rank's KV cache (every layer it holds, K and V)
        if self.ranks is not None:  # slot ids are the driver's: every rank must have every slot
            self.num_offload_blocks = self.ranks.min_over_ranks(self.num_offload_blocks)
        self.offload_cache = None
        self.disk_store: DiskKVStore | None = None
        self.prefetcher: TierPrefetcher | None = None  # disk-tier hits read off the step loop (one rank)
        self.disk_entries: list[tuple[int, bytes, tuple[int, ...]]] = []  # (slot, key, tokens) found at start
        if not config.kv_offload_memory:
            return
        why = ""
        if not config.enable_prefix_caching or self.rope_needs_lengths:
            why = "prefix caching is off"
        elif not self.kv_groups.is_single or any(w is not None for w in self.kv_groups.windows):
            why = "the model's layers slide over windows (a tier is kept for full attention only)"
        elif self.num_offload_blocks < 1:
            why = f"{config.kv_offload_memory} bytes hold no block of {block_bytes}"
        if why:
            self.num_offload_blocks = 0
            plan.decide("kv_offload", "none", f"--kv-offload-memory {config.kv_offload_memory}, but {why}")
            return
        self.offload_cache = allocate_offload_cache(self.kv_cache, self.num_offload_blocks)
        populate_when_idle(self.offload_cache, "kv_offload")
        value = f"host memory: {self.num_offload_blocks} blocks, {self.num_offload_blocks * block_bytes / 2**20:.1f} MiB"
        why = f"--kv-offload-memory {config.kv_offload_memory}"
        if config.kv_offload_disk:
            path, size = parse_disk_spec(config.kv_offload_disk)
            slots = size // block_bytes  # SIZE is each rank's, as --kv-offload-memory is
            if self.ranks is not None:  # slot ids are the driver's: every rank must have every slot
                slots = self.ranks.min_over_ranks(slots)
            if config.enable_lora:
                why += "; no disk tier: LoRA adapters' KV is keyed by their name and path, not their weights"
            elif slots >= 1:
                shape = (*self.kv_cache.shape[:2], *self.kv_cache.shape[3:])
                fingerprint = disk_fingerprint(self.model_fingerprint, weight_files_id(config.model), self.block_size,
                                               shape, self.kv_cache.dtype, config.rank)
                self.disk_store = DiskKVStore(path, fingerprint, shape, self.kv_cache.dtype, slots)
                self.disk_entries = self.disk_store.scan()
                if self.ranks is not None:
                    self.disk_entries = self._disk_entries_on_every_rank(self.disk_entries)
                else:
                    self.prefetcher = TierPrefetcher(self.kv_cache, self.offload_cache, self.disk_store)
                value += (f"; disk {self.disk_store.dir}: {slots} blocks, {len(self.disk_entries)} "
                          f"found at start ({self.disk_store.num_corrupt} corrupt, removed)")
            else:
                why += f"; no disk tier: {size} bytes hold no block of {block_bytes}"
        plan.decide("kv_offload", value, why)

    def _disk_entries_on_every_rank(self, entries: list[tuple[int, bytes, tuple[int, ...]]]) -> list:
        """The disk tier's blocks found at start that every rank holds its share of, in the same slot (a
        rank killed with writes pending, or a corrupt file on one rank, leaves a block incomplete: it is
        recomputed). This rank's files of the others are removed."""
        mine = [(slot, key) for slot, key, _ in entries]
        common = set(mine)
        for theirs in self.ranks.gather_objects(mine):
            common &= set(theirs)
        for slot, key in mine:
            if (slot, key) not in common:
                self.disk_store.discard(slot)
        return [entry for entry in entries if (entry[0], entry[1]) in common]

    def _choose_step(self) -> None:
        """Choose the attention backend, attach LoRA, build the decode-linear kernel, build (or start) the
        compiled decode step; then the sampler."""
        config, plan = self.config, self.plan
        kv_name = self.kv_cache_format.name
        # What attention needs to know of the cache's rows: a quantized format's name, else None.
        self.attn_kv_dtype = kv_name if self.kv_cache_format.quantized else None
        self.attention_backend = select_backend(config.attention_backend, self.device, kv_name, self.head_dim,
                                                self.kv_v_dim)
        plan.decide("attention_backend", self.attention_backend, f"--attention-backend {config.attention_backend}")
        if config.batch_invariant and self.attention_backend != "paged":
            raise ValueError("--batch-invariant needs the paged attention kernel, which cannot run here (here: "
                             f"{self.device.type}, KV {kv_name}, head_dim {self.head_dim}; it needs a CPU, a "
                             "float32/bfloat16/int8/fp8 KV cache, head_dim a multiple of 8, a C++ compiler and "
                             "$PDSERVE_DISABLE_KERNELS unset)")
        self.lora = None  # LoRAManager with --enable-lora (pdserve.engine.lora): adapters in slots, mixed per step
        if config.enable_lora:
            from pdserve.engine.lora.manager import LoRAManager

            self.lora = LoRAManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras)
        if self.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16) and not config.batch_invariant:
            # decode-sized matmuls stream each weight once (pdserve.engine.layers.decode_linear): built now, run
            # where the kernel choice says (plan's native_kernels)
            decode_linear.build_kernel()
        self._compiled_decode = None  # CompiledDecodeStep: decode-only steps' forward under torch.compile
        self._compile_thread = None  # the thread building it (decode_step_compile "background")
        compile_step, why = decide_decode_step(config.enforce_eager, config.batch_invariant, self.quantization,
                                               self.dtype, self.quantization is not None and build_kernel(),
                                               self.ranks is None, self.attention_backend)
        if compile_step and config.decode_step_compile == "background":
            self._compile_thread = threading.Thread(target=self._compile_decode_step, name="compile-decode-step",
                                                    daemon=True)
            why = "in the background: decode steps run eagerly until it is warm (the log says when)"
        elif compile_step:  # oneDNN-packed linears included (pdserve.engine.layers.onednn_linear)
            if not self._compile_decode_step():
                why = "CompiledDecodeStep.build declined (logged above)"
        plan.decide("decode_step", "compiled" if self._compiled_decode is not None or self._compile_thread else
                    "eager", why)
        self.sampler = Sampler(config.seed)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.total_kv_heads = self.model.total_kv_heads  # the cache's KV heads over all TP ranks (MLA: 1 latent)
        self.kv_agent = None  # KVRankAgent once a worker attaches one (pdserve.kvtransfer.agent)
        self.report_keys = None  # non-driver rank: CURVE keys of its reports to the driver (serve_rank's)

    def _compile_decode_step(self) -> bool:
        """Build the compiled decode step (``CompiledDecodeStep.build``) and switch decode steps to it;
        False where it stays eager. Runs on the start-up path or in the compile thread."""
        step = CompiledDecodeStep.build(self)
        self._compiled_decode = step  # one assignment: a step reads the old value or the new, both usable
        return step is not None

    @property
    def decode_step_state(self) -> str:
        """How decode steps run now: ``compiled``, ``compiling`` (in the background; eager meanwhile) or
        ``eager`` (heartbeats carry it; ``/workers`` shows it)."""
        if self._compiled_decode is not None:
            return "compiled"
        return "compiling" if self._compile_thread is not None and self._compile_thread.is_alive() else "eager"

    def wait_for_compiled_step(self, timeout_s: float | None = None) -> bool:
        """Block until a background compile of the decode step has finished (at most ``timeout_s``);
        True if decode steps now run compiled."""
        if self._compile_thread is not None:
            self._compile_thread.join(timeout_s)
        return self._compiled_decode is not None

    def prepare_inputs(self, scheduled: list[tuple[Request, int]],
                       block_copies: list[tuple[int, int]] = (),
                       tier_ops: list[TierOp] = ()) -> tuple[ExecuteModel, list[Request]]:
        """The flattened step for ``(request, num_new_tokens)`` pairs, and the requests it samples
        (in ``sample_indices`` order; a request with ``k`` drafts owns ``k + 1`` rows)."""
        spans = [(r, r.num_computed_tokens, r.num_computed_tokens + n) for r, n in scheduled]
        step = flatten_step(spans, self.block_size, self.rope_needs_lengths, self.kv_groups.num_groups)
        step.block_copies = list(block_copies)
        step.kv_tier_ops = list(tier_ops)
        if self.lora is not None:
            step.lora_loads, step.lora_slots = self.lora.plan([r.lora for r, _ in scheduled])
        sample_requests: list[Request] = []
        for (request, _, end), last_row in zip(spans, step.query_start_loc[1:]):
            num_drafts = len(request.spec_token_ids)  # drafts: scored after the last token
            if end == request.num_tokens + num_drafts:  # caught up: it samples its next token (verifies drafts)
                step.sample_indices.extend(range(last_row - 1 - num_drafts, last_row))
                sample_requests.append(request)
        return step, sample_requests

    def _tensors(self, step: ExecuteModel) -> ModelInput:
        def as_tensor(values):
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        metadata = AttentionMetadata(
            slot_mapping=as_tensor(step.slot_mapping),
            block_tables=as_tensor(step.block_tables).reshape(len(step.block_tables), -1),
            seq_lens=as_tensor(step.seq_lens),
            query_start_loc=as_tensor(step.query_start_loc),
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            backend=self.attention_backend,
            batch_invariant=self.config.batch_invariant,
            kv_cache_dtype=self.attn_kv_dtype,
            rope_seq_lens=as_tensor(step.rope_seq_lens) if step.rope_seq_lens else None,
        )
        if step.group_slot_mappings:  # KV cache groups 1..: their own slots and tables, the same sequences
            metadata.group_tables = [(as_tensor(slots), as_tensor(tables).reshape(len(tables), -1))
                                     for slots, tables in zip(step.group_slot_mappings, step.group_block_tables)]
        return ModelInput(as_tensor(step.input_ids), as_tensor(step.positions), metadata,
                          as_tensor(step.sample_indices))

    @torch.inference_mode()
    def execute(self, scheduled: list[tuple[Request, int]], on_layer_done=None,
                block_copies: list[tuple[int, int]] = (), kv_ops: KVStepOps | None = None,
                tier_ops: list[TierOp] = ()) -> ModelRunnerOutput:
        """Run one forward over ``scheduled`` (on every rank of the worker) and sample (driver).

        Args:
            scheduled: (request, num_new_tokens) pairs, as the scheduler gave them.
            on_layer_done: called with this rank's layer index once that layer's K/V are in the cache.
            block_copies: (src, dst) block pairs to copy first (the scheduler's copy-on-write).
            kv_ops: KV transfer work for every rank's agent (``pdserve.kvtransfer.agent``), done first.
            tier_ops: the offload tiers' copies (``BlockManager.take_tier_copies``), done in order
                before anything else.

        Returns:
            the sampled token (and, where asked, its logprobs) of every request whose
            last known token was computed this step.
        """
        if not scheduled and not block_copies and kv_ops is None and not tier_ops:
            return ModelRunnerOutput()
        step, sample_requests = self.prepare_inputs(scheduled, block_copies, tier_ops)
        num_sampled = len(step.sample_indices)  # one row per request, k + 1 with k drafts
        prompt_spans = add_prompt_logprob_rows(step, scheduled)  # their rows follow the sampled ones
        step.kv = kv_ops
        if self.ranks is not None:
            self.ranks.broadcast_step(step)
        rows = self.run_step(step, on_layer_done)
        if rows is None or not (sample_requests or prompt_spans):
            return ModelRunnerOutput()
        output = self._sample(self.model.compute_logits(rows[:num_sampled]), sample_requests) \
            if sample_requests else ModelRunnerOutput()
        if prompt_spans:
            output.prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, rows[num_sampled:],
                                                             prompt_spans)
        return output

    @torch.inference_mode()
    def run_step(self, step: ExecuteModel, on_layer_done=None) -> torch.Tensor | None:
        """This rank's part of one step: block copies, its layers, the pipeline hand-offs.

        Returns the hidden rows to sample [num_sampled, hidden_size] on the driver, None elsewhere.
        """
        if step.attach is not None:
            self.attach_kv_agent(step.attach)
        if step.kv_tier_ops:  # first: they read blocks this step may overwrite
            start = time.perf_counter()
            copy_tier_blocks(self.kv_cache, self.offload_cache, step.kv_tier_ops, self.disk_store,
                             self.tier_copy_stats)
            self.tier_copy_seconds += time.perf_counter() - start
        agent = self.kv_agent
        if step.kv is not None and agent is not None:
            agent.apply(step.kv, [step.block_tables, *step.group_block_tables])
        if step.block_copies:
            copy_blocks(self.kv_cache, step.block_copies)
        if step.lora_loads:
            self.lora.load(step.lora_loads)
        if not step.input_ids:
            return None
        if step.lora_slots:  # some sequence has an adapter: every linear layer adds its term this step
            self.lora.activate(step.lora_slots, step.query_start_loc, self.device)
            try:
                return self._run_forward(step, on_layer_done)
            finally:
                self.lora.deactivate()
        return self._run_forward(step, on_layer_done)

    def _run_forward(self, step: ExecuteModel, on_layer_done=None) -> torch.Tensor | None:
        """``run_step``'s forward and pipeline hand-offs (the KV, block-copy and LoRA work done)."""
        agent = self.kv_agent
        inp = self._tensors(step)
        ranks = self.ranks
        hidden_in = None
        if ranks is not None and not ranks.is_first_stage:
            hidden_in = ranks.recv_hidden(len(step.input_ids), self.hidden_size, self.dtype)
        if on_layer_done is None and agent is not None and agent.sending:
            on_layer_done = agent.on_layer_done
        out_rows = None  # the sampled rows, where the last layer computes only those (_out_rows)
        try:
            md = inp.attn_metadata
            compiled = self._compiled_decode  # read once: a background compile may set it between steps
            if (compiled is not None and not step.lora_slots  # adapters: eager
                    and md.max_query_len == 1 and on_layer_done is None  # decode-only: its RoPE length is
                    and (md.rope_seq_lens is None or torch.equal(md.rope_seq_lens, md.seq_lens))):  # position + 1
                hidden = compiled(inp, self.kv_cache)
            else:
                out_rows = self._out_rows(step, inp)
                hidden = self.model(inp.input_ids, inp.positions, self.kv_cache, md, on_layer_done, hidden=hidden_in,
                                    out_rows=out_rows)
        except Exception as e:
            if agent is not None and agent.sending:
                agent.abort_sends(f"prefill forward failed: {e}")
            raise
        if agent is not None and agent.sending:
            agent.after_forward()
        if ranks is not None and not ranks.is_last_stage:
            ranks.send_hidden(hidden)
            rows = None
        else:
            rows = hidden[:len(step.sample_indices)] if out_rows is not None else hidden[inp.sample_indices]
        if ranks is None:
            return rows
        return ranks.exchange_sample_rows(rows, (len(step.sample_indices), self.hidden_size), self.dtype)

    def _out_rows(self, step: ExecuteModel, inp: ModelInput) -> torch.Tensor | None:
        """The rows the last layer must compute past attention: those sampled (``sample_indices``), where
        they are fewer than the step's rows and this rank holds the model's last layer; else None (all).
        Not with LoRA adapters, whose rows find their adapter by position in the step. A step that samples
        nothing (a prompt's middle chunk) still computes its last row, whose result is dropped: no op of any
        family need take an empty batch."""
        if len(step.sample_indices) == len(step.input_ids) or step.lora_slots:
            return None
        if self.ranks is not None and not self.ranks.is_last_stage:
            return None
        if not step.sample_indices:
            return torch.tensor([len(step.input_ids) - 1], device=self.device)
        return inp.sample_indices

    def broadcast_kv(self, ops: KVStepOps) -> None:
        """Driver: a step with KV transfer work only (every rank's agent does its part now)."""
        self.execute([], kv_ops=ops)

    def attach_kv_agent(self, attach: RankAttach, report=None) -> None:
        """Give this rank its KV transfer agent (the driver passes ``report``; other ranks report over ZMQ).

        On the driver this also tells every other rank to attach theirs.
        """
        from pdserve.common.transport import PushSocket
        from pdserve.kvtransfer.agent import KVRankAgent

        if self.kv_agent is not None:
            return
        rank = self.ranks.rank if self.ranks is not None else 0
        if report is None:
            report = PushSocket(attach.driver_addr, keys=self.report_keys).send
        layout = KVLayoutSpec(self.config.tensor_parallel_size, self.config.pipeline_parallel_size,
                              self.model.config.num_hidden_layers, self.total_kv_heads)
        self.kv_agent = KVRankAgent(attach, rank, layout, self.kv_cache, report, attach.transfer_timeout_s,
                                    kv_cache_dtype=self.kv_cache_format.name, kv_groups=self.kv_groups)
        if self.ranks is not None and self.ranks.is_driver:
            if attach.role == WorkerRole.DECODE:  # the other ranks' lanes rendezvous in the driver's store
                pairs = self.kv_agent.decode_pairs
                attach = msgspec.structs.replace(attach, store_host=pairs.store_host, store_port=pairs.store_port)
            self.ranks.broadcast_step(ExecuteModel(attach=attach))

    def kv_layout(self) -> KVLayout:
        """This worker's KV layout, as advertised to peers."""
        return KVLayout(tensor_parallel_size=self.config.tensor_parallel_size,
                        pipeline_parallel_size=self.config.pipeline_parallel_size,
                        num_layers=self.model.config.num_hidden_layers, num_kv_heads=self.total_kv_heads,
                        kv_cache_dtype=self.kv_cache_format.name, quantization=self.quantization or "none")

    def serve_rank(self, report_keys=None) -> None:
        """A non-driver rank's whole life: run each step the driver broadcasts until ``shutdown``.

        ``report_keys``: the cluster's CURVE keys (``pdserve.common.curve``) for the socket its KV agent
        reports to the driver's mailbox on; None without a cluster secret."""
        assert self.ranks is not None and not self.ranks.is_driver
        self.report_keys = report_keys
        try:
            while True:
                step = self.ranks.broadcast_step(None)
                if step.shutdown:
                    return
                self.run_step(step)
        finally:
            if self.kv_agent is not None:
                self.kv_agent.close()
            if self.disk_store is not None:  # its queued writes go to disk before the process ends
                self.disk_store.close()

    def ping_ranks(self) -> None:
        """Driver: an empty step, so a dead rank is noticed (an error here) while the worker is idle."""
        if self.ranks is not None:
            self.ranks.broadcast_step(ExecuteModel())

    def shutdown_ranks(self) -> None:
        """Driver: end the other ranks' loops (best effort: they may be gone already)."""
        if self.kv_agent is not None:
            self.kv_agent.close()
        if self.ranks is None:
            return
        try:
            self.ranks.broadcast_step(ExecuteModel(shutdown=True))
        except Exception as e:  # noqa: BLE001  a dead rank: the others time out on their own
            logger.warning("could not tell every rank to stop: %s", e)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> ModelRunnerOutput:
        """Sample one token per request, with logprobs for those that asked."""
        if any(r.spec_token_ids for r in requests):
            return self._verify(logits, requests)
        rows = [
            SamplingRow(r.sampling_params, r.num_output_tokens, self._banned(r), output_token_ids=r.output_token_ids,
                        sample_index=r.sample_index, prompt_token_ids=r.prompt_token_ids)
            for r in requests
        ]
        # Structured outputs: the batch's allowed-token bitmask (None when no row has a grammar).
        token_bitmask = build_token_bitmask([r.structured_output for r in requests], self.vocab_size)
        out = self.sampler(logits, rows) if token_bitmask is None else \
            self.sampler(logits, rows, token_bitmask=token_bitmask)
        return ModelRunnerOutput(
            sampled_token_ids={r.request_id: t for r, t in zip(requests, out.token_ids)},
            logprobs={r.request_id: lp for r, lp in zip(requests, out.logprobs) if lp is not None})

    def _verify(self, logits: torch.Tensor, requests: list[Request]) -> ModelRunnerOutput:
        """Speculative decoding: rejection-sample each request's drafts against its ``k + 1`` rows."""
        rows: list[SamplingRow] = []
        groups: list[DraftGroup] = []
        for r in requests:
            groups.append(DraftGroup(len(rows), r.spec_token_ids, r.spec_draft_probs))
            for j in range(len(r.spec_token_ids) + 1):  # row j: after the first j drafts
                n_out = r.num_output_tokens + j
                rows.append(SamplingRow(r.sampling_params, n_out, self._banned(r, n_out),
                                        output_token_ids=[*r.output_token_ids, *r.spec_token_ids[:j]],
                                        sample_index=r.sample_index, prompt_token_ids=r.prompt_token_ids))
        verified = self.rejection_sampler(logits, rows, groups, self._draft_bitmask(requests, len(rows)))
        out = ModelRunnerOutput()
        for r, v in zip(requests, verified):
            out.sampled_token_ids[r.request_id] = v.token_id
            if v.accepted:
                out.accepted_draft_ids[r.request_id] = v.accepted
            if v.logprobs is not None:
                out.spec_logprobs[r.request_id] = v.logprobs
        return out

    def _draft_bitmask(self, requests: list[Request], num_rows: int) -> torch.Tensor | None:
        """Structured outputs under speculation: row j of a constrained request allows what its
        grammar allows after its first j drafts (the matcher steps through them, then rolls back)."""
        constrained = [r.structured_output for r in requests if r.structured_output is not None]
        if not constrained:
            return None
        bitmask = allocate_token_bitmask(num_rows, self.vocab_size, constrained[0].manager)
        row = 0
        for r in requests:
            state, drafts = r.structured_output, r.spec_token_ids
            if state is not None:
                for j in range(len(drafts) + 1):
                    state.fill_bitmask(bitmask, row + j)
                    if j < len(drafts):
                        state.accept_tokens([drafts[j]])  # drafts were cut to the grammar's valid prefix
                if drafts:
                    state.rollback(len(drafts))
            row += len(drafts) + 1
        return bitmask

    def _banned(self, request: Request, num_output_tokens: int | None = None) -> tuple[int, ...]:
        """Tokens the request may not draw as output token number ``num_output_tokens`` (default: its next)."""
        params = request.sampling_params
        if num_output_tokens is None:
            num_output_tokens = request.num_output_tokens
        if num_output_tokens >= params.min_tokens:
            return ()
        banned = set(params.stop_token_ids)
        if not params.ignore_eos:
            banned |= self.eos_token_ids
        return tuple(banned)
