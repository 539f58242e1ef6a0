"""What travels on a pair's process group, besides the KV itself.

A pair's group carries one ordered stream (a single tag), rank 0 -> rank 1:

    hello   int64[4]  once per pair: [MAGIC, generation, crc32(prefill_id), crc32(decode_id)]
    then per request, in the order the KVTransferHeaders were sent:
    meta    int64[10] [MAGIC, crc32(request_id), num_layers, num_blocks,
                       block_size, num_kv_heads, head_dim, dtype_code, kv_slots, layer_blocks]
    layer i           [kv_slots, num_blocks_i, block_size, num_kv_heads, row_len], i = 0..num_layers-1,
                      as the messages of ``layer_runs``: slot by slot, each slot's blocks in runs

``num_blocks_i`` is ``num_blocks`` for every layer, unless the header's ``layer_num_blocks``
names each layer's count (a model whose sliding-window layers keep fewer blocks than its full
ones: KV cache groups, ``pdserve.common.kv_cache_groups``); ``num_blocks`` is then the largest
and ``layer_blocks`` is the crc32 of that list (``layer_blocks_code``; 0 when every layer has
``num_blocks``).

``kv_slots`` is what the model caches per token and KV head: 2 (K, then V) or 1 (a latent
row, DeepSeek's MLA, whose value is its own first kv_lora_rank values): a latent layer is
half the bytes of a K/V layer of the same row width, and it is shipped as the cache holds it.

``dtype_code`` names the KV cache dtype (``_DTYPE_CODES``), and ``head_dim`` is
always the model's head_dim. For a plain cache (float32, bfloat16, float16) a
layer's elements are that dtype and ``row_len = head_dim``. For a quantized
cache (int8, fp8_e4m3, fp8_e5m2; ``pdserve.common.kv_quant``) a layer is uint8
and ``row_len = head_dim + 4``: each (token, KV head) row is its head_dim
quantized bytes followed by its float32 scale, shipped as the cache holds them.

A layer travels as several messages, in its bytes' order (``layer_runs``): each KV slot's
blocks, in runs of at most ``CPU_MESSAGE_BYTES`` (never less than one block) on a CPU pair,
whole on a CUDA one. The sender gathers and sends one run at a time, so on a CPU the run it
just gathered is still in its core's L2 cache when the kernel copies it into the socket (a
run whose blocks are adjacent in the cache is only summed there and sent from the cache:
``OutgoingKV``'s ``send_from_cache``; the receiver cannot tell the two apart); a
whole layer (1-4 MiB for a 512-2048-token prompt of the bench model) was not. Smaller runs
lose more to gloo's cost per message than they gain: on a 2-core Zen 5 class machine, 12 MiB
moved at 0.60x raw gloo in 128 KiB runs, 0.46x in 256 KiB runs, 0.86-0.88x in 512 KiB runs,
against 0.78-0.80x as whole layers (``benchmarks/bench_transfer.py``; docs/benchmarks.md,
thirteenth session). The split never changes the bytes, only where one message ends.

A pair whose ranks share a host (``kvtransfer.shm``) carries the same messages in the same order, but
publishes each through a shared-memory arena as a descriptor (offset, size); only a message outside the
arena (the meta, a request that did not fit) still travels on the group, its descriptor saying so.

The receiver checks ``meta`` against the ZMQ header before posting any layer
receive, so a disagreement is reported instead of corrupting memory (gloo
aborts the process when more bytes arrive than a receive expects, and silently
accepts fewer).
"""

from __future__ import annotations

import zlib

import torch

from pdserve.common.protocol import KVTransferHeader
from pdserve.common.kv_quant import KV_CACHE_FORMATS

MAGIC = 0x4B565832  # "KVX2": a layer in runs (layer_runs); "KVXF", one message a layer, is retired
TAG = 0
CPU_MESSAGE_BYTES = 512 * 1024  # most bytes in one message of a layer on a CPU pair (layer_runs)

# KV dtype name -> meta code. 1-4: plain elements of that torch dtype; 5, 9, 10: quantized rows with
# their scale (int8, fp8 e4m3, fp8 e5m2). 6-8 (uint8, float8_e4m3fn, float8_e5m2 as plain elements)
# are retired: no KV cache holds those, and a code is never reused for another meaning.
_DTYPE_CODES: dict[str, int] = {
    "float32": 1,
    "float16": 2,
    "bfloat16": 3,
    "float64": 4,
    "int8": 5,
    "fp8_e4m3": 9,
    "fp8_e5m2": 10,
}
_META_FIELDS = ("magic", "request", "num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim", "dtype",
                "kv_slots", "layer_blocks")


class KVTransferError(RuntimeError):
    """A KV transfer failed: timeout, peer gone, size/checksum mismatch, misuse."""


def crc(text: str) -> int:
    return zlib.crc32(text.encode())


def dtype_name(dtype: torch.dtype | str) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: the spelling used in ``KVTransferHeader.dtype``.

    A KV dtype name (``"int8"``, ``"fp8_e4m3"``, ...) is returned as it is; KVTransferError for a
    dtype no transfer carries (``torch.uint8`` too: a quantized cache's name must be given)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPE_CODES:
        raise KVTransferError(f"KV dtype {dtype} cannot be transferred")
    return name


def dtype_from_name(name: str) -> torch.dtype:
    """The torch dtype of a layer on the wire for KV dtype ``name`` (torch.uint8 for a quantized one);
    KVTransferError for an unknown name."""
    fmt = KV_CACHE_FORMATS.get(name)
    dtype = fmt.storage_dtype if fmt is not None else getattr(torch, name, None) if name in _DTYPE_CODES else None
    if not isinstance(dtype, torch.dtype):
        raise KVTransferError(f"unknown KV dtype {name!r}")
    return dtype


def row_len(name: str, head_dim: int) -> int:
    """A wire layer's last axis for KV dtype ``name``: head_dim, or head_dim + 4 bytes quantized."""
    fmt = KV_CACHE_FORMATS.get(name)
    return fmt.row_len(head_dim) if fmt is not None else head_dim


def layer_blocks_code(layer_num_blocks: list[int]) -> int:
    """The meta's ``layer_blocks`` field: crc32 of each layer's block count, 0 for [] (all ``num_blocks``)."""
    if not layer_num_blocks:
        return 0
    return zlib.crc32(",".join(map(str, layer_num_blocks)).encode()) or 1


def layer_prefix(layer: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """The front of a contiguous staging layer [kv_slots, capacity, block_size, H, row_len] viewed as
    [kv_slots, num_blocks, block_size, H, row_len], itself contiguous: where a layer that carries fewer
    blocks than the stream's largest is gathered, sent and received."""
    kv_slots, _, *rest = layer.shape
    numel = kv_slots * num_blocks * layer[0, 0].numel()
    return layer.view(-1)[:numel].view(kv_slots, num_blocks, *rest)


def layer_runs(kv_slots: int, num_blocks: int, block_bytes: int, device_type: str) -> list[tuple[int, int, int]]:
    """The messages a layer [kv_slots, num_blocks, ...] travels in, in order: ``(slot, first block, end
    block)`` each. On a CPU pair each slot's blocks go in runs of ``CPU_MESSAGE_BYTES // block_bytes``
    blocks (at least one); elsewhere each slot's blocks in one message (NCCL has no cache to keep
    warm, and each message costs a launch). ``block_bytes``: one block of one slot, in bytes. A layer
    of no blocks has no messages."""
    per = max(1, CPU_MESSAGE_BYTES // max(block_bytes, 1)) if device_type == "cpu" else max(num_blocks, 1)
    return [(slot, first, min(first + per, num_blocks)) for slot in range(kv_slots)
            for first in range(0, num_blocks, per)]


def layer_messages(layer: torch.Tensor) -> list[torch.Tensor]:
    """``layer`` [kv_slots, num_blocks, block_size, H, row_len] (contiguous) as its messages
    (``layer_runs``): contiguous views that cover its bytes once, in order."""
    kv_slots, num_blocks = layer.shape[:2]
    block_bytes = layer[0, 0].numel() * layer.element_size() if num_blocks else 0
    return [layer[slot, first:end] for slot, first, end in
            layer_runs(kv_slots, num_blocks, block_bytes, layer.device.type)]


def make_meta(request_id: str, num_layers: int, layer: torch.Tensor, kv_dtype: str | None = None,
              layer_num_blocks: list[int] = ()) -> torch.Tensor:
    """The ``meta`` message for ``layer`` [kv_slots, num_blocks, block_size, H, row_len], on its device.

    kv_dtype: the KV dtype name; None takes the layer's torch dtype (a plain cache). The meta's
    head_dim is the model's (row_len less a quantized row's 4 scale bytes). layer_num_blocks: each
    layer's block count when they differ (``num_blocks`` is then their largest), else empty."""
    name = dtype_name(kv_dtype if kv_dtype is not None else layer.dtype)
    if layer.dtype != dtype_from_name(name):
        raise KVTransferError(f"a {name} KV layer must be {dtype_from_name(name)}, got {layer.dtype}")
    kv_slots, num_blocks, block_size, num_kv_heads, last = layer.shape
    fmt = KV_CACHE_FORMATS.get(name)
    head_dim = fmt.head_dim_of(last) if fmt is not None else last
    values = [MAGIC, crc(request_id), num_layers, num_blocks, block_size, num_kv_heads, head_dim,
              _DTYPE_CODES[name], kv_slots, layer_blocks_code(list(layer_num_blocks))]
    return torch.tensor(values, dtype=torch.int64, device=layer.device)


def expected_meta(header: KVTransferHeader, device: torch.device) -> torch.Tensor:
    """The ``meta`` a sender of ``header`` must put on the wire (KVTransferError for an unknown dtype)."""
    dtype_from_name(header.dtype)
    values = [MAGIC, crc(header.request_id), header.num_layers, header.num_blocks, header.block_size,
              header.num_kv_heads, header.head_dim, _DTYPE_CODES[header.dtype], header.kv_slots,
              layer_blocks_code(header.layer_num_blocks)]
    return torch.tensor(values, dtype=torch.int64, device=device)


def describe_meta_mismatch(expected: torch.Tensor, got: torch.Tensor) -> str:
    """``"num_blocks: header 4, stream 5; ..."`` for the fields that differ."""
    diffs = [f"{name}: header {e}, stream {g}"
             for name, e, g in zip(_META_FIELDS, expected.tolist(), got.tolist()) if e != g]
    return "; ".join(diffs)
