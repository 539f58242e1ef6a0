"""The decoder's linears in each weight layout, at decode and prefill row counts, one pinned core.

    python benchmarks/bench_linear_formats.py                  # bench preset shapes, rows 1..288
    python benchmarks/bench_linear_formats.py --rows 1 8 --core 1

For the ``bench`` preset's 48 decoder linears (12 layers of qkv, o, gate_up, down; random weights
of their shapes, 302 MiB in float32, so every pass streams them from memory as a decode step does),
prints the median time of one pass over all of them at each row count through:

* the decode kernel on plain weights (``pdserve.engine.layers.decode_linear``, up to its row limit);
* oneDNN on weights reordered once into its blocked layout (``--linear-weight-format onednn``);
* the panel kernel on weights packed once in 16-feature panels (``--linear-weight-format panel``,
  ``pdserve.engine.layers.panel_linear``), in one arena on 2 MiB pages as the engine keeps them;
* ``F.linear`` on plain weights (MKL's sgemm on a CPU build of torch).

``--linear-weight-format auto`` makes the same comparison at load on a model's own weights
(``weight_format.choose_linear_weight_format``); this script shows the whole curve.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from pdserve.engine.layers import decode_linear, panel_linear
from pdserve.engine.layers.weight_format import panel_arena

HIDDEN, INTERMEDIATE, Q_KV, LAYERS = 768, 2048, 768 + 2 * 256, 12  # the bench preset


def median_ms(step, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 288])
    ap.add_argument("--core", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    kernel = decode_linear.build_kernel()
    shapes = [(Q_KV, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS
    weights = [torch.randn(n, k) for n, k in shapes]
    packed = [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    # panels as the engine keeps them: one arena on 2 MiB pages (weight_format.panel_arena)
    panels = [panel_linear.pack_panels(w, out) for w, out in zip(weights, panel_arena(weights))] \
        if panel_linear.build_kernel() else None
    print(f"{len(weights)} linears, {sum(w.nbytes for w in weights) / 2**20:.0f} MiB float32, one thread on core "
          f"{args.core}; median ms of one pass over all of them")
    print("| rows | decode kernel (plain) | oneDNN (packed) | panel kernel (panels) | F.linear (plain) |")
    print("|---|---|---|---|---|")
    with torch.inference_mode():
        for m in args.rows:
            xs = {k: torch.randn(m, k) for k in (HIDDEN, INTERMEDIATE)}
            cells = []
            if kernel and m <= decode_linear.KERNEL_MAX_ROWS:
                cells.append(median_ms(lambda: [decode_linear.decode_linear_kernel(xs[w.shape[1]], w)
                                                for w in weights], args.repeats))
            else:
                cells.append(None)
            cells.append(median_ms(lambda: [torch.ops.mkldnn._linear_pointwise(xs[w.shape[1]], p, None, "none",
                                                                               [None], "")
                                            for w, p in zip(weights, packed)], args.repeats))
            cells.append(None if panels is None else median_ms(
                lambda: [panel_linear.panel_linear(xs[w.shape[1]], p, w.shape[0]) for w, p in zip(weights, panels)],
                args.repeats))
            cells.append(median_ms(lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights],
                                   args.repeats))
            print(f"| {m} | " + " | ".join("n/a" if c is None else f"{c:.1f}" for c in cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
