"""Which layout a CPU engine keeps its float linear weights in, and the packing into oneDNN's.

``pack_linear_weights`` reorders every float decoder linear weight into oneDNN's blocked layout once,
at load, and ``pack_lm_head`` the LM head's; ``choose_linear_weight_format`` times both layouts on
the model's own weights for ``--linear-weight-format auto``. The layers then compute through
``onednn_linear`` (``layers._project``, the models' ``compute_logits``).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
from torch import nn

from pdserve.engine import decode_linear, onednn_linear
from pdserve.engine.layers import ColumnParallelLinear, RowParallelLinear, linear


def pack_linear_weights(model: nn.Module) -> int:
    """Reorder every float ``ColumnParallelLinear``/``RowParallelLinear`` weight of ``model`` into oneDNN's
    blocked layout, once, and compute those layers through oneDNN from then on (what vLLM's CPU backend
    does with its ``onednn_mm`` handles). The plain weight is dropped: ``weight`` keeps its shape, dtype
    and device over no memory (a zero-stride view), ``packed_weight`` holds the values, and
    ``packed_handle`` names them to ``torch.ops.pdserve.onednn_linear`` (how a compiled decode step,
    which cannot take the packed tensor, reaches them).

    Why: MKL's sgemm repacks the weight on every call and, on this project's AMD cores, ran a prefill's
    GEMMs at 88-103 GFLOPS where oneDNN's JIT kernels on packed weights run 107-113 (a 288-token prompt's
    48 linear layers of the bench preset: 467 -> 399 ms on one core, float32; bfloat16 214 -> 199 ms).
    Prefill workers pack; an engine that decodes packs where ``choose_linear_weight_format`` times
    oneDNN faster than the decode kernel on its own weights (``EngineConfig.linear_weight_format``).
    Int8 and batch-invariant layers are left as they are. Returns the number of layers packed: 0 where
    oneDNN is not available, fewer than all where its reorder fails (the rest keep their plain weights)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in model.modules():
        if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or module.packed_weight is not None:
            continue
        weight = module.weight
        if (module.weight_scale is not None or module.batch_invariant or weight.device.type != "cpu"
                or weight.dtype not in (torch.float32, torch.bfloat16)):
            continue
        if not _pack(module):  # a oneDNN build without this reorder (some CPUs, dtypes)
            return packed
        packed += 1
    return packed


def _pack(module: nn.Module) -> bool:
    """Move ``module.weight`` into oneDNN's blocked layout: ``packed_weight`` holds it, ``packed_handle``
    names it to ``onednn_linear``, and ``weight`` becomes a zero-stride view of its shape and dtype over
    no memory. False (``module`` unchanged) where oneDNN cannot reorder it."""
    weight = module.weight
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (RuntimeError, NotImplementedError):
        return False
    module.packed_weight = packed
    module.packed_handle = onednn_linear.register_packed_weight(packed)
    module.weight = nn.Parameter(torch.zeros((), dtype=weight.dtype).expand(weight.shape), requires_grad=False)
    return True


def pack_lm_head(model: nn.Module) -> bool:
    """Reorder ``model.lm_head``'s weight [vocab, hidden] into oneDNN's blocked layout, as
    ``pack_linear_weights`` does for the decoder's layers, so ``compute_logits`` runs through oneDNN
    (``onednn_linear.packed_linear``) instead of the few-row decode kernel or MKL. Only an untied float
    CPU head that is not batch-invariant: a head tied to the embedding stays plain (the embedding
    lookup reads the same tensor, so packing would keep two copies of the vocabulary). The plain
    weight is dropped as for the layers (a zero-stride view keeps its shape and dtype).

    Why: on a Zen 5 class core the bench preset's head (16k x 768, float32, cold) took 1.87 / 2.68 /
    7.38 ms at 1 / 8 / 32 rows in the decode kernel and 1.65 / 2.40 / 5.12 ms in oneDNN. Returns whether
    the head was packed (False where oneDNN is unavailable, the head is tied, absent or not a float
    CPU tensor, or the reorder fails)."""
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    inner = getattr(model, "model", None)
    if (not torch.backends.mkldnn.is_available() or not isinstance(weight, torch.Tensor)
            or getattr(head, "packed_weight", None) is not None or getattr(model, "batch_invariant", False)
            or head is getattr(inner, "embed_tokens", None) or weight.device.type != "cpu"
            or weight.dtype not in (torch.float32, torch.bfloat16) or weight.dim() != 2):
        return False
    return _pack(head)


PROBE_BYTES = 256 * 2**20  # weights the format probe streams per timing: past any core's caches
PROBE_MARGIN = 1.10  # oneDNN is chosen when its probed matmuls take at most this times the plain path's


def choose_linear_weight_format(model: nn.Module, rows: Sequence[int] = (1, 8, 64),
                                repeats: int = 5) -> tuple[str, str]:
    """``--linear-weight-format auto`` on an engine that decodes (a decode worker, ``LLM``): measure,
    at load, which layout computes this engine's matmuls faster on this CPU, and return (``"onednn"``
    or ``"plain"``, a line saying why).

    Only one layout is kept, and which is faster depends on the CPU. The plain weights go through the
    decode kernel for a decode step's few rows, and MKL's sgemm for a prompt chunk's many. On one
    machine type (Zen 4 class) the kernel beat oneDNN at one row, and MKL ran 10-15% behind it on
    prompts. On another (Zen 5 class), oneDNN won everywhere: 8.1 against 9.6 ms for the bench
    preset's 48 linears at one row, and 43 against 105 ms at 64 rows, where MKL runs at 40-45% of
    oneDNN's speed.

    So this times both layouts on the model's own weights: the first linears up to ``PROBE_BYTES``,
    streamed from memory as in a step. It runs each of ``rows`` (decode batches and one prompt
    chunk), interleaving the two layouts, best of ``repeats`` (start-up contention from other
    processes biases neither). oneDNN is chosen when its summed time is at most ``PROBE_MARGIN`` times
    the plain path's. Returns plain when oneDNN is unavailable or no float linear layer qualifies."""
    if not torch.backends.mkldnn.is_available():
        return "plain", "oneDNN is not available"
    weights, total = [], 0
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.packed_weight is None \
                and module.weight_scale is None and not module.batch_invariant \
                and module.weight.device.type == "cpu" and module.weight.dtype in (torch.float32, torch.bfloat16):
            weights.append(module.weight.detach())
            total += module.weight.nbytes
            if total >= PROBE_BYTES:
                break
    if not weights:
        return "plain", "no float linear layer to pack"
    decode_linear.build_kernel()  # the plain path's decode rows run through it (built once, then cached)
    try:
        packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    except (RuntimeError, NotImplementedError) as e:
        return "plain", f"oneDNN cannot reorder these weights ({type(e).__name__})"
    inputs = {(n, w.shape[1]): torch.randn(n, w.shape[1], dtype=w.dtype) for n in rows for w in weights}

    def timed(step) -> float:
        start = time.perf_counter()
        step()
        return time.perf_counter() - start

    best = {(layout, n): float("inf") for layout in ("plain", "onednn") for n in rows}
    with torch.inference_mode():
        for _ in range(repeats):
            for n in rows:
                best["plain", n] = min(best["plain", n], timed(
                    lambda: [linear(inputs[n, w.shape[1]], w) for w in weights]))
                best["onednn", n] = min(best["onednn", n], timed(
                    lambda: [torch.ops.mkldnn._linear_pointwise(inputs[n, w.shape[1]], p, None, "none", [None], "")
                             for w, p in zip(weights, packed)]))
    plain_s = sum(best["plain", n] for n in rows)
    onednn_s = sum(best["onednn", n] for n in rows)
    choice = "onednn" if onednn_s <= PROBE_MARGIN * plain_s else "plain"
    per_rows = ", ".join(f"{n}: {best['plain', n] * 1e3:.1f} / {best['onednn', n] * 1e3:.1f}" for n in rows)
    why = (f"{len(weights)} linears ({total / 2**20:.0f} MiB), ms plain / oneDNN at rows {per_rows}; "
           f"sum {plain_s * 1e3:.1f} / {onednn_s * 1e3:.1f}")
    return choice, why
