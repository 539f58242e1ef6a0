"""What a ``ModelRunner`` decided at start-up, and why: its choices as one printable object.

A runner's start-up is a chain of choices: the dtype (the checkpoint's, or the flag's), the cores it
pins, the quantization, this rank's layers, each native kernel or torch's path (timed), the linear
weights' layout (timed), the KV cache's format and size, the attention backend, and whether the decode
step is compiled. Each is made here, by a function of the config and what was measured, and recorded
with its reason in a ``RunnerPlan``; ``ModelRunner`` builds from the plan. The plan is logged once when
the runner is ready (``describe``) and sent to routers at registration (``RegisterWorker.plan``, shown
in ``/workers``), so how a worker runs is never a guess.

Some choices need the loaded model (the probes time its own layers), so the plan fills in three steps:
before the model loads (device, dtype, KV format, cores, quantization, layers), after it loads (kernels,
weight layout) and once the cache exists (cache size, attention backend, decode step).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pdserve.engine.layers.weight_format import (PREFILL_PROBE_BYTES, PREFILL_PROBE_ROWS,
                                                 choose_linear_weight_format)

# The plan's fields in the order they are decided and printed.
DECISIONS = ("device", "dtype", "kv_cache_dtype", "cpu_cores", "quantization", "layers", "native_kernels",
             "linear_weight_format", "kv_cache", "kv_offload", "attention_backend", "decode_step")


@dataclass
class RunnerPlan:
    """One runner's start-up choices, each a short value with the reason it was taken (``why``).

    Values are strings, as shown: ``dtype`` "float32", ``cpu_cores`` "0-1", ``layers`` "0-11 of 12",
    ``native_kernels`` "prefill_attention=native, elementwise=torch", ``decode_step`` "compiled" or
    "eager", ``kv_cache`` "4096 blocks x 16 tokens, 192.0 MiB". A decision not made on this worker
    (no cores pinned off the CPU, say) is absent.
    """

    values: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)

    def decide(self, name: str, value, why: str = "") -> None:
        """Record decision ``name`` (one of ``DECISIONS``) as ``value``, taken because ``why``.
        Raises KeyError for a name that is not a decision."""
        if name not in DECISIONS:
            raise KeyError(f"{name!r} is not a runner decision; one of {', '.join(DECISIONS)}")
        self.values[name] = str(value)
        if why:
            self.why[name] = why

    def __getitem__(self, name: str) -> str:
        return self.values[name]

    def as_dict(self) -> dict[str, str]:
        """``{decision: "value (why)"}`` in decision order: what ``/workers`` shows."""
        return {name: self.values[name] + (f" ({self.why[name]})" if name in self.why else "")
                for name in DECISIONS if name in self.values}

    def describe(self) -> str:
        """The plan as lines ``name: value (why)``, one per decision made."""
        return "\n".join(f"  {name}: {text}" for name, text in self.as_dict().items())


def decide_linear_weight_format(requested: str, device: torch.device, single_rank: bool, batch_invariant: bool,
                                quantization: str | None, model, role: str | None = None) -> tuple[str, str]:
    """The linear weights' layout for ``--linear-weight-format requested`` and why: ``auto`` times the
    layouts on ``model``'s own weights (``weight_format.choose_linear_weight_format``) where that can
    pay (one CPU rank, float weights, not batch-invariant), on the rows this engine's steps have (``role``
    "prefill": prompt chunks only, ``PREFILL_PROBE_ROWS``; else decode batches and a prompt chunk), else
    keeps ``plain``; a named layout is kept."""
    if requested != "auto":
        return requested, "--linear-weight-format"
    if device.type != "cpu":
        return "plain", "not a CPU"
    if not single_rank:
        return "plain", "several ranks would each choose"
    if batch_invariant:
        return "plain", "--batch-invariant"
    if quantization is not None:
        return "plain", f"--quantization {quantization}"
    if role == "prefill":
        fmt, why = choose_linear_weight_format(model, rows=PREFILL_PROBE_ROWS, probe_bytes=PREFILL_PROBE_BYTES)
        return fmt, f"timed at prompt rows: {why}"
    fmt, why = choose_linear_weight_format(model)
    return fmt, f"timed: {why}"


def decide_decode_step(enforce_eager: bool, batch_invariant: bool, quantization: str | None,
                       dtype: torch.dtype, int8_kernel_built: bool, single_rank: bool = True,
                       attention_backend: str = "paged") -> tuple[bool, str]:
    """Whether the decode step is compiled (``torch.compile``, ``CompiledDecodeStep``) and why not if not.
    Compiled by default; eager with ``--enforce-eager``, with ``--batch-invariant`` (inductor fuses and
    reorders reductions by batch size, not shown invariant), and with int8 weights without the int8
    kernel (bfloat16 activations or no compiler: inductor would convert the weight itself, 3-4x slower
    than eager), and where ``CompiledDecodeStep`` does not apply: several ranks (their steps run
    collectives), or attention not through the paged kernel's opaque op."""
    if batch_invariant:
        return False, "--batch-invariant (a compiled step is not shown invariant)"
    if quantization is not None and not (dtype == torch.float32 and int8_kernel_built):
        return False, (f"--quantization {quantization} without the int8 kernel (float32 activations and a C++ "
                       "compiler; see pdserve.engine.layers.int8_linear)")
    if enforce_eager:
        return False, "--enforce-eager"
    if not single_rank:
        return False, "several ranks (compiled only for a single-rank worker)"
    if attention_backend != "paged":
        return False, f"the {attention_backend} attention backend (compiled only over the paged kernel)"
    return True, ""
