"""The decode step's forward under torch.compile (inductor), compiled and warmed before steps use it.

A decode-only step (one new token per sequence) is the step a decode worker runs thousands of
times a second's worth: its forward is traced once with a symbolic batch size (torch
specializes batch 1 on its own) and replayed, so the Python of every layer, the elementwise
ops inductor fuses and the small tensors between them cost nothing per step. Attention
(``pdserve::paged_decode_attention``), the MoE experts (``pdserve::moe_experts``), the
decode linear kernel and oneDNN-packed linears (``pdserve::onednn_linear``, by handle) are opaque
operators inside the graph. Steps with longer queries
(prefill chunks, speculative verification), LoRA adapters, a layer hook (KV sends) or several
ranks run eagerly (``ModelRunner._run_forward`` decides). Prefill stays eager: MKL's GEMMs
already take ~85% of a float32 prefill here, and in one try (2026-11-25, the bench preset, 288
tokens, one core) the same forward compiled with a dynamic sequence length took 10 s against
0.55 s eager, inductor generating its own kernels for part of the graph.

Compiling takes a while (35-55 s for the built-in model's three graphs on one Zen 3 core with a cold
inductor cache; a restart with the cache warm, see docs/benchmarks.md), so a worker builds the step in
a thread while it already serves with eager steps (``EngineConfig.decode_step_compile``): the warm-up
runs on a scratch cache of its own, never on blocks that requests hold, and the runner switches to the
step once every graph is compiled.
"""

from __future__ import annotations

import logging
import os
import time
import types
from typing import TYPE_CHECKING, Protocol

import torch

from pdserve.engine.layers import decode_linear
from pdserve.engine.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from pdserve.engine.execution.model_input import ModelInput

logger = logging.getLogger(__name__)

# Inductor's wrapper checks every input's and every opaque operator's output size and stride with a call
# each (~176 a step on the bench preset): 0.1 ms of the Python that runs the graph at batch 1 (0.61-0.63 ->
# 0.48-0.53 ms). The graph's inputs are checked by dynamo's guards already, and the operators' fake
# kernels by tests/test_compiled_step.py (every step's tokens against transformers').
_INDUCTOR_OPTIONS = {"size_asserts": False, "alignment_asserts": False}


def use_persistent_compile_cache() -> str:
    """Point inductor's cache (its generated code, FX graphs and AOT autograd artifacts) at
    ``~/.cache/pdserve/inductor`` unless ``$TORCHINDUCTOR_CACHE_DIR`` is set, so that a restart, after a
    reboot too, finds the graphs compiled before (torch's default is ``/tmp/torchinductor_<user>``, which
    /tmp's cleaners take; vLLM keeps its compile cache under ``~/.cache`` likewise). Returns the directory."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not path:
        path = os.path.join(os.path.expanduser("~"), ".cache", "pdserve", "inductor")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path  # read by inductor at each use
    return path


def _keep_guards(guards) -> list[bool]:
    """Dynamo's ``guard_filter_fn``: keep the guards on the step's inputs and every tensor's checks
    (shapes, strides, dtypes), drop the rest of those on the model's modules (see ``CompiledDecodeStep.build``)."""
    return [g.guard_type == "TENSOR_MATCH" or not g.orig_guard.source.is_unspecialized_nn_module() for g in guards]


class DecodeRunner(Protocol):
    """What the compiled step reads of its ``ModelRunner`` (which builds it, so it does not import it)."""

    model: torch.nn.Module
    device: torch.device
    kv_cache: torch.Tensor
    ranks: object | None  # TP/PP rank group: compiled only on one rank
    attention_backend: str
    attn_kv_dtype: str | None  # the KV cache's quantized format, None for the model's dtype


class CompiledDecodeStep:
    """A runner's decode-only forward, compiled.

    ``step(inp, kv_cache) -> hidden [num_seqs, hidden_size]`` for a ``ModelInput`` whose every
    sequence has one new token (``max_query_len == 1``). Build it with ``build``.
    """

    def __init__(self, runner: DecodeRunner):
        self.runner = runner
        self._compiled = None

    @classmethod
    def build(cls, runner: DecodeRunner) -> CompiledDecodeStep | None:
        """Compile ``runner``'s decode step and warm it up now; None where it stays eager (logged).
        Safe to call from a thread while ``runner`` serves eager steps: it reads the model and writes
        only a scratch KV cache.

        One graph with a symbolic batch size serves every decode batch (torch specializes batch 1 on
        its own, so both are compiled here, at start-up). Inductor's cache
        (``use_persistent_compile_cache``) makes a restart's compile a cache hit. Only a single-rank
        worker whose attention runs through the opaque ``pdserve::paged_decode_attention`` op
        compiles. An inductor failure costs speed, never the worker: it is logged and the step
        runs eagerly.
        """
        if runner.ranks is not None or runner.attention_backend != "paged":
            logger.info("decode step runs eagerly (compiled only for single-rank workers on the paged backend)")
            return None
        step = cls(runner)
        # Dynamo keeps its graphs (and its recompilation limit) per code object. Each step compiles a
        # code object of its own, a copy of _forward's, so one model's graphs can never serve another
        # model's step, whatever guards are dropped below: the packed linears' handles, for one, are
        # constants of the graph, and two models of one shape would otherwise share it.
        method = step._forward.__func__
        own = types.FunctionType(method.__code__.replace(), method.__globals__, method.__name__,
                                 method.__defaults__, method.__closure__)
        # Dynamo's guards on the model's modules (a hooks dict per module, each parameter's tensor checks:
        # ~1,450 of the step's ~2,300 guards) cost 0.25-0.3 ms of every step at batch 1 on the bench preset.
        # They would catch a module changed after the compile, and nothing changes one: weights are loaded
        # and packed, and LoRA slots attached, before it.
        use_persistent_compile_cache()
        compiled = torch.compile(types.MethodType(own, step), dynamic=True,
                                 options={"guard_filter_fn": _keep_guards, **_INDUCTOR_OPTIONS})
        start = time.monotonic()
        try:
            step._warm_up(compiled)
        except Exception as e:  # noqa: BLE001
            logger.warning("could not compile the decode step (%s: %s); running it eagerly", type(e).__name__, e)
            return None
        step._compiled = compiled
        logger.info("decode step compiled in %.1f s (--enforce-eager turns this off)", time.monotonic() - start)
        return step

    def __call__(self, inp: ModelInput, kv_cache: torch.Tensor) -> torch.Tensor:
        md = inp.attn_metadata
        slots, tables = md.slot_mapping, md.block_tables
        if md.group_tables:  # KV cache groups: [num_groups, batch] slots, [num_groups, batch, width] tables
            width = max(t.shape[1] for _, t in md.group_tables)
            width = max(width, tables.shape[1])
            pad = torch.nn.functional.pad
            slots = torch.stack([slots, *(s for s, _ in md.group_tables)])
            tables = torch.stack([pad(t, (0, width - t.shape[1])) for t in (tables, *(t for _, t in md.group_tables))])
        if tables.shape[-1] < 2:  # at least two wide, as compiled (the kernel reads only seq_lens' worth)
            tables = torch.nn.functional.pad(tables, (0, 2 - tables.shape[-1]))
        with torch.inference_mode(False), torch.no_grad():  # inference tensors do not mix with compile
            return self._compiled(inp.input_ids.clone(), inp.positions.clone(), kv_cache, slots.clone(),
                                  tables.clone(), md.seq_lens.clone(), md.query_start_loc.clone())

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor) -> torch.Tensor:
        """The model forward of a decode-only step (one new token per sequence), from plain tensors.

        slot_mapping [batch] and block_tables [batch, width], or with KV cache groups one of each per
        group, stacked: [num_groups, batch] and [num_groups, batch, width]."""
        runner = self.runner
        model = runner.model
        groups = model.kv_cache_groups

        def metadata_of(slots: torch.Tensor, tables: torch.Tensor) -> AttentionMetadata:
            return AttentionMetadata(slots, tables, seq_lens, query_start_loc, max_query_len=1, max_seq_len=0,
                                     backend=runner.attention_backend, kv_cache_dtype=runner.attn_kv_dtype)

        hidden = model.embed(input_ids)
        start, end = model.layer_range
        if groups is None:
            metadata = metadata_of(slot_mapping, block_tables)
            for i in range(end - start):
                hidden = model.decoder_layers[start + i](positions, hidden, kv_cache, metadata, layer=i)
            return hidden
        per_group = [metadata_of(slot_mapping[g], block_tables[g]) for g in range(groups.num_groups)]
        for i in range(end - start):
            hidden = model.decoder_layers[start + i](positions, hidden, kv_cache, per_group[groups.layer_groups[i]],
                                                   layer=groups.layer_slots[i])
        return hidden

    def _warm_up(self, compiled) -> None:
        """Compile now every graph a decode step can need, so no request pays a recompilation: batch 1
        (torch specializes a size of 1), batches 2 to ``KERNEL_MAX_ROWS`` (the decode linear kernel's
        range, a guard of its own) and larger ones.

        The inputs look like real ones to dynamo's guards: distinct tensors (one tensor passed as
        input_ids, positions and slot_mapping is an aliasing guard every real step fails), block
        tables at least three wide and of a width no other input size has (dynamo's duck sizing ties
        two dimensions of one size into one symbol, and a real step whose tables are wider fails that
        guard: two wide equals the cache's K/V dimension; three equalled a Gemma 3 checkpoint's three KV
        cache groups, and every real step recompiled, ~5-10 s each, until the recompile limit), and a
        cache shaped as the runner's but for its number of blocks (``_scratch_cache``), so requests'
        blocks are never written."""
        device = self.runner.device
        kv_cache = _scratch_cache(self.runner.kv_cache)
        batches = [1, 2]
        if decode_linear.build_kernel():  # the kernel takes 1..KERNEL_MAX_ROWS rows; larger batches: torch's GEMM
            batches.append(decode_linear.KERNEL_MAX_ROWS + 1)
        groups = self.runner.model.kv_cache_groups
        lead = () if groups is None else (groups.num_groups,)
        taken = {*kv_cache.shape, *batches, *(b + 1 for b in batches), *lead}  # b + 1: query_start_loc
        width = next(n for n in range(3, 128) if n not in taken)
        for batch in batches:
            logger.info("compiling the decode step (batch %d)...", batch)
            with torch.inference_mode(False), torch.no_grad():
                def zeros(*shape):
                    return torch.zeros(*shape, dtype=torch.int64, device=device)

                compiled(zeros(batch), zeros(batch), kv_cache, zeros(*lead, batch), zeros(*lead, batch, width),
                         zeros(batch) + 1, torch.arange(batch + 1, device=device))


def _scratch_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """A zeroed cache shaped as ``kv_cache`` [layers, kv_slots, num_blocks, block_size, heads, row] but with
    a few blocks: a number no other size of the warm-up's inputs has (batches 1, 2, 33; the tables' width is
    picked after it), so dynamo's size-equality guards are the same as a real step's and the graphs it
    compiles serve the real cache (``num_blocks`` is a symbolic size of the graph)."""
    taken = set(kv_cache.shape) | {0, 1, 2, 3, 4, decode_linear.KERNEL_MAX_ROWS + 1, decode_linear.KERNEL_MAX_ROWS + 2}
    num_blocks = next(n for n in range(5, 64) if n not in taken)
    shape = list(kv_cache.shape)
    shape[2] = num_blocks
    return torch.zeros(shape, dtype=kv_cache.dtype, device=kv_cache.device)
