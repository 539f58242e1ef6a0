"""One linear layer's LoRA adapters in slots, and their term for a batch that mixes adapters.

A layer with ``P`` fused parts (qkv_proj: 3, gate_up_proj: 2, o_proj and down_proj: 1),
``S`` slots (``--max-loras``) and rank ``R`` (``--max-lora-rank``; smaller adapters are
zero-padded) stacks every slot's A and B::

    lora_a: [P*S*R, in_local]    row (p*S + s)*R + j: row j of part p's A in slot s
    lora_b: [P*S*R, out_local]   the same rows of B^T, nonzero only in part p's output columns

For a step whose token t belongs to slot ``slot[t]`` (-1: the base model), the LoRA term is

    shrink = x @ lora_a^T                 [N, P*S*R]   every slot's projection of every token
    shrink *= mask                        mask[t, c] = 1 where column c belongs to slot[t]
    delta  = shrink @ lora_b              [N, out_local]

two matmuls for the whole batch, whatever mix of adapters it holds: the token-to-adapter
gather of Punica's BGMV/SGMV kernels (Chen et al., 2023) done as a mask, which costs
``S`` times the arithmetic of the token's own adapter, small next to the base layer while
``S*R`` is small against its width. No per-adapter forward, no per-token weight copies.

Tensor parallelism (Megatron-style, as the base layer): a column-parallel layer keeps A
whole and this rank's rows of B; a row-parallel layer keeps this rank's columns of A and
all of B, and its term is added before the all-reduce, which then sums it with the base.
"""

from __future__ import annotations

import torch


class LoRAStepMapping:
    """Which slot each token of one step uses, as the masks ``LoRASlots.add_to`` needs.

    Args:
        token_slots: [num_tokens] int64, each token's slot, -1 for the base model.
        num_slots, max_rank: the runner's S and R.
        dtype: the model's dtype (the masks multiply activations).
    """

    def __init__(self, token_slots: torch.Tensor, num_slots: int, max_rank: int, dtype: torch.dtype):
        self.token_slots = token_slots
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self._masks: dict[int, torch.Tensor] = {}

    def mask(self, num_parts: int) -> torch.Tensor:
        """[num_tokens, num_parts*S*R]: 1 where the column belongs to the token's slot, else 0."""
        mask = self._masks.get(num_parts)
        if mask is None:
            cols = torch.arange(num_parts * self.num_slots * self.max_rank, device=self.token_slots.device)
            col_slot = (cols // self.max_rank) % self.num_slots  # (P*S*R,)
            mask = (col_slot[None, :] == self.token_slots[:, None]).to(self.dtype)  # (N, P*S*R)
            self._masks[num_parts] = mask
        return mask


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
        # the activations' dtype: an int8 layer's scales have it (pdserve.engine.quantization)
        dtype = weight.dtype if weight.is_floating_point() else linear.weight_scale.dtype
        self.lora_a = torch.zeros(rows, in_local, dtype=dtype, device=weight.device)  # (P*S*R, in)
        self.lora_b = torch.zeros(rows, out_local, dtype=dtype, device=weight.device)  # (P*S*R, out)
        if self.row_parallel:
            self.local_input_size = linear.local_input_size
        else:
            self.output_sizes, self.local_sizes = linear.output_sizes, linear.local_sizes
            self.num_shards = linear.num_shards

    def _rows(self, part: int, slot: int) -> slice:
        start = (part * self.num_slots + slot) * self.max_rank
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
        """y + this step's LoRA term: x [N, in_local], y [N, out_local] (the base layer's output,
        before a row-parallel all-reduce). y itself when no adapter is in the step."""
        mapping = self.context.mapping
        if mapping is None:
            return y
        shrink = (x @ self.lora_a.t()) * mapping.mask(self.num_parts)  # (N, P*S*R)
        # y += shrink @ lora_b inside the GEMM (beta = 1): no second pass over the [N, out] output.
        # y is the base layer's fresh output, owned by this forward, so writing into it is safe.
        return y.addmm_(shrink, self.lora_b)  # (N, out_local)
