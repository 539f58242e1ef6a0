"""Which layout a CPU engine keeps its float linear weights in, and the packing into it.

Three layouts: ``plain`` (as loaded), ``onednn`` (``pack_linear_weights``: oneDNN's blocked layout, for
float32 and bfloat16) and ``panel`` (``pack_panel_weights``: 16-feature column panels for the panel
kernel, float32). Each is packed once, at load, the LM head too (``pack_lm_head``), and only one copy
is kept. ``choose_linear_weight_format`` times the layouts on the model's own weights for
``--linear-weight-format auto``. The layers then compute through ``onednn_linear`` or
``panel_linear`` (``layers._project``, the models' ``compute_logits``).
"""

from __future__ import annotations

import math
import time
from typing import Sequence

import torch
from torch import nn

from pdserve.common.utils import empty_on_huge_pages, release_pages
from pdserve.engine.layers import decode_linear, onednn_linear, panel_linear
from pdserve.kernels import builds_avx512
from pdserve.engine.layers.base import ColumnParallelLinear, RowParallelLinear, linear


# The layouts that pack, and what they are, for the load log.
PACKED_LAYOUTS = {"onednn": "oneDNN's blocked layout (prefill GEMMs)",
                  "panel": "16-feature panels (the panel kernel)"}


def pack_model(model: nn.Module, layout: str) -> tuple[int, bool]:
    """Pack ``model``'s decoder linears and its LM head into ``layout`` (a key of ``PACKED_LAYOUTS``):
    returns (layers packed, whether the head was). Raises ValueError for another layout."""
    if layout == "onednn":
        return pack_linear_weights(model), pack_lm_head(model, "onednn")
    if layout == "panel":
        return pack_panel_weights(model), pack_lm_head(model, "panel")
    raise ValueError(f"a model packs into one of {', '.join(PACKED_LAYOUTS)}, not {layout!r}")


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
    An engine packs where ``choose_linear_weight_format`` times oneDNN fastest on its own weights at the
    rows its steps have (``EngineConfig.linear_weight_format``), as a prefill worker of several ranks does
    untimed.
    Int8 and batch-invariant layers are left as they are. Returns the number of layers packed: 0 where
    oneDNN is not available, fewer than all where its reorder fails (the rest keep their plain weights)."""
    if not torch.backends.mkldnn.is_available():
        return 0
    packed = 0
    for module in model.modules():
        if not _packable(module, (torch.float32, torch.bfloat16)):
            continue
        if not _pack(module):  # a oneDNN build without this reorder (some CPUs, dtypes)
            return packed
        packed += 1
    return packed


def pack_panel_weights(model: nn.Module) -> int:
    """Pack every float32 ``ColumnParallelLinear``/``RowParallelLinear`` weight of ``model`` into 16-feature
    column panels, once, and compute those layers through the panel kernel from then on
    (``pdserve.engine.layers.panel_linear``: a decode batch's rows overlap the weight stream with their FMAs).
    ``panel_weight`` holds the panels (``panel_handle`` names them to a compiled decode step's op)
    and ``weight`` becomes a zero-stride view of its shape and dtype over no memory. Int8,
    batch-invariant, bfloat16 and already packed layers are left as they are. Returns the number of
    layers packed: 0 where the kernel cannot be built here.

    All the layers' panels lie back to back in one arena on 2 MiB pages (``panel_arena``): a decode step
    streams them whole, and on 4 KiB pages the stream paid a page walk every 4 KiB and the hardware
    prefetchers stopped at each page's end. On a Zen 4 EPYC core the bench preset's 48 linears took
    13.0 / 12.9 / 48.6 ms at 1 / 8 / 32 rows in the arena against 17.1 / 17.3 / 52.7 on 4 KiB pages."""
    if not panel_linear.build_kernel():
        return 0
    modules = [module for module in model.modules() if _packable(module, (torch.float32,))]
    if modules:
        for module, out in zip(modules, panel_arena([module.weight for module in modules])):
            _pack_panels(module, out)
    return len(modules)


ARENA_MIN_BYTES = 2**20  # parameters smaller than this (norms, biases) stay where they are


def place_in_arenas(model: nn.Module) -> int:
    """Move ``model``'s CPU parameters of at least ``ARENA_MIN_BYTES`` into arenas on 2 MiB pages (one per
    dtype for the decoder linears' weights, one per dtype for the rest: embeddings, experts), each a view
    of its arena with its values copied; returns the bytes moved. Call it on a model just built, before the
    checkpoint is read into it: a view's pages are touched first by the copy, so the arena's huge pages
    back them (``empty_on_huge_pages``). A parameter shared by several modules (a tied LM head) moves once.

    A decode step streams every weight once: the plain decode kernel's 48 linears of the bench preset on a
    Zen 4 EPYC core took 12.9 / 13.3 / 18.1 ms at 1 / 2 / 8 rows in an arena against 14.1 / 15.5 / 22.5 on
    4 KiB pages. Weights that are packed later (``pack_model``) hand their pages back as they are dropped
    (``release_pages``), and an arena none of whose views is left is freed whole."""
    groups: dict[tuple[bool, torch.dtype], list[nn.Parameter]] = {}
    seen: set[int] = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if (id(param) in seen or param.device.type != "cpu" or not param.is_contiguous()
                    or param.numel() * param.element_size() < ARENA_MIN_BYTES):
                continue
            seen.add(id(param))
            linear_weight = name == "weight" and isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            groups.setdefault((linear_weight, param.dtype), []).append(param)
    moved = 0
    for (_, dtype), params in groups.items():
        for param, view in zip(params, arena_views([tuple(p.shape) for p in params], dtype)):
            view.copy_(param.data)
            param.data = view
            moved += param.numel() * param.element_size()
    return moved


def arena_views(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """Contiguous tensors of ``shapes``, back to back in one arena on transparent huge pages
    (``empty_on_huge_pages``), each starting on a 64-byte line. Where Linux grants no huge pages the arena
    is ordinary memory."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    align = max(1, 64 // itemsize)
    sizes = [-(-math.prod(shape) // align) * align for shape in shapes]
    arena = empty_on_huge_pages(sum(sizes), dtype)
    views, offset = [], 0
    for shape, size in zip(shapes, sizes):
        views.append(arena[offset: offset + math.prod(shape)].view(shape))
        offset += size
    return views


def panel_arena(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Room for ``weights``' panels (each [N, K] -> ``panel_linear.panels_shape(N, K)``, float32): views of
    one arena on huge pages (``arena_views``), back to back in ``weights``' order."""
    return arena_views([panel_linear.panels_shape(*w.shape) for w in weights], torch.float32)


def _packable(module: nn.Module, dtypes: tuple[torch.dtype, ...]) -> bool:
    """Whether ``module`` is a decoder linear whose plain float CPU weight (of one of ``dtypes``) may be packed."""
    if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)) or _is_packed(module):
        return False
    weight = module.weight
    return (module.weight_scale is None and not module.batch_invariant and weight.device.type == "cpu"
            and weight.dtype in dtypes)


def _is_packed(module: nn.Module) -> bool:
    return getattr(module, "packed_weight", None) is not None or getattr(module, "panel_weight", None) is not None


def _drop_plain(module: nn.Module) -> None:
    """``module.weight`` becomes a zero-stride view of its shape and dtype over no memory (its values now
    live in a packed copy); ``packed_out_features`` keeps its N as an int, which a compiled step reads
    instead of the placeholder's shape. Its pages in an arena (``place_in_arenas``) go back to the kernel
    at once, as a weight of its own would be freed."""
    weight = module.weight
    release_pages(weight)
    module.packed_out_features = weight.shape[0]
    module.weight = nn.Parameter(torch.zeros((), dtype=weight.dtype).expand(weight.shape), requires_grad=False)


def _pack_panels(module: nn.Module, out: torch.Tensor) -> None:
    """Move ``module.weight`` [N, K] into panels: ``panel_weight`` [ceil(N / 16), K, 16], written into ``out``
    (a view of a ``panel_arena``)."""
    module.panel_weight = panel_linear.pack_panels(module.weight, out)
    module.panel_handle = panel_linear.register_panels(module.panel_weight)
    _drop_plain(module)


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
    _drop_plain(module)
    return True


def pack_lm_head(model: nn.Module, layout: str = "onednn") -> bool:
    """Pack ``model.lm_head``'s weight [vocab, hidden] into ``layout`` (``onednn``: oneDNN's blocked layout,
    float32 or bfloat16; ``panel``: 16-feature panels, float32), as ``pack_linear_weights`` and
    ``pack_panel_weights`` do for the decoder's layers, so ``compute_logits`` runs through that path
    instead of the few-row decode kernel or MKL. Only an untied float CPU head that is not
    batch-invariant: a head tied to the embedding stays plain (the embedding lookup reads the same
    tensor, so packing would keep two copies of the vocabulary). The plain weight is dropped as for
    the layers (a zero-stride view keeps its shape and dtype).

    Why: on a Zen 5 class core the bench preset's head (16k x 768, float32, cold) took 1.87 / 2.68 /
    7.38 ms at 1 / 8 / 32 rows in the decode kernel and 1.65 / 2.40 / 5.12 ms in oneDNN. Returns whether
    the head was packed (False where the layout's library is unavailable, the head is tied, absent or
    not a float CPU tensor of the layout's dtypes, or the reorder fails). Raises ValueError for an
    unknown layout."""
    if layout not in ("onednn", "panel"):
        raise ValueError(f"an LM head packs into onednn or panel, not {layout!r}")
    head = getattr(model, "lm_head", None)
    weight = getattr(head, "weight", None)
    inner = getattr(model, "model", None)
    dtypes = (torch.float32, torch.bfloat16) if layout == "onednn" else (torch.float32,)
    if (not isinstance(weight, torch.Tensor) or _is_packed(head) or getattr(model, "batch_invariant", False)
            or head is getattr(inner, "embed_tokens", None) or weight.device.type != "cpu"
            or weight.dtype not in dtypes or weight.dim() != 2):
        return False
    if layout == "panel":
        if not panel_linear.build_kernel():
            return False
        _pack_panels(head, panel_arena([weight])[0])
        return True
    return torch.backends.mkldnn.is_available() and _pack(head)


PROBE_BYTES = 256 * 2**20  # weights the format probe streams per timing: past any core's caches
# A packed layout replaces the plain path only when its probed matmuls are at least this much faster (mean
# slowdown times this at most plain's): the probe times the matmuls alone, while a packed layout in a step
# also pays for its op by handle and its own prompt-chunk path. On an Intel Xeon with AVX-512 (2 MiB L2 a
# core) the probe put panels 2% behind plain and a margin that favoured packed layouts chose them, and the
# whole decode step then took 36.9 ms at batch 1 against plain's 29.4 (48.5 against 41.3 at batch 8).
PROBE_MARGIN = 1.05
# A prefill worker's steps are prompt chunks only: 64 rows (a short prompt) and 256 (one prompt's whole chunk,
# the prefill worker's default cap a step). Its matmuls are compute-bound, so fewer weights suffice (a
# timing at 256 rows over 32 MiB is ~40 ms on a Zen 4 core; the probe took 1.3 s there).
PREFILL_PROBE_ROWS = (64, 256)
PREFILL_PROBE_BYTES = 32 * 2**20
LAYOUT_NAMES = {"plain": "plain", "onednn": "oneDNN", "panel": "panel"}


def choose_linear_weight_format(model: nn.Module, rows: Sequence[int] = (1, 8, 64), repeats: int = 5,
                                probe_bytes: int = PROBE_BYTES) -> tuple[str, str]:
    """``--linear-weight-format auto`` on a single-rank CPU engine: measure, at load, which layout computes
    this engine's matmuls fastest on this CPU, and return (``"plain"``, ``"onednn"`` or ``"panel"``, a line
    saying why). ``rows``: the row counts its steps have (an engine that decodes: decode batches and a
    prompt chunk, the default; a prefill worker: ``PREFILL_PROBE_ROWS``); ``probe_bytes``: how much of the
    model's weights each timing runs through (a prefill worker: ``PREFILL_PROBE_BYTES``).

    Only one layout is kept, and which is fastest depends on the CPU. The plain weights go through the
    decode kernel for a decode step's few rows, and MKL's sgemm for a prompt chunk's many. On one
    machine type (Zen 4 class) the kernel beat oneDNN at one row, and MKL ran 10-15% behind it on
    prompts. On another (Zen 5 class), oneDNN beat plain everywhere (8.1 against 9.6 ms for the bench
    preset's 48 linears at one row, 43 against 105 ms at 64 rows), and the panel kernel beat oneDNN
    from 8 rows up (9.7 against 13.7 ms at 8 rows, 46 against 56 at 64; float32 only). On a third (an
    AVX2 EPYC, no AVX-512) the decode kernel beat oneDNN at 1 and 8 rows (20 against 26 ms, 32 against
    41 for 43 linears) and lost by 8% at 64, and panels, written for AVX-512's registers, ran 3-8x
    slower than either: they are not timed without AVX-512.

    So this times the layouts on the model's own weights: the first linears up to ``probe_bytes``,
    streamed from memory as in a step. (A prefill worker kept oneDNN untimed until a Zen 4 EPYC, where
    panels ran its 64-token prompts 11% faster, 121 against 135 ms on one core for the bench preset, and
    256-2,048 within 1.5%.) It runs each of ``rows`` (decode batches and one prompt chunk), interleaving
    the layouts, best of ``repeats`` (start-up contention from other processes biases none).
    Each row count weighs alike: the layout with the least mean slowdown against the
    fastest at each row count wins, a packed one over plain only when it is ``PROBE_MARGIN`` ahead
    (``pick_layout``). On a fourth machine (an Intel Xeon with AVX-512) panels led at 1 row by 5%, plain
    at 8 rows by 12%, oneDNN at 64 rows by 11%, and panels ran the whole decode step 25% slower than
    plain. A layout whose library is unavailable (oneDNN, the panel
    kernel) or whose dtype it does not take (panel: float32) is not timed. Returns plain when no packed layout
    qualifies or no float linear layer exists."""
    weights, total = [], 0
    for module in model.modules():
        if _packable(module, (torch.float32, torch.bfloat16)):
            weights.append(module.weight.detach())
            total += module.weight.nbytes
            if total >= probe_bytes:
                break
    if not weights:
        return "plain", "no float linear layer to pack"
    decode_linear.build_kernel()  # the plain path's decode rows run through it (built once, then cached)
    inputs = {(n, w.shape[1]): torch.randn(n, w.shape[1], dtype=w.dtype) for n in rows for w in weights}
    layouts = {"plain": lambda n: [linear(inputs[n, w.shape[1]], w) for w in weights]}
    skipped = []
    if not torch.backends.mkldnn.is_available():
        skipped.append("oneDNN is not available")
    else:
        try:
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
            layouts["onednn"] = lambda n: [
                torch.ops.mkldnn._linear_pointwise(inputs[n, w.shape[1]], p, None, "none", [None], "")
                for w, p in zip(weights, packed)]
        except (RuntimeError, NotImplementedError) as e:
            skipped.append(f"oneDNN cannot reorder these weights ({type(e).__name__})")
    if weights[0].dtype != torch.float32:
        skipped.append("panels take float32 only")
    elif not builds_avx512():  # its 16-feature panels hold two AVX2 registers a row: 3-8x the decode kernel's time
        skipped.append("panels are written for AVX-512")
    elif not panel_linear.build_kernel():
        skipped.append("the panel kernel cannot be built here")
    else:
        panels = [panel_linear.pack_panels(w, out) for w, out in zip(weights, panel_arena(weights))]  # as packed
        layouts["panel"] = lambda n: [panel_linear.panel_linear(inputs[n, w.shape[1]], p, w.shape[0])
                                      for w, p in zip(weights, panels)]
    if len(layouts) == 1:
        return "plain", "; ".join(skipped)

    def timed(step, n) -> float:
        start = time.perf_counter()
        step(n)
        return time.perf_counter() - start

    best = {(layout, n): float("inf") for layout in layouts for n in rows}
    with torch.inference_mode():
        for _ in range(repeats):
            for n in rows:
                for layout, step in layouts.items():
                    best[layout, n] = min(best[layout, n], timed(step, n))
    choice, slowdown = pick_layout(best, rows)
    names = " / ".join(LAYOUT_NAMES[layout] for layout in layouts)
    per_rows = ", ".join(f"{n}: " + " / ".join(f"{best[layout, n] * 1e3:.1f}" for layout in layouts) for n in rows)
    why = (f"{len(weights)} linears ({total / 2**20:.0f} MiB), ms {names} at rows {per_rows}; "
           f"mean slowdown " + " / ".join(f"{s:.2f}" for s in slowdown.values()))
    if skipped:
        why += f"; {'; '.join(skipped)}"
    return choice, why


def pick_layout(best: dict[tuple[str, int], float], rows: Sequence[int]) -> tuple[str, dict[str, float]]:
    """The layout ``choose_linear_weight_format`` keeps, from its timings ``best[(layout, rows)]`` (seconds;
    ``"plain"`` among the layouts), and each layout's mean slowdown.

    Each row count weighs alike: a layout's score is its mean slowdown against the fastest at each row
    count (a sum of times let a prompt chunk's 64 rows, 5-7x a decode step's time, decide alone). A
    packed layout replaces plain only when its slowdown times ``PROBE_MARGIN`` is at most plain's (issue
    35: no path slower than the one it replaces)."""
    layouts = list(dict.fromkeys(layout for layout, _ in best))
    fastest = {n: min(best[layout, n] for layout in layouts) for n in rows}
    slowdown = {layout: sum(best[layout, n] / fastest[n] for n in rows) / len(rows) for layout in layouts}
    score = {layout: s * (1.0 if layout == "plain" else PROBE_MARGIN) for layout, s in slowdown.items()}
    return min(score, key=score.get), slowdown
