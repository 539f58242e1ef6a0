"""``pdserve bench serve``: an async load generator for any OpenAI-compatible server.

Each request streams (``stream_options.include_usage``) from ``/v1/completions`` (or
``/v1/chat/completions``) with greedy sampling and EOS ignored, so it generates exactly the
``max_tokens`` its workload entry asks for. Requests arrive all at once (rate ``inf``) or at
gamma-distributed intervals: mean ``1 / rate`` seconds, shape ``burstiness`` (1 = a Poisson
process; lower is burstier, higher is more regular), as vLLM's ``bench serve``. At most
``max_concurrency`` are in flight when set.

    from pdserve.bench import ServeConfig, DatasetConfig, run_benchmark_sync
    result = run_benchmark_sync(ServeConfig(url="http://127.0.0.1:8000",
                                            dataset=DatasetConfig(num_prompts=8)))
    print(result.metrics["output_throughput"])
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from pdserve.bench import phases
from pdserve.bench.datasets import (DEFAULT_VOCAB_SIZE, BenchRequest, DatasetConfig, build_requests, prompt_text,
                                    vocab_size_of, warmup_requests)
from pdserve.bench.metrics import RequestOutput, compute_metrics, format_table

BACKENDS = ("openai", "transformers-serve")


@dataclass
class ServeConfig:
    """One ``bench serve`` run.

    Args:
        url: the server, with or without a trailing ``/v1`` (``http://127.0.0.1:8000``).
        model: model name to send; None: the first id of ``GET /v1/models``.
        endpoint: ``/v1/completions`` or ``/v1/chat/completions``.
        backend: ``openai`` (pdserve, vLLM: token-id prompts, ``ignore_eos``) or
            ``transformers-serve`` (text prompts; EOS turned off through ``generation_config``).
        dataset: the workload to build when ``run_benchmark`` is given none.
        tokenizer: checkpoint directory whose tokenizer turns token ids into text where the API
            needs text (chat, transformers-serve), and whose config.json gives the vocabulary size.
        request_rate: requests per second; ``inf`` sends them all at once.
        burstiness: gamma shape of the arrival intervals (1.0: Poisson).
        max_concurrency: most requests in flight; None: no limit.
        seed: seeds the arrival times.
        goodput_slos: SLOs in ms by metric (``ttft``, ``tpot``, ``e2el``) for goodput.
        percentiles: which percentiles to report (0..100).
        num_warmups: requests sent (and not measured) before the run.
        request_timeout_s: a request taking longer fails.
        api_key: sent as ``Authorization: Bearer``.
        extra_body: merged into every request body.
        ignore_eos: generate exactly ``max_tokens`` tokens.
        disable_tqdm: no progress bar.
    """

    url: str
    model: str | None = None
    endpoint: str = "/v1/completions"
    backend: str = "openai"
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    tokenizer: str | None = None
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    goodput_slos: dict[str, float] = field(default_factory=dict)
    percentiles: list[float] = field(default_factory=lambda: [50.0, 90.0, 99.0])
    num_warmups: int = 0
    request_timeout_s: float = 3600.0
    api_key: str | None = None
    extra_body: dict = field(default_factory=dict)
    ignore_eos: bool = True
    disable_tqdm: bool = False

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0 (inf: all at once), got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if self.num_warmups < 0:
            raise ValueError("num_warmups must be >= 0")

    @property
    def is_chat(self) -> bool:
        return self.endpoint.rstrip("/").endswith("chat/completions")


@dataclass
class BenchResult:
    """A finished run: ``metrics`` (``compute_metrics``' dict), the settings, and every request's outcome."""

    metrics: dict
    settings: dict
    outputs: list[RequestOutput]
    requests: list[BenchRequest]
    phases: dict | None = None  # a pdserve router's hops to the first token (``phases.summarize``)

    @property
    def errors(self) -> list[str]:
        """Each failed request's error, in request order."""
        return [o.error for o in self.outputs if not o.success]

    def to_dict(self, detailed: bool = False) -> dict:
        """JSON-ready: settings, metrics, errors; with ``detailed`` also per-request arrays (seconds)."""
        d = {**self.settings, **self.metrics, "errors": self.errors}
        if self.phases is not None:
            d["ttft_phases"] = self.phases
        if detailed:
            d.update(input_lens=[o.prompt_len for o in self.outputs],
                     output_lens=[o.output_tokens for o in self.outputs],
                     requested_output_lens=[r.output_len for r in self.requests],
                     ttfts=[o.ttft_s for o in self.outputs], e2els=[o.e2el_s for o in self.outputs],
                     tpots=[o.tpot_s for o in self.outputs], itls=[o.itl_s for o in self.outputs],
                     send_times=[o.send_s for o in self.outputs], successes=[o.success for o in self.outputs],
                     request_errors=[o.error for o in self.outputs])
        return d

    def table(self) -> str:
        """The human summary ``bench serve`` prints."""
        s = self.settings
        rate = s["request_rate"]
        header = {"Model:": s["model"], "Request rate (req/s):": "inf" if rate == "inf" else rate,
                  "Burstiness:": s["burstiness"], "Max concurrency:": s["max_concurrency"] or "none"}
        table = format_table(self.metrics, s["percentiles"], header=header)
        return table if self.phases is None else f"{table}\n{phases.format_summary(self.phases)}"


def arrival_offsets(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each of ``n`` requests is sent, in seconds from the start (the first at 0).

    Intervals are gamma-distributed with shape ``burstiness`` and mean ``1 / request_rate``
    (scale ``1 / (request_rate * burstiness)``); ``inf`` sends all at 0. Seeded.
    """
    if n <= 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * n
    rng = random.Random(seed)
    scale = 1.0 / (request_rate * burstiness)
    offsets, t = [0.0], 0.0
    for _ in range(n - 1):
        t += rng.gammavariate(burstiness, scale)
        offsets.append(t)
    return offsets


def base_url(url: str) -> str:
    """``http://h:p/v1/`` -> ``http://h:p`` (the benchmark adds ``/v1/...`` itself)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def first_model_id(client: httpx.AsyncClient, url: str) -> str:
    """The first model ``GET /v1/models`` lists. Raises RuntimeError when it lists none."""
    resp = await client.get(f"{base_url(url)}/v1/models")
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def request_body(cfg: ServeConfig, model: str, req: BenchRequest, tokenizer=None) -> dict:
    """The JSON body for ``req``; text prompts come from ``tokenizer`` where the API needs text."""
    needs_text = cfg.is_chat or cfg.backend == "transformers-serve"
    if needs_text and not isinstance(req.prompt, str) and tokenizer is None:
        raise ValueError(f"{cfg.backend} {cfg.endpoint} takes text prompts: pass a tokenizer to decode token ids")
    prompt = prompt_text(req, tokenizer) if needs_text else req.prompt
    body: dict = {"model": model, "max_tokens": req.output_len, "temperature": 0.0, "stream": True}
    if cfg.is_chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if cfg.backend == "transformers-serve":  # it refuses unknown fields; EOS -1 turns the EOS check off
        gen = {"max_new_tokens": req.output_len, "do_sample": False}
        if cfg.ignore_eos:
            gen["eos_token_id"] = -1
        body["generation_config"] = json.dumps(gen)
    else:
        body["stream_options"] = {"include_usage": True}
        body["ignore_eos"] = cfg.ignore_eos
    body.update(cfg.extra_body)
    return body


def _chunk_text(choice: dict) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


async def send_request(client: httpx.AsyncClient, url: str, body: dict, prompt_len: int | None,
                       headers: dict | None = None) -> RequestOutput:
    """POST one streaming request and time it. Never raises (but on cancellation): a failure is returned
    as ``RequestOutput(success=False, error=...)``."""
    out = RequestOutput(prompt_len=prompt_len or 0)
    stamps: list[float] = []
    usage: dict = {}
    start = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                out.error = f"HTTP {resp.status_code}: {text[:500]}"
                return out
            async for line in resp.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                now = time.perf_counter()
                if chunk.get("error"):
                    out.error = f"error in stream: {json.dumps(chunk['error'])[:500]}"
                    return out
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if any(_chunk_text(c) for c in chunk.get("choices") or []):
                    stamps.append(now)
        end = time.perf_counter()
    except asyncio.CancelledError:
        raise
    except Exception as e:  # noqa: BLE001  a failed request is a result, not a crash
        out.error = f"{type(e).__name__}: {e}"[:500]
        return out
    if not stamps:
        out.error = "the response streamed no text"
        return out
    out.success = True
    out.ttft_s = stamps[0] - start
    out.itl_s = [b - a for a, b in zip(stamps, stamps[1:])]
    out.e2el_s = end - start
    out.output_tokens = int(usage.get("completion_tokens") or len(stamps))
    if usage.get("prompt_tokens"):
        out.prompt_len = int(usage["prompt_tokens"])
    return out


def _load_tokenizer(cfg: ServeConfig, requests: list[BenchRequest]):
    needs_text = cfg.is_chat or cfg.backend == "transformers-serve"
    if not needs_text or all(isinstance(r.prompt, str) for r in requests):
        return None
    if not cfg.tokenizer:
        raise ValueError(f"{cfg.backend} {cfg.endpoint} takes text prompts: pass --tokenizer DIR to decode "
                         "the workload's token ids")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.tokenizer)


def resolve_dataset(cfg: ServeConfig, model: str) -> DatasetConfig:
    """``cfg.dataset`` with its vocabulary size filled in: given, else the tokenizer's or a local model
    directory's config.json, else ``DEFAULT_VOCAB_SIZE`` (with a note on stderr)."""
    ds = cfg.dataset
    if ds.vocab_size is not None:
        return ds
    size = vocab_size_of(cfg.tokenizer) or vocab_size_of(model)
    if size is None:
        size = DEFAULT_VOCAB_SIZE
        if ds.name != "jsonl":
            print(f"pdserve bench: vocabulary size unknown (no --tokenizer / --vocab-size); token ids drawn from "
                  f"[10, {size})", file=sys.stderr)
    return dataclasses.replace(ds, vocab_size=size)


async def run_benchmark(cfg: ServeConfig, requests: list[BenchRequest] | None = None) -> BenchResult:
    """Send the workload (``requests``, or the one ``cfg.dataset`` builds) and measure it. Given
    ``requests``, ``cfg.dataset`` only describes them in the settings.

    Failed requests are counted and their errors kept. Raises httpx.HTTPError / RuntimeError
    when the model name cannot be found, ValueError for a workload the API cannot take.
    """
    from tqdm import tqdm

    url = base_url(cfg.url)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else None
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None, keepalive_expiry=60)
    timeout = httpx.Timeout(cfg.request_timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers) as client:
        model = cfg.model or await first_model_id(client, url)
        dataset = cfg.dataset
        if requests is None:
            dataset = resolve_dataset(cfg, model)
            requests = build_requests(dataset)
        tokenizer = _load_tokenizer(cfg, requests)
        endpoint_url = f"{url}/{cfg.endpoint.lstrip('/')}"
        bodies = [request_body(cfg, model, r, tokenizer) for r in requests]
        warmup_errors = []
        if cfg.num_warmups:  # the workload's shapes, prompts of their own: measured prompts stay uncached
            if dataset.name == "jsonl":
                print("pdserve bench: a jsonl workload has no other prompts: the warm-up sends its first ones, "
                      "which the measured run then finds in the prefix cache", file=sys.stderr)
            warm_bodies = [request_body(cfg, model, r, tokenizer)
                           for r in warmup_requests(resolve_dataset(cfg, model), requests, cfg.num_warmups)]
            warm = await asyncio.gather(*(send_request(client, endpoint_url, body, None) for body in warm_bodies))
            warmup_errors = [o.error for o in warm if not o.success]
        offsets = arrival_offsets(len(requests), cfg.request_rate, cfg.burstiness, cfg.seed)
        semaphore = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(requests), disable=cfg.disable_tqdm, desc="requests")
        figures_before = await phases.scrape(client, url)  # a pdserve router's hops: where TTFT went
        start = time.perf_counter()

        async def one(i: int) -> RequestOutput:
            await asyncio.sleep(max(0.0, start + offsets[i] - time.perf_counter()))
            if semaphore is not None:
                await semaphore.acquire()
            try:
                send_s = time.perf_counter() - start
                out = await send_request(client, endpoint_url, bodies[i], requests[i].prompt_len)
                out.send_s = send_s
            finally:
                if semaphore is not None:
                    semaphore.release()
            bar.update(1)
            return out

        outputs = await asyncio.gather(*(one(i) for i in range(len(requests))))
        duration = time.perf_counter() - start
        bar.close()
        figures_after = await phases.scrape(client, url) if figures_before is not None else None
        ttft_phases = phases.summarize(figures_before, figures_after)
    settings = {
        "date": time.strftime("%Y%m%d-%H%M%S"), "backend": cfg.backend, "url": url, "endpoint": cfg.endpoint,
        "model": model, "num_prompts": len(requests),
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency, "seed": cfg.seed,
        "goodput_slos_ms": cfg.goodput_slos or None, "percentiles": cfg.percentiles,
        "dataset": dataclasses.asdict(dataset), "num_warmups": cfg.num_warmups, "warmup_errors": warmup_errors,
    }
    metrics = compute_metrics(outputs, duration, cfg.percentiles, cfg.goodput_slos or None)
    return BenchResult(metrics, settings, list(outputs), list(requests), ttft_phases)


def run_benchmark_sync(cfg: ServeConfig, requests: list[BenchRequest] | None = None) -> BenchResult:
    """``run_benchmark`` in a fresh event loop (call it from code that has none running)."""
    return asyncio.run(run_benchmark(cfg, requests))


def write_result(result: BenchResult, path: str, detailed: bool = False) -> None:
    """Write ``result.to_dict(detailed)`` as JSON to ``path``."""
    with open(path, "w") as f:
        json.dump(result.to_dict(detailed), f, indent=2)
        f.write("\n")
