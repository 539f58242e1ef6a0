"""Prompt logprobs: the logprob of every prompt token given its prefix (vLLM's ``prompt_logprobs``).

A step computes logits only at the rows it samples (``ExecuteModel.sample_indices``).
For a request with ``sampling_params.prompt_logprobs`` set, the model runner appends
the rows of its prompt positions to ``sample_indices`` after the sampled ones, so
every rank of a tensor/pipeline-parallel worker hands the driver those rows too
(nothing else changes on the ranks). Position ``p`` of the prompt predicts prompt
token ``p + 1``, so a chunk computing positions ``[start, end)`` yields the entries
of prompt tokens ``start + 1 .. min(end, num_prompt_tokens - 1)``; entries
accumulate on the request over chunked-prefill chunks (``Request.prompt_logprobs``)
and a position already covered (a preempted request recomputed) is not taken again::

    prompt:     t0   t1   t2   t3   t4          (num_prompt_tokens 5)
    chunk 1:    p0   p1   p2                     rows p0, p1, p2 -> entries of t1, t2, t3
    chunk 2:                   p3   p4           row p3 -> entry of t4 (p4 samples the first output)

The first prompt token has no entry (``None`` in vLLM's list; the router and ``LLM``
add it). Logprobs are the raw log-softmax of the logits, as for output tokens.
Such requests never adopt prefix-cache hits (a cached position has no logits), as in
vLLM; their full blocks still enter the cache.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.common.protocol import ExecuteModel, TokenLogprob
from pdserve.engine.scheduling.request import Request

ROWS_PER_SLICE = 256  # prompt rows turned into logits at once ([rows, vocab_size] float32 at a time)


@dataclass
class PromptLogprobSpan:
    """One request's prompt positions ``[first, last)`` whose logits this step computes.

    Their hidden rows follow the sampled rows, in plan order, ``last - first`` each.
    """

    request: Request
    first: int
    last: int


def wants_prompt_logprobs(request: Request) -> bool:
    """Choice 0 of a request that asked (the other choices share its prompt)."""
    return request.sampling_params.prompt_logprobs is not None and request.sample_index == 0


def add_prompt_logprob_rows(step: ExecuteModel, scheduled: list[tuple[Request, int]]) -> list[PromptLogprobSpan]:
    """Append to ``step.sample_indices`` the rows of prompt positions whose entries are still missing.

    Args:
        step: the step ``ModelRunner.prepare_inputs`` built from ``scheduled`` (edited in place).
        scheduled: (request, num_new_tokens) pairs, in the step's order.

    Returns:
        the spans, in the order their rows were appended.
    """
    spans = []
    for seq, (request, num_new) in enumerate(scheduled):
        if not wants_prompt_logprobs(request):
            continue
        start = request.num_computed_tokens
        first = max(start, len(request.prompt_logprobs))
        last = min(start + num_new, request.num_prompt_tokens - 1)
        if first >= last:
            continue
        offset = step.query_start_loc[seq] - start  # row of position p is offset + p
        step.sample_indices.extend(range(offset + first, offset + last))
        spans.append(PromptLogprobSpan(request, first, last))
    return spans


def compute_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                            spans: list[PromptLogprobSpan]) -> dict[str, list[TokenLogprob]]:
    """Entries of the spans' prompt tokens.

    Args:
        compute_logits: final norm + LM head, [n, hidden_size] -> [n, vocab_size].
        hidden: [sum of span lengths, hidden_size], the spans' rows in order.
        spans: from ``add_prompt_logprob_rows``.

    Returns:
        request_id -> one ``TokenLogprob`` per prompt token ``first + 1 .. last`` (with ``rank``
        and the top ``prompt_logprobs`` alternatives).
    """
    out: dict[str, list[TokenLogprob]] = {}
    row = 0
    for span in spans:
        num_top = span.request.sampling_params.prompt_logprobs
        targets = span.request.prompt_token_ids[span.first + 1:span.last + 1]
        entries: list[TokenLogprob] = []
        for lo in range(0, len(targets), ROWS_PER_SLICE):
            hi = min(lo + ROWS_PER_SLICE, len(targets))
            logprobs = compute_logits(hidden[row + lo:row + hi]).float().log_softmax(dim=-1)  # (S, V)
            token_ids = torch.tensor(targets[lo:hi], dtype=torch.int64, device=logprobs.device)
            entries += token_logprobs_with_rank(logprobs, token_ids, num_top)
        row += len(targets)
        out[span.request.request_id] = entries
    return out


def token_logprobs_with_rank(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[TokenLogprob]:
    """Each row's entry for ``token_ids``: its logprob, vLLM's rank, and the top ``num_top``.

    Args:
        logprobs: [n, vocab_size] log-softmax.
        token_ids: [n] int64.
        num_top: alternatives per row (0: none).

    ``rank`` is how many ids have a logprob at least the token's (1 for the argmax), as vLLM counts it.
    """
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))  # (n, 1)
    ranks = (logprobs >= chosen).sum(dim=1).tolist()
    top_values: list[list[float]] = [[] for _ in range(len(ranks))]
    top_ids: list[list[int]] = [[] for _ in range(len(ranks))]
    k = min(num_top, logprobs.shape[1])
    if k > 0:
        values, ids = logprobs.topk(k, dim=-1)  # (n, k), sorted descending
        top_values, top_ids = values.tolist(), ids.tolist()
    return [TokenLogprob(token_id=t, logprob=lp, top_token_ids=ti, top_logprobs=tv, rank=r)
            for t, lp, ti, tv, r in zip(token_ids.tolist(), chosen.squeeze(1).tolist(), top_ids, top_values, ranks)]
