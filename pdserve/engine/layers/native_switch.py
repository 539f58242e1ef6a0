"""Which native kernels run in this process: the switches ``kernel_choice`` sets and the kernels' Python
wrappers read (``native(name)``), kept apart from the probe so that the wrappers need not import it."""

from __future__ import annotations

from pdserve.engine.layers import decode_linear

KERNELS = ("prefill_attention", "elementwise", "decode_linear")

_native: dict[str, bool] = {}  # kernel -> whether its native path runs; absent: it does (if it builds)
# prompt attention: the kernel only over at most this many keys (None: any), for a fresh prompt (rows = keys)
# and for a chunk after cached rows (rows < keys)
_native_max_keys: dict[bool, int | None] = {True: None, False: None}


def native(kernel: str) -> bool:
    """Whether ``kernel``'s native path may run in this process (``choose_kernels`` decided, or nothing has)."""
    return _native.get(kernel, True)


def native_max_keys(fresh: bool = True) -> int | None:
    """The most keys a prompt's attention goes through the native kernel with (None: no limit): for a fresh
    prompt (``fresh``: as many rows as keys) or a chunk after cached rows."""
    return _native_max_keys[fresh]


def set_native_max_keys(limit: int | None, chunk_limit: int | None = None) -> None:
    """Prompt attention over more than ``limit`` keys (a fresh prompt) or ``chunk_limit`` (a chunk after
    cached rows) takes SDPA (None: the kernel at any length)."""
    _native_max_keys[True], _native_max_keys[False] = limit, chunk_limit


def set_native(kernel: str, on: bool) -> None:
    """Run ``kernel``'s native path (``on``) or its torch path from now on, in this process."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; one of {', '.join(KERNELS)}")
    _native[kernel] = on
    if kernel == "decode_linear":
        decode_linear.set_enabled(on)
