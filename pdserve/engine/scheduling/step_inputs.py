"""A step's flattened inputs: what each scheduled request computes, as the model runner's ranks take it.

Requests computing ``(start, end)`` spans of their tokens become one ``ExecuteModel``: input ids
and positions of every new token, the cache slot each one's K/V goes to (``slot_mapping``), and
each sequence's block table, padded to the batch's widest, for attention to read its context.
With KV cache groups (``pdserve.common.kv_cache_groups``) every group has its own slots and tables.
"""

from __future__ import annotations

from pdserve.common.protocol import ExecuteModel
from pdserve.engine.scheduling.request import Request


def flatten_step(spans: list[tuple[Request, int, int]], block_size: int, rope_lengths: bool = False,
                 num_groups: int = 1) -> ExecuteModel:
    """One forward's flattened inputs for ``(request, start, end)`` spans: each computes the tokens at
    positions [start, end) (prompt, output, then drafts) into its block tables' slots and attends
    over positions [0, end). ``sample_indices`` is left empty for the caller. ``rope_lengths``: also each
    request's known length (``rope_seq_lens``), for a model whose RoPE reads it. ``num_groups``: KV cache
    groups (``pdserve.common.kv_cache_groups``); groups 1.. get ``group_slot_mappings``/``group_block_tables``."""
    step = ExecuteModel(query_start_loc=[0])
    for request, start, end in spans:
        step.input_ids.extend(request.token_ids_between(start, end))
        step.positions.extend(range(start, end))
        step.seq_lens.append(end)
        if rope_lengths:  # a prompt's chunks: the whole prompt's length
            step.rope_seq_lens.append(max(end, request.num_tokens))
        step.query_start_loc.append(step.query_start_loc[-1] + end - start)
    step.slot_mapping, step.block_tables = _group_inputs(spans, block_size, 0)
    for g in range(1, num_groups):
        slots, tables = _group_inputs(spans, block_size, g)
        step.group_slot_mappings.append(slots)
        step.group_block_tables.append(tables)
    step.max_query_len = max((end - start for _, start, end in spans), default=0)
    step.max_seq_len = max(step.seq_lens, default=0)
    return step


def _group_inputs(spans: list[tuple[Request, int, int]], block_size: int, group: int
                  ) -> tuple[list[int], list[list[int]]]:
    """KV cache group ``group``'s slot mapping [num_tokens] and block tables [num_seqs][width] for ``spans``.

    Entries freed out of a sliding window (``NULL_BLOCK``, always a prefix) read block 0: the window masks them."""
    slots: list[int] = []
    tables = [r.block_tables[group] for r, _, _ in spans]
    for table, (_, start, end) in zip(tables, spans):
        slots.extend(table[p // block_size] * block_size + p % block_size for p in range(start, end))
    width = max((len(t) for t in tables), default=0)
    return slots, [(t if not t or t[0] >= 0 else [max(b, 0) for b in t]) + [0] * (width - len(t)) for t in tables]
