"""Configuration of one worker's engine (model, KV cache, scheduler limits)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field

from pdserve.common.utils import parse_cpu_list, parse_size
from pdserve.common.kv_dtype_names import KV_CACHE_DTYPE_CHOICES

# --native-kernels: ``auto`` times each native kernel against torch at load (layers/kernel_choice.py);
# ``all`` runs every kernel that builds.
NATIVE_KERNEL_MODES = ("auto", "all")


def default_native_kernels() -> str:
    """``$PDSERVE_NATIVE_KERNELS`` where set (``auto`` or ``all``), else ``auto``."""
    return os.environ.get("PDSERVE_NATIVE_KERNELS") or "auto"


QUANTIZATION_METHODS = ("int8", "compressed-tensors")

# --decode-step-compile: when the compiled decode step is built (EngineConfig.decode_step_compile).
DECODE_STEP_COMPILE = ("background", "startup")


def check_quantization_name(name: str | None) -> None:
    """Raise ValueError unless ``name`` is None or one of ``QUANTIZATION_METHODS``."""
    if name is not None and name not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {name!r}; choose from {', '.join(QUANTIZATION_METHODS)} "
                         "(or leave it unset for unquantized weights)")


@dataclass(frozen=True)
class ParallelConfig:
    """How one worker's model is split.

    Args:
        tensor_parallel_size: ranks each layer is sharded over (Megatron-LM style).
        pipeline_parallel_size: contiguous groups of layers (stages), one after another.
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self):
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size ({self.tensor_parallel_size}) and pipeline_parallel_size "
                             f"({self.pipeline_parallel_size}) must be >= 1")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def coords(self, rank: int) -> tuple[int, int]:
        """(pp_rank, tp_rank) of global ``rank``."""
        return divmod(rank, self.tensor_parallel_size)

    def rank_of(self, pp_rank: int, tp_rank: int) -> int:
        return pp_rank * self.tensor_parallel_size + tp_rank


DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
DEFAULT_MAX_NUM_SEQS = 128  # vLLM's CPU default for its API server
# With --kv-cache-memory auto, the share of the host's memory a worker may hold (weights and KV cache).
# Half, not vLLM's 92%: a pdserve host also runs the router, and its prefill and decode workers share it
# (pdserve up splits this share among the workers it starts). Each worker of a bench-preset 1P+1D on a
# 24 GiB host gets 5.3 GiB of KV, 226k tokens.
DEFAULT_MEMORY_UTILIZATION = 0.5
# A prefill worker's default step budget. Prefill is compute-bound, and a CPU's GEMM runs at its
# peak from a few hundred rows (bench preset, one core: 82 GFLOPS at 512 rows, no more at 2,048), so
# batching more prompts into one step adds no throughput, only latency: every prompt of the batch
# gets its first token when the whole batch is done (DistServe's prefill-batching argument, OSDI'24).
# A longer prompt is chunked, so a queue of short ones is never stuck behind one long forward.
PREFILL_MAX_NUM_BATCHED_TOKENS = 512

LINEAR_WEIGHT_FORMATS = ("auto", "plain", "onednn", "panel")  # see EngineConfig.linear_weight_format
ENGINE_ROLES = (None, "prefill", "decode")  # see EngineConfig.role


def default_long_prefill_token_threshold(role: str | None, max_num_batched_tokens: int) -> int:
    """The per-request prompt tokens per step a worker of ``role`` gets by default. A prefill worker
    cuts a long prompt to half its step budget, so the prompts queued behind it are computed in its
    next step rather than after its last (DistServe's point: prefill batching decides TTFT). A
    decode worker and ``LLM`` leave it off (0), as vLLM does."""
    return max(1, max_num_batched_tokens // 2) if role == "prefill" else 0


def default_prefill_admission(role: str | None) -> str:
    """How a worker of ``role`` admits a prompt into what a step's budget leaves: a prefill worker
    starts only prompts the step can finish (``whole``: run to completion, so no prompt's first token
    waits for a second step), a decode worker and ``LLM`` fill the budget with a chunk (``fill``,
    vLLM's chunked prefill, which keeps a mixed step's size steady)."""
    return "whole" if role == "prefill" else "fill"


def default_linear_weight_format() -> str:
    """What ``--linear-weight-format auto`` leaves to an engine: ``auto`` (timed at load; ``EngineConfig``
    resolves it to ``onednn`` for a prefill worker of several ranks), or ``$PDSERVE_LINEAR_WEIGHT_FORMAT``
    where set (the tests pin ``plain`` there, so that which path a test takes does not depend on the
    machine; tests/test_packed_weights.py and test_panel_linear.py cover the packed layouts)."""
    return os.environ.get("PDSERVE_LINEAR_WEIGHT_FORMAT") or "auto"


def parse_kv_cache_memory(text: str | int) -> int | None:
    """``--kv-cache-memory``: a size (``parse_size``) in bytes, or ``auto`` -> None.

    Raises:
        ValueError: neither.
    """
    return None if isinstance(text, str) and text.strip().lower() == "auto" else parse_size(text)


def default_max_num_batched_tokens(role: str | None) -> int:
    """The step budget a worker of ``role`` ("prefill", "decode", None for the offline LLM) gets by default."""
    return PREFILL_MAX_NUM_BATCHED_TOKENS if role == "prefill" else DEFAULT_MAX_NUM_BATCHED_TOKENS


@dataclass
class EngineConfig:
    """What a worker's engine needs to load the model and size its KV cache.

    Args:
        model: Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer).
        dtype: ``auto`` (the checkpoint's torch_dtype, float32 on a CPU without native bf16;
            see ``pdserve.common.utils.resolve_dtype``), ``float32``, ``bfloat16``, ``float16``.
        kv_cache_dtype: ``auto`` (the model dtype), ``float32``, ``bfloat16``, ``float16``, or a
            quantized format, ``int8``, ``fp8_e4m3``, ``fp8_e5m2`` (per-token-head scales; see
            ``pdserve.common.kv_quant``); what the KV cache (and the KV transfer) holds.
        device: ``auto``, ``cpu``, ``cuda``, ``cuda:N``.
        block_size: token slots per KV block.
        kv_cache_memory: KV cache budget in bytes (``--kv-cache-memory 2GiB``); None (``auto``, the
            default): sized at start from the host's memory (``kv_cache.auto_kv_cache_budget``).
        memory_utilization: with ``kv_cache_memory`` auto, the fraction of the host's memory (its cgroup's
            limit where lower) this worker, all its ranks, may hold in weights and KV cache (vLLM's
            ``--gpu-memory-utilization``, which its CPU backend reads the same way). ``pdserve up`` gives
            each worker it starts its ranks' part of ``DEFAULT_MEMORY_UTILIZATION``.
        kv_offload_memory: bytes of host memory, beyond the KV cache, that evicted prefix-cache blocks
            are copied to and hit from (``--kv-offload-memory 4GiB``; 0: none;
            ``pdserve.engine.scheduling.kv_offload``). Per rank.
        kv_offload_disk: ``PATH:SIZE``: a disk tier below the host one (``--kv-offload-disk``;
            ``pdserve.engine.execution.kv_disk``): what the host tier evicts is written there, a hit is read
            back, and the files survive restarts. Per rank (each rank keeps its share of a block); needs
            ``kv_offload_memory``.
        max_num_seqs: most requests in flight per worker (128, vLLM's CPU default for its API server).
        max_num_batched_tokens: token budget of one step.
        max_model_len: longest sequence; None = the model's max_position_embeddings.
        seed: seeds sampling for requests that give no seed.
        num_threads: torch intra-op CPU threads; None leaves torch's default.
        enable_prefix_caching: reuse the KV of full blocks whose tokens (and all before) match.
        remote_prefill_threshold: decode worker: prompts with fewer uncached tokens than this are
            prefilled locally instead of by a prefill worker (conditional disaggregation).
        long_prefill_token_threshold: most prompt tokens a prompt longer than a step's budget computes
            per step (vLLM's flag; see ``SchedulerConfig``), so the prompts queued behind it share its
            steps; 0: no cap (``default_long_prefill_token_threshold`` gives each role's default).
        prefill_admission: ``fill`` or ``whole``: may a waiting prompt start as a chunk of what a
            step's budget leaves (see ``SchedulerConfig``); ``default_prefill_admission`` gives each
            role's default.
        tensor_parallel_size, pipeline_parallel_size: ranks (processes) of this engine; see
            ``pdserve.engine.execution.parallel``. kv_cache_memory is per rank.
        rank: this process's rank (0 = the driver, which starts the engine; others only run steps).
        master_addr, master_port: the driver's rendezvous (torch's MASTER_ADDR / MASTER_PORT). Left
            out on the driver, it starts every other rank itself on this machine.
        rank_timeout_s: how long any collective of the ranks may wait (a dead rank fails the others).
        enforce_eager: run the model eagerly (no torch.compile / CUDA graphs), as vLLM's flag;
            defaults to ``$PDSERVE_ENFORCE_EAGER`` (set and not 0: eager).
        decode_step_compile: when a compiled decode step is built: ``startup`` (before the engine serves:
            the offline ``LLM``'s default, as vLLM compiles before it generates) or ``background`` (a
            thread compiles it while decode steps run eagerly, and steps switch to it once it is warm:
            workers' default, so a worker serves within seconds of start-up; ``pdserve.engine.execution.
            compiled_step``).
        attention_backend: ``auto`` | ``paged`` (native CPU kernel) | ``reference`` (plain torch);
            see ``pdserve.engine.layers.attention.select_backend``.
        cpu_cores: the CPU cores this worker's threads run on (``"0-3"``, ``"0,2"``); None: all.
        scheduling_policy: ``fcfs`` (arrival order) or ``priority`` (requests' ``priority``, lower
            sooner; preemption evicts the largest first); see ``pdserve.engine.scheduling.request_queue``.
        speculative_config: vLLM's ``--speculative-config`` JSON (``{"method": "ngram",
            "num_speculative_tokens": 4, "prompt_lookup_max": 4}`` or ``{"method": "draft_model",
            "model": DIR, "num_speculative_tokens": 4}``); None: off. Decoding engines only (a
            prefill worker ignores it). See ``pdserve.engine.execution.spec_decode``.
        batch_invariant: a request's logits and tokens are bit-identical whatever else is in the
            batch and however its prefill is chunked (He & Thinking Machines Lab, "Defeating
            Nondeterminism in LLM Inference", 2025): padded matmuls, every query through the paged
            kernel, no compiled decode step. Needs the paged backend and TP <= 2 (ValueError else).
        linear_weight_format: ``auto`` | ``plain`` | ``onednn`` | ``panel``. ``onednn``: the decoder's linear
            weights are reordered once, at load, into oneDNN's blocked layout and every matmul of
            theirs runs through oneDNN (``pdserve.engine.layers.weight_format.pack_linear_weights``; vLLM's CPU
            backend does the same): faster than MKL on a prefill's few hundred rows (15% on Zen 4
            class cores, 2.3x on Zen 5 class). ``panel``: float32 weights packed once in 16-feature
            panels, every matmul through the panel kernel (``pdserve.engine.layers.panel_linear``: 30% faster
            than oneDNN at decode batches of 8-32 rows on Zen 5 class cores, 5-25% behind on prompt chunks).
            ``plain``: MKL, and the decode kernel for a decode step's few rows. ``auto``: on a single-rank
            CPU engine, the layout whose matmuls run fastest here, timed at load on the rows its steps have
            (``weight_format.choose_linear_weight_format``: decode batches and a prompt chunk for an engine
            that decodes, prompt chunks for a prefill worker); ``onednn`` on a prefill worker of several
            ranks (resolved here, so its ranks get it on their command line), ``plain`` elsewhere.
            ``$PDSERVE_LINEAR_WEIGHT_FORMAT`` overrides what ``auto`` means (``default_linear_weight_format``).
        role: the worker kind this engine serves as: ``prefill`` (prompt steps only: a prefill worker),
            ``decode``, or None (both: ``LLM``, a colocated worker). ``from_cli_args`` sets it; it picks the
            row counts the layout probe times.
        native_kernels: ``auto`` | ``all``. ``auto``: at load each native kernel that has a torch path
            (prompt attention, the fused elementwise ops, the few-row decode matmul) is timed against
            it on this CPU and the faster kept (``pdserve.engine.layers.kernel_choice``); ``all``: every kernel
            that builds, untimed. Default ``$PDSERVE_NATIVE_KERNELS`` or ``auto``.
        disable_hybrid_kv_cache_manager: a model whose layers mix sliding windows with full attention
            (Gemma 3, gpt-oss) keeps every block in every layer, one block table per request, instead of
            one table per layer group that frees what leaves a window (vLLM's flag of this name; see
            ``pdserve.common.kv_cache_groups``).
        quantization: None (weights as loaded; a compressed-tensors checkpoint is detected from its
            config.json), ``int8`` (the decoder's linear weights quantized at load time, weight-only,
            per output channel, with torchao; embedding and LM head kept) or ``compressed-tensors``
            (insist on such a checkpoint); see ``pdserve.engine.layers.quantization``. ValueError for
            another name; the model runner raises ValueError where it cannot run (CPU with
            float32/bfloat16 only) or when the name does not fit the checkpoint.
        enable_lora: serve LoRA adapters (Hu et al., "LoRA", 2021) next to the base model, batched
            together (``pdserve.engine.lora``); max_loras: adapters one step may hold (its LoRA slots);
            max_lora_rank: the largest adapter rank accepted; max_cpu_loras: adapters kept read
            in host memory (default: max_loras), as vLLM's flags.
    """

    model: str
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory: int | None = None
    memory_utilization: float = DEFAULT_MEMORY_UTILIZATION
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None
    seed: int = 0
    num_threads: int | None = None
    enable_prefix_caching: bool = True
    remote_prefill_threshold: int = 16
    long_prefill_token_threshold: int = 0
    prefill_admission: str = "fill"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    rank_timeout_s: float = 120.0
    enforce_eager: bool = field(default_factory=lambda: os.environ.get("PDSERVE_ENFORCE_EAGER", "") not in ("", "0"))
    decode_step_compile: str = "startup"
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    cpu_cores: str | None = None
    scheduling_policy: str = "fcfs"
    speculative_config: str | None = None
    batch_invariant: bool = False
    enable_expert_parallel: bool = False
    disable_hybrid_kv_cache_manager: bool = False
    linear_weight_format: str = field(default_factory=lambda: default_linear_weight_format())
    role: str | None = None
    native_kernels: str = field(default_factory=lambda: default_native_kernels())
    quantization: str | None = None
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    kv_offload_memory: int = 0
    kv_offload_disk: str | None = None

    def __post_init__(self):
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive (or None: auto)")
        if not 0 < self.memory_utilization <= 1:
            raise ValueError(f"memory_utilization must be in (0, 1], got {self.memory_utilization}")
        if self.kv_offload_memory < 0:
            raise ValueError("kv_offload_memory must be >= 0")
        if self.kv_offload_disk is not None:
            parse_disk_spec(self.kv_offload_disk)
            if not self.kv_offload_memory:
                raise ValueError("--kv-offload-disk needs --kv-offload-memory: blocks reach the disk tier through "
                                 "the host one")
        if self.cpu_cores is not None:
            parse_cpu_list(self.cpu_cores)  # a bad list fails here, before any rank starts
        if self.native_kernels not in NATIVE_KERNEL_MODES:
            raise ValueError(f"native_kernels must be one of {', '.join(NATIVE_KERNEL_MODES)}, "
                             f"got {self.native_kernels!r}")
        if self.linear_weight_format not in LINEAR_WEIGHT_FORMATS:
            raise ValueError(f"linear_weight_format must be one of {', '.join(LINEAR_WEIGHT_FORMATS)}, "
                             f"got {self.linear_weight_format!r}")
        if self.role not in ENGINE_ROLES:
            raise ValueError(f"role must be one of {', '.join(map(str, ENGINE_ROLES))}, got {self.role!r}")
        if self.linear_weight_format == "auto" and self.role == "prefill" and self.parallel.world_size > 1:
            # each rank would time on its own and might choose differently; its ranks get this on their command
            # line. oneDNN was the faster prompt path on every CPU measured (15% to 2.3x ahead of MKL).
            self.linear_weight_format = "onednn"
        if self.decode_step_compile not in DECODE_STEP_COMPILE:
            raise ValueError(f"decode_step_compile must be one of {', '.join(DECODE_STEP_COMPILE)}, "
                             f"got {self.decode_step_compile!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.speculative_config is not None:
            self.speculative  # noqa: B018  a bad config fails here, before any rank starts
        if self.kv_cache_dtype not in KV_CACHE_DTYPE_CHOICES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose from "
                             f"{', '.join(KV_CACHE_DTYPE_CHOICES)}")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0: no cap)")
        if self.batch_invariant and self.attention_backend == "reference":
            raise ValueError("batch_invariant needs the paged attention kernel (attention_backend auto or paged): "
                             "the reference backend's padded SDPA reduces differently with the batch")
        if self.batch_invariant and self.tensor_parallel_size > 2:
            raise ValueError("batch_invariant supports tensor_parallel_size <= 2: an all-reduce over more ranks "
                             "may add the partial sums in an order that changes with the batch")
        check_quantization_name(self.quantization)
        if self.max_loras < 1 or self.max_lora_rank < 1 or (self.max_cpu_loras is not None
                                                             and self.max_cpu_loras < self.max_loras):
            raise ValueError(f"max_loras ({self.max_loras}) and max_lora_rank ({self.max_lora_rank}) must be >= 1, "
                             f"and max_cpu_loras ({self.max_cpu_loras}) >= max_loras")
        if self.enable_lora and self.batch_invariant:
            raise ValueError("enable_lora and batch_invariant cannot be combined: the LoRA matmuls are not padded "
                             "to a batch-independent shape")
        world_size = self.parallel.world_size  # validates the sizes
        if not 0 <= self.rank < world_size:
            raise ValueError(f"rank {self.rank} is outside the worker's {world_size} ranks")

    @property
    def speculative(self):
        """The parsed ``SpeculativeConfig``, or None (raises ValueError for a bad one)."""
        from pdserve.engine.speculative_config import SpeculativeConfig

        if self.speculative_config is None:
            return None
        return SpeculativeConfig.from_json(self.speculative_config)

    @property
    def parallel(self) -> ParallelConfig:
        return ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        g = parser.add_argument_group("engine")
        g.add_argument("--model", required=True, help="Hugging Face checkpoint directory")
        g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                       help="model dtype; auto: the checkpoint's torch_dtype, float32 on a CPU without native "
                            "bf16 (AVX-512 BF16 / AMX)")
        g.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPE_CHOICES),
                       help="KV cache dtype (auto: the model's); int8 / fp8_e4m3 / fp8_e5m2 store quantized rows "
                            "with per-token-head scales (about 4x fewer bytes than float32); the KV transfer "
                            "ships the cache's bytes as they are and says the dtype in its header")
        g.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
        g.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
        g.add_argument("--kv-cache-memory", type=parse_kv_cache_memory, default=None,
                       help="KV cache budget per rank, e.g. 2GiB; auto (the default): what --memory-utilization "
                            "of the host's memory leaves once the weights are loaded, at most what --max-num-seqs "
                            "sequences of --max-model-len tokens fill")
        g.add_argument("--memory-utilization", type=float, default=DEFAULT_MEMORY_UTILIZATION,
                       help=f"with --kv-cache-memory auto: the fraction of the host's memory (a container's limit "
                            f"where lower) this worker may hold in weights and KV cache (default "
                            f"{DEFAULT_MEMORY_UTILIZATION}; pdserve up gives each worker it starts its ranks' part of that)")
        g.add_argument("--kv-offload-memory", type=parse_size, default="0",
                       help="host memory beyond the KV cache for evicted prefix blocks (an offload tier: a prefix "
                            "found there is copied back instead of recomputed), e.g. 4GiB; 0: none")
        g.add_argument("--kv-offload-disk", default=None, metavar="PATH:SIZE",
                       help="a disk tier below --kv-offload-memory, e.g. /var/cache/pdserve-kv:20GiB: blocks the "
                            "host tier evicts are written there and read back on a hit; the files survive a "
                            "restart (warm restart), checked by model fingerprint and checksum")
        g.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                       help=f"most requests in flight on this worker (default {DEFAULT_MAX_NUM_SEQS})")
        g.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help=f"token budget of one step (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}; a prefill worker's "
                            f"{PREFILL_MAX_NUM_BATCHED_TOKENS}: a CPU's GEMM is saturated by a few hundred rows, so "
                            "a bigger prefill batch only delays every prompt in it)")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
        g.add_argument("--seed", type=int, default=0, help="seed of the sampler's generator (requests without a seed)")
        g.add_argument("--num-threads", type=int, default=None,
                       help="torch CPU threads (default: one per core of --cpu-cores, else torch's default)")
        g.add_argument("--cpu-cores", default=None,
                       help="pin this worker to these cores, e.g. 0-3 or 0,2 (its ranks split them); "
                            "pdserve up gives each worker its own share by default")
        g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="turn prefix caching off (on by default)")
        g.add_argument("--remote-prefill-threshold", type=int, default=16,
                       help="decode worker: prefill prompts with fewer uncached tokens locally")
        g.add_argument("--long-prefill-token-threshold", type=int, default=None,
                       help="most tokens a prompt longer than the step budget computes per step, so it shares its "
                            "steps with the prompts queued behind it (vLLM's flag; a prompt that fits one step is "
                            "never split; 0: no cap; default: half the step budget on a prefill worker, else 0)")
        g.add_argument("--prefill-admission", choices=["fill", "whole"], default=None,
                       help="fill: a waiting prompt may start as a chunk of what a step's budget leaves (vLLM's "
                            "chunked prefill); whole: a prompt that fits one step waits for a step that can "
                            "finish it, so it never spans two (default: whole on a prefill worker, else fill)")
        g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="ranks each layer is split over")
        g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, help="pipeline stages")
        g.add_argument("--rank", type=int, default=None,
                       help="this process's rank in its worker (default: $RANK or 0); ranks > 0 only run steps")
        g.add_argument("--master-addr", default=None,
                       help="the driver rank's rendezvous host (default: $MASTER_ADDR; unset on the driver: "
                            "it starts all ranks on this machine)")
        g.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: $MASTER_PORT)")
        g.add_argument("--rank-timeout", type=float, default=120.0, dest="rank_timeout_s",
                       help="seconds any collective between a worker's ranks may wait")
        g.add_argument("--enforce-eager", action="store_true",
                       default=os.environ.get("PDSERVE_ENFORCE_EAGER", "") not in ("", "0"),
                       help="run the decode step eagerly: no torch.compile at start-up (as vLLM's flag; "
                            "default: $PDSERVE_ENFORCE_EAGER)")
        g.add_argument("--decode-step-compile", default="background", choices=list(DECODE_STEP_COMPILE),
                       help="background: serve at once with eager decode steps while a thread compiles the "
                            "decode step, then switch to it (a first start compiles for tens of seconds on a "
                            "small CPU; a restart reuses inductor's cache); startup: compile before registering "
                            "(default background)")
        g.add_argument("--attention-backend", default="auto", choices=["auto", "paged", "reference"],
                       help="paged: native CPU kernel reading K/V through block tables; reference: gather + "
                            "SDPA in plain torch (any device); auto: paged where it runs")
        g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                       help="waiting order: fcfs (arrival) or priority (the request's priority field, lower "
                            "sooner; preemption evicts the lowest priority first)")
        g.add_argument("--speculative-config", default=None,
                       help='speculative decoding (vLLM\'s JSON): \'{"method": "ngram", "num_speculative_tokens": '
                            '4, "prompt_lookup_max": 4}\' or \'{"method": "draft_model", "model": DIR, '
                            '"num_speculative_tokens": 4}\'; decode side only')
        g.add_argument("--batch-invariant", action="store_true",
                       help="bit-identical results for a request whatever else is batched with it and however "
                            "its prefill is chunked (padded matmuls, all attention through the paged kernel, "
                            "eager decode); costs speed, needs the paged backend")
        g.add_argument("--enable-expert-parallel", action="store_true",
                       help="MoE models: split the routed experts across the worker's tensor-parallel ranks "
                            "(each rank holds num_experts / TP whole experts) instead of slicing every expert; "
                            "attention stays tensor-parallel")
        g.add_argument("--linear-weight-format", choices=LINEAR_WEIGHT_FORMATS, default="auto",
                       help="onednn: the decoder's linear weights reordered at load into oneDNN's blocked layout, "
                            "every matmul through oneDNN (faster prefill GEMMs on CPU); panel: float32 weights packed "
                            "in 16-feature panels for the panel kernel (decode batches of 8-64 rows); plain: MKL, "
                            "and the decode kernel for decode steps; auto: on a single-rank CPU engine, the "
                            "layout whose matmuls run fastest here on the rows its steps have, timed at load "
                            "(onednn on a prefill worker of several ranks)")
        g.add_argument("--native-kernels", choices=NATIVE_KERNEL_MODES, default=None,
                       help="auto: each native kernel that replaces a torch path (prompt attention, fused "
                            "RMSNorm/SwiGLU/RoPE, few-row decode matmuls) is timed against it at load on this "
                            "CPU and the faster kept (the choice is logged and shown in /workers); all: every "
                            "kernel that builds, untimed (default: $PDSERVE_NATIVE_KERNELS or auto)")
        g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                       help="models mixing sliding-window and full-attention layers (Gemma 3, gpt-oss): keep every "
                            "KV block in every layer (one block table) instead of freeing what leaves a window")
        g.add_argument("--quantization", "-q", default=None, choices=QUANTIZATION_METHODS,
                       help="int8: quantize the linear weights at load time (weight-only, per output channel, "
                            "torchao; embedding and LM head kept); compressed-tensors: a W8A16/W4A16 checkpoint "
                            "(detected without the flag too); CPU, float32/bfloat16")
        g.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (the request's adapter is applied in a batch mixing adapters)")
        g.add_argument("--max-loras", type=int, default=1, help="LoRA adapters one step may hold")
        g.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank accepted")
        g.add_argument("--max-cpu-loras", type=int, default=None,
                       help="LoRA adapters kept read in host memory (default: --max-loras)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, role: str | None = None) -> "EngineConfig":
        """The config from ``add_cli_args`` flags; rank and rendezvous fall back to RANK / MASTER_ADDR /
        MASTER_PORT from the environment, as torch's launchers set them. ``role`` ("prefill",
        "decode" or None) becomes the config's and picks the defaults that differ by role: the token budget
        (``PREFILL_MAX_NUM_BATCHED_TOKENS`` for a prefill worker), the prompt admission and chunk cap, and
        what ``--linear-weight-format auto`` means (``default_linear_weight_format``)."""
        rank = args.rank if args.rank is not None else int(os.environ.get("RANK", "0"))
        master_port = args.master_port or (int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None)
        budget = (default_max_num_batched_tokens(role) if args.max_num_batched_tokens is None
                  else args.max_num_batched_tokens)
        return cls(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                   kv_cache_memory=args.kv_cache_memory, memory_utilization=args.memory_utilization,
                   max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=budget,
                   max_model_len=args.max_model_len,
                   seed=args.seed, num_threads=args.num_threads, enable_prefix_caching=args.enable_prefix_caching,
                   remote_prefill_threshold=args.remote_prefill_threshold,
                   long_prefill_token_threshold=default_long_prefill_token_threshold(role, budget)
                   if args.long_prefill_token_threshold is None else args.long_prefill_token_threshold,
                   prefill_admission=args.prefill_admission or default_prefill_admission(role),
                   tensor_parallel_size=args.tensor_parallel_size, pipeline_parallel_size=args.pipeline_parallel_size,
                   rank=rank, master_addr=args.master_addr or os.environ.get("MASTER_ADDR"), master_port=master_port,
                   rank_timeout_s=args.rank_timeout_s, attention_backend=args.attention_backend,
                   kv_cache_dtype=args.kv_cache_dtype, cpu_cores=args.cpu_cores,
                   enforce_eager=args.enforce_eager, decode_step_compile=args.decode_step_compile,
                   scheduling_policy=args.scheduling_policy,
                   speculative_config=args.speculative_config, batch_invariant=args.batch_invariant,
                   enable_expert_parallel=args.enable_expert_parallel,
                   disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager,
                   linear_weight_format=args.linear_weight_format if args.linear_weight_format != "auto"
                   else default_linear_weight_format(),
                   role=role,
                   enable_lora=args.enable_lora, max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                   max_cpu_loras=args.max_cpu_loras, quantization=args.quantization,
                   native_kernels=args.native_kernels or default_native_kernels(),
                   kv_offload_memory=args.kv_offload_memory, kv_offload_disk=args.kv_offload_disk)

    def rank_cli_args(self, rank: int, master_addr: str, master_port: int) -> list[str]:
        """``pdserve rank`` arguments that start rank ``rank`` of this engine (how the driver spawns them)."""
        args = ["--model", self.model, "--dtype", self.dtype, "--device", self.device, "--block-size",
                str(self.block_size), "--kv-cache-memory", str(self.kv_cache_memory or "auto"),
                "--memory-utilization", repr(self.memory_utilization), "--max-num-seqs",
                str(self.max_num_seqs), "--max-num-batched-tokens", str(self.max_num_batched_tokens),
                "--seed", str(self.seed), "--tensor-parallel-size", str(self.tensor_parallel_size),
                "--pipeline-parallel-size", str(self.pipeline_parallel_size), "--rank", str(rank),
                "--master-addr", master_addr, "--master-port", str(master_port),
                "--rank-timeout", str(self.rank_timeout_s), "--attention-backend", self.attention_backend,
                "--kv-cache-dtype", self.kv_cache_dtype]
        if self.max_model_len is not None:
            args += ["--max-model-len", str(self.max_model_len)]
        if self.num_threads is not None:
            args += ["--num-threads", str(self.num_threads)]
        if self.cpu_cores is not None:
            args += ["--cpu-cores", self.cpu_cores]
        if self.enforce_eager:
            args.append("--enforce-eager")
        args += ["--decode-step-compile", self.decode_step_compile]
        if not self.enable_prefix_caching:
            args.append("--no-prefix-caching")
        if self.batch_invariant:
            args.append("--batch-invariant")
        if self.enable_expert_parallel:
            args.append("--enable-expert-parallel")
        if self.disable_hybrid_kv_cache_manager:
            args.append("--disable-hybrid-kv-cache-manager")
        args += ["--linear-weight-format", self.linear_weight_format, "--native-kernels", self.native_kernels]
        if self.quantization is not None:
            args += ["--quantization", self.quantization]
        if self.enable_lora:
            args += ["--enable-lora", "--max-loras", str(self.max_loras), "--max-lora-rank", str(self.max_lora_rank)]
            if self.max_cpu_loras is not None:
                args += ["--max-cpu-loras", str(self.max_cpu_loras)]
        if self.kv_offload_memory:
            args += ["--kv-offload-memory", str(self.kv_offload_memory)]
        if self.kv_offload_disk:
            args += ["--kv-offload-disk", self.kv_offload_disk]
        return args


def parse_disk_spec(spec: str) -> tuple[str, int]:
    """``PATH:SIZE`` (``--kv-offload-disk /var/cache/kv:20GiB``) -> (path, bytes).

    Raises:
        ValueError: no ``:SIZE``, or a size that does not parse."""
    path, sep, size = spec.rpartition(":")
    if not sep or not path:
        raise ValueError(f"--kv-offload-disk takes PATH:SIZE (e.g. /var/cache/pdserve-kv:20GiB), got {spec!r}")
    return path, parse_size(size)
