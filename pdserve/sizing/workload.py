"""The requests a simulation replays: when each arrives, its prompt's token ids, its output length.

Two sources, both lazy (one request made at a time, so a million-request run holds only the ones in
flight):

* **synthetic**: ``pdserve bench serve``'s workload flags (``DatasetConfig``) and arrivals
  (``--request-rate``, ``--burstiness``: gamma intervals, 1 = Poisson). Up to ``EXACT_LIMIT``
  requests the prompts are the very ones ``bench serve`` sends for the same flags and seed (so a
  simulated run and a real one see the same prefix hits); past it, prompts are made cheaply with the
  same lengths' distribution and the same shared prefix, each request's own tokens unique.
* **trace**: a JSONL file with the columns of public LLM-serving traces, one request per line:
  Mooncake's ``{"timestamp": ms, "input_length": N, "output_length": M, "hash_ids": [...]}`` (each hash
  id one block of ``block_tokens`` tokens, so requests sharing leading hash ids share a prefix), or
  ``arrival_s`` (seconds) for ``timestamp``, ``input_len`` / ``output_len`` for the lengths; or a CSV
  with Azure's LLM inference trace columns (``TIMESTAMP, ContextTokens, GeneratedTokens``).
  Arrival times are taken from the first request's, divided by ``time_scale``.
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.bench.datasets import DEFAULT_NUM_PROMPTS, MIN_TOKEN_ID, DatasetConfig, build_requests

EXACT_LIMIT = 20_000  # synthetic prompts made exactly as bench serve makes them up to this many requests
_TOKEN_SPAN = 30_000  # token ids the simulator makes up are in [MIN_TOKEN_ID, MIN_TOKEN_ID + _TOKEN_SPAN)


@dataclass
class SimRequest:
    """One request of a simulated workload: arrival (s from the start), prompt token ids, output tokens."""

    index: int
    arrival_s: float
    prompt_token_ids: list[int]
    output_len: int


def arrivals(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> Iterator[float]:
    """``n`` arrival times (s), lazily: the same numbers as ``pdserve.bench.serve.arrival_offsets``."""
    if math.isinf(request_rate):
        for _ in range(n):
            yield 0.0
        return
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    t = 0.0
    for i in range(n):
        if i:
            t += rng.gammavariate(burstiness, scale)
        yield t


_CYCLE = 997  # the filler tokens after a unique prompt's head repeat with this period
_filler: list[int] = []  # MIN_TOKEN_ID + k % _CYCLE for k = 0, 1, ...: sliced, not rebuilt, per prompt


def _unique_tokens(index: int, length: int) -> list[int]:
    """``length`` token ids whose first block no other request index starts with (two tokens name it)."""
    head = [MIN_TOKEN_ID + index // _TOKEN_SPAN % _TOKEN_SPAN, MIN_TOKEN_ID + index % _TOKEN_SPAN]
    start, count = index % _CYCLE, max(0, length - 2)
    if len(_filler) < start + count:
        _filler.extend(MIN_TOKEN_ID + k % _CYCLE for k in range(len(_filler), start + count + _CYCLE))
    return (head + _filler[start:start + count])[:length]


def synthetic(cfg: DatasetConfig, request_rate: float, burstiness: float = 1.0) -> Iterator[SimRequest]:
    """``cfg``'s requests arriving at ``request_rate`` per second (``inf``: all at 0), lazily.

    Raises ValueError for a jsonl ``cfg`` (use ``trace``)."""
    if cfg.name == "jsonl":
        raise ValueError("a jsonl dataset is a trace: pass it as --trace")
    n = cfg.num_prompts or DEFAULT_NUM_PROMPTS
    times = arrivals(n, request_rate, burstiness, cfg.seed)
    if n <= EXACT_LIMIT:
        for i, (req, t) in enumerate(zip(build_requests(cfg), times)):
            yield SimRequest(i, t, req.prompt, req.output_len)
        return
    rng = random.Random(cfg.seed)
    lo_in, hi_in = cfg.input_bounds()
    lo_out, hi_out = cfg.output_bounds()
    prefix = [MIN_TOKEN_ID + rng.randrange(_TOKEN_SPAN) for _ in range(cfg.prefix_len)]
    for i, t in enumerate(times):
        suffix_len = max(rng.randint(lo_in, hi_in), 0 if prefix else 1)
        yield SimRequest(i, t, prefix + _unique_tokens(i, suffix_len), rng.randint(lo_out, hi_out))


def _block_tokens(hash_id: int, block_tokens: int) -> list[int]:
    """The token ids of trace block ``hash_id`` (the same for every request naming it, distinct per id)."""
    base = hash_id * 1_000_003
    return [MIN_TOKEN_ID + (base + j * 7919) % _TOKEN_SPAN for j in range(block_tokens)]


def _first(row: dict, names: tuple[str, ...], line_no: int, path: str):
    for name in names:
        if name in row and row[name] is not None:
            return row[name]
    raise ValueError(f"{path}:{line_no}: no {' / '.join(names)} field")


def _azure_time(text: str) -> float:
    """Azure's ``2023-11-16 18:15:46.6805900`` (7 fractional digits) as POSIX seconds."""
    date, _, frac = text.strip().partition(".")
    stamp = datetime.datetime.fromisoformat(date).replace(tzinfo=datetime.timezone.utc).timestamp()
    return stamp + (float("0." + frac) if frac else 0.0)


def _rows(path: str) -> Iterator[tuple[int, float, int, int, list[int] | None, list[int] | None]]:
    """(line, arrival seconds, input length, output length, hash ids, prompt ids) of each request."""
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            for line_no, row in enumerate(csv.DictReader(f), 2):
                try:
                    yield (line_no, _azure_time(row["TIMESTAMP"]), int(row["ContextTokens"]),
                           int(row["GeneratedTokens"]), None, None)
                except (KeyError, ValueError) as e:
                    raise ValueError(f"{path}:{line_no}: not an Azure trace row ({e})") from None
        return
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{line_no}: not JSON ({e})") from None
            if "arrival_s" in row:
                t = float(row["arrival_s"])
            else:
                t = float(_first(row, ("timestamp",), line_no, path)) / 1000.0
            prompt = row.get("prompt") if isinstance(row.get("prompt"), list) else None
            n_in = len(prompt) if prompt is not None and "input_length" not in row and "input_len" not in row \
                else int(_first(row, ("input_length", "input_len", "prompt_len"), line_no, path))
            n_out = int(_first(row, ("output_length", "output_len", "max_tokens"), line_no, path))
            yield line_no, t, n_in, n_out, row.get("hash_ids"), prompt


def trace(path: str, num_prompts: int | None = None, block_tokens: int = 512,
          time_scale: float = 1.0) -> Iterator[SimRequest]:
    """The requests of trace file ``path`` (the module's docstring has the formats), the first
    ``num_prompts`` (all: None), arrivals from the first one's, divided by ``time_scale``.

    Raises:
        ValueError: a malformed line (named), a non-positive length, or arrivals out of order.
        OSError: an unreadable file.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale}")
    start = last = None
    for i, (line_no, t, n_in, n_out, hash_ids, prompt) in enumerate(_rows(path)):
        if num_prompts is not None and i >= num_prompts:
            return
        if n_in < 1 or n_out < 1:
            raise ValueError(f"{path}:{line_no}: input and output lengths must be >= 1, got {n_in} and {n_out}")
        if start is None:
            start = t
        if last is not None and t < last:
            raise ValueError(f"{path}:{line_no}: arrivals must not go back in time ({t} after {last})")
        last = t
        if prompt is not None:
            tokens = [int(x) for x in prompt][:n_in]
        elif hash_ids:
            tokens = [tok for h in hash_ids for tok in _block_tokens(int(h), block_tokens)][:n_in]
        else:
            tokens = []
        if len(tokens) < n_in:  # the rest is this request's own
            tokens += _unique_tokens(i, n_in - len(tokens)) if not tokens else \
                [MIN_TOKEN_ID + (i * 7 + j) % _TOKEN_SPAN for j in range(n_in - len(tokens))]
        yield SimRequest(i, (t - start) / time_scale, tokens, n_out)
