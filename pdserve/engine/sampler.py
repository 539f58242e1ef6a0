"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds.

Sampling uses the exponential-race form of the Gumbel-max trick: with
``q ~ Exponential(1)`` per vocabulary entry, ``argmax(p / q)`` is a draw from
``p``. It is one batched op, and lets each seeded row draw its own noise.

Seeded requests are reproducible across workers: the noise for output token
``k`` comes from a generator seeded with ``(seed, k)``, so the same seed gives
the same text whether the first token was sampled by a prefill worker and the
rest by a decode worker, or a preempted request was recomputed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.common.protocol import SamplingParams

_GREEDY_EPS = 1e-5


@dataclass
class SamplingRow:
    """One row of the logits to sample: its params and how far the request is."""

    params: SamplingParams
    num_output_tokens: int  # tokens already generated (this draw is number num_output_tokens)
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS while min_tokens is not reached


class Sampler:
    """Turns logits into token ids.

    Args:
        seed: seeds the worker's generator, used by rows without ``params.seed``.
    """

    def __init__(self, seed: int = 0):
        self._generator: torch.Generator | None = None
        self._seed = seed

    def _worker_generator(self, device: torch.device) -> torch.Generator:
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device)
            self._generator.manual_seed(self._seed)
        return self._generator

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """Sample one token per row.

        Args:
            logits: [num_rows, vocab_size] float32.
            rows: one entry per logits row.

        Returns:
            num_rows token ids.
        """
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        logits = logits.float()
        for i, row in enumerate(rows):
            if row.banned_token_ids:
                logits[i, list(row.banned_token_ids)] = float("-inf")
        temperatures = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        greedy = temperatures < _GREEDY_EPS
        greedy_tokens = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return greedy_tokens.tolist()

        scaled = logits / torch.where(greedy, 1.0, temperatures).unsqueeze(1)
        scaled = _apply_top_k_top_p(scaled, rows)
        probs = scaled.softmax(dim=-1)  # (R, V)
        noise = self._exponential_noise(probs, rows)  # (R, V)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled).tolist()

    def _exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            block = torch.empty((len(unseeded), probs.shape[1]), device=probs.device)
            block.exponential_(generator=self._worker_generator(probs.device))
            noise[unseeded] = block
        for i, row in enumerate(rows):
            if row.params.seed is None:
                continue
            gen = torch.Generator(device=probs.device)
            gen.manual_seed((row.params.seed * 1_000_003 + row.num_output_tokens) % (2**63))
            noise[i].exponential_(generator=gen)
        return noise.clamp_(min=1e-10)


def _apply_top_k_top_p(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p (nucleus, Holtzman et al. 2020) sets.

    Args:
        logits: [num_rows, vocab_size], temperature already applied.
    """
    vocab_size = logits.shape[1]
    top_k = [r.params.top_k if r.params.top_k else vocab_size for r in rows]
    top_p = [r.params.top_p for r in rows]
    if all(k >= vocab_size for k in top_k) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, sorted_idx = logits.sort(dim=-1, descending=True)  # (R, V)
    ranks = torch.arange(vocab_size, device=logits.device).unsqueeze(0)  # (1, V)
    k = torch.tensor(top_k, device=logits.device).clamp(1, vocab_size).unsqueeze(1)  # (R, 1)
    drop = ranks >= k
    sorted_probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs  # probability above each entry
    p = torch.tensor(top_p, device=logits.device, dtype=sorted_probs.dtype).unsqueeze(1)
    drop |= mass_before >= p  # the top entry always has mass_before 0, so it is kept
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_idx, sorted_logits)
