"""Logits processors of issue 12: bad words, logit bias, repetition penalty (vLLM's semantics).

The sampler calls ``apply_logits_processors`` after its banned tokens (``min_tokens``)
and before the frequency/presence penalties, which is vLLM v1's order::

    bad words (-inf) --> logit_bias (+bias) --> repetition_penalty --> frequency/presence

* **bad words** (vLLM's ``bad_words``): a one-token bad word is always banned; for a
  longer one, its last token is banned when the output so far ends with the rest
  (the word's other tokens). Only output tokens count, as in vLLM.
* **logit_bias** (OpenAI's): ``logit[t] += bias[t]``.
* **repetition_penalty** (CTRL, Keskar et al. 2019; vLLM's and transformers' form):
  for every token seen in the prompt or the output so far, a positive logit is
  divided by the penalty and a negative one multiplied by it (``1.0`` is off).

Every function takes ``logits: [num_rows, vocab_size]`` float and returns the same
tensor when no row asks for it, else a new one (the caller's logits are never
edited in place, so raw logprobs taken earlier stay raw).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pdserve.common.protocol import SamplingParams


class LogitsRow(Protocol):
    """What the processors read of one row (the sampler's ``SamplingRow`` is one)."""

    params: SamplingParams
    output_token_ids: Sequence[int]
    prompt_token_ids: Sequence[int]


def apply_logits_processors(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """Bad words, then logit bias, then repetition penalty; see the module docstring.

    Args:
        logits: [num_rows, vocab_size] float; not modified.
        rows: one per logits row.

    Returns:
        [num_rows, vocab_size]: ``logits`` itself when no row uses any of the three.
    """
    logits = apply_bad_words(logits, rows)
    logits = apply_logit_bias(logits, rows)
    return apply_repetition_penalty(logits, rows)


def bad_word_bans(bad_words_token_ids: Sequence[Sequence[int]], output_token_ids: Sequence[int]) -> set[int]:
    """Token ids a row may not sample next because of its bad words (vLLM's rule).

    A bad word of ``k`` tokens bans its last token when the output's last ``k - 1``
    tokens equal its first ``k - 1`` (always, for ``k == 1``). A word longer than
    the output + 1 cannot complete yet and bans nothing.
    """
    banned = set()
    num_out = len(output_token_ids)
    for word in bad_words_token_ids:
        prefix_len = len(word) - 1
        if not word or prefix_len > num_out:
            continue
        if prefix_len == 0 or list(output_token_ids[num_out - prefix_len:]) == list(word[:prefix_len]):
            banned.add(word[-1])
    return banned


def ban_tokens(logits: torch.Tensor, pairs: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Set ``logits[row, token]`` to -inf for each (row, token) pair, on a copy (none made without pairs)."""
    if not pairs:
        return logits
    row_idx, token_idx = zip(*pairs)
    logits = logits.clone()
    logits[list(row_idx), list(token_idx)] = float("-inf")
    return logits


def apply_bad_words(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """Set each row's banned bad-word tokens (``bad_word_bans``) to -inf."""
    return ban_tokens(logits, [(i, t) for i, r in enumerate(rows) if r.params.bad_words_token_ids
                               for t in bad_word_bans(r.params.bad_words_token_ids, r.output_token_ids)])


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """Add each row's ``logit_bias`` (token id -> bias) to its logits."""
    triples = [(i, t, b) for i, r in enumerate(rows) if r.params.logit_bias
               for t, b in r.params.logit_bias.items()]
    if not triples:
        return logits
    row_idx, token_idx, bias = zip(*triples)
    logits = logits.clone()
    logits.index_put_((torch.tensor(row_idx, device=logits.device), torch.tensor(token_idx, device=logits.device)),
                      torch.tensor(bias, dtype=logits.dtype, device=logits.device), accumulate=True)
    return logits


def apply_repetition_penalty(logits: torch.Tensor, rows: Sequence[LogitsRow]) -> torch.Tensor:
    """CTRL's repetition penalty over each row's prompt + output tokens.

    For every token id seen: ``logit / p`` if ``logit > 0`` else ``logit * p``.
    """
    penalized = [i for i, r in enumerate(rows) if r.params.repetition_penalty != 1.0]
    if not penalized:
        return logits
    vocab_size = logits.shape[1]
    seen = torch.zeros((len(penalized), vocab_size), dtype=torch.bool, device=logits.device)  # (P, V)
    for k, i in enumerate(penalized):
        ids = [*rows[i].prompt_token_ids, *rows[i].output_token_ids]
        if ids:
            seen[k, torch.tensor(ids, dtype=torch.int64, device=logits.device)] = True
    penalty = torch.tensor([rows[i].params.repetition_penalty for i in penalized], dtype=logits.dtype,
                           device=logits.device).unsqueeze(1)  # (P, 1)
    index = torch.tensor(penalized, dtype=torch.int64, device=logits.device)
    rows_logits = logits[index]  # (P, V), a copy
    scaled = torch.where(rows_logits > 0, rows_logits / penalty, rows_logits * penalty)
    logits = logits.clone()
    logits[index] = torch.where(seen, scaled, rows_logits)
    return logits
