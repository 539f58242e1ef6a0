"""The client side of ``pdserve profile``'s serving passes: a ``pdserve up`` cluster started and stopped by pid,
and requests streamed through its router as ``pdserve bench serve`` streams them (its own request body), one at a
time, all at once or as a Poisson process, with each chunk's arrival time; the router's TTFT hops scraped
(``pdserve:request_phase_seconds``). ``serving_profiler`` measures with them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time


class ServingCluster:
    """``pdserve up`` of one layout (``--colocated``, or one prefill and one decode worker), started and
    stopped by pid, its decode steps compiled before it is used."""

    def __init__(self, model: str, flags: list[str], colocated: bool):
        from pdserve.common.utils import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        layout = ["--colocated"] if colocated else ["--num-prefill", "1", "--num-decode", "1"]
        cmd = [sys.executable, "-m", "pdserve", "--log-level", "warning", "up", *layout, "--model", model,
               "--port", self.url.rsplit(":", 1)[1], *flags]
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.num_workers = 1 if colocated else 2

    def wait_ready(self, timeout_s: float = 900) -> str:
        """Until every worker serves with its decode step compiled (or eager by flag); the model id."""
        import httpx

        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=30) as client:
            while True:
                if self.proc.poll() is not None:
                    self.log.seek(0)
                    raise RuntimeError(f"pdserve up exited: {self.log.read()[-2000:].decode(errors='replace')}")
                try:
                    workers = client.get(f"{self.url}/workers").json()
                    if len(workers) >= self.num_workers and all(w.get("decode_step") in ("compiled", "eager")
                                                                for w in workers):
                        return client.get(f"{self.url}/v1/models").json()["data"][0]["id"]
                except (httpx.HTTPError, ValueError, KeyError, IndexError):
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster did not come up in {timeout_s:.0f} s")
                time.sleep(0.5)

    def close(self) -> None:
        import signal

        try:
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(60)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)
        self.log.close()


def request_body(url: str, model_id: str, prompt: list[int], max_tokens: int) -> dict:
    """A profiling request's JSON body: ``pdserve bench serve``'s own (``bench.serve.request_body``: greedy,
    EOS ignored, usage streamed), so what the profile times is what a benchmark's requests cost (a request
    sampled at the API's default temperature 1 took ~15% longer a decode step on the default model here)."""
    from pdserve.bench.datasets import BenchRequest
    from pdserve.bench.serve import ServeConfig, request_body as bench_body

    return bench_body(ServeConfig(url=url), model_id, BenchRequest(prompt=prompt, output_len=max_tokens))


async def stream_poisson(url: str, model_id: str, prompts: list[list[int]], max_tokens: int, rate: float,
                         seed: int = 0) -> list[list[float]]:
    """Stream ``prompts`` arriving as a Poisson process of ``rate`` per second (seeded), each to its end: each
    one's send time then its chunks' arrival times (perf_counter s, ``stream_one``)."""
    import asyncio
    import random

    import httpx

    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in prompts:
        offsets.append(t)
        t += rng.expovariate(rate)

    async def one(client, prompt, offset) -> list[float]:
        await asyncio.sleep(offset)
        return await stream_one(client, url, model_id, prompt, max_tokens)

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await client.get(f"{url}/health")
        return list(await asyncio.gather(*(one(client, p, o) for p, o in zip(prompts, offsets))))


async def stream_one(client, url: str, model_id: str, prompt: list[int], max_tokens: int) -> list[float]:
    """One streamed request on ``client``: its send time then its chunks' arrival times (perf_counter s).

    Raises:
        RuntimeError: no token came back."""
    body = request_body(url, model_id, prompt, max_tokens)
    times = [time.perf_counter()]
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if line.startswith("data:") and '"text"' in line:
                times.append(time.perf_counter())
    if len(times) < 2:
        raise RuntimeError(f"no token came back through the router (HTTP {resp.status_code})")
    return times


async def stream_batch(url: str, model_id: str, prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
    """Stream every prompt at once; each one's send time then its chunks' arrival times (perf_counter s)."""
    import asyncio

    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await client.get(f"{url}/health")  # the connection is open before the clock starts
        return list(await asyncio.gather(*(stream_one(client, url, model_id, p, max_tokens) for p in prompts)))


def lone_ttfts(url: str, model_id: str, prompts: list[list[int]], idle_s: list[float] | None = None,
                max_tokens: int = 1) -> list[float]:
    """Each prompt streamed alone (``max_tokens`` output tokens) by one client on one kept-alive connection, as
    a benchmark's client sends them, one after the other, the i-th after ``idle_s[i]`` seconds with nothing in
    flight (default: none): their times to first token (s)."""
    import asyncio

    import httpx

    async def run() -> list[float]:
        ttfts = []
        async with httpx.AsyncClient(timeout=300) as client:
            await client.get(f"{url}/health")  # the connection is open before the first prompt
            for i, prompt in enumerate(prompts):
                if idle_s and idle_s[i]:
                    await asyncio.sleep(idle_s[i])
                times = await stream_one(client, url, model_id, prompt, max_tokens)
                ttfts.append(times[1] - times[0])
        return ttfts

    return asyncio.run(run())


def hop_means(phases: dict | None) -> dict[str, float]:
    """Each hop's mean (s) in a ``bench.phases.summarize`` result (empty without one)."""
    return {name: hop["mean_s"] for name, hop in phases["phases"].items()} if phases else {}


def scrape_phases(url: str):
    """The router's TTFT hops so far (``pdserve.bench.phases``)."""
    import asyncio

    import httpx

    from pdserve.bench.phases import scrape

    async def once():
        async with httpx.AsyncClient(timeout=30) as client:
            return await scrape(client, url)

    return asyncio.run(once())
