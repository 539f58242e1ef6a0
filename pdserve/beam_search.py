"""Beam search above the engine: beams, Hugging Face's scoring and finishing rules (no torch).

Beam search (Graves 2012; as in Hugging Face transformers' ``generate(num_beams=...)``)
keeps ``beam_width`` running hypotheses per prompt. pdserve runs it *above* the
engine, as vLLM does (``LLM.beam_search``, ``use_beam_search`` on the OpenAI
server): every step, each running beam of each prompt becomes one engine request
``prompt + beam tokens`` with ``max_tokens=1`` and ``logprobs=K``, and this module
turns the returned top-K log-probabilities into the next beams. The beams' shared
prefixes are not recomputed: every full KV block is found in the prefix cache
(see docs/architecture.md, "Beam search").

The rules are those of transformers 5's ``GenerationMixin._beam_search`` (the
installed version is the reference; ``do_sample=False``), per prompt:

* ``K = max(2, 1 + num_eos_token_ids) * beam_width`` candidates per step: the K best
  ``(beam, token)`` pairs by ``cum_logprob(beam) + logprob(token | beam)`` over every
  running beam and the whole vocabulary (a beam's own top K suffice, so each engine
  request asks for ``logprobs=K``). Log-probabilities are the raw model's
  (log-softmax of the logits; ``temperature`` does not change them).
* A candidate *hits a stop* if its token is an EOS id (unless ``ignore_eos``) or the
  hypothesis reaches ``max_tokens`` generated tokens.
* The next running beams are the first ``beam_width`` candidates, in score order, that
  did not hit a stop.
* Only a candidate ranked among the first ``beam_width`` that hits a stop becomes a
  finished hypothesis, scored ``cum_logprob / generated_len ** length_penalty``, where
  ``generated_len`` counts the generated tokens including the EOS and excluding the
  prompt (vLLM instead divides by the whole sequence length, prompt included, less a
  final EOS; pdserve follows transformers). The ``beam_width`` best finished
  hypotheses are kept. None is added once the prompt is done (below), nor, with
  ``early_stopping=True``, once ``beam_width`` are kept.
* After the step, with all ``beam_width`` finished slots filled, the prompt is done
  when the best running beam cannot beat the worst kept hypothesis:
  ``best_cum_logprob / L ** length_penalty <= worst_score``, where ``L`` is
  ``max_tokens`` for ``early_stopping="never"`` with ``length_penalty > 0`` and the
  current generated length otherwise. ``early_stopping=True`` stops as soon as the
  slots are filled. Every candidate hitting a stop (``max_tokens`` reached) ends it too.
* The result is the kept hypotheses, best score first.

Scores are summed in float64 here (transformers sums in float32); the engine's
log-probabilities and transformers' differ in the last bits anyway, so the beams
agree except where two candidates tie to within that noise.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.common.protocol import SamplingParams, TokenLogprob
from pdserve.common.validation import MAX_LOGPROBS, MAX_N, ValidationError

__all__ = ["BeamSearchParams", "BeamSearchSequence", "BeamSearchOutput", "BeamSearch",
           "check_beam_search_params", "num_candidates", "beam_step_params", "run_beam_search",
           "engine_step_runner"]

EarlyStopping = bool | str  # True, False or "never" (transformers' ``early_stopping``)


@dataclass
class BeamSearchParams:
    """How to beam-search (vLLM's ``BeamSearchParams``, plus transformers' ``early_stopping``).

    Args:
        beam_width: beams kept per prompt, and hypotheses returned (``num_beams`` and
            ``num_return_sequences`` in transformers; ``n`` on the OpenAI API).
        max_tokens: most generated tokens per hypothesis.
        ignore_eos: never finish a hypothesis on an EOS token (only ``max_tokens`` ends them).
        temperature: accepted for vLLM's signature; beam search scores raw log-probabilities,
            so it changes nothing.
        length_penalty: exponent of the generated length that divides a finished
            hypothesis' summed logprob; > 0 favours longer outputs, < 0 shorter ones.
        early_stopping: True, False (default, as transformers and vLLM) or "never".
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False


@dataclass
class BeamSearchSequence:
    """One returned hypothesis (vLLM's ``BeamSearchSequence``).

    ``tokens`` holds the prompt and then the generated tokens (a final EOS included);
    ``text`` is the generated text only, from ``text_token_ids`` (no final EOS); ``cum_logprob`` the sum
    of the generated tokens' logprobs (nats); ``score`` the length-penalized score it was
    ranked by; ``finish_reason`` is "stop" (EOS) or "length".
    """

    tokens: list[int]
    cum_logprob: float
    num_prompt_tokens: int
    score: float
    finish_reason: str
    text: str | None = None

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens, a final EOS included."""
        return self.tokens[self.num_prompt_tokens:]

    @property
    def text_token_ids(self) -> list[int]:
        """The generated tokens that make ``text``: a final EOS left out (as vLLM does)."""
        ids = self.output_token_ids
        return ids[:-1] if self.finish_reason == "stop" else ids


@dataclass
class BeamSearchOutput:
    """The ``beam_width`` hypotheses of one prompt, best score first (vLLM's ``BeamSearchOutput``)."""

    sequences: list[BeamSearchSequence]


@dataclass
class _Beam:
    output_token_ids: list[int]
    cum_logprob: float


@dataclass
class _Hypothesis:
    output_token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str


def num_candidates(beam_width: int, num_eos_token_ids: int) -> int:
    """Candidates kept per step, K = max(2, 1 + num_eos_token_ids) * beam_width (transformers' rule)."""
    return max(2, 1 + num_eos_token_ids) * beam_width


def check_beam_search_params(params: BeamSearchParams, num_eos_token_ids: int) -> None:
    """Raise ValidationError unless ``params`` can run (``param`` names the OpenAI field).

    ``beam_width`` is bounded by the engine's logprob limit: each step asks the engine for the
    top K = ``num_candidates(beam_width, num_eos_token_ids)`` logprobs, at most ``MAX_LOGPROBS``.
    """
    eos = 0 if params.ignore_eos else num_eos_token_ids
    widest = min(MAX_N, MAX_LOGPROBS // num_candidates(1, eos))
    if not isinstance(params.beam_width, int) or not 1 <= params.beam_width <= widest:
        raise ValidationError(f"beam search needs n (the beam width) in [1, {widest}] with this model's "
                              f"{eos} EOS token ids, got {params.beam_width}", "n")
    if params.max_tokens < 1:
        raise ValidationError(f"max_tokens must be at least 1, got {params.max_tokens}", "max_tokens")
    if not math.isfinite(params.length_penalty):
        raise ValidationError(f"length_penalty must be finite, got {params.length_penalty}", "length_penalty")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise ValidationError(f"temperature must be >= 0, got {params.temperature}", "temperature")
    if not (isinstance(params.early_stopping, bool) or params.early_stopping == "never"):
        raise ValidationError(f'early_stopping must be true, false or "never", got {params.early_stopping!r}',
                              "early_stopping")


def beam_step_params(num_logprobs: int) -> SamplingParams:
    """The engine request of one beam for one step: one greedy token and its top ``num_logprobs``."""
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=num_logprobs)


class BeamSearch:
    """The beam search of one prompt, stepped by whoever runs the model (a state machine).

    Args:
        prompt_token_ids: [num_prompt_tokens] token ids.
        params: checked ``BeamSearchParams``.
        eos_token_ids: the model's EOS ids (ignored with ``params.ignore_eos``).
        max_tokens: the generated-length cap to use instead of ``params.max_tokens`` (e.g. what
            ``max_model_len`` leaves); it stands for transformers' ``max_length - prompt length``.

    Use: while not ``done``: run one forward per ``beam_token_ids()`` entry, then ``step`` with
    each one's top-``num_logprobs`` logprobs; finally ``output()``.
    """

    def __init__(self, prompt_token_ids: Sequence[int], params: BeamSearchParams,
                 eos_token_ids: frozenset[int] | set[int], max_tokens: int | None = None):
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.max_tokens = params.max_tokens if max_tokens is None else max_tokens
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        self.num_logprobs = num_candidates(params.beam_width, len(self.eos_token_ids))
        self.running: list[_Beam] = [_Beam([], 0.0)]  # transformers' beams 1.. start at -1e9: unused
        self.finished: list[_Hypothesis] = []  # best score first, at most beam_width
        self.num_generated = 0
        self.done = False
        self._cannot_improve = False  # transformers' ``~is_early_stop_heuristic_unsatisfied``

    def beam_token_ids(self) -> list[list[int]]:
        """Prompt + tokens of every running beam: this step's engine requests, in beam order."""
        return [self.prompt_token_ids + beam.output_token_ids for beam in self.running]

    def step(self, top: Sequence[TokenLogprob]) -> None:
        """Advance one token from each running beam's top log-probabilities.

        Args:
            top: one per running beam (``beam_token_ids()`` order), with ``top_token_ids`` /
                ``top_logprobs`` the beam's best next tokens, best first, at least
                ``min(num_logprobs, vocab)`` of them.

        Raises:
            RuntimeError: called when done; ValueError: ``top`` does not match the beams.
        """
        if self.done:
            raise RuntimeError("step() on a finished beam search")
        if len(top) != len(self.running):
            raise ValueError(f"got {len(top)} logprob rows for {len(self.running)} beams")
        width, k = self.params.beam_width, self.num_logprobs
        candidates = [(beam.cum_logprob + lp, b, token_id)
                      for b, (beam, row) in enumerate(zip(self.running, top))
                      for token_id, lp in zip(row.top_token_ids[:k], row.top_logprobs[:k])]
        # The K best over every beam; ties go to the lower (beam, token), as a flat top-k would.
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))
        candidates = candidates[:k]
        self.num_generated += 1
        at_length = self.num_generated >= self.max_tokens
        stops = [at_length or token_id in self.eos_token_ids for _, _, token_id in candidates]

        may_add = not self._cannot_improve and not (
            self.params.early_stopping is True and len(self.finished) == width)
        if may_add:
            denominator = self.num_generated ** self.params.length_penalty
            for rank, ((cum, b, token_id), stop) in enumerate(zip(candidates, stops)):
                if rank < width and stop:
                    reason = "stop" if token_id in self.eos_token_ids else "length"
                    self.finished.append(_Hypothesis(self.running[b].output_token_ids + [token_id], cum,
                                                     cum / denominator, reason))
            self.finished.sort(key=lambda h: -h.score)  # stable: earlier hypotheses win ties
            del self.finished[width:]

        self.running = [_Beam(self.running[b].output_token_ids + [token_id], cum)
                        for (cum, b, token_id), stop in zip(candidates, stops) if not stop][:width]
        self._update_cannot_improve()
        self.done = (all(stops) or not self.running or self._cannot_improve
                     or (self.params.early_stopping is True and len(self.finished) == width))

    def _update_cannot_improve(self) -> None:
        """transformers' ``_check_early_stop_heuristic`` (sticky once true)."""
        if self._cannot_improve or not self.running or len(self.finished) < self.params.beam_width:
            return
        lp = self.params.length_penalty
        length = self.max_tokens if self.params.early_stopping == "never" and lp > 0 else self.num_generated
        best_possible = self.running[0].cum_logprob / length ** lp
        self._cannot_improve = best_possible <= self.finished[-1].score

    def output(self) -> BeamSearchOutput:
        """The kept hypotheses, best first (text not filled in). Call once ``done``."""
        hypotheses = list(self.finished)
        if len(hypotheses) < self.params.beam_width:  # cannot happen while max_tokens ends the search
            denominator = max(self.num_generated, 1) ** self.params.length_penalty
            hypotheses += [_Hypothesis(b.output_token_ids, b.cum_logprob, b.cum_logprob / denominator, "length")
                           for b in self.running]
            hypotheses.sort(key=lambda h: -h.score)
        n = len(self.prompt_token_ids)
        return BeamSearchOutput([BeamSearchSequence(self.prompt_token_ids + h.output_token_ids, h.cum_logprob, n,
                                                    h.score, h.finish_reason)
                                 for h in hypotheses[:self.params.beam_width]])


def run_beam_search(searches: Sequence[BeamSearch],
                    run_step: Callable[[list[tuple[list[int], int]]], list[TokenLogprob]]) -> None:
    """Drive ``searches`` to the end, every running beam of every prompt in one batch per step.

    Args:
        run_step: given ``[(token_ids, num_logprobs)]``, one per beam, runs each as a one-token
            request (``beam_step_params(num_logprobs)``) and returns each one's top logprobs,
            in the same order.
    """
    while True:
        live = [s for s in searches if not s.done]
        if not live:
            return
        batch = [(ids, s.num_logprobs) for s in live for ids in s.beam_token_ids()]
        rows = run_step(batch)
        if len(rows) != len(batch):
            raise RuntimeError(f"beam step returned {len(rows)} rows for {len(batch)} beams")
        start = 0
        for s in live:
            num_beams = len(s.running)
            s.step(rows[start:start + num_beams])
            start += num_beams


def engine_step_runner(core, new_request_id: Callable[[], str], lora=None
                       ) -> Callable[[list[tuple[list[int], int]]], list[TokenLogprob]]:
    """A ``run_step`` for ``run_beam_search`` over an in-process ``EngineCore`` (the offline ``LLM``),
    every beam with LoRA adapter ``lora`` (a ``LoRARequest``; None: the base model).

    Each beam is queued as its own one-token request (``stop_at_max_model_len``: the offline
    rule), the engine is stepped until all have their token (continuous batching; full KV
    blocks of the shared prefixes come from the prefix cache), and their top logprobs are
    returned in order. Requests still queued when something raises are aborted (blocks freed).

    Raises:
        RuntimeError: the scheduler made no progress (a beam that can never be admitted).
    """
    def run_step(batch: list[tuple[list[int], int]]) -> list[TokenLogprob]:
        request_ids = [new_request_id() for _ in batch]
        rows: dict[str, TokenLogprob] = {}
        try:
            for request_id, (token_ids, num_logprobs) in zip(request_ids, batch):
                core.add_request(request_id, token_ids, beam_step_params(num_logprobs), stop_at_max_model_len=True,
                                 lora=lora)
            while core.has_unfinished():
                scheduler_output, outputs = core.step()
                if scheduler_output.is_empty():
                    raise RuntimeError(f"the scheduler made no progress with {core.scheduler.num_waiting} "
                                       f"beam requests waiting")
                for output in outputs:
                    rows[output.request.group_id] = output.logprobs[0]
        finally:
            for request_id in request_ids:
                if request_id not in rows:
                    core.abort(request_id)
        return [rows[request_id] for request_id in request_ids]

    return run_step
