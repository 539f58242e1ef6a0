"""The model runner's LoRA side: adapters in slots, adapters in host memory, each step's mapping.

Every rank of a worker has a ``LoRAManager`` over its share of the model. The driver plans
each step (``plan``): which slot every adapter of the batch sits in, loading the ones that
are not in a slot yet into free slots, or into the slots whose adapters were used longest ago
and are not in this batch. The plan travels with the step (``ExecuteModel.lora_loads`` and
``lora_slots``), so every rank loads the same adapter into the same slot (each its own shard,
read from ``lora_path`` itself) and maps the same tokens to it (``activate``).

The scheduler admits at most ``max_loras`` distinct adapters among the requests in flight
(``SchedulerConfig.max_loras``), so a step's adapters always fit the slots.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from pdserve.common.protocol import LoRARequest
from pdserve.engine.layers.base import ColumnParallelLinear, RowParallelLinear
from pdserve.engine.lora.adapter import LoRAAdapter, LoRAAdapterError, load_adapter
from pdserve.engine.lora.layers import LoRAContext, LoRASlots, LoRAStepMapping

logger = logging.getLogger(__name__)


class LoRAManager:
    """LoRA slots on one rank's model, and the adapters read so far.

    Args:
        model: this rank's share of the model (a ``CausalLM``) (its decoder layers get ``LoRASlots``).
        max_loras: S, slots (adapters in one step). max_lora_rank: R.
        max_cpu_loras: adapters kept read in host memory (least recently used dropped first).

    Raises:
        ValueError: max_loras or max_lora_rank < 1.
    """

    def __init__(self, model, max_loras: int, max_lora_rank: int, max_cpu_loras: int | None = None):
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be >= 1")
        self.model = model
        self.hf_config = model.config
        self.max_loras, self.max_lora_rank = max_loras, max_lora_rank
        self.max_cpu_loras = max(max_cpu_loras or max_loras, max_loras)
        self.context = LoRAContext()
        self.layers: dict[tuple[int, str], LoRASlots] = {}  # (global layer, "self_attn.qkv_proj") -> slots
        start, end = model.layer_range
        for layer in range(start, end):
            block = model.decoder_layers[layer]
            for name, module in block.named_modules():
                if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    module.lora = LoRASlots(module, max_loras, max_lora_rank, self.context)
                    self.layers[(layer, name)] = module.lora
        self.slots: list[LoRARequest | None] = [None] * max_loras  # the adapter in each slot
        self._slot_used = [0] * max_loras  # plan counter when each slot last served a step
        self._num_plans = 0
        self._cpu: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id -> adapter
        num_bytes = sum(s.lora_a.numel() * s.lora_a.element_size() + s.lora_b.numel() * s.lora_b.element_size()
                        for s in self.layers.values())
        logger.info("LoRA: %d slots of rank %d over %d layers (%.1f MiB)", max_loras, max_lora_rank,
                    len(self.layers), num_bytes / 2**20)

    def get_adapter(self, lora: LoRARequest) -> LoRAAdapter:
        """The adapter of ``lora``, read from disk unless in host memory already.

        Raises:
            LoRAAdapterError: the adapter cannot serve this model (see ``load_adapter``).
        """
        adapter = self._cpu.get(lora.lora_int_id)
        if adapter is not None:
            self._cpu.move_to_end(lora.lora_int_id)
            return adapter
        adapter = load_adapter(lora.lora_name, lora.lora_path, self.hf_config, self.max_lora_rank)
        self._cpu[lora.lora_int_id] = adapter
        while len(self._cpu) > self.max_cpu_loras:
            self._cpu.popitem(last=False)
        logger.info("LoRA adapter %r (id %d, rank %d, %.1f MiB) read from %s", lora.lora_name, lora.lora_int_id,
                    adapter.rank, adapter.num_bytes / 2**20, lora.lora_path)
        return adapter

    def plan(self, loras: list[LoRARequest | None]) -> tuple[list[tuple[int, LoRARequest]], list[int]]:
        """Driver: the slot of each sequence's adapter in one step, and the loads that puts there.

        Args:
            loras: each sequence's adapter (None: the base model), in batch order.

        Returns:
            (loads, slots): ``loads`` (slot, adapter) to load first; ``slots`` [num_seqs], -1 for
            the base model. Both empty when no sequence has an adapter.

        Raises:
            ValueError: more distinct adapters than slots (the scheduler's limit was broken).
        """
        if all(lora is None for lora in loras):
            return [], []
        self._num_plans += 1
        wanted = list(dict.fromkeys(lora.lora_int_id for lora in loras if lora is not None))
        if len(wanted) > self.max_loras:
            raise ValueError(f"a step holds {len(wanted)} LoRA adapters; there are {self.max_loras} slots")
        where = {lora.lora_int_id: i for i, lora in enumerate(self.slots) if lora is not None}
        by_id = {lora.lora_int_id: lora for lora in loras if lora is not None}
        loads: list[tuple[int, LoRARequest]] = []
        for lora_id in wanted:
            if lora_id in where:
                continue
            taken = set(where[i] for i in wanted if i in where)
            free = [i for i in range(self.max_loras) if i not in taken]
            slot = min(free, key=lambda i: (self.slots[i] is not None, self._slot_used[i]))  # empty, else LRU
            if self.slots[slot] is not None:
                where.pop(self.slots[slot].lora_int_id, None)
            where[lora_id] = slot
            self.slots[slot] = by_id[lora_id]
            loads.append((slot, by_id[lora_id]))
        for lora_id in wanted:
            self._slot_used[where[lora_id]] = self._num_plans
        return loads, [-1 if lora is None else where[lora.lora_int_id] for lora in loras]

    def load(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """Put each (slot, adapter) into this rank's layers (every rank runs this for the driver's plan).

        Raises:
            LoRAAdapterError: an adapter cannot be read (its slot is left empty).
        """
        for slot, lora in loads:
            try:
                adapter = self.get_adapter(lora)
            except LoRAAdapterError:
                for slots in self.layers.values():
                    slots.clear_slot(slot)
                self.slots[slot] = None
                raise
            per_layer: dict[tuple[int, str], dict] = {}
            for (layer, module, shard_id), pair in adapter.weights.items():
                per_layer.setdefault((layer, module), {})[shard_id] = pair
            for key, slots in self.layers.items():
                parts = per_layer.get(key)
                if parts:
                    slots.set_slot(slot, parts)
                else:
                    slots.clear_slot(slot)
            self.slots[slot] = lora

    def activate(self, seq_slots: list[int], query_start_loc: list[int], device) -> None:
        """Map this step's tokens to slots (every layer adds its adapters' terms until ``deactivate``).

        seq_slots: [num_seqs] slot per sequence (-1: base); query_start_loc: [num_seqs + 1].
        """
        self.context.mapping = LoRAStepMapping(list(seq_slots), list(query_start_loc), device)

    def deactivate(self) -> None:
        self.context.mapping = None
