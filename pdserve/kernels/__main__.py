"""``python -m pdserve.kernels``: build every native kernel for this CPU now (``make install`` runs it).

A kernel is otherwise built on first use, by the first process that needs it: 15-20 s in all on a
2-core AVX2 EPYC, which a first ``pdserve up`` would pay before it answers. Prints what built (or why
not) and how long it took; exits 0 either way (a kernel that cannot build has a torch path).
"""

from __future__ import annotations

import logging
import sys
import time

from pdserve import kernels


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(message)s")
    built = []
    start = time.perf_counter()
    for name in ("paged_attention", "prefill_attention", "elementwise", "decode_linear", "kv_gather",
                 "int8_linear", "panel_linear", "torch_ops"):
        t0 = time.perf_counter()
        ok = getattr(kernels, f"load_{name}")() is not None
        built.append(f"{name} {'built' if ok else 'NOT built'} ({time.perf_counter() - t0:.1f} s)")
    print(f"pdserve kernels for {kernels.kernel_isa()} in {kernels.cache_dir()}: {', '.join(built)}; "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
