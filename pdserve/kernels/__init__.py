"""Native CPU kernels, compiled on first use with the system C++ compiler and loaded with ctypes.

``paged_attention.cpp`` (paged attention over the KV cache), ``prefill_attention.cpp`` (causal
attention of prompt rows over their own keys), ``elementwise.cpp`` (RMSNorm, SwiGLU and rotary
embedding in one pass each, for eager forwards), ``int8_linear.cpp`` (weight-only int8 matmul) and
``decode_linear.cpp`` (float32 / bfloat16 matmul for a few rows: decode steps) and ``panel_linear.cpp``
(float32 matmul on weights packed in 16-feature panels: decode batches of 8-64 rows) and ``kv_gather.cpp``
(the KV transfer's gather and checksum in one pass) are plain C++ with a
C ABI (no torch headers; they share ``vec8.h``, the vector helpers and a vectorized exp), so each
builds in about a second with ``g++ -O3 -march=native -fopenmp`` (``$PDSERVE_KERNEL_ISA``: another x86-64 level). The shared library is cached under
``$PDSERVE_KERNEL_CACHE`` (default ``~/.cache/pdserve/kernels``), keyed by the source, the
headers, the compiler flags and this CPU's instruction sets, so a restart or another worker on
the same machine reuses it. With no compiler (or a failed build) a loader returns None and the engine
falls back to plain torch (the gathering attention path; dequantized int8 weights), saying so once.

``torch_ops.cpp`` is the exception: the C++ CPU kernels of two ``torch.ops.pdserve`` operators a compiled
decode step calls ~50 times a step, which include torch's headers and link against it (~10 s to build, once
per torch version; ``load_torch_ops``), and call the kernels above through pointers bound at load.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import pathlib
import platform
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

_KERNEL_DIR = pathlib.Path(__file__).parent
# No -ffast-math: linked into a shared library it sets flush-to-zero for the whole process
# (crtfastmath.o), changing every other computation in it. The kernel vectorizes by hand instead.
_FLAGS = ["-O3", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
# $PDSERVE_KERNEL_ISA: which instruction set the kernels are built for. ``native`` (the default) is
# this CPU's own (-march=native: AVX-512 code where it has AVX-512, AVX2 code where it has AVX2, NEON
# on aarch64); the others build a lesser x86-64 level on a CPU that has more, so the AVX2 paths run
# and are tested on an AVX-512 machine (with ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2
# capping torch and oneDNN the same way). Each kernel picks its vector width from the macros the
# level defines (__AVX512F__, __AVX2__).
KERNEL_ISAS = {"native": "-march=native", "avx512": "-march=x86-64-v4", "avx2": "-march=x86-64-v3",
               "generic": "-march=x86-64-v2"}
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


def machine_key() -> str:
    """A short hash of what a measured choice between a native kernel and torch's path depends on, the
    model aside: this CPU (model and flags), the ISA the kernels are built for, their sources, and
    torch's version. ``pdserve.engine.execution.measured_choices`` keys its cache by it."""
    sources = b"".join(p.read_bytes() for p in sorted([*_KERNEL_DIR.glob("*.cpp"), *_KERNEL_DIR.glob("*.h")]))
    parts = [_cpu_key(), " ".join(compiler_flags()), torch.__version__]
    return hashlib.sha256("\n".join(parts).encode() + sources).hexdigest()[:16]


def kernel_isa() -> str:
    """The instruction set the kernels are built for: ``$PDSERVE_KERNEL_ISA`` (a key of ``KERNEL_ISAS``),
    default ``native``. Raises ValueError for another value."""
    isa = os.environ.get("PDSERVE_KERNEL_ISA", "native") or "native"
    if isa not in KERNEL_ISAS:
        raise ValueError(f"$PDSERVE_KERNEL_ISA must be one of {', '.join(KERNEL_ISAS)}, got {isa!r}")
    return isa


def compiler_flags() -> list[str]:
    """The flags every kernel is compiled with (``kernel_isa``'s -march among them)."""
    return [*_FLAGS, KERNEL_ISAS[kernel_isa()]]


def builds_avx512() -> bool:
    """Whether the kernels are built with AVX-512 here (``kernel_isa``, and for ``native`` this CPU's flags)."""
    isa = kernel_isa()
    if isa in ("avx2", "generic"):
        return False
    return isa == "avx512" or "avx512f" in _cpu_key().split()


def cache_dir() -> pathlib.Path:
    """Where built kernels are kept ($PDSERVE_KERNEL_CACHE or ~/.cache/pdserve/kernels)."""
    return pathlib.Path(os.environ.get("PDSERVE_KERNEL_CACHE", pathlib.Path.home() / ".cache/pdserve/kernels"))


def _build(source: pathlib.Path, compiler: str, flags: list[str] | None = None,
           libraries: tuple[str, ...] = ()) -> pathlib.Path:
    """Compile ``source`` into the cache with ``flags`` (default ``compiler_flags()``), linked against
    ``libraries`` (flags after the source), atomically: concurrent builders each write a temp file and rename."""
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))  # what it may include
    flags = compiler_flags() if flags is None else flags
    key = hashlib.sha256(source.read_bytes() + headers + " ".join([*flags, *libraries]).encode() +
                         _cpu_key().encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        logger.info("compiling %s (once per machine; cached in %s)", source.name, target.parent)
        subprocess.run([compiler, *flags, str(source), "-o", tmp, *libraries], check=True, capture_output=True,
                       text=True, timeout=300)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


# The C types a kernel's entry points use, as ctypes declares them for the call (any pointer is an address).
_C_TYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float}
_PROTOTYPE = re.compile(r"\bint\s+(pdserve_\w+)\s*\(([^)]*)\)\s*\{")


@dataclass(frozen=True)
class KernelFunction:
    """One C entry point of a kernel source, as its definition declares it: ``int name(params)``.

    params: (C type, name) per parameter, in order. Every entry point returns an int (0: done; other
    values are the kernel's refusals, which its docstring lists)."""

    name: str
    params: tuple[tuple[str, str], ...]

    @property
    def argtypes(self) -> list:
        """The ctypes argument types (pointers as ``c_void_p``: callers pass ``tensor.data_ptr()``)."""
        return [ctypes.c_void_p if "*" in ctype else _C_TYPES[ctype] for ctype, _ in self.params]


def kernel_functions(source: str | pathlib.Path) -> dict[str, KernelFunction]:
    """The ``pdserve_*`` entry points defined in a kernel source (its file name, e.g. ``"elementwise.cpp"``,
    or a path), read from their C definitions: the one place their signatures are written.
    Raises KeyError for a parameter type ctypes is not told about here (``_C_TYPES``)."""
    path = pathlib.Path(source) if pathlib.Path(source).is_absolute() else _KERNEL_DIR / source
    functions = {}
    for name, params in _PROTOTYPE.findall(path.read_text()):
        parsed = []
        for param in " ".join(params.split()).split(","):
            ctype, _, pname = param.strip().rpartition(" ")
            ctype = ctype.replace("const ", "").strip()
            if pname.startswith("*"):
                ctype, pname = ctype + "*", pname.lstrip("*")
            if "*" not in ctype and ctype not in _C_TYPES:
                raise KeyError(f"{path.name}: {name} takes a {ctype!r}, which has no ctypes type here")
            parsed.append((ctype, pname))
        functions[name] = KernelFunction(name, tuple(parsed))
    return functions


def _load(name: str, what: str, fallback: str, build_flags=None) -> ctypes.CDLL | None:
    """Library ``name``, built from ``name``.cpp, with every ``pdserve_*`` function of it typed from its C
    definition (``kernel_functions``); or None where it cannot be built here (logged once: ``what``
    could not be built, ``fallback`` runs instead). ``build_flags``: a function giving (compiler flags,
    libraries) for a library not built with ``compiler_flags()``, called only to build it."""
    if name in _loaded:  # every layer of every forward asks: no lock once it is known (a dict read is atomic)
        return _loaded[name]
    with _lock:
        if name in _loaded:
            return _loaded[name]
        lib = None
        compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
        if os.environ.get("PDSERVE_DISABLE_KERNELS"):
            logger.info("native kernels disabled by $PDSERVE_DISABLE_KERNELS: %s", fallback)
        elif compiler is None:
            logger.warning("no C++ compiler found: %s", fallback)
        else:
            try:
                flags, libraries = build_flags() if build_flags is not None else (None, ())
                lib = ctypes.CDLL(str(_build(_KERNEL_DIR / f"{name}.cpp", compiler, flags, libraries)))
                for function in kernel_functions(f"{name}.cpp").values():
                    fn = getattr(lib, function.name)
                    fn.restype = ctypes.c_int
                    fn.argtypes = function.argtypes
            except (OSError, subprocess.SubprocessError, AttributeError) as e:
                detail = getattr(e, "stderr", "") or ""
                logger.warning("could not build the %s kernel (%s%s): %s", what, e,
                               f": {detail[-2000:]}" if detail else "", fallback)
                lib = None
        _loaded[name] = lib
        return lib


def load_paged_attention() -> ctypes.CDLL | None:
    """The compiled paged-attention library, or None where it cannot be built here (logged once)."""
    return _load("paged_attention", "paged-attention", "paged attention runs on the plain-torch (gathering) path")


def load_int8_linear() -> ctypes.CDLL | None:
    """The compiled weight-only int8 linear library (``int8_linear.cpp``), or None where it cannot
    be built here (logged once; int8 layers then dequantize their weight for each call)."""
    return _load("int8_linear", "int8 linear", "int8 layers dequantize their weights for every call instead")


def load_decode_linear() -> ctypes.CDLL | None:
    """The compiled few-row linear library (``decode_linear.cpp``: ``pdserve_f32_linear`` and
    ``pdserve_bf16_linear``), or None where it cannot be built here (logged once; decode matmuls then
    use torch's GEMM)."""
    return _load("decode_linear", "decode linear", "decode matmuls run through torch's GEMM")


def load_panel_linear() -> ctypes.CDLL | None:
    """The compiled panel linear library (``panel_linear.cpp``: ``pdserve_f32_pack_panels`` and
    ``pdserve_f32_panel_linear``), or None where it cannot be built here (logged once; the engine then
    keeps another weight layout)."""
    return _load("panel_linear", "panel linear", "linear weights keep another layout")


def load_prefill_attention() -> ctypes.CDLL | None:
    """The compiled causal prefill-attention library (``prefill_attention.cpp``), or None where it
    cannot be built here (logged once; prompts then attend with torch's SDPA)."""
    return _load("prefill_attention", "prefill attention", "prompt rows attend with torch's scaled_dot_product_attention")


def load_kv_gather() -> ctypes.CDLL | None:
    """The compiled KV transfer library (``kv_gather.cpp``: ``pdserve_kv_checksum`` and
    ``pdserve_kv_gather_checksum``), or None where it cannot be built here (logged once; the transfer
    then gathers with ``index_select`` and checksums with torch reductions)."""
    return _load("kv_gather", "KV gather", "the KV transfer gathers and checksums with torch operators")


def load_elementwise() -> ctypes.CDLL | None:
    """The compiled elementwise library (``elementwise.cpp``: ``pdserve_silu_and_mul``,
    ``pdserve_rms_norm``, ``pdserve_rope_rotate_half``), or None where it cannot be built here
    (logged once; those layers then run as torch operators)."""
    return _load("elementwise", "elementwise", "RMSNorm, SwiGLU and RoPE run as torch operators")


# The C++ operators (torch_ops.cpp) include torch's headers and link against its libraries, so they are built
# for this torch (its version and library directory are in the flags, hence in the cache key), with no -march:
# they only check, allocate and call the kernels above.
def _torch_ops_flags() -> tuple[list[str], tuple[str, ...]]:
    """(compiler flags, libraries) for ``torch_ops.cpp``."""
    from torch.utils import cpp_extension

    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    flags = ["-O2", "-shared", "-fPIC", "-std=c++20", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
             f"-DPDSERVE_TORCH_VERSION={torch.__version__}", *(f"-I{path}" for path in cpp_extension.include_paths())]
    return flags, (f"-L{lib_dir}", f"-Wl,-rpath,{lib_dir}", "-lc10", "-ltorch_cpu")


def load_torch_ops() -> ctypes.CDLL | None:
    """The C++ CPU kernels of the decode step's frequent operators (``torch_ops.cpp``:
    ``pdserve::panel_linear_by_handle``, ``pdserve::decode_linear``, ``pdserve::paged_decode_attention_f32``),
    built once for this torch and loaded, which registers them with torch's dispatcher, with the native
    kernels they call bound (the panel and decode linear and the paged attention libraries). Returns the
    library (its ``pdserve_torch_ops_set_panels`` keeps the panels' table:
    ``pdserve.engine.layers.panel_linear``), or None where it cannot be built here, with
    ``$PDSERVE_DISABLE_KERNELS`` or ``$PDSERVE_DISABLE_TORCH_OPS`` (logged once): those operators then run
    their Python implementations (one more Python call and a ctypes call each, ~10-20 us)."""
    fallback = "the decode step's linear and attention operators call their Python implementations"
    if os.environ.get("PDSERVE_DISABLE_TORCH_OPS"):
        if "torch_ops" not in _loaded:
            logger.info("C++ operators disabled by $PDSERVE_DISABLE_TORCH_OPS: %s", fallback)
            _loaded["torch_ops"] = None
        return None
    first = "torch_ops" not in _loaded
    panel, decode, paged = load_panel_linear(), load_decode_linear(), load_paged_attention()  # what it calls
    lib = _load("torch_ops", "C++ operators", fallback, _torch_ops_flags)  # loading registers the kernels
    if lib is not None and first:  # bound once more by a racing first caller at worst: the same pointers
        for name, kernel in (("panel_linear", panel and panel.pdserve_f32_panel_linear),
                             ("f32_linear", decode and decode.pdserve_f32_linear),
                             ("bf16_linear", decode and decode.pdserve_bf16_linear),
                             ("paged_decode_attention", paged and paged.pdserve_paged_decode_attention)):
            if kernel is not None:
                lib.pdserve_torch_ops_bind(name.encode(), ctypes.cast(kernel, ctypes.c_void_p))
    return lib
