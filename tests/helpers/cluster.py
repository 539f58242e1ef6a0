"""Helpers for tests that start a real cluster: reference texts, waiting for freed blocks, metrics, load."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoModelForCausalLM, AutoTokenizer

WORDS = ("the quick brown fox jumps over lazy dogs while seven wizards quietly pack boxes of liquor "
         "near a river bank in autumn light").split()


def workers(cluster) -> list[dict]:
    return httpx.get(f"{cluster.url}/workers", timeout=10).json()


def wait_all_blocks_free(cluster, timeout_s=15.0) -> None:
    """Wait until every worker reports all blocks free and nothing queued, in a heartbeat sent after this call."""
    start = time.monotonic()
    deadline = start + timeout_s
    while time.monotonic() < deadline:
        ws = [w for w in workers(cluster) if w["last_seen_s_ago"] < 3.0]  # silent longer: dead, holds nothing
        fresh = all(w["last_seen_s_ago"] < time.monotonic() - start - 0.05 for w in ws)
        if fresh and all(w["num_free_blocks"] == w["num_blocks"] and w["num_running"] == 0 and
                         w["num_waiting"] == 0 for w in ws):
            return
        time.sleep(0.3)
    pytest.fail(f"KV blocks not all free again: {json.dumps(workers(cluster))}")


def hf_greedy_texts(model_dir: str, prompts: list, max_tokens: int) -> dict:
    """Transformers' greedy completion of each prompt (text, or token ids), exactly ``max_tokens`` long
    (as with ``ignore_eos``), keyed by the prompt (token-id prompts as tuples)."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = {}
    for prompt in prompts:
        ids = tok(prompt).input_ids if isinstance(prompt, str) else list(prompt)
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                 do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
        texts[prompt if isinstance(prompt, str) else tuple(prompt)] = tok.decode(out[0, len(ids):],
                                                                                skip_special_tokens=True)
    return texts


def prompt_text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def metric_totals(cluster) -> dict[str, float]:
    """Sum of every sample of each metric family (over workers and roles)."""
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def wait_metric_increase(cluster, name: str, before: dict[str, float], min_delta: float, timeout_s: float = 10.0):
    """Worker counters reach /metrics with the next heartbeat (every second): poll for them."""
    deadline = time.monotonic() + timeout_s
    while True:
        delta = metric_totals(cluster).get(name, 0.0) - before.get(name, 0.0)
        if delta >= min_delta or time.monotonic() > deadline:
            return delta
        time.sleep(0.3)


API_KEY = "sk-scale-test"


MAX_TOKENS = 40


class Load:
    """``num_clients`` threads streaming greedy completions until ``stop()``; keeps every result and error."""

    def __init__(self, url: str, prompts: list[str], num_clients: int = 4):
        self.api = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, timeout=120, max_retries=0)
        self.prompts = prompts
        self.results: list[tuple[str, str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._client, args=(i,), daemon=True) for i in range(num_clients)]
        for t in self._threads:
            t.start()

    def _client(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self._stop.is_set():
            prompt = rng.choice(self.prompts)
            try:
                stream = self.api.completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS,
                                                     temperature=0, stream=True, extra_body={"ignore_eos": True})
                self.results.append((prompt, "".join(chunk.choices[0].text for chunk in stream if chunk.choices)))
            except Exception as e:  # noqa: BLE001  every failure is a test failure, reported below
                self.errors.append(f"{type(e).__name__}: {e}")

    def wait_for(self, num_results: int, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while len(self.results) < num_results and time.monotonic() < deadline and not self.errors:
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)


def stream_until_cut(url: str, prompt: str, streaming) -> None:
    """Stream a long completion (1,500 tokens, EOS ignored) from the router at ``url``; wait at the barrier
    ``streaming`` once its first chunk arrived, then read on until the stream ends or is cut (a killed
    router: the error is the point, swallowed)."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=60,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 1500, "ignore_eos": True,
                                "stream": True}) as resp:
            lines = resp.iter_lines()
            next(lines)
            streaming.wait(timeout=60)
            for _ in lines:
                pass
    except (httpx.HTTPError, threading.BrokenBarrierError):
        pass


def wait_until(condition, timeout_s: float = 30.0, what: str = ""):
    """Poll ``condition()`` (an HTTP error counts as not yet) until it returns something true; return it.

    Raises:
        AssertionError: ``timeout_s`` passed first."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = condition()
        except httpx.HTTPError:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)
