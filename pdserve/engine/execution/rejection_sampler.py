"""Verification of draft tokens by rejection sampling, exact in the target's distribution.

For draft ``d_j`` proposed from a distribution ``q_j`` (a point mass for prompt
lookup and greedy drafts), with ``p_j`` the target's distribution at that
position (after every logits processor, temperature, top-k/top-p: exactly what
ordinary sampling would draw from):

* accept ``d_j`` with probability ``min(1, p_j(d_j) / q_j(d_j))``;
* at the first rejection, draw the step's last token from the residual
  ``max(0, p_j - q_j)`` renormalized, and stop;
* if all ``k`` drafts are accepted, draw a bonus token from ``p_k``.

Each emitted token is then distributed as ``p`` (Leviathan et al., ICML 2023,
Theorem 1; Chen et al. 2023). Greedy requests accept a draft iff it equals the
target's argmax and emit the argmax at the first mismatch, so their output is
token for token what non-speculative greedy decoding gives.

Rows of one request are contiguous in ``logits``: row ``j`` scores the token
after ``d_1..d_j`` (row 0: after the last sampled token). Each row's
``SamplingRow`` carries that position's output so far (penalties, ``min_tokens``
bans) and draw number (seeded requests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.common.protocol import TokenLogprob
from pdserve.engine.execution.sampler import Sampler, SamplingRow, apply_token_bitmask, is_greedy


@dataclass
class DraftGroup:
    """One request's drafts in the verification batch.

    Attributes:
        start: its first row in ``logits`` (it owns ``len(draft_token_ids) + 1`` rows).
        draft_token_ids: [k] the proposed tokens.
        draft_probs: [k, vocab_size] the distribution each draft was drawn from, or None
            for point masses (prompt lookup, greedy drafts).
    """

    start: int
    draft_token_ids: list[int]
    draft_probs: torch.Tensor | None = None


@dataclass
class VerifiedTokens:
    """What one request emits this step: ``accepted`` drafts, then ``token_id``.

    ``logprobs`` has one entry per emitted token (accepted + 1) when the request asked.
    """

    accepted: list[int]
    token_id: int
    logprobs: list[TokenLogprob] | None


class RejectionSampler:
    """Verifies the drafts of a batch with the target's logits (uses ``sampler``'s processing
    and random streams, so seeded requests stay reproducible)."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow], groups: list[DraftGroup],
                 token_bitmask: torch.Tensor | None = None) -> list[VerifiedTokens]:
        """Verify every group's drafts.

        Args:
            logits: [num_rows, vocab_size] target logits, ``sum(k + 1)`` rows; not modified.
            rows: one per logits row.
            groups: one per request, in row order.
            token_bitmask: structured outputs: [num_rows, num_words] allowed tokens per row (see
                ``Sampler.__call__``); applied before every other processor, as in plain sampling.

        Returns:
            One ``VerifiedTokens`` per group.
        """
        sampler = self.sampler
        logits = logits.float()
        raw_logprobs, asked = sampler.raw_logprobs(logits, rows)
        processed = sampler.process_logits(apply_token_bitmask(logits, token_bitmask), rows)
        argmax = processed.argmax(dim=-1).tolist()  # (R,)
        sampled_rows = [i for i, r in enumerate(rows) if not is_greedy(r.params)]
        probs = sampler.probs(processed, rows) if sampled_rows else None  # (R, V)
        accept_prob = self._accept_probs(probs, rows, groups)
        emitted_rows: list[int] = []  # per group: the row whose distribution gives the last token
        final_dists: list[torch.Tensor | None] = []  # None: take the argmax
        results: list[tuple[list[int], int]] = []
        for g in groups:
            greedy = is_greedy(rows[g.start].params)
            accepted: list[int] = []
            dist = None
            for j, draft in enumerate(g.draft_token_ids):
                row = g.start + j
                if greedy:
                    if draft != argmax[row]:
                        break
                elif accept_prob[row] < 1.0 and self._uniform(rows[row]) >= accept_prob[row]:
                    dist = self._residual(probs[row], draft, g.draft_probs[j] if g.draft_probs is not None else None)
                    break
                accepted.append(draft)
            row = g.start + len(accepted)
            if not greedy and dist is None:
                dist = probs[row]  # all accepted: the bonus token
            emitted_rows.append(row)
            final_dists.append(dist)
            results.append((accepted, row))
        last_tokens = self._draw(emitted_rows, final_dists, argmax, rows)
        emitted = [0] * len(rows)  # the token each row emitted (rows after a rejection: unused)
        for (accepted, row), g, token in zip(results, groups, last_tokens):
            emitted[g.start:row + 1] = accepted + [token]
        logprobs = sampler.gather_logprobs(raw_logprobs, asked, torch.tensor(emitted), rows)
        return [VerifiedTokens(accepted, token,
                               logprobs[g.start:row + 1] if rows[g.start].params.logprobs is not None else None)
                for (accepted, row), g, token in zip(results, groups, last_tokens)]

    @staticmethod
    def _accept_probs(probs: torch.Tensor | None, rows: list[SamplingRow], groups: list[DraftGroup]) -> list[float]:
        """min(1, p(d) / q(d)) for every draft row of a sampled request (1.0 elsewhere)."""
        accept = [1.0] * len(rows)
        if probs is None:
            return accept
        for g in groups:
            if is_greedy(rows[g.start].params) or not g.draft_token_ids:
                continue
            k = len(g.draft_token_ids)
            ids = torch.tensor(g.draft_token_ids)
            p = probs[g.start:g.start + k].gather(1, ids.unsqueeze(1)).squeeze(1)  # (k,)
            q = g.draft_probs.gather(1, ids.unsqueeze(1)).squeeze(1) if g.draft_probs is not None else torch.ones(k)
            ratio = torch.where(q > 0, p / q.clamp(min=1e-30), torch.ones_like(p)).clamp(max=1.0).tolist()
            accept[g.start:g.start + k] = ratio
        return accept

    def _uniform(self, row: SamplingRow) -> float:
        """One U[0, 1) draw for the accept test of ``row`` (a stream apart from its token noise)."""
        gen = self.sampler.row_generator(row, torch.device("cpu"), stream=1)
        return float(torch.rand((), generator=gen))

    @staticmethod
    def _residual(p: torch.Tensor, draft: int, q: torch.Tensor | None) -> torch.Tensor:
        """[vocab_size] max(0, p - q), renormalized; q None is the point mass on ``draft``."""
        if q is None:
            residual = p.clone()
            residual[draft] = 0.0
        else:
            residual = (p - q).clamp(min=0.0)
        total = residual.sum()
        return residual / total if total > 0 else p  # p == q: never rejected, but stay safe

    def _draw(self, emitted_rows: list[int], dists: list[torch.Tensor | None], argmax: list[int],
              rows: list[SamplingRow]) -> list[int]:
        """The last token of each group: the argmax (greedy) or one draw from its distribution."""
        tokens = [argmax[row] for row in emitted_rows]
        todo = [i for i, d in enumerate(dists) if d is not None]
        if todo:
            dist = torch.stack([dists[i] for i in todo])  # (T, V)
            noise = self.sampler.exponential_noise(dist, [rows[emitted_rows[i]] for i in todo])
            drawn = (dist / noise).argmax(dim=-1).tolist()
            for i, token in zip(todo, drawn):
                tokens[i] = token
        return tokens
