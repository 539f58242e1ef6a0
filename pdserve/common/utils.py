"""Small helpers shared by every process: sizes, devices, dtypes, ids.

torch is imported inside the helpers that use it: the launcher imports this module and never needs
torch, whose import takes 2-3 s of a 2-core machine's start-up."""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import random
import re
import socket
import sys
import weakref
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_size(text: str | int) -> int:
    """Parse a memory size such as ``"2GiB"``, ``"512MiB"``, ``"1.5GB"`` or ``4096`` into bytes.

    Raises:
        ValueError: not a size.
    """
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"not a memory size: {text!r} (use e.g. 512MiB or 2GiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def host_memory_limit() -> int:
    """Bytes of memory this process's host offers it: the machine's total, or its cgroup's limit where lower
    (a container's ``memory.max`` under cgroup v2, ``memory.limit_in_bytes`` under v1)."""
    import psutil

    total = psutil.virtual_memory().total
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit():
            total = min(total, int(text))
    return total


def parse_cpu_list(text: str) -> list[int]:
    """``"0-3,6"`` -> ``[0, 1, 2, 3, 6]`` (Linux's cpu-list syntax, as taskset and cgroups write it).

    Raises:
        ValueError: not a cpu list, or an empty one.
    """
    cores: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not match:
            raise ValueError(f"not a cpu list: {text!r} (use e.g. 0-3 or 0,2,4)")
        lo, hi = int(match.group(1)), int(match.group(2) or match.group(1))
        if hi < lo:
            raise ValueError(f"not a cpu list: {text!r} ({lo}-{hi} is empty)")
        cores.update(range(lo, hi + 1))
    return sorted(cores)


def format_cpu_list(cores: list[int]) -> str:
    """``[0, 1, 2, 3, 6]`` -> ``"0-3,6"`` (inverse of ``parse_cpu_list``)."""
    parts, cores = [], sorted(set(cores))
    i = 0
    while i < len(cores):
        j = i
        while j + 1 < len(cores) and cores[j + 1] == cores[j] + 1:
            j += 1
        parts.append(str(cores[i]) if i == j else f"{cores[i]}-{cores[j]}")
        i = j + 1
    return ",".join(parts)


def pin_to_cores(cpu_cores: str | None, num_threads: int | None, rank: int = 0, world_size: int = 1) -> list[int]:
    """Pin this process to its share of ``cpu_cores`` and size torch's thread pool to it.

    A worker of ``world_size`` ranks given ``cpu_cores`` splits them: rank r takes every
    world_size-th core from the r-th (all of them when there are fewer cores than ranks).
    Threads: ``num_threads``, or one per core of the share. ``cpu_cores`` None only applies
    ``num_threads`` (when given). Returns the cores this process may run on.

    With two threads or more (and no binding of the user's in the environment), each of torch's OpenMP
    threads is bound to one core of the share (``thread_affinity.bind_openmp_threads``: unbound, a
    thread woken after idle could wait ~10 ms behind the one that woke it).

    Raises:
        ValueError: a bad cpu list, or cores this process may not use.
    """
    import torch

    from pdserve.common.thread_affinity import bind_openmp_threads

    if cpu_cores is None:
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores = parse_cpu_list(cpu_cores)
    allowed = os.sched_getaffinity(0)
    if not set(cores) <= allowed:
        raise ValueError(f"--cpu-cores {cpu_cores}: cores {format_cpu_list(sorted(set(cores) - allowed))} are not "
                         f"available to this process (it may use {format_cpu_list(sorted(allowed))})")
    share = cores[rank::world_size] if len(cores) >= world_size else cores
    os.sched_setaffinity(0, share)
    torch.set_num_threads(num_threads or len(share))
    bound = bind_openmp_threads(share, torch.get_num_threads())  # one a core: no wake-up stall after idle
    if bound is not None:
        logger.info("OpenMP threads bound one to a core: %s", format_cpu_list(bound))
    return share


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (<malloc.h>)
_malloc_tuned = False


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the kernel.

    A CPU forward allocates and frees tensors of megabytes every layer (activations, attention
    scores). By default glibc serves those with fresh ``mmap`` pages, or trims them off the
    heap top once the free top exceeds twice the largest freed chunk, handing them back to the
    kernel, so every layer pays page faults on first write: a tenth of a float32 prefill's
    time went to elementwise ops that were mostly faulting. Raising the mmap threshold to its
    maximum (32 MiB) and never trimming the heap makes later allocations reuse warm pages, as
    vLLM's CPU backend gets by preloading tcmalloc. The cost: the process keeps its peak heap.
    Idempotent; returns False where it does nothing (not glibc, or
    ``PDSERVE_KEEP_FREED_MEMORY=0``).
    """
    global _malloc_tuned
    if _malloc_tuned:
        return True
    if os.environ.get("PDSERVE_KEEP_FREED_MEMORY", "1") == "0":
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = mallopt(_M_MMAP_THRESHOLD, 32 * 2**20) == 1 and mallopt(_M_TRIM_THRESHOLD, 2**31 - 1) == 1
    _malloc_tuned = ok
    return ok


def resolve_device(name: str) -> torch.device:
    """``"auto"`` picks CUDA when available, else CPU. The one place devices are chosen."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


_DTYPES = ("float32", "float", "bfloat16", "float16", "half")  # --dtype's names; "float" and "half" are aliases


def cpu_has_native_bf16() -> bool:
    """Whether this CPU computes bfloat16 natively (AVX-512 BF16 or AMX); else bf16 is emulated and slow."""
    import torch

    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # an older torch: read the flags
        try:
            with open("/proc/cpuinfo") as f:
                flags = next((line for line in f if line.startswith("flags")), "").split()
        except OSError:
            return False
        return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(name: str, device: torch.device, checkpoint_dtype: str | None = None) -> tuple[torch.dtype, str]:
    """The model dtype for ``--dtype NAME`` on ``device``, and why (one line for the start-up log).

    ``auto`` follows vLLM's rule, adapted to CPUs: the checkpoint's ``torch_dtype``
    (``checkpoint_dtype``, e.g. ``"bfloat16"``; None = unknown, taken as float32), except
    that a CPU without native bf16 (``cpu_has_native_bf16``) runs bfloat16 and float16
    checkpoints in float32, a CPU with it runs float16 checkpoints in bfloat16, and CUDA runs
    float32 checkpoints in bfloat16.

    Raises:
        ValueError: an unknown dtype name.
    """
    import torch

    dtypes = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16, "half": torch.float16}
    if name != "auto":
        if name not in dtypes:
            raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(_DTYPES)}")
        return dtypes[name], f"--dtype {name}"
    ckpt = dtypes.get(str(checkpoint_dtype or "float32").removeprefix("torch."), torch.float32)
    ckpt_name = str(ckpt).removeprefix("torch.")
    if device.type == "cuda":
        if ckpt == torch.float32:
            return torch.bfloat16, "auto: float32 checkpoint, bfloat16 on CUDA"
        return ckpt, f"auto: the checkpoint's {ckpt_name}"
    if ckpt == torch.float32:
        return ckpt, "auto: the checkpoint's float32"
    if cpu_has_native_bf16():
        why = "the checkpoint's" if ckpt == torch.bfloat16 else f"{ckpt_name} checkpoint, and this CPU has"
        return torch.bfloat16, f"auto: {why} bfloat16 (native on this CPU: AVX-512 BF16 / AMX)"
    return torch.float32, (f"auto: {ckpt_name} checkpoint, but this CPU has no native bf16 (AVX-512 BF16 / AMX): "
                           "float32 is faster here")


WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def reachable_host(bind_host: str, node_address: str = "127.0.0.1") -> str:
    """Where to reach a server bound to ``bind_host`` on this node: ``node_address`` for a wildcard
    (0.0.0.0, ::), else ``bind_host`` itself. What ``pdserve is up:`` prints and health checks use."""
    return node_address if bind_host in WILDCARD_HOSTS else bind_host


# Ports free_port hands out lie below the kernel's ephemeral range (outgoing connections and bind(0) take
# theirs from it) and above Ray's worker ports (10002-19999 by default).
_PICK_FLOOR = 20000
_DEFAULT_EPHEMERAL = (32768, 60999)  # Linux's default net.ipv4.ip_local_port_range
_handed_out: set[int] = set()


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's ephemeral port range ``(first, last)``, inclusive: where ``connect()`` and ``bind(port 0)``
    take their ports (Linux's ``net.ipv4.ip_local_port_range``; its default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first, last = (int(x) for x in f.read().split())
        return first, last
    except (OSError, ValueError):
        return _DEFAULT_EPHEMERAL


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now and that this process has not handed out before (for tests
    and the local launcher, which pass it to a process that binds it seconds later).

    Chosen at random below the kernel's ephemeral range (``ephemeral_port_range``), from 20000 up, so no
    outgoing connection can take it in the meantime: a port from ``bind(port 0)`` comes from that range,
    and a cluster starting up opens many connections (a router once failed to bind its ZMQ port because one
    had). Where the range leaves no room below it, the kernel's ``bind(port 0)`` choice.
    """
    first, _ = ephemeral_port_range()
    if first - _PICK_FLOOR >= 1024:
        rng = random.Random()
        for _ in range(64):
            port = rng.randrange(_PICK_FLOOR, first)
            if port in _handed_out:
                continue
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            _handed_out.add(port)
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    _handed_out.add(port)
    return port


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to exactly ``host:port`` (the first address ``host`` resolves to that binds), listening.

    SO_REUSEADDR as torch's own store socket sets, so a restarted driver can take the port
    back while old connections sit in TIME_WAIT.

    Raises:
        OSError: ``host`` does not resolve, or none of its addresses is on this machine or the port is taken.
    """
    error: OSError | None = None
    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
            sock.listen(socket.SOMAXCONN)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise OSError(f"cannot listen on {host}:{port}: {error}") from error


_MADV_HUGEPAGE = 14  # <sys/mman.h>, Linux
_MADV_POPULATE_WRITE = 23  # Linux 5.14+
HUGE_PAGE_BYTES = 2 * 2**20
PAGE_BYTES = mmap.PAGESIZE  # the base page (4 KiB on x86-64)


def advise_huge_pages(tensor: torch.Tensor) -> bool:
    """Ask Linux to back ``tensor``'s memory with 2 MiB transparent huge pages (``madvise``).

    Streams that cross many 4 KiB pages pay a TLB miss and a page walk at each, and the hardware
    prefetchers stop at page boundaries: a decode step reads each sequence's KV blocks from all over a
    cache of gigabytes (a 2 GiB cache spans 512k pages, the TLB holds a few thousand), and every weight
    once. Call it before the pages are first touched. Only the 2 MiB-aligned interior is advised;
    returns False where it does nothing (not Linux, THP disabled, a small tensor)."""
    return _madvise(tensor, HUGE_PAGE_BYTES, _MADV_HUGEPAGE)


def populate_pages(tensor: torch.Tensor) -> bool:
    """Make ``tensor``'s whole pages resident and writable now, as a first write to each would, without
    changing their contents (``madvise(MADV_POPULATE_WRITE)``, Linux 5.14+): the kernel allocates and
    zero-fills a page that was never touched, and leaves one in use as it is. False where nothing was
    done (the kernel refused or is older, not Linux, no whole page inside)."""
    return _madvise(tensor, PAGE_BYTES, _MADV_POPULATE_WRITE)


def _madvise(tensor: torch.Tensor, page: int, advice: int) -> bool:
    """``madvise(advice)`` over the whole ``page``-byte pages inside ``tensor``'s memory; False where nothing
    was advised (none inside, not Linux, or the kernel refused)."""
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    begin, stop = (start + page - 1) // page * page, end // page * page
    if stop <= begin or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.madvise(ctypes.c_void_p(begin), ctypes.c_size_t(stop - begin), advice) == 0
    except (OSError, AttributeError):
        return False


def empty_on_huge_pages(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised 1-D CPU tensor of ``numel`` elements that starts on a 2 MiB boundary and is advised
    onto transparent huge pages (``advise_huge_pages``) before any page is touched: an arena for weights
    that are streamed whole every step (at most 2 MiB more is allocated, for the alignment). Its views'
    pages can be handed back early (``release_pages``). An arena below glibc's mmap threshold (32 MiB once
    ``keep_freed_memory`` ran) may reuse heap pages a freed tensor already touched, which stay 4 KiB ones."""
    import torch

    itemsize = torch.empty((), dtype=dtype).element_size()
    pad = HUGE_PAGE_BYTES // itemsize
    raw = torch.empty(numel + pad, dtype=dtype)
    offset = (-raw.data_ptr() % HUGE_PAGE_BYTES) // itemsize
    arena = raw[offset: offset + numel]
    advise_huge_pages(arena)
    start = raw.data_ptr()
    _arenas[start] = start + raw.numel() * itemsize
    weakref.finalize(raw.untyped_storage(), _arenas.pop, start, None)
    return arena


_arenas: dict[int, int] = {}  # start -> end address of each live empty_on_huge_pages allocation
_MADV_DONTNEED = 4  # <sys/mman.h>, Linux


def release_pages(tensor: torch.Tensor) -> bool:
    """Hand the pages of ``tensor``, a view of an ``empty_on_huge_pages`` arena that nothing will read again,
    back to the kernel (``madvise(MADV_DONTNEED)`` on its whole 4 KiB pages): a weight dropped from an arena
    whose other views live on (packed into another layout at load) would otherwise stay resident until they
    all go. Returns False, doing nothing, for a tensor outside every arena, or where Linux refuses."""
    begin = tensor.data_ptr()
    end = begin + tensor.numel() * tensor.element_size()
    if not any(start <= begin and end <= stop for start, stop in _arenas.items()):
        return False
    return _madvise(tensor, PAGE_BYTES, _MADV_DONTNEED)
