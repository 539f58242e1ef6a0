"""Native kernel or torch's own path: chosen on this machine, by measurement, when an engine loads.

Each native kernel (``pdserve/kernels``) replaces a torch path, and whether it is the faster
depends on the CPU it runs on. The prompt attention kernel ran 2x torch's flash SDPA on a Zen 5 core
with AVX-512, while the same source, built for an AVX2 EPYC, ran 6-9x slower than SDPA there (its
16-lane tiles did not fit AVX2's 16 registers). So an engine does not run a kernel because it builds:
``choose_kernels`` times each kernel against the path it replaces, on this engine's own shapes
(interleaved, best of ``REPEATS``, a few milliseconds each), keeps the faster, logs both figures, and
the worker reports the choice (``/workers``: ``kernels``).

The kernels it decides, each a name call sites ask ``native(name)`` about:

- ``prefill_attention``: a prompt's causal attention (``prefill_attention.causal_attention``)
  against torch's SDPA, one layer's heads, for fresh prompts of ``ATTENTION_FRESH`` tokens and for a
  chunk of ``ATTENTION_CHUNK_ROWS`` rows after cached ones over ``ATTENTION_CHUNK_KEYS`` keys. Which wins
  changes with the shape: on an AVX2 EPYC the kernel led on fresh prompts up to ~1,000 tokens (14.8
  against 19.8 ms at 512) while SDPA's GEMM blocks led on every chunk (21 against 27 ms for 256 rows over
  1,024 keys). So for each shape the kernel takes the lengths up to the longest it won at, with every
  shorter one (``native_max_keys``);
- ``elementwise``: RMSNorm, SwiGLU and rotary embedding in one pass each
  (``pdserve.engine.layers.elementwise``) against their torch operators, the model's own layers on
  ``ELEMENTWISE_ROWS`` rows;
- ``decode_linear``: a decode step's few-row matmuls on plain weights (``pdserve.engine.layers.decode_linear``)
  against torch's GEMM, on the model's first linears at ``DECODE_ROWS`` rows (the
  ``--linear-weight-format`` probe then times the plain layout on the path chosen here).

Not decided here: the paged decode attention (``--attention-backend``; its torch path gathers every
sequence's context into padded tensors each step), the KV transfer's gather (its torch path is two
passes over the bytes where the kernel makes one) and the int8 linear (its torch path dequantizes the
whole weight on every call). docs/benchmarks.md has each of them against its torch path, per machine.

``native_kernels="all"`` (``--native-kernels all``; the tests pin it, so which path a test takes does
not depend on the machine) runs every kernel that builds, unprobed. The choice is process-wide: a
process serves one engine (several engines in one process, as in tests, share the last one's).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from pdserve.engine.config import NATIVE_KERNEL_MODES
from pdserve.engine.layers.native_switch import KERNELS, native, native_max_keys, set_native, set_native_max_keys  # noqa: F401

logger = logging.getLogger(__name__)

REPEATS = 5
ATTENTION_FRESH = (128, 512, 1024)  # fresh prompts' tokens the attention probe times
ATTENTION_CHUNK_ROWS = 256  # a prompt chunk after cached rows (a prefill worker's long prompts go 256 a step)
ATTENTION_CHUNK_KEYS = (512, 2048)  # the keys such a chunk attends over, probed
ELEMENTWISE_ROWS = 256
DECODE_ROWS = (1, 8)
DECODE_PROBE_BYTES = 48 * 2**20  # the first linears' weights, up to this much (streamed as in a step)

@dataclass
class KernelChoice:
    """One kernel's decision: ``path`` is ``native`` or ``torch``; the probe's best times in ms, summed over
    its shapes (None where one path could not run); ``why`` the line logged; ``max_keys`` and
    ``max_chunk_keys`` (prompt attention) the most keys the native path takes for a fresh prompt and for
    a chunk after cached rows (None: any; 0: none)."""

    kernel: str
    path: str
    native_ms: float | None = None
    torch_ms: float | None = None
    why: str = ""
    max_keys: int | None = None
    max_chunk_keys: int | None = None


def _best_ms(paths: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each path's best time in ms over ``repeats`` rounds, the paths interleaved (after one warm call each)."""
    for run in paths.values():
        run()
    best = {name: float("inf") for name in paths}
    for _ in range(repeats):
        for name, run in paths.items():
            start = time.perf_counter()
            run()
            best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def _toggled(kernel: str, work: Callable[[], object]) -> dict[str, Callable[[], object]]:
    """``work`` run with ``kernel`` native and with it off, as the two paths a probe times."""
    def with_native(on: bool) -> Callable[[], object]:
        def run():
            before = native(kernel)
            set_native(kernel, on)
            try:
                return work()
            finally:
                set_native(kernel, before)
        return run
    return {"native": with_native(True), "torch": with_native(False)}


def _decide(kernel: str, times: dict[str, float], what: str) -> KernelChoice:
    path = "native" if times["native"] <= times["torch"] else "torch"
    why = f"{what}: native {times['native']:.2f} ms, torch {times['torch']:.2f} ms"
    return KernelChoice(kernel, path, times["native"], times["torch"], why)


def _first(model: nn.Module, attrs: tuple[str, ...]) -> nn.Module | None:
    return next((m for m in model.modules() if all(hasattr(m, a) for a in attrs)), None)


def _attention_limit(times: list[tuple[int, dict[str, float]]]) -> tuple[int | None, bool]:
    """From ``(keys, best ms per path)`` in increasing keys: the longest length up to which the kernel won
    at every probed length (None: it lost at the shortest), and whether it won at all of them."""
    limit = None
    for n, t in times:
        if t["native"] > t["torch"]:
            return limit, False
        limit = n
    return limit, True


def probe_prefill_attention(model: nn.Module, max_keys: int, repeats: int = REPEATS) -> KernelChoice | None:
    """Causal attention with the heads of ``model``'s first attention layer, kernel against SDPA, in the two
    shapes a prompt takes: a fresh prompt of each of ``ATTENTION_FRESH`` tokens, and a chunk of
    ``ATTENTION_CHUNK_ROWS`` rows after cached ones over each of ``ATTENTION_CHUNK_KEYS`` keys (lengths up
    to ``max_keys``, the model's longest context). Per shape the kernel takes the lengths up to the
    longest at which it won at every length probed (``max_keys`` / ``max_chunk_keys`` of the choice); the
    path is ``torch`` where it lost at the shortest of both. None where the kernel cannot take these heads
    (not float32, head dims not multiples of 16, not built)."""
    from pdserve.kernels import load_prefill_attention
    from pdserve.engine.layers.prefill_attention import causal_attention

    attn = _first(model, ("num_heads", "num_kv_heads", "head_dim"))
    if attn is None:
        return None
    num_heads, num_kv_heads, head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
    v_dim = getattr(attn, "kv_v_dim", head_dim)
    dtype = next(model.parameters()).dtype
    if dtype != torch.float32 or head_dim % 16 or v_dim % 16 or num_heads % max(num_kv_heads, 1) \
            or load_prefill_attention() is None:
        return None
    g = torch.Generator().manual_seed(0)
    total = {"native": 0.0, "torch": 0.0}

    def timed(rows: int, keys: int) -> dict[str, float]:
        q = torch.randn(rows, num_heads, head_dim, generator=g)
        k = torch.randn(keys, num_kv_heads, head_dim, generator=g)
        v = torch.randn(keys, num_kv_heads, v_dim, generator=g)
        out = torch.empty(rows, num_heads, v_dim)
        masks: list[torch.Tensor | None] = [None]  # SDPA's [rows, keys] mask for a chunk, built once
        times = _best_ms(_toggled("prefill_attention", lambda: causal_attention(
            out, q, k, v, num_heads // num_kv_heads, head_dim ** -0.5, masks)), repeats if keys <= 512 else 2)
        for path in total:
            total[path] += times[path]
        return times

    fresh = [(n, timed(n, n)) for n in ATTENTION_FRESH if n <= max_keys] or \
        [(max_keys, timed(max_keys, max_keys))]
    chunks = [(n, timed(ATTENTION_CHUNK_ROWS, n)) for n in ATTENTION_CHUNK_KEYS if n <= max_keys]
    fresh_limit, fresh_all = _attention_limit(fresh)
    chunk_limit, chunk_all = _attention_limit(chunks) if chunks else (None, False)
    path = "native" if fresh_limit is not None or chunk_limit is not None else "torch"

    def said(times: list[tuple[int, dict[str, float]]], limit: int | None, won_all: bool) -> str:
        figures = ", ".join(f"{n}: {t['native']:.2f} / {t['torch']:.2f}" for n, t in times)
        return f"{figures} ({'native' if won_all else 'torch' if limit is None else f'native up to {limit}'})"

    why = (f"{num_heads} heads of {head_dim}, ms native / torch; fresh prompts of "
           f"{said(fresh, fresh_limit, fresh_all)}" + (f"; chunks of {ATTENTION_CHUNK_ROWS} rows over "
                                                       f"{said(chunks, chunk_limit, chunk_all)}" if chunks else ""))
    return KernelChoice("prefill_attention", path, total["native"], total["torch"], why,
                        max_keys=None if fresh_all else (fresh_limit or 0),
                        max_chunk_keys=None if chunk_all or not chunks else (chunk_limit or 0))


def probe_elementwise(model: nn.Module, repeats: int = REPEATS) -> KernelChoice | None:
    """The model's first RMSNorm and SwiGLU on ``ELEMENTWISE_ROWS`` rows, fused kernels against torch's
    operators (the layers' own forwards, toggled); None for a model without them or not in float32."""
    from pdserve.kernels import load_elementwise
    from pdserve.engine.layers.base import RMSNorm, SiluAndMul

    norm = next((m for m in model.modules() if isinstance(m, RMSNorm)), None)
    act = next((m for m in model.modules() if isinstance(m, SiluAndMul)), None)
    if norm is None or norm.weight.dtype != torch.float32 or load_elementwise() is None:
        return None
    g = torch.Generator().manual_seed(0)
    hidden = norm.weight.shape[0]
    x = torch.randn(ELEMENTWISE_ROWS, hidden, generator=g)
    mlp = _first(model, ("gate_up_proj",))
    width = 2 * (mlp.gate_up_proj.weight.shape[0] // 2) if mlp is not None else 2 * hidden
    gate_up = torch.randn(ELEMENTWISE_ROWS, width, generator=g)

    def work():
        with torch.inference_mode():
            norm(x)
            if act is not None:
                act(gate_up)

    return _decide("elementwise", _best_ms(_toggled("elementwise", work), repeats),
                   f"RMSNorm{' + SwiGLU' if act is not None else ''} on {ELEMENTWISE_ROWS} rows")


def probe_decode_linear(model: nn.Module, repeats: int = REPEATS) -> KernelChoice | None:
    """The model's first linears (up to ``DECODE_PROBE_BYTES``) at ``DECODE_ROWS`` rows, the few-row kernel
    against torch's GEMM; None where the kernel is not built or takes none of them."""
    from pdserve.engine.layers import decode_linear
    from pdserve.engine.layers.base import ColumnParallelLinear, RowParallelLinear, linear

    if not decode_linear.build_kernel():
        return None
    weights, total = [], 0
    for m in model.modules():
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and m.weight.dtype in (torch.float32,
                                                                                          torch.bfloat16) \
                and m.weight.stride(-1) == 1 and m.weight.untyped_storage().nbytes() >= m.weight.nbytes:
            weights.append(m.weight.detach())
            total += m.weight.nbytes
            if total >= DECODE_PROBE_BYTES:
                break
    if not weights:
        return None
    g = torch.Generator().manual_seed(0)
    inputs = {(n, w.shape[1]): torch.randn(n, w.shape[1], generator=g).to(w.dtype) for n in DECODE_ROWS
              for w in weights}
    before = native("decode_linear")  # whether the kernel takes these shapes, whatever an earlier choice said
    set_native("decode_linear", True)
    try:
        applies = decode_linear.kernel_applies(inputs[DECODE_ROWS[0], weights[0].shape[1]], weights[0])
    finally:
        set_native("decode_linear", before)
    if not applies:
        return None

    def work():
        with torch.inference_mode():
            for n in DECODE_ROWS:
                for w in weights:
                    linear(inputs[n, w.shape[1]], w)

    rows = "+".join(str(n) for n in DECODE_ROWS)
    return _decide("decode_linear", _best_ms(_toggled("decode_linear", work), repeats),
                   f"{len(weights)} linears ({total / 2**20:.0f} MiB) at {rows} rows")


def _builds(kernel: str) -> bool:
    """Whether ``kernel``'s library builds (or was built) here."""
    from pdserve.engine.layers import decode_linear
    from pdserve.kernels import load_elementwise, load_prefill_attention

    if kernel == "decode_linear":
        return decode_linear.build_kernel()
    return (load_prefill_attention if kernel == "prefill_attention" else load_elementwise)() is not None


def apply_kernel_choices(choices: dict[str, KernelChoice]) -> None:
    """Make ``choices`` this process's: each kernel's path, and prompt attention's key limits."""
    for choice in choices.values():
        set_native(choice.kernel, choice.path == "native")
        if choice.kernel == "prefill_attention":
            set_native_max_keys(choice.max_keys, choice.max_chunk_keys)


def choose_kernels(model: nn.Module, mode: str, max_keys: int) -> dict[str, KernelChoice]:
    """Decide, for this process, which native kernels run (module docstring), and log why.

    ``mode``: ``auto`` (probe each) or ``all`` (every kernel that builds, unprobed). ``max_keys``: the longest
    context the engine attends (``max_model_len``; caps the attention probe's lengths). Returns the choices (under ``all``, ``native`` for
    each kernel that builds); a kernel that cannot run here, or (``auto``) does not apply to this model, is
    absent (its torch path runs regardless).
    Raises ValueError for an unknown mode."""
    if mode not in NATIVE_KERNEL_MODES:
        raise ValueError(f"native_kernels must be one of {', '.join(NATIVE_KERNEL_MODES)}, got {mode!r}")
    set_native_max_keys(None)
    if mode == "all":
        for kernel in KERNELS:
            set_native(kernel, True)
        return {k: KernelChoice(k, "native", why="--native-kernels all") for k in KERNELS if _builds(k)}
    start = time.perf_counter()
    choices = {}
    for probe in (lambda: probe_prefill_attention(model, max_keys), lambda: probe_elementwise(model),
                  lambda: probe_decode_linear(model)):
        choice = probe()
        if choice is not None:
            apply_kernel_choices({choice.kernel: choice})
            choices[choice.kernel] = choice
    if choices:
        logger.info("native kernels, timed against torch on this CPU in %.2f s: %s", time.perf_counter() - start,
                    "; ".join(f"{c.kernel} -> {c.path} ({c.why})" for c in choices.values()))
    return choices
