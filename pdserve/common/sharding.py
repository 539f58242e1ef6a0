"""How a model is cut over the ranks of a worker, and how KV moves between two cuts (no torch).

A worker of ``T`` tensor-parallel x ``P`` pipeline-parallel ranks (rank =
pp_rank * T + tp_rank) holds, on each rank, the KV of its stage's layers and
its TP rank's KV heads (``rank_slice``). A prefill worker and a decode worker
may be cut differently; ``transfer_pieces`` says which prefill rank sends which
part of its KV to which decode rank, so that every decode rank receives exactly
its own slice, once:

    piece(p, d) = send_slice(prefill, p)  intersect  rank_slice(decode, d)      (when non-empty)

``send_slice`` is ``rank_slice`` except that a KV head copied on several TP
ranks (fewer KV heads than ranks) is sent only by the lowest of them.
"""

from __future__ import annotations

from dataclasses import dataclass


def kv_head_layout(total_kv_heads: int, tp_size: int) -> tuple[int, int]:
    """(KV heads per TP rank, ranks sharing each KV head).

    With at least as many KV heads as ranks the heads are split (``total / tp`` each, no
    sharing); with fewer, each rank holds one head and ``tp / total`` ranks hold a copy of
    it (vLLM's rule for grouped-query attention).

    Raises:
        ValueError: the heads cannot be spread evenly.
    """
    if total_kv_heads >= tp_size:
        if total_kv_heads % tp_size:
            raise ValueError(f"num_key_value_heads={total_kv_heads} is not divisible by the TP size {tp_size}")
        return total_kv_heads // tp_size, 1
    if tp_size % total_kv_heads:
        raise ValueError(f"the TP size {tp_size} is not a multiple of num_key_value_heads={total_kv_heads}")
    return 1, tp_size // total_kv_heads


def stage_layer_range(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """The contiguous layers [start, end) of pipeline stage ``pp_rank``.

    Layers split as evenly as possible; the later stages take the remainder (the first
    stage also embeds, and holds the driver's sampling head).

    Raises:
        ValueError: fewer layers than stages.
    """
    if num_layers < pp_size:
        raise ValueError(f"{num_layers} layers cannot be split into {pp_size} pipeline stages")
    base, extra = divmod(num_layers, pp_size)
    sizes = [base + (1 if stage >= pp_size - extra else 0) for stage in range(pp_size)]
    start = sum(sizes[:pp_rank])
    return start, start + sizes[pp_rank]


@dataclass(frozen=True)
class KVLayoutSpec:
    """How one worker's KV cache is split: its parallel sizes and the model's totals."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    num_layers: int
    num_kv_heads: int

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class KVSlice:
    """Global layers [layer_start, layer_end) x KV heads [head_start, head_end)."""

    layer_start: int
    layer_end: int
    head_start: int
    head_end: int

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def num_heads(self) -> int:
        return self.head_end - self.head_start

    def intersect(self, other: "KVSlice") -> "KVSlice | None":
        s = KVSlice(max(self.layer_start, other.layer_start), min(self.layer_end, other.layer_end),
                    max(self.head_start, other.head_start), min(self.head_end, other.head_end))
        return s if s.num_layers > 0 and s.num_heads > 0 else None


@dataclass(frozen=True)
class KVPiece:
    """One prefill rank's part of one decode rank's slice."""

    prefill_rank: int
    decode_rank: int
    slice: KVSlice


def rank_slice(layout: KVLayoutSpec, rank: int) -> KVSlice:
    """The layers and KV heads whose KV ``rank`` holds."""
    pp_rank, tp_rank = divmod(rank, layout.tensor_parallel_size)
    start, end = stage_layer_range(layout.num_layers, layout.pipeline_parallel_size, pp_rank)
    heads_per_rank, _ = kv_head_layout(layout.num_kv_heads, layout.tensor_parallel_size)
    first = tp_rank * min(layout.num_kv_heads, layout.tensor_parallel_size) // layout.tensor_parallel_size
    first *= heads_per_rank
    return KVSlice(start, end, first, first + heads_per_rank)


def send_slice(layout: KVLayoutSpec, rank: int) -> KVSlice | None:
    """What ``rank`` sends: its slice, unless another (lower) TP rank holds a copy of the same heads."""
    _, tp_rank = divmod(rank, layout.tensor_parallel_size)
    _, replicas = kv_head_layout(layout.num_kv_heads, layout.tensor_parallel_size)
    return rank_slice(layout, rank) if tp_rank % replicas == 0 else None


def transfer_pieces(prefill: KVLayoutSpec, decode: KVLayoutSpec) -> list[KVPiece]:
    """Every (prefill rank -> decode rank) piece, ordered by prefill rank, then decode rank.

    Raises:
        ValueError: the two workers do not run the same model (layer or KV head counts differ).
    """
    if (prefill.num_layers, prefill.num_kv_heads) != (decode.num_layers, decode.num_kv_heads):
        raise ValueError(f"prefill and decode workers disagree on the model: {prefill} vs {decode}")
    pieces = []
    for p in range(prefill.world_size):
        sent = send_slice(prefill, p)
        if sent is None:
            continue
        for d in range(decode.world_size):
            part = sent.intersect(rank_slice(decode, d))
            if part is not None:
                pieces.append(KVPiece(p, d, part))
    return pieces


def endpoint(worker_id: str, rank: int) -> str:
    """The name of one rank of a worker in KV transfer pairs ("decode-0#1")."""
    return f"{worker_id}#{rank}"
