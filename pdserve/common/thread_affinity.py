"""Bind a worker's OpenMP threads one to a core, as vLLM's CPU worker does (``init_cpu_threads_env``).

Why: torch's intra-op threads (and oneDNN's, MKL's and the native kernels', which share libgomp's pool
with them) sleep in the kernel once a parallel region has been over for a while. Unbound, the Linux
scheduler may wake the sleeper on the core of the thread that woke it (wake-affine), where the waking
thread itself runs: that thread finishes its share of the region and spins at the closing barrier
while the woken one waits behind it for its turn on the core. Measured on the 2-core Xeon of
2026-12-02 (24 matmuls of [200, 512] x [512, 512], two threads): the first op after 100 ms or more of
idle took 10.3-10.7 ms instead of 0.4 (0.6-0.9 after 10-50 ms of idle), which made two threads slower
than one for a lone op sequence; with each thread bound to its own core, 0.85 ms after any idle. In a
colocated cluster at low load that was every prompt: a worker that idles between requests.

How: a parallel region of libgomp's own (``GOMP_parallel``, the entry point ``#pragma omp parallel``
compiles to), run from the thread that drives the model, in which thread k binds itself to core k of
the worker's share. libgomp reuses the same pool threads, in the same order, for every later region
of that thread (torch's, oneDNN's, the kernels'), so the binding lasts. The calling thread is bound to
the first core: threads it starts afterwards inherit that core (as with ``GOMP_CPU_AFFINITY``).
"""

from __future__ import annotations

import ctypes
import logging
import os

logger = logging.getLogger(__name__)

# Set by the user or the launcher (core lending binds its own): their binding wins.
_BINDING_ENV = ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY")
DISABLE_ENV = "PDSERVE_NO_THREAD_BINDING"


def _loaded_libgomp() -> ctypes.CDLL | None:
    """libgomp as this process already has it loaded (torch's), or None: another OpenMP runtime, or none."""
    try:
        return ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except (OSError, AttributeError):  # not loaded (torch built with another runtime), or not Linux
        return None


def bind_openmp_threads(cores: list[int], num_threads: int) -> list[int] | None:
    """Bind this thread's OpenMP team of ``num_threads`` threads one to a core of ``cores``, in order
    (thread 0, the caller, to ``cores[0]``). Call it after ``torch.set_num_threads(num_threads)``.

    Returns the core of each thread, or None when nothing was bound: one thread, more threads than
    cores, a binding set in the environment (``GOMP_CPU_AFFINITY``, ``OMP_PROC_BIND``, ...),
    ``$PDSERVE_NO_THREAD_BINDING`` set, or no libgomp loaded (torch on another OpenMP runtime).
    Raises OSError if a thread could not be bound (a core this process may not use)."""
    if num_threads < 2 or num_threads > len(cores) or not hasattr(os, "sched_setaffinity"):
        return None
    if os.environ.get(DISABLE_ENV) or any(os.environ.get(name) for name in _BINDING_ENV):
        return None
    gomp = _loaded_libgomp()
    if gomp is None or not hasattr(gomp, "GOMP_parallel"):
        logger.info("OpenMP threads left unbound: torch does not run on libgomp here")
        return None
    gomp.omp_get_thread_num.restype = ctypes.c_int
    region = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
    gomp.GOMP_parallel.argtypes = [region, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    gomp.GOMP_parallel.restype = None
    bound: dict[int, int] = {}
    errors: list[OSError] = []

    def bind(_data) -> None:  # runs on every thread of the team, each holding the GIL in turn
        k = gomp.omp_get_thread_num()
        try:
            os.sched_setaffinity(0, {cores[k]})  # 0: the calling thread
            bound[k] = cores[k]
        except OSError as e:
            errors.append(e)

    gomp.GOMP_parallel(region(bind), None, num_threads, 0)  # ctypes lets go of the GIL for the call
    if errors:
        raise errors[0]
    return [bound[k] for k in sorted(bound)]
