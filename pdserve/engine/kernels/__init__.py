"""Native CPU kernels, compiled on first use with the system C++ compiler and loaded with ctypes.

``paged_attention.cpp`` is plain C++ with a C ABI (no torch headers), so it builds in about
a second with ``g++ -O3 -march=native -fopenmp``. The shared library is cached under
``$PDSERVE_KERNEL_CACHE`` (default ``~/.cache/pdserve/kernels``), keyed by the source, the
compiler flags and this CPU's instruction sets, so a restart or another worker on the same
machine reuses it. With no compiler (or a failed build) ``load_paged_attention`` returns
None and the engine falls back to the plain-torch attention path, saying so once.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import threading

import torch

logger = logging.getLogger(__name__)

_SOURCE = pathlib.Path(__file__).with_name("paged_attention.cpp")
# No -ffast-math: linked into a shared library it sets flush-to-zero for the whole process
# (crtfastmath.o), changing every other computation in it. The kernel vectorizes by hand instead.
_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}

# The kernel's kv_dtype codes, by KV cache dtype name (pdserve.common.kv_quant): plain float32 and
# bfloat16 elements, or packed rows of head_dim quantized bytes plus a float32 scale.
KV_DTYPE_CODES = {"float32": 0, "bfloat16": 1, "int8": 2, "fp8_e4m3": 3, "fp8_e5m2": 4}


def _cpu_key() -> str:
    """What -march=native depends on: the CPU's model and flags (from /proc/cpuinfo on Linux)."""
    parts = [platform.machine(), torch.backends.cpu.get_cpu_capability()]
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "model name")):
                    parts.append(line.strip())
                if line.startswith("flags"):
                    break
    except OSError:
        pass
    return "|".join(parts)


def cache_dir() -> pathlib.Path:
    """Where built kernels are kept ($PDSERVE_KERNEL_CACHE or ~/.cache/pdserve/kernels)."""
    return pathlib.Path(os.environ.get("PDSERVE_KERNEL_CACHE", pathlib.Path.home() / ".cache/pdserve/kernels"))


def _build(source: pathlib.Path, compiler: str) -> pathlib.Path:
    """Compile ``source`` into the cache (atomically: concurrent builders each write a temp file and rename)."""
    key = hashlib.sha256(source.read_bytes() + " ".join(_FLAGS).encode() + _cpu_key().encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        logger.info("compiling %s (once per machine; cached in %s)", source.name, target.parent)
        subprocess.run([compiler, *_FLAGS, str(source), "-o", tmp], check=True, capture_output=True, text=True,
                       timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_paged_attention() -> ctypes.CDLL | None:
    """The compiled paged-attention library, or None where it cannot be built here (logged once)."""
    with _lock:
        if "paged_attention" in _loaded:
            return _loaded["paged_attention"]
        lib = None
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
        if os.environ.get("PDSERVE_DISABLE_KERNELS"):
            logger.info("native kernels disabled by $PDSERVE_DISABLE_KERNELS: plain-torch attention")
        elif compiler is None:
            logger.warning("no C++ compiler found: paged attention runs on the plain-torch (gathering) path")
        else:
            try:
                lib = ctypes.CDLL(str(_build(_SOURCE, compiler)))
                fn = lib.pdserve_paged_attention
                fn.restype = ctypes.c_int
                p, i64 = ctypes.c_void_p, ctypes.c_int64
                fn.argtypes = [p, p, p, ctypes.c_int, p, i64, p, p, p, i64, i64, i64, i64, i64, i64,
                               ctypes.c_float, i64, ctypes.c_int]
            except (OSError, subprocess.SubprocessError, AttributeError) as e:
                detail = getattr(e, "stderr", "") or ""
                logger.warning("could not build the paged-attention kernel (%s%s): plain-torch attention instead",
                               e, f": {detail[-2000:]}" if detail else "")
                lib = None
        _loaded["paged_attention"] = lib
        return lib
