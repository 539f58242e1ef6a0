"""Workloads for ``pdserve bench``: what each request asks for.

Three kinds, all seeded so two runs (or two systems) get the same requests:

* ``random``: prompts of random token ids, so their lengths are exact in tokens
  (the completions API takes a list of ints as the prompt). Lengths follow vLLM's
  ``--random-range-ratio``: uniform integers in ``[floor(L * (1 - r)), ceil(L * (1 + r))]``,
  or explicit ``[min, max]`` bounds.
* ``shared-prefix``: the same ``prefix_len`` tokens, then a random suffix (a system prompt).
* ``jsonl``: one JSON object per line, ``{"prompt": str | [int], "max_tokens" | "output_len": int}``.

Token ids are drawn from ``[MIN_TOKEN_ID, vocab_size)``: the lowest ids of the built-in
models are special tokens (BOS, EOS, padding), and a random prompt should not contain them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
from dataclasses import dataclass

MIN_TOKEN_ID = 10
DEFAULT_VOCAB_SIZE = 1000  # every built-in model has at least this many tokens
DEFAULT_NUM_PROMPTS = 100
DATASETS = ("random", "shared-prefix", "jsonl")


@dataclass
class BenchRequest:
    """One request of a workload.

    Args:
        prompt: token ids (exact length) or text (its length is the server's count).
        output_len: ``max_tokens`` asked for; with EOS ignored, the tokens that come back.
    """

    prompt: list[int] | str
    output_len: int

    @property
    def prompt_len(self) -> int | None:
        """Prompt tokens when the prompt is token ids; None for text (the server counts it)."""
        return len(self.prompt) if isinstance(self.prompt, list) else None


@dataclass
class DatasetConfig:
    """How to build a workload (``pdserve bench serve``'s dataset flags).

    Args:
        name: ``random`` | ``shared-prefix`` | ``jsonl``.
        num_prompts: requests to build; None: ``DEFAULT_NUM_PROMPTS`` (jsonl: every line).
        input_len, output_len, range_ratio: vLLM's random lengths (``range_ratio`` in [0, 1)).
        min_input, max_input, min_output, max_output: explicit inclusive bounds; each one
            given overrides the range-ratio bound it names.
        prefix_len: tokens every prompt starts with (shared-prefix; ``random`` takes it too, as
            vLLM's ``--random-prefix-len``); the random part's length comes on top.
        dataset_path: the jsonl file.
        vocab_size: token ids are drawn from ``[MIN_TOKEN_ID, vocab_size)``; None: ``DEFAULT_VOCAB_SIZE``
            (``run_benchmark`` first looks for the tokenizer's).
        seed: seeds every random choice.
    """

    name: str = "random"
    num_prompts: int | None = None
    input_len: int = 256
    output_len: int = 64
    range_ratio: float = 0.0
    min_input: int | None = None
    max_input: int | None = None
    min_output: int | None = None
    max_output: int | None = None
    prefix_len: int = 0
    dataset_path: str | None = None
    vocab_size: int | None = None
    seed: int = 0

    def __post_init__(self):
        if self.name not in DATASETS:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)}, got {self.name!r}")
        if not 0.0 <= self.range_ratio < 1.0:
            raise ValueError(f"range_ratio must be in [0, 1), got {self.range_ratio}")
        if self.vocab_size is not None and self.vocab_size <= MIN_TOKEN_ID:
            raise ValueError(f"vocab_size must exceed {MIN_TOKEN_ID}, got {self.vocab_size}")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError("num_prompts must be >= 1")
        if self.prefix_len < 0:
            raise ValueError("prefix_len must be >= 0")
        if self.name == "shared-prefix" and self.prefix_len < 1:
            raise ValueError("the shared-prefix dataset needs prefix_len >= 1")
        if self.name == "jsonl" and not self.dataset_path:
            raise ValueError("the jsonl dataset needs a dataset_path")
        lo_in, hi_in = self.input_bounds()
        lo_out, hi_out = self.output_bounds()
        if lo_in < 0 or lo_in > hi_in:
            raise ValueError(f"bad input length range [{lo_in}, {hi_in}]")
        if lo_out < 1 or lo_out > hi_out:
            raise ValueError(f"bad output length range [{lo_out}, {hi_out}] (outputs need >= 1 token)")
        if self.name == "random" and self.prefix_len + hi_in < 1:
            raise ValueError("random prompts need at least one token")

    def input_bounds(self) -> tuple[int, int]:
        """Inclusive range of random prompt (or suffix) lengths, in tokens."""
        lo = math.floor(self.input_len * (1 - self.range_ratio))
        hi = math.ceil(self.input_len * (1 + self.range_ratio))
        return (lo if self.min_input is None else self.min_input,
                hi if self.max_input is None else self.max_input)

    def output_bounds(self) -> tuple[int, int]:
        """Inclusive range of output lengths (``max_tokens``); never below 1."""
        lo = max(1, math.floor(self.output_len * (1 - self.range_ratio)))
        hi = math.ceil(self.output_len * (1 + self.range_ratio))
        return (lo if self.min_output is None else self.min_output,
                hi if self.max_output is None else self.max_output)


def vocab_size_of(model_dir: str | None) -> int | None:
    """``vocab_size`` from ``model_dir/config.json``; None when there is no such file or field."""
    if not model_dir:
        return None
    path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        cfg = json.load(f)
    size = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    return int(size) if size else None


def build_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """The workload ``cfg`` describes. Raises ValueError (bad jsonl) or OSError (unreadable file)."""
    if cfg.name == "jsonl":
        return jsonl_requests(cfg.dataset_path, cfg.num_prompts, default_output_len=cfg.output_len)
    return random_requests(cfg)


def random_requests(cfg: DatasetConfig) -> list[BenchRequest]:
    """``num_prompts`` requests of random token ids, each starting with the same ``cfg.prefix_len`` tokens.

    Prompt length = ``cfg.prefix_len`` + a length drawn from ``cfg.input_bounds()``; output length
    from ``cfg.output_bounds()``. The same ``cfg`` always gives the same requests.
    """
    rng = random.Random(cfg.seed)
    n = cfg.num_prompts or DEFAULT_NUM_PROMPTS
    lo_in, hi_in = cfg.input_bounds()
    lo_out, hi_out = cfg.output_bounds()
    prefix_len = cfg.prefix_len
    vocab_size = cfg.vocab_size or DEFAULT_VOCAB_SIZE
    prefix = [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(prefix_len)]
    requests = []
    for _ in range(n):
        suffix_len = rng.randint(lo_in, hi_in)
        if prefix_len + suffix_len == 0:
            suffix_len = 1
        suffix = [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(suffix_len)]
        requests.append(BenchRequest(prefix + suffix, rng.randint(lo_out, hi_out)))
    return requests


def jsonl_requests(path: str, num_prompts: int | None = None, default_output_len: int = 64) -> list[BenchRequest]:
    """Requests from a jsonl file: the first ``num_prompts`` lines (all when None); blank lines skipped.

    Each line: ``{"prompt": "text" | [ids], "max_tokens": N}`` (or ``"output_len": N``; neither:
    ``default_output_len``). Raises ValueError naming the line of a malformed entry.
    """
    requests: list[BenchRequest] = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            if num_prompts is not None and len(requests) >= num_prompts:
                break
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e})") from None
            if not isinstance(obj, dict) or "prompt" not in obj:
                raise ValueError(f"{path}:{line_no}: expected an object with a 'prompt'")
            prompt = obj["prompt"]
            ok = isinstance(prompt, str) or (
                isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt))
            if not ok or not prompt:
                raise ValueError(f"{path}:{line_no}: 'prompt' must be a non-empty string or list of token ids")
            output_len = obj.get("max_tokens", obj.get("output_len", default_output_len))
            if not isinstance(output_len, int) or isinstance(output_len, bool) or output_len < 1:
                raise ValueError(f"{path}:{line_no}: 'max_tokens'/'output_len' must be a positive integer")
            requests.append(BenchRequest(prompt, output_len))
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests


def prompt_text(request: BenchRequest, tokenizer) -> str:
    """The prompt as text, for servers that take only strings (``tokenizer.decode`` of token ids)."""
    if isinstance(request.prompt, str):
        return request.prompt
    return tokenizer.decode(request.prompt, skip_special_tokens=True)


WARMUP_SEED_OFFSET = 7919  # a warm-up's random prompts: the workload's seed + this


def warmup_requests(cfg: DatasetConfig, requests: list[BenchRequest], num: int) -> list[BenchRequest]:
    """``num`` warm-up requests of the workload's shapes with prompts of their own, so the measured
    prompts meet no prefix-cache entry the warm-up left (a shared prefix, where the workload has one,
    is warmed as a system prompt would be). A jsonl workload has no others: its own first requests,
    cycled, are returned (the runs they warm then hit the prefix cache; ``bench serve`` says so)."""
    if num <= 0:
        return []
    if cfg.name == "jsonl" or not requests:
        return [requests[i % len(requests)] for i in range(num)] if requests else []
    fresh = random_requests(dataclasses.replace(cfg, num_prompts=num, seed=cfg.seed + WARMUP_SEED_OFFSET))
    prefix = requests[0].prompt[:cfg.prefix_len]  # the workload's shared prefix, not the fresh seed's
    return [BenchRequest(prefix + r.prompt[cfg.prefix_len:], r.output_len) for r in fresh]
