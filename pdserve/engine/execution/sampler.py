"""Token sampling: greedy, temperature, top-k, top-p, penalties, logprobs, per-request seeds.

Order of operations on one row of logits (vLLM's order):

    raw logits --> logprobs (log-softmax, for rows that ask; "raw" logprobs)
        |
        +--> grammar bitmask (-inf; structured outputs, pdserve.engine.execution.structured_output)
        +--> banned tokens (-inf) --> bad words (-inf) --> logit_bias --> repetition_penalty
             --> frequency/presence penalties
             --> greedy argmax, or temperature --> top-k/top-p --> draw

(bad words, logit_bias and repetition_penalty: ``pdserve.engine.execution.logits_processors``)

Sampling uses the exponential-race form of the Gumbel-max trick: with
``q ~ Exponential(1)`` per vocabulary entry, ``argmax(p / q)`` is a draw from
``p``. It is one batched op, and lets each seeded row draw its own noise.

Seeded requests are reproducible across workers: the noise for output token
``k`` of choice ``sample_index`` comes from a generator seeded with
``(seed, sample_index, k)`` only, so the same seed gives the same text whether
the first token was sampled by a prefill worker and the rest by a decode
worker, or a preempted request was recomputed; and the ``n`` choices of one
seeded request differ from each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pdserve.common.protocol import SamplingParams, TokenLogprob
from pdserve.engine.execution.logits_processors import apply_logits_processors, ban_tokens

_GREEDY_EPS = 1e-5
_MASK64 = 2**64 - 1


@dataclass
class SamplingRow:
    """One row of the logits to sample: its params and how far the request is."""

    params: SamplingParams
    num_output_tokens: int  # tokens already generated (this draw is number num_output_tokens)
    banned_token_ids: tuple[int, ...] = ()  # e.g. EOS while min_tokens is not reached
    output_token_ids: Sequence[int] = ()  # tokens generated so far (not the prompt), for penalties
    sample_index: int = 0  # which of the request's n choices this row samples
    prompt_token_ids: Sequence[int] = ()  # the prompt, for repetition_penalty


@dataclass
class SamplerOutput:
    """One entry per logits row.

    ``logprobs[i]`` is None unless ``rows[i].params.logprobs`` is set.
    """

    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Turns logits into token ids (and, where asked, their logprobs).

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
    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 token_bitmask: torch.Tensor | None = None) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: [num_rows, vocab_size]; not modified.
            rows: one entry per logits row.
            token_bitmask: structured outputs: [num_rows, num_words] int32, ``num_words * 32 >= vocab_size``;
                bit ``t % 32`` of word ``t // 32`` clear = token ``t`` disallowed in that row
                (``structured_output.build_token_bitmask``). None: every token allowed.
        """
        assert logits.shape[0] == len(rows), (logits.shape, len(rows))
        logits = logits.float()
        raw_logprobs, asked = self.raw_logprobs(logits, rows)
        logits = apply_token_bitmask(logits, token_bitmask)  # structured outputs
        logits = self.process_logits(logits, rows)
        token_ids = self._sample(logits, rows)  # (R,)
        return SamplerOutput(token_ids.tolist(), self.gather_logprobs(raw_logprobs, asked, token_ids, rows))

    @staticmethod
    def raw_logprobs(logits: torch.Tensor, rows: list[SamplingRow]) -> tuple[torch.Tensor | None, list[int]]:
        """Log-softmax of the unprocessed float32 logits of the rows that ask for logprobs.

        Returns ([num_asked, vocab_size] or None, the asked row indices). Indexing with a
        list copies, so later edits of ``logits`` do not reach these.
        """
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        return (logits[asked].log_softmax(dim=-1) if asked else None), asked

    @staticmethod
    def gather_logprobs(raw_logprobs: torch.Tensor | None, asked: list[int], token_ids: torch.Tensor,
                        rows: list[SamplingRow]) -> list[TokenLogprob | None]:
        """One entry per row: the TokenLogprob of ``token_ids[i]`` for asked rows, else None."""
        logprobs: list[TokenLogprob | None] = [None] * len(rows)
        if raw_logprobs is not None:
            for i, lp in zip(asked, _gather_logprobs(raw_logprobs, token_ids[asked], [rows[i] for i in asked])):
                logprobs[i] = lp
        return logprobs

    @staticmethod
    def process_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """Every logits processor of the rows, in order (banned tokens, bad words, logit_bias,
        repetition_penalty, frequency/presence penalties).

        Args:
            logits: [num_rows, vocab_size] float32; not modified (a copy is made where edited).

        Returns:
            [num_rows, vocab_size] processed logits, before temperature and top-k/top-p.
        """
        logits = _apply_banned(logits, rows)
        logits = apply_logits_processors(logits, rows)
        return _apply_penalties(logits, rows)

    @staticmethod
    def probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """The distribution each row samples from: processed logits / temperature, top-k/top-p, softmax.

        Greedy rows (temperature 0) get temperature 1 here; their callers take the argmax.

        Args:
            logits: [num_rows, vocab_size] processed logits (``process_logits``).

        Returns:
            [num_rows, vocab_size] float32 probabilities.
        """
        temperatures = torch.tensor([r.params.temperature for r in rows], device=logits.device)
        scaled = logits / torch.where(temperatures < _GREEDY_EPS, 1.0, temperatures).unsqueeze(1)
        return _apply_top_k_top_p(scaled, rows).softmax(dim=-1)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[num_rows, vocab_size] processed logits -> [num_rows] int64 token ids."""
        greedy = torch.tensor([is_greedy(r.params) for r in rows], device=logits.device)
        greedy_tokens = logits.argmax(dim=-1)
        if bool(greedy.all()):
            return greedy_tokens
        probs = self.probs(logits, rows)  # (R, V)
        noise = self.exponential_noise(probs, rows)  # (R, V)
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, greedy_tokens, sampled)

    def exponential_noise(self, probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """[num_rows, vocab_size] Exponential(1) draws: ``argmax(probs / noise)`` samples ``probs``.

        Seeded rows draw from their own generator (``row_seed``), others from the worker's.
        """
        noise = torch.empty_like(probs)
        unseeded = [i for i, r in enumerate(rows) if r.params.seed is None]
        if unseeded:
            block = torch.empty((len(unseeded), probs.shape[1]), device=probs.device)
            block.exponential_(generator=self._worker_generator(probs.device))
            noise[unseeded] = block
        for i, row in enumerate(rows):
            if row.params.seed is None:
                continue
            noise[i].exponential_(generator=self.row_generator(row, probs.device))
        return noise.clamp_(min=1e-10)

    def row_generator(self, row: SamplingRow, device: torch.device, stream: int = 0) -> torch.Generator:
        """The generator of one row's draws: its own for a seeded row (``row_seed``; ``stream``
        separates several draws of one position), the worker's otherwise."""
        if row.params.seed is None:
            return self._worker_generator(device)
        gen = torch.Generator(device=device)
        value = row_seed(row.params.seed, row.sample_index, row.num_output_tokens)
        gen.manual_seed(value if not stream else _splitmix64(value ^ stream) % 2**63)
        return gen


def is_greedy(params: SamplingParams) -> bool:
    """Temperature 0 (below 1e-5): the row takes the argmax."""
    return params.temperature < _GREEDY_EPS


def row_seed(seed: int, sample_index: int, num_output_tokens: int) -> int:
    """The generator seed of one seeded draw; a function of its arguments only.

    Choice 0 keeps the single-sample stream ``seed * 1_000_003 + k``, so n=1
    output is what it was before choices existed; other choices hash the index in.
    """
    value = (seed * 1_000_003 + num_output_tokens) % 2**63
    if sample_index:
        value = _splitmix64(value ^ _splitmix64(sample_index)) % 2**63
    return value


def _splitmix64(x: int) -> int:
    """SplitMix64 finalizer (Steele, Lea, Flood 2014): a bijective 64-bit mixer."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor | None) -> torch.Tensor:
    """Set the logits of tokens a row's grammar disallows to -inf (structured outputs), on a copy.

    The eager form of ``llguidance.torch.apply_token_bitmask_inplace``, whose ``torch.compile``
    costs seconds on a CPU worker's first constrained step.

    Args:
        logits: [num_rows, vocab_size]; returned unchanged (same tensor) when ``bitmask`` is None.
        bitmask: [num_rows, num_words] int32, ``num_words * 32 >= vocab_size``; bit ``t % 32`` of
            word ``t // 32`` set = token ``t`` allowed.
    """
    if bitmask is None:
        return logits
    num_rows, vocab_size = logits.shape
    bits = torch.arange(32, device=logits.device, dtype=torch.int32)
    words = bitmask.to(logits.device, non_blocking=True).unsqueeze(-1)  # (R, W, 1)
    allowed = ((words >> bits) & 1).reshape(num_rows, -1)[:, :vocab_size].bool()  # (R, V)
    return logits.masked_fill(~allowed, float("-inf"))


def _apply_banned(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Set banned tokens to -inf, on a copy (only made when some row bans a token)."""
    return ban_tokens(logits, [(i, t) for i, r in enumerate(rows) for t in r.banned_token_ids])


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """OpenAI frequency/presence penalties over each row's output tokens (not its prompt).

    ``logit[t] -= frequency_penalty * count(t) + presence_penalty * (count(t) > 0)``.

    Args:
        logits: [num_rows, vocab_size]; returned unchanged (same tensor) when no row is penalized.
    """
    penalized = [i for i, r in enumerate(rows)
                 if (r.params.frequency_penalty or r.params.presence_penalty) and r.output_token_ids]
    if not penalized:
        return logits
    vocab_size = logits.shape[1]
    max_len = max(len(rows[i].output_token_ids) for i in penalized)
    # Pad with vocab_size: an extra column that collects the padding and is dropped.
    padded = [list(rows[i].output_token_ids) + [vocab_size] * (max_len - len(rows[i].output_token_ids))
              for i in penalized]
    ids = torch.tensor(padded, dtype=torch.int64, device=logits.device)  # (P, L)
    counts = torch.zeros((len(penalized), vocab_size + 1), device=logits.device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=counts.dtype))
    counts = counts[:, :vocab_size]  # (P, V)
    freq = torch.tensor([rows[i].params.frequency_penalty for i in penalized], device=logits.device)
    pres = torch.tensor([rows[i].params.presence_penalty for i in penalized], device=logits.device)
    penalty = freq.unsqueeze(1) * counts + pres.unsqueeze(1) * (counts > 0)  # (P, V)
    index = torch.tensor(penalized, dtype=torch.int64, device=logits.device)
    return logits.index_add(0, index, penalty, alpha=-1)


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


def _gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor,
                     rows: list[SamplingRow]) -> list[TokenLogprob]:
    """TokenLogprobs of rows that asked.

    Args:
        logprobs: [num_asked, vocab_size] raw log-softmax.
        token_ids: [num_asked] sampled ids.
        rows: the rows that asked, in the same order.
    """
    sampled = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()  # (A,)
    token_list = token_ids.tolist()
    max_k = min(max(r.params.logprobs for r in rows), logprobs.shape[1])
    top_values: list[list[float]] = [[] for _ in rows]
    top_ids: list[list[int]] = [[] for _ in rows]
    if max_k > 0:
        values, ids = logprobs.topk(max_k, dim=-1)  # (A, max_k), sorted descending
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(token_id=token_list[a], logprob=sampled[a], top_token_ids=top_ids[a][:row.params.logprobs],
                     top_logprobs=top_values[a][:row.params.logprobs])
        for a, row in enumerate(rows)
    ]
