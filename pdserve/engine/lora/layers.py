"""One linear layer's LoRA adapters in slots, and their term for a batch that mixes adapters.

A layer with ``P`` fused parts (qkv_proj: 3, gate_up_proj: 2, o_proj and down_proj: 1),
``S`` slots (``--max-loras``) and rank ``R`` (``--max-lora-rank``; smaller adapters are
zero-padded) stacks every slot's A and B, slot by slot::

    lora_a: [S*P*R, in_local]    row (s*P + p)*R + j: row j of part p's A in slot s
    lora_b: [S*P*R, out_local]   the same rows of B^T, nonzero only in part p's output columns

so slot s is the contiguous block of rows ``s*P*R .. (s+1)*P*R`` (a view, no copy). For a
step, the tokens of each adapter in it form a group (``LoRAStepMapping``), and each group
adds its own adapter's term to its rows of the base output:

    shrink = x[rows] @ A_s^T              [n_s, P*R]
    y[rows] += shrink @ B_s               [n_s, out_local]   (inside the GEMM: addmm_)

This is the segmented gather of Punica's SGMV (Chen et al., "Punica: Multi-Tenant LoRA Serving",
2023) written with torch ops: a group whose tokens are one run of rows (one prompt, or
adjacent decode rows) takes views of x and y; a scattered group gathers its rows
(``index_select``) and scatters its term back (``index_add_``). One pair of small matmuls per
adapter in the step, each over its own tokens only; no per-adapter forward of the model, no
per-token weight copies; base-model tokens cost nothing.

Tensor parallelism (Megatron-style, as the base layer): a column-parallel layer keeps A
whole and this rank's rows of B; a row-parallel layer keeps this rank's columns of A and
all of B, and its term is added before the all-reduce, which then sums it with the base.
"""

from __future__ import annotations

import torch


class LoRAStepMapping:
    """The token groups of one step: for each slot in use, the rows of the step's tokens that use it.

    Args:
        seq_slots: [num_seqs] each sequence's slot, -1 for the base model.
        query_start_loc: [num_seqs + 1] cumulative token counts (sequence i's tokens are rows
            ``query_start_loc[i] .. query_start_loc[i + 1]``).
        device: where the row indices of a scattered group live.

    ``groups``: (slot, rows) per slot in use, slots ascending; ``rows`` is a ``slice`` when the
    slot's tokens are one run of rows, else an int64 tensor of row indices, ascending.
    """

    def __init__(self, seq_slots: list[int], query_start_loc: list[int], device: torch.device | str = "cpu"):
        runs: dict[int, list[tuple[int, int]]] = {}
        for slot, start, end in zip(seq_slots, query_start_loc, query_start_loc[1:]):
            if slot < 0 or start == end:
                continue
            slot_runs = runs.setdefault(slot, [])
            if slot_runs and slot_runs[-1][1] == start:  # adjacent to the last run: extend it
                slot_runs[-1] = (slot_runs[-1][0], end)
            else:
                slot_runs.append((start, end))
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot in sorted(runs):
            if len(runs[slot]) == 1:
                rows: slice | torch.Tensor = slice(*runs[slot][0])
            else:
                rows = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in runs[slot]]).to(device)
            self.groups.append((slot, rows))


class LoRAContext:
    """Shared by every ``LoRASlots`` of a model: the current step's mapping, or None (no adapter
    in the batch: the layers add nothing, and the compiled decode step may run)."""

    mapping: LoRAStepMapping | None = None


class LoRASlots:
    """The stacked adapters of one ``ColumnParallelLinear`` or ``RowParallelLinear``.

    Args:
        linear: the base layer (its ``output_sizes``/``local_sizes``/``num_shards`` or
            ``local_input_size`` and TP rank say how to shard A and B).
        num_slots: S, adapters held at once. max_rank: R.
        context: the model's ``LoRAContext``.
    """

    def __init__(self, linear, num_slots: int, max_rank: int, context: LoRAContext):
        self.context = context
        self.num_slots, self.max_rank = num_slots, max_rank
        self.row_parallel = not hasattr(linear, "output_sizes")
        self.tp_rank, self.tp_size = linear.tp_rank, linear.tp_size
        weight = linear.weight
        out_local, in_local = weight.shape
        self.num_parts = 1 if self.row_parallel else len(linear.output_sizes)
        rows = self.num_parts * num_slots * max_rank
        # the activations' dtype: an int8 layer's scales have it (pdserve.engine.layers.quantization)
        dtype = weight.dtype if weight.is_floating_point() else linear.weight_scale.dtype
        self.lora_a = torch.zeros(rows, in_local, dtype=dtype, device=weight.device)  # (S*P*R, in)
        self.lora_b = torch.zeros(rows, out_local, dtype=dtype, device=weight.device)  # (S*P*R, out)
        if self.row_parallel:
            self.local_input_size = linear.local_input_size
        else:
            self.output_sizes, self.local_sizes = linear.output_sizes, linear.local_sizes
            self.num_shards = linear.num_shards

    def _rows(self, part: int, slot: int) -> slice:
        start = (slot * self.num_parts + part) * self.max_rank
        return slice(start, start + self.max_rank)

    def clear_slot(self, slot: int) -> None:
        """Zero slot ``slot`` (an empty slot adds nothing)."""
        for part in range(self.num_parts):
            self.lora_a[self._rows(part, slot)] = 0
            self.lora_b[self._rows(part, slot)] = 0

    def set_slot(self, slot: int, parts: dict[int | None, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's weights for this layer into slot ``slot`` (its other parts zeroed).

        parts: shard_id (None for an unfused layer) -> (A [r, in_features], B [out_features, r]),
        unsharded, scaling folded into B; r <= max_rank.
        """
        self.clear_slot(slot)
        for shard_id, (a, b) in parts.items():
            part = 0 if shard_id is None else shard_id
            rank = a.shape[0]
            rows = self._rows(part, slot)
            rows = slice(rows.start, rows.start + rank)
            if self.row_parallel:
                start = self.tp_rank * self.local_input_size
                self.lora_a[rows] = a[:, start:start + self.local_input_size].to(self.lora_a.dtype)
                self.lora_b[rows] = b.t().to(self.lora_b.dtype)
            else:
                local = self.local_sizes[part]
                piece = self.tp_rank * self.num_shards[part] // self.tp_size
                dst = sum(self.local_sizes[:part])
                self.lora_a[rows] = a.to(self.lora_a.dtype)
                self.lora_b[rows, dst:dst + local] = b[piece * local:(piece + 1) * local].t().to(self.lora_b.dtype)

    def add_to(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + this step's LoRA terms: x [N, in_local], y [N, out_local] (the base layer's output,
        before a row-parallel all-reduce), updated in place and returned. y itself when no
        adapter is in the step. y is the base layer's fresh output, owned by this forward, so
        writing into it is safe."""
        mapping = self.context.mapping
        if mapping is None:
            return y
        width = self.num_parts * self.max_rank
        for slot, rows in mapping.groups:
            lora_a = self.lora_a[slot * width:(slot + 1) * width]  # (P*R, in), a view
            lora_b = self.lora_b[slot * width:(slot + 1) * width]  # (P*R, out)
            if isinstance(rows, slice):  # one run of rows: views of x and y, the add inside the GEMM
                y[rows].addmm_(x[rows] @ lora_a.t(), lora_b)
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ lora_a.t()) @ lora_b)
        return y
