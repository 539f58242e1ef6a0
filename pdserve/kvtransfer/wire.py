"""What travels on a pair's process group, besides the KV itself.

A pair's group carries one ordered stream (a single tag), rank 0 -> rank 1:

    hello   int64[4]  once per pair: [MAGIC, generation, crc32(prefill_id), crc32(decode_id)]
    then per request, in the order the KVTransferHeaders were sent:
    meta    int64[8]  [MAGIC, crc32(request_id), num_layers, num_blocks,
                       block_size, num_kv_heads, head_dim, dtype_code]
    layer i           [2, num_blocks, block_size, num_kv_heads, head_dim], i = 0..num_layers-1

The receiver checks ``meta`` against the ZMQ header before posting any layer
receive, so a disagreement is reported instead of corrupting memory (gloo
aborts the process when more bytes arrive than a receive expects, and silently
accepts fewer).
"""

from __future__ import annotations

import zlib

import torch

from pdserve.common.protocol import KVTransferHeader

MAGIC = 0x4B565846  # "KVXF"
TAG = 0

_DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float64": 4,
    "int8": 5,
    "uint8": 6,
    "float8_e4m3fn": 7,
    "float8_e5m2": 8,
}
_META_FIELDS = ("magic", "request", "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype")


class KVTransferError(RuntimeError):
    """A KV transfer failed: timeout, peer gone, size/checksum mismatch, misuse."""


def crc(text: str) -> int:
    return zlib.crc32(text.encode())


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the spelling used in ``KVTransferHeader.dtype``."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_CODES:
        raise KVTransferError(f"KV dtype {dtype} cannot be transferred")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """Inverse of ``dtype_name``; KVTransferError for an unknown name."""
    dtype = getattr(torch, name, None) if name in _DTYPE_CODES else None
    if not isinstance(dtype, torch.dtype):
        raise KVTransferError(f"unknown KV dtype {name!r}")
    return dtype


def make_meta(request_id: str, num_layers: int, layer: torch.Tensor) -> torch.Tensor:
    """The ``meta`` message for ``layer`` [2, num_blocks, block_size, H, D], on its device."""
    _, num_blocks, block_size, num_kv_heads, head_dim = layer.shape
    values = [MAGIC, crc(request_id), num_layers, num_blocks, block_size, num_kv_heads, head_dim,
              _DTYPE_CODES[dtype_name(layer.dtype)]]
    return torch.tensor(values, dtype=torch.int64, device=layer.device)


def expected_meta(header: KVTransferHeader, device: torch.device) -> torch.Tensor:
    """The ``meta`` a sender of ``header`` must put on the wire."""
    dtype_from_name(header.dtype)
    values = [MAGIC, crc(header.request_id), header.num_layers, header.num_blocks, header.block_size,
              header.num_kv_heads, header.head_dim, _DTYPE_CODES[header.dtype]]
    return torch.tensor(values, dtype=torch.int64, device=device)


def describe_meta_mismatch(expected: torch.Tensor, got: torch.Tensor) -> str:
    """``"num_blocks: header 4, stream 5; ..."`` for the fields that differ."""
    diffs = [f"{name}: header {e}, stream {g}"
             for name, e, g in zip(_META_FIELDS, expected.tolist(), got.tolist()) if e != g]
    return "; ".join(diffs)
