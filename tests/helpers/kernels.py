"""Random paged batches and batch-invariance runs shared by the kernel and quantization tests."""

from __future__ import annotations

import random

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.agreement import greedy_outputs, teacher_forced_logits


def _batch(rng: random.Random, q_lens_ctx: list[tuple[int, int]], block_size: int, num_blocks: int):
    """Block tables (random, distinct blocks), computed and new token counts for (q_len, context) pairs."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables, computed, new = [], [], []
    for q_len, ctx in q_lens_ctx:
        need = -(-ctx // block_size)
        tables.append([free.pop() for _ in range(need)])
        computed.append(ctx - q_len)
        new.append(q_len)
    return tables, computed, new


# (M, position of the probe row) pairs: every M in 1..40 and a few prefill-sized ones.
_ROW_PLACES = [(m, p) for m in range(1, 41) for p in sorted({0, m // 2, m - 1})] + \
    [(m, p) for m in (127, 513, 1031) for p in (0, m // 3, m - 1)]


def _distinct_rows(fn, width: int) -> int:
    """How many different bit patterns fn gives one fixed row placed among random rows."""
    gen = torch.Generator().manual_seed(0)
    row = torch.randn(width, generator=gen)
    seen = set()
    for m, pos in _ROW_PLACES:
        x = torch.randn(m, width, generator=gen)
        x[pos] = row
        seen.add(fn(x)[pos].numpy().tobytes())
    return len(seen)


_TARGET = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, logprobs=3, ignore_eos=True)


def _target_prompt(vocab_size: int) -> list[int]:
    rng = random.Random(7)
    return [rng.randrange(3, vocab_size) for _ in range(53)]


def _runs(llm: LLM, num_runs: int, seed: int) -> list[tuple]:
    """The target request's (tokens, logprobs) in ``num_runs`` runs, each among random traffic
    (1-4 other prompts of 2-60 tokens, greedy or sampled) under a random step budget, so its
    prefill is chunked differently and its decode steps see different batch sizes."""
    rng = random.Random(seed)
    prompt = _target_prompt(llm.vocab_size)
    results = []
    for _ in range(num_runs):
        llm.scheduler.config.max_num_batched_tokens = rng.choice([11, 16, 29, 40, 64, 2048])
        others = [[rng.randrange(3, llm.vocab_size) for _ in range(rng.randint(2, 60))]
                  for _ in range(rng.randint(1, 4))]
        params = [SamplingParams(max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 0.8]),
                                 ignore_eos=True) for _ in others]
        where = rng.randint(0, len(others))
        prompts = others[:where] + [prompt] + others[where:]
        params = params[:where] + [_TARGET] + params[where:]
        choice = llm.generate(prompts, params, use_tqdm=False)[where].outputs[0]
        logprobs = tuple((lp.token_id, lp.logprob, tuple(lp.top_token_ids), tuple(lp.top_logprobs))
                         for lp in choice.logprobs)
        results.append((tuple(choice.token_ids), logprobs))
    return results


def kv_dtype_runs(model: str, check_int8_runner):
    """Six seeded random prompts through ``model`` with float32, int8 and fp8_e4m3 KV caches (``LLM``, 4 MiB, no
    prefix caching): (prompts, float32's greedy outputs, int8's, and each dtype's teacher-forced logits
    [rows, vocab] over float32's sequences, the same rows for all). ``check_int8_runner(runner)`` looks at the
    int8 engine's model runner while it is open."""
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 2000) for _ in range(rng.randint(4, 40))] for _ in range(6)]
    llms = {name: LLM(model, kv_cache_dtype=name, kv_cache_memory="4MiB", enable_prefix_caching=False)
            for name in ("float32", "int8", "fp8_e4m3")}
    try:
        check_int8_runner(llms["int8"].core.runner)
        base, int8 = greedy_outputs(llms["float32"], prompts, 12), greedy_outputs(llms["int8"], prompts, 12)
        sequences = [p + out for p, out in zip(prompts, base)]
        logits = {name: torch.cat(teacher_forced_logits(llm, sequences)) for name, llm in llms.items()}
    finally:
        for llm in llms.values():
            llm.close()
    return prompts, base, int8, logits
