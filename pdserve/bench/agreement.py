"""How closely one engine follows another (e.g. int8 weights against the float model): greedy
token agreement and teacher-forced logit error, measured through the offline ``LLM``.

Used by benchmarks/bench_weight_quant.py and tests/test_quantization.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from pdserve.common.protocol import SamplingParams


@dataclass
class GreedyAgreement:
    """Greedy outputs of a test engine against a reference engine's, prompt by prompt.

    num_prompts; num_identical: outputs identical token for token; mean_prefix_share: the mean, over
    prompts, of (tokens identical up to the first divergence) / (reference output length).
    """

    num_prompts: int
    num_identical: int
    mean_prefix_share: float

    @property
    def identical_share(self) -> float:
        return self.num_identical / max(self.num_prompts, 1)


def greedy_agreement(reference: Sequence[Sequence[int]], test: Sequence[Sequence[int]]) -> GreedyAgreement:
    """Compare two lists of greedy outputs (token ids), one per prompt, in the same order."""
    if len(reference) != len(test):
        raise ValueError(f"{len(reference)} reference outputs against {len(test)} test outputs")
    shares = []
    for ref, out in zip(reference, test):
        prefix = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), min(len(ref), len(out)))
        shares.append(prefix / len(ref) if ref else 1.0)
    num_identical = sum(list(r) == list(o) for r, o in zip(reference, test))
    return GreedyAgreement(len(reference), num_identical, sum(shares) / max(len(shares), 1))


def greedy_outputs(llm, prompts: Sequence[list[int]], max_tokens: int) -> list[list[int]]:
    """``llm``'s greedy continuation (token ids, exactly ``max_tokens``, EOS ignored) of each prompt."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(list(prompts), params, use_tqdm=False)]


@torch.inference_mode()
def teacher_forced_logits(llm, sequences: Sequence[list[int]]) -> list[torch.Tensor]:
    """The logits ``llm`` gives at every position of each sequence: [len(seq), vocab_size] float32 each
    (row i scores the token after ``seq[:i + 1]``).

    Runs each sequence as a prompt with ``prompt_logprobs`` (one prefill; prefix caching must be off,
    else cached positions have no rows) and records what the model's ``compute_logits`` returns.
    """
    model = llm.core.runner.model
    if llm.core.config.enable_prefix_caching:
        raise ValueError("teacher_forced_logits needs an LLM with enable_prefix_caching=False")
    calls: list[torch.Tensor] = []
    inner = model.compute_logits

    def record(hidden: torch.Tensor) -> torch.Tensor:
        logits = inner(hidden)
        calls.append(logits.float().clone())
        return logits

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    out = []
    model.compute_logits = record  # an instance attribute shadows the method for this call only
    try:
        for seq in sequences:
            calls.clear()
            llm.generate([list(seq)], params, use_tqdm=False)
            last, prompt_rows = calls[0], torch.cat(calls[1:])  # sampled row first, then the prompt's rows
            out.append(torch.cat([prompt_rows, last]))  # (len(seq), vocab)
    finally:
        del model.compute_logits
    return out
