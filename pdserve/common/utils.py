"""Small helpers shared by every process: sizes, devices, dtypes, ids."""

from __future__ import annotations

import re
import socket

import torch

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


def resolve_device(name: str) -> torch.device:
    """``"auto"`` picks CUDA when available, else CPU. The one place devices are chosen."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``"auto"`` is float32 on CPU and bfloat16 on CUDA.

    Raises:
        ValueError: an unknown dtype name.
    """
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
              "float16": torch.float16, "half": torch.float16}
    if name not in dtypes:
        raise ValueError(f"unknown dtype {name!r}; choose from auto, {', '.join(dtypes)}")
    return dtypes[name]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (for tests and the local launcher)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


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
