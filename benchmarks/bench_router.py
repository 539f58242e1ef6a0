"""Router capacity: the router's CPU per request and per streamed token, what one router sustains,
and where its time goes (issue 21, item 5).

    python benchmarks/bench_router.py                    # one router
    python benchmarks/bench_router.py --num-routers 2    # two routers sharing the port (SO_REUSEPORT)
    python benchmarks/bench_router.py --profile-s 8      # + py-spy over a router under load

Starts ``pdserve up`` on the tiny default model with one decode worker (prompts prefilled locally:
the router's work is the same for a remote prefill), routers pinned to core 0, the worker and this
load generator to core 1. For each ``--max-tokens`` value (default 1 and 64) it streams
``--requests`` chat completions at ``--concurrency`` (ignore_eos, so every request streams exactly
that many tokens) and reads each router's CPU time (user + system, ``/proc``) before and after.
Fitting ``cpu = a * requests + b * tokens`` over the runs gives the router's cost per request
(``a``: HTTP, JSON, tokenizing, routing, the request's messages) and per streamed token (``b``:
the ZMQ delta, detokenizing, one SSE event). A router is saturated when its CPU use reaches one
core; ``1 / (a + b * tokens)`` is then its ceiling in requests/s, printed beside what was measured.

``--profile-s`` samples the first router with ``py-spy`` (400 Hz) during a run
and groups the samples by what the stack is doing: tokenize, detokenize, SSE, ZMQ + msgpack, JSON +
pydantic, HTTP (uvicorn / h11 / starlette), routing, the asyncio loop itself, other.
Loopback only; every process it starts, it stops.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import inspect
import json
import os
import re
import shutil
import subprocess
import tempfile
import time

import httpx
import psutil
import torch

from pdserve.common.utils import free_port
from pdserve.default_model.tiny_model import ensure_default_model
from pdserve.cluster.launcher import ClusterSpec, LocalCluster

ROUTER_CORE, OTHER_CORE = 0, 1

# What a router's stack is doing, by the first matching (file or function) pattern, innermost first.
CATEGORIES = [
    ("tokenize", ("tokenizers", "tokenization_utils", "preprocess.py", "apply_chat_template", "jinja2")),
    ("detokenize", ("detokeniz", "decode_tokens", "convert_ids_to_tokens")),
    ("SSE", ("sse_starlette", "sse.py", "_stream_", "serving.py:stream", "StreamingResponse")),
    ("ZMQ + msgpack", ("zmq", "msgspec", "transport.py", "sockets.py")),
    ("JSON + pydantic", ("json", "pydantic", "openai_protocol.py", "orjson")),
    ("HTTP (uvicorn, h11, starlette)", ("uvicorn", "h11", "httptools", "starlette", "fastapi", "anyio")),
    ("routing + registry", ("routing.py", "registry.py", "engine.py")),
    ("asyncio loop", ("asyncio", "selectors.py", "base_events.py")),
]


@dataclasses.dataclass
class Run:
    max_tokens: int
    requests: int
    tokens: int
    wall_s: float
    router_cpu_s: float  # summed over routers
    errors: int


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


async def stream_one(client: httpx.AsyncClient, url: str, body: dict) -> int:
    """One streamed chat completion; returns the tokens it streamed (its usage chunk's completion_tokens)."""
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        tail = b""
        async for chunk in r.aiter_bytes():  # not parsed: the generator must stay cheaper than the router
            tail = (tail + chunk)[-512:]
        found = re.search(rb'"completion_tokens":\s*(\d+)', tail)  # the usage chunk (stream_options)
        n = int(found.group(1)) if found else 0
    return n


async def drive(url: str, model: str, max_tokens: int, requests: int, concurrency: int,
                router_pids: list[int]) -> Run:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:
        sem = asyncio.Semaphore(concurrency)
        errors = 0

        async def one(i: int) -> int:
            nonlocal errors
            body = {"model": model, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": f"request {i}: the quick brown fox jumps over"}]}
            async with sem:
                try:
                    return await stream_one(client, url, body)
                except (httpx.HTTPError, RuntimeError):
                    errors += 1
                    return 0

        await asyncio.gather(*(one(i) for i in range(min(concurrency, 16))))  # warm: connections, caches
        cpu0, t0 = cpu_seconds(router_pids), time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(requests)))
        wall, cpu = time.perf_counter() - t0, cpu_seconds(router_pids) - cpu0
    return Run(max_tokens, requests, sum(counts), wall, cpu, errors)


def fit(runs: list[Run]) -> tuple[float, float]:
    """Least squares of ``cpu = a * requests + b * tokens`` over the runs: (a, b) in CPU seconds.

    Raises:
        ValueError: fewer than two runs with different tokens per request (the costs cannot be split).
    """
    if len({r.tokens / r.requests for r in runs}) < 2:
        raise ValueError("need runs with different tokens per request to separate the two costs")
    design = torch.tensor([[r.requests, r.tokens] for r in runs], dtype=torch.float64)
    cpu = torch.tensor([[r.router_cpu_s] for r in runs], dtype=torch.float64)
    a, b = torch.linalg.lstsq(design, cpu).solution.flatten().tolist()
    return a, b


def categorize(stack: str) -> str:
    frames = stack.split(";")[::-1]  # innermost first
    for frame in frames:
        for name, patterns in CATEGORIES:
            if any(p in frame for p in patterns):
                return name
    return "other"


def profile(pid: int, seconds: float) -> subprocess.Popen | None:
    if shutil.which("py-spy") is None:
        print("py-spy not found: no profile")
        return None
    out = tempfile.NamedTemporaryFile(suffix=".txt", delete=False).name
    proc = subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "400",
                             "--format", "raw", "--output", out, "--nonblocking"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    proc.out_path = out  # type: ignore[attr-defined]
    return proc


def report_profile(proc: subprocess.Popen, verbose: int = 0) -> dict[str, float]:
    proc.wait(timeout=120)
    samples: collections.Counter[str] = collections.Counter()
    leaves: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    idle = 0
    with open(proc.out_path) as f:  # type: ignore[attr-defined]
        for line in f:
            stack, _, count = line.rstrip().rpartition(" ")
            if not count.isdigit():
                continue
            if "select (selectors.py" in stack.split(";")[-1] or "epoll" in stack.split(";")[-1]:
                idle += int(count)  # waiting for events: not CPU
                continue
            category = categorize(stack)
            samples[category] += int(count)
            leaves[category][stack.split(";")[-1]] += int(count)
    os.unlink(proc.out_path)  # type: ignore[attr-defined]
    busy = sum(samples.values())
    print(f"router profile: {busy} busy samples ({idle} more waiting in the event loop's select)")
    shares = {k: v / busy for k, v in samples.most_common()} if busy else {}
    for k, share in shares.items():
        top = ", ".join(f"{leaf} {n}" for leaf, n in leaves[k].most_common(verbose))
        print(f"  {k:32s} {share * 100:5.1f}%" + (f"   innermost: {top}" if top else ""))
    return shares


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the tiny default model)")
    ap.add_argument("--num-routers", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--profile-s", type=float, default=0.0, help="py-spy the first router during the last run")
    ap.add_argument("--profile-top", type=int, default=0, help="with --profile-s: name each group's N busiest frames")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    model = args.model or str(ensure_default_model("tiny"))
    kwargs = {}
    if args.num_routers != 1:
        if "num_routers" not in inspect.signature(ClusterSpec).parameters:
            raise SystemExit("this pdserve has no router tier (ClusterSpec.num_routers)")
        kwargs["num_routers"] = args.num_routers
    spec = ClusterSpec(model=model, num_prefill=0, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "256MiB", "--max-num-seqs", str(max(args.concurrency, 64))],
                       **kwargs)
    os.sched_setaffinity(0, {OTHER_CORE})
    with LocalCluster(spec) as cluster:
        router_pids = [p.pid for name, p in cluster.procs if name.startswith("router")]
        for name, p in cluster.procs:
            os.sched_setaffinity(p.pid, {ROUTER_CORE} if name.startswith("router") else {OTHER_CORE})
            for child in psutil.Process(p.pid).children(recursive=True):
                child.cpu_affinity([ROUTER_CORE] if name.startswith("router") else [OTHER_CORE])
        served = httpx.get(f"{cluster.url}/v1/models", timeout=30).json()["data"][0]["id"]
        runs = []
        for i, max_tokens in enumerate(args.max_tokens):
            spy = profile(router_pids[0], args.profile_s) if args.profile_s and i == len(args.max_tokens) - 1 else None
            run = asyncio.run(drive(cluster.url, served, max_tokens, args.requests, args.concurrency, router_pids))
            runs.append(run)
            util = run.router_cpu_s / run.wall_s / len(router_pids)
            print(f"max_tokens {max_tokens:4d}: {run.requests} requests in {run.wall_s:.2f} s = "
                  f"{run.requests / run.wall_s:.1f} req/s, {run.tokens / run.wall_s:.0f} streamed tok/s; router CPU "
                  f"{run.router_cpu_s:.2f} s ({util * 100:.0f}% of a core per router), "
                  f"{run.router_cpu_s / run.requests * 1e3:.2f} ms/request; errors {run.errors}", flush=True)
            shares = report_profile(spy, args.profile_top) if spy is not None else None
        a, b = fit(runs) if len(runs) > 1 else (runs[0].router_cpu_s / runs[0].requests, 0.0)
        print(f"router CPU: {a * 1e3:.2f} ms per request + {b * 1e6:.0f} us per streamed token "
              f"({args.num_routers} router{'s' if args.num_routers > 1 else ''})")
        for m in args.max_tokens:
            print(f"  one router's ceiling at {m} tokens/request: {1 / (a + b * m):.0f} req/s, "
                  f"{m / (a + b * m):.0f} tok/s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"num_routers": args.num_routers, "runs": [dataclasses.asdict(r) for r in runs],
                           "cpu_per_request_s": a, "cpu_per_token_s": b,
                           "profile": shares if args.profile_s else None}, f, indent=2)


if __name__ == "__main__":
    main()
