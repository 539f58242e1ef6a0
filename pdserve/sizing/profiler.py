"""``pdserve profile``: measure real workers and write the profile the simulator and planner read.

Each worker kind is measured in a process of its own, built exactly as ``pdserve up`` builds that
worker (``EngineConfig.from_cli_args`` of the role, with the flags given) and pinned as ``pdserve up``
pins it on this machine (a disaggregated worker to its share of the cores, a colocated one to them
all), its decode step compiled first (as a warm worker runs it):

* **prefill**: one prompt of N new tokens, for N over powers of two up to the step budget, and N in
  ``CACHED_NEW_TOKENS`` after K in ``PREFILL_CACHED`` cached tokens (a prefix computed first, then
  hit); the median of ``repeats`` steps, each prompt with its own fresh tokens and a length not
  measured before (N, N - 1, ...: a new length's first step builds its kernels, as it does in
  serving, where prompt lengths vary);
* **decode**: B sequences of context C decoding together, for B over powers of two up to
  ``max_num_seqs`` and C in ``DECODE_CONTEXTS``; the median step of ``repeats``;
* **one core**: a kind pinned to several cores is timed again on one of them at a few points
  (``SCALING_PROMPTS``, ``SCALING_BATCHES``): the ratios say how its steps slow when ``pdserve up``
  places it on fewer cores (a small model's steps barely use a second thread, so "in proportion to
  the cores" would be far off);
* **transfer**: one request's KV through pdserve's own pairs (``PrefillPairs`` / ``DecodePairs``:
  headers, per-layer checksums, layer runs), between two processes on two cores, for a range of
  prompt lengths, timed from the first layer sent until both sides hold the bytes and checksum;
* **serving**: the colocated and decode kinds again inside a real cluster (``pdserve up``: router,
  workers, a streaming client on the same machine, as a benchmark runs): the decode grid as the
  clients see it (``serving_decode_seconds``) and the fixed latency of a request outside the steps
  (``request_overhead_s``).

Steps are timed around ``EngineCore.step`` (schedule, forward, sample, update): what a worker's loop
spends per step besides its sockets.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

from pdserve.sizing.profile import PROFILE_VERSION, Profile, WorkerProfile, fit_attention_pair_seconds

PREFILL_CACHED = (256, 512)
CACHED_NEW_TOKENS = (64, 256)
DECODE_CONTEXTS = (32, 256, 768, 2048)
TRANSFER_TOKENS = (64, 256, 1024, 2048)
SCALING_PROMPTS = (64, 256, 512)  # the prompt lengths and decode batches a worker of several cores is also
SCALING_BATCHES = (1, 8, 32)  # timed on one of them (``one_core_ratios``)
OVERHEAD_TOKENS = (16, 128, 512, 1500)
LOADED_UTILIZATION = 0.5  # a prefill worker's prompts are also timed arriving at this share of its capacity
LOADED_PROMPTS = 24
_CTX = mp.get_context("spawn")


def machine_facts() -> dict:
    """The CPU (model name, AVX2 / AVX-512 / AMX), cores, Python and torch versions."""
    facts = {"cores": len(os.sched_getaffinity(0)), "python": platform.python_version(), "machine": platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
        name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
        flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
        facts["cpu"] = name
        facts["isa"] = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
        facts["avx512_bf16"] = "avx512_bf16" in flags
        facts["amx"] = "amx_tile" in flags
    except OSError:
        pass
    try:
        import torch

        facts["torch"] = torch.__version__
    except ImportError:
        pass
    return facts


def kind_role(kind: str) -> str:
    """The role whose defaults a worker kind's flags are read with."""
    return "prefill" if kind == "prefill" else "decode"


def kind_cores(kind: str, num_cores: int) -> list[int]:
    """The cores ``pdserve up`` gives a worker of ``kind`` on a machine of ``num_cores`` (one prefill and
    one decode worker share it evenly; a colocated worker takes them all)."""
    available = sorted(os.sched_getaffinity(0))[:num_cores]
    if kind == "colocated" or len(available) == 1:
        return available
    half = max(1, len(available) // 2)
    return available[:half] if kind == "prefill" else available[half:2 * half]


def _powers(limit: int, start: int = 1) -> list[int]:
    values, v = [], start
    while v < limit:
        values.append(v)
        v *= 2
    values.append(limit)
    return sorted(set(values))


# ---- one worker kind, in its own process ---------------------------------------------------------

def threads_per_rank(worker_args: argparse.Namespace, num_cores: int) -> int:
    """Torch threads each rank of a worker with ``worker_args``' layout runs on ``num_cores`` cores, as
    ``pdserve up`` gives them: the cores shared out among the TP x PP ranks (a TP-2 worker on 2 cores: one
    each). Every rank on every core oversubscribes them: spinning threads made a TP-2 decode step 16x
    slower (142 ms against 8.8 at batch 1 on a 2-core Xeon)."""
    return max(1, num_cores // (worker_args.tensor_parallel_size * worker_args.pipeline_parallel_size))


def measure_worker(kind: str, model: str, flags: list[str], cores: list[int], repeats: int,
                   on_point=None, scaling_only: bool = False) -> dict:
    """Build the engine of ``kind`` and measure its grids (runs in the calling process; pins it).

    ``scaling_only``: only ``SCALING_PROMPTS`` and ``SCALING_BATCHES`` at one decode context (the second
    of ``DECODE_CONTEXTS`` the model allows), no cached-prefix points (the few points that compare
    ``cores`` with the full profile's)."""
    from pdserve.common.protocol import SamplingParams
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core import EngineCore

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    core_list = ",".join(map(str, cores))
    threads = threads_per_rank(parser.parse_args(["--model", model, *flags]), len(cores))
    args = parser.parse_args(["--model", model, "--cpu-cores", core_list, "--num-threads", str(threads), *flags])
    role = kind_role(kind)
    config = EngineConfig.from_cli_args(args, role=role)
    core = EngineCore(config)
    try:
        runner = core.runner
        runner.wait_for_compiled_step(600)
        sched = core.scheduler.config
        block_size = runner.block_size
        budget = sched.max_num_batched_tokens
        max_len = sched.max_model_len
        counter = iter(range(10**9))

        def prompt(n: int) -> list[int]:  # fresh tokens: never a prefix-cache hit
            i = next(counter)
            return [10 + (i * 7919 + j * 104729) % 900 for j in range(n)]

        def timed_steps(request_ids: set[str]) -> list[float]:
            """Run steps until ``request_ids`` have all sampled once; each step's seconds."""
            times, pending = [], set(request_ids)
            while pending:
                t0 = time.perf_counter()
                _, outputs = core.step()
                times.append(time.perf_counter() - t0)
                pending -= {o.request.request_id for o in outputs}
            return times

        lengths_seen: set[int] = set()

        def fresh_length(n: int) -> int:
            """``n`` or the nearest length below it not measured yet: serving meets many prompt lengths, and
            a length's first step builds its kernels (oneDNN makes its primitives per shape), so a profile of
            repeated lengths would measure only warm shapes."""
            m = n
            while m in lengths_seen and m > 1:
                m -= 1
            lengths_seen.add(m)
            return m

        def prefill_step(n: int, prefix: list[int]) -> float:
            """Median seconds of the steps computing one prompt of about ``n`` fresh tokens after ``prefix``
            (cached), each of ``repeats`` a length not measured before (``fresh_length``)."""
            samples = []
            for r in range(repeats):
                rid = f"p{next(counter)}"
                core.add_request(rid, prefix + prompt(fresh_length(n)), SamplingParams(max_tokens=1, ignore_eos=True))
                samples.append(sum(timed_steps({rid})))
            if on_point:
                on_point()
            return statistics.median(samples)

        # prompts of N tokens, nothing cached; then N after a cached prefix of K (computed first, then hit)
        tokens = _powers(min(budget, max_len - 2), 16)
        if scaling_only:
            tokens = [n for n in SCALING_PROMPTS if n <= tokens[-1]]
        prefill_seconds = [prefill_step(n, []) for n in tokens]
        cached_points = []
        for k in PREFILL_CACHED if not scaling_only else ():
            prefix = prompt(k)
            core.add_request(f"prefix{k}", prefix + [5], SamplingParams(max_tokens=1, ignore_eos=True))
            timed_steps({f"prefix{k}"})
            for n in CACHED_NEW_TOKENS:
                if k + n < max_len - 1 and n <= budget:
                    cached_points.append([n, k, prefill_step(n, prefix)])
        # decode grid: B sequences of context C
        batches = [b for b in _powers(sched.max_num_seqs) if b <= sched.max_num_seqs]
        if scaling_only:
            batches = [b for b in SCALING_BATCHES if b <= sched.max_num_seqs]
        contexts = []
        decode_seconds = []
        for c in DECODE_CONTEXTS:
            need_blocks = batches[-1] * (-(-(c + repeats + 4) // block_size))
            if c + repeats + 4 >= max_len or need_blocks > runner.num_blocks:
                continue
            contexts.append(c)
        if scaling_only:
            contexts = contexts[1:2] or contexts[:1]
        for c in contexts:
            ids = [f"d{c}-{i}" for i in range(batches[-1])]
            for rid in ids:
                core.add_request(rid, prompt(c - 1), SamplingParams(max_tokens=max_len - c, ignore_eos=True))
            timed_steps(set(ids))  # every prompt computed and its first token sampled
            column = {}
            live = list(ids)
            for b in reversed(batches):
                for rid in live[b:]:
                    core.abort(rid)
                live = live[:b]
                core.step()  # one unmeasured step at this batch size
                samples = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    core.step()
                    samples.append(time.perf_counter() - t0)
                column[b] = statistics.median(samples)
                if on_point:
                    on_point()
            for rid in live:
                core.abort(rid)
            decode_seconds.append([column[b] for b in batches])
        decode_seconds = [list(row) for row in zip(*decode_seconds)]  # [batch][context]
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        return WorkerProfile(
            kind=kind, role=role, cores=len(cores), threads=threads, flags=list(flags),
            num_blocks=runner.num_blocks, block_size=block_size,
            block_bytes=runner.kv_cache_bytes // runner.num_blocks * ranks,
            max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=budget, max_model_len=max_len,
            long_prefill_token_threshold=sched.long_prefill_token_threshold,
            prefill_admission=sched.prefill_admission, remote_prefill_threshold=sched.remote_prefill_threshold,
            enable_prefix_caching=core.block_manager.enable_prefix_caching,
            prefill_tokens=tokens, prefill_seconds=prefill_seconds, prefill_cached_points=cached_points,
            attention_pair_seconds=fit_attention_pair_seconds(tokens, prefill_seconds, cached_points),
            decode_batch=batches, decode_context=contexts, decode_seconds=decode_seconds,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size).to_dict()
    finally:
        core.close()


def one_core_ratios(full: WorkerProfile, one: dict) -> dict:
    """``WorkerProfile``'s ``one_core_prefill_ratio`` and ``one_core_decode_ratio``: the medians of the
    one-core pass's step times (``measure_worker(..., scaling_only=True)``) over the full profile's at the
    same points (interpolated)."""
    prefill = [s / full.prefill(n) for n, s in zip(one["prefill_tokens"], one["prefill_seconds"])
               if full.prefill(n) > 0]
    decode = [one["decode_seconds"][i][j] / full.engine_decode(b, c)
              for i, b in enumerate(one["decode_batch"]) for j, c in enumerate(one["decode_context"])
              if full.engine_decode(b, c) > 0]
    return {"one_core_prefill_ratio": statistics.median(prefill) if prefill else 0.0,
            "one_core_decode_ratio": statistics.median(decode) if decode else 0.0}


def num_points(model: str, flags: list[str], kind: str) -> int:
    """How many grid points ``measure_worker`` will time (for the progress bar; an estimate)."""
    budget = 512 if kind == "prefill" else 2048
    seqs = 64
    for i, flag in enumerate(flags[:-1]):
        if flag == "--max-num-batched-tokens":
            budget = int(flags[i + 1])
        elif flag == "--max-num-seqs":
            seqs = int(flags[i + 1])
    return (len(_powers(budget, 16)) + len(PREFILL_CACHED) * len(CACHED_NEW_TOKENS)
            + len(_powers(seqs)) * len(DECODE_CONTEXTS))


def _worker_main(kind, model, flags, cores, repeats, queue) -> None:
    _measure_child(kind, model, flags, cores, repeats, False, queue)


def _one_core_main(kind, model, flags, cores, repeats, queue) -> None:
    _measure_child(kind, model, flags, cores, repeats, True, queue)


def _measure_child(kind, model, flags, cores, repeats, scaling_only, queue) -> None:
    try:
        result = measure_worker(kind, model, flags, cores, repeats, on_point=lambda: queue.put(("point", None)),
                                scaling_only=scaling_only)
        queue.put(("done", result))
    except BaseException as e:  # the parent reports it
        queue.put(("error", f"{type(e).__name__}: {e}"))


# ---- the transfer -------------------------------------------------------------------------------

def _decode_side(ctrl, out, core: int) -> None:
    os.sched_setaffinity(0, {core})
    import msgspec
    import torch

    torch.set_num_threads(1)
    from pdserve.common.protocol import KVTransferHeader
    from pdserve.kvtransfer.receiver import DecodePairs, ReceivedKV

    def on_received(r) -> None:
        out.put(("received", time.monotonic()))
        if isinstance(r, ReceivedKV):
            pairs.release(r.kv)

    pairs = DecodePairs("D", "127.0.0.1", "cpu", 60.0, on_received)
    out.put(("ready", pairs.store_port))
    while True:
        cmd, arg = ctrl.get(timeout=600)
        if cmd == "generation":
            out.put(("generation", pairs.generation_for(arg)))
        elif cmd == "header":
            pairs.submit(msgspec.msgpack.decode(arg, type=KVTransferHeader))
        else:
            break
    pairs.close()


def measure_transfer(model: str, repeats: int, cores: list[int], on_point=None) -> dict:
    """KV transfer seconds for ``TRANSFER_TOKENS`` prompts of ``model``'s KV shape (float32, one rank
    each side), through pdserve's pairs between this process and a spawned decode side."""
    import msgspec
    import torch

    from pdserve.common.protocol import KVTransferHeader
    from pdserve.engine.execution.kv_cache import allocate_kv_cache
    from pdserve.kvtransfer.sender import OutgoingKV, PrefillPairs

    os.sched_setaffinity(0, {cores[0]})
    torch.set_num_threads(1)
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    num_layers, num_kv_heads = cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    block_size = 16
    max_blocks = max(TRANSFER_TOKENS) // block_size
    kv_cache = allocate_kv_cache(num_layers, max_blocks + 1, block_size, num_kv_heads, head_dim, torch.float32, "cpu")
    kv_cache.normal_()
    ctrl, out = _CTX.Queue(), _CTX.Queue()
    d = _CTX.Process(target=_decode_side, args=(ctrl, out, cores[-1]), daemon=True)
    d.start()
    sizes, seconds = [], []
    try:
        _, store_port = out.get(timeout=60)
        ctrl.put(("generation", "P"))
        _, generation = out.get(timeout=30)
        pairs = PrefillPairs("P", "cpu", 60.0)
        pairs.request_pair("D", "127.0.0.1", store_port, generation)
        deadline = time.monotonic() + 60
        while (pair := pairs.get("D", generation)) is None:
            if pairs.failure("D", generation) or time.monotonic() > deadline:
                raise RuntimeError(f"no transfer pair: {pairs.failure('D', generation)}")
            time.sleep(0.01)
        seq = 0
        for tokens in TRANSFER_TOKENS:
            num_blocks = tokens // block_size
            block_ids = list(range(1, num_blocks + 1))
            samples = []
            for r in range(repeats + 1):
                seq += 1
                rid = f"t{seq}"
                header = KVTransferHeader(request_id=rid, prefill_worker_id="P", pair_generation=generation,
                                          num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                                          num_kv_heads=num_kv_heads, head_dim=head_dim, dtype="float32",
                                          num_tokens=tokens)
                ctrl.put(("header", msgspec.msgpack.encode(header)))
                outgoing = OutgoingKV(pair, rid, num_layers, send_from_cache=True)
                outgoing.start(kv_cache[0], block_ids)
                time.sleep(0.02)  # the header reaches the decode side first, as in serving
                t0 = time.monotonic()
                for layer in range(num_layers):
                    outgoing.send_layer(layer, kv_cache[layer], block_ids)
                outgoing.wait(60)
                t_sent = time.monotonic()
                _, t_recv = out.get(timeout=60)
                if r:
                    samples.append(max(t_sent, t_recv) - t0)
            sizes.append(num_layers * 2 * num_blocks * block_size * num_kv_heads * head_dim * 4)
            seconds.append(statistics.median(samples))
            if on_point:
                on_point()
        pairs.close()
    finally:
        ctrl.put(("stop", None))
        d.join(10)
        if d.is_alive():
            d.kill()
    return {"prefill_layout": "tp1pp1", "decode_layout": "tp1pp1", "backend": "gloo", "bytes": sizes,
            "seconds": seconds}


def _transfer_main(model, repeats, cores, queue) -> None:
    try:
        queue.put(("done", measure_transfer(model, repeats, cores, on_point=lambda: queue.put(("point", None)))))
    except BaseException as e:
        queue.put(("error", f"{type(e).__name__}: {e}"))


def _run_child(target, args, bar) -> dict:
    """Run ``target(*args, queue)`` in a spawned process; its progress ticks the bar; its result back."""
    queue = _CTX.Queue()
    proc = _CTX.Process(target=target, args=(*args, queue), daemon=False)
    proc.start()
    try:
        while True:
            try:
                kind, payload = queue.get(timeout=5)
            except Exception:
                if not proc.is_alive():
                    raise RuntimeError(f"the profiling process died (exit code {proc.exitcode})") from None
                continue
            if kind == "point":
                bar.update(1)
            elif kind == "done":
                return payload
            else:
                raise RuntimeError(f"profiling failed: {payload}")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


# ---- serving: a real router and workers ------------------------------------------------------------

class _Cluster:
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


async def _stream_poisson(url: str, model_id: str, prompts: list[list[int]], max_tokens: int, rate: float,
                          seed: int = 0) -> None:
    """Stream ``prompts`` arriving as a Poisson process of ``rate`` per second (seeded), each to its end."""
    import asyncio
    import random

    import httpx

    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in prompts:
        offsets.append(t)
        t += rng.expovariate(rate)

    async def one(client, prompt, offset) -> None:
        await asyncio.sleep(offset)
        body = {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            async for _ in resp.aiter_lines():
                pass

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await client.get(f"{url}/health")
        await asyncio.gather(*(one(client, p, o) for p, o in zip(prompts, offsets)))


async def _stream_batch(url: str, model_id: str, prompts: list[list[int]], max_tokens: int) -> list[list[float]]:
    """Stream every prompt at once; each one's send time then its chunks' arrival times (perf_counter s)."""
    import asyncio

    import httpx

    async def one(client, prompt) -> list[float]:
        body = {"model": model_id, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
        times = [time.perf_counter()]
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:") and '"text"' in line:
                    times.append(time.perf_counter())
        if len(times) < 2:
            raise RuntimeError(f"no token came back through the router (HTTP {resp.status_code})")
        return times

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        await client.get(f"{url}/health")  # the connection is open before the clock starts
        return list(await asyncio.gather(*(one(client, p) for p in prompts)))


def serving_step_seconds(streams: list[list[float]]) -> float:
    """The decode step the clients saw, from ``_stream_batch``'s streams (``_step_seconds``)."""
    return _step_seconds([t[1:] for t in streams])  # each stream's send time left out


def step_jitter(streams: list[list[float]]) -> float | None:
    """The coefficient of variation of the gaps between a stream's chunks while every stream decoded
    (``_stream_batch``'s streams); None with too few gaps."""
    streams = [t[1:] for t in streams]
    start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
    gaps = [b - a for t in streams for a, b in zip(t, t[1:]) if start <= a and b <= end]
    if len(gaps) < 8:
        return None
    mean = statistics.fmean(gaps)
    return statistics.pstdev(gaps) / mean if mean > 0 else None


def _step_seconds(streams: list[list[float]]) -> float:
    """The decode step as the clients saw it while every stream was decoding: the window from the last
    stream's first token to the first stream's last token, times the streams, over the tokens (chunks)
    that arrived in it. The median per-stream time per token when the window holds too few."""
    start, end = max(t[0] for t in streams), min(t[-1] for t in streams)
    chunks = sum(sum(1 for x in t if start < x <= end) for t in streams)
    if end - start > 0 and chunks >= 4 * len(streams):
        return (end - start) * len(streams) / chunks
    per_stream = [(t[-1] - t[0]) / (len(t) - 1) for t in streams if len(t) > 1]
    return statistics.median(per_stream)


def _scrape_phases(url: str):
    """The router's TTFT hops so far (``pdserve.bench.phases``)."""
    import asyncio

    import httpx

    from pdserve.bench.phases import scrape

    async def once():
        async with httpx.AsyncClient(timeout=30) as client:
            return await scrape(client, url)

    return asyncio.run(once())


class _HostMeter:
    """CPU seconds (user + system) of a cluster's router processes and of this process (the streaming
    client), read before and after a pass."""

    def __init__(self, launcher_pid: int):
        import psutil

        children = psutil.Process(launcher_pid).children(recursive=True)
        self.routers = [c for c in children if "router" in c.cmdline()]  # python -m pdserve router ... (workers: --router)

    def read(self) -> tuple[float, float]:
        router = 0.0
        for proc in self.routers:
            times = proc.cpu_times()
            router += times.user + times.system
        return router, time.process_time()


def _least_squares(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Coefficients ``x`` minimising ``|rows x - ys|`` (normal equations, Gaussian elimination with
    pivoting); None when the columns do not determine them."""
    n = len(rows[0])
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] + [sum(r[i] * y for r, y in zip(rows, ys))]
         for i in range(n)]
    scale = max(abs(a[i][i]) for i in range(n)) or 1.0
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        if abs(a[pivot][col]) <= 1e-12 * scale:
            return None
        a[col], a[pivot] = a[pivot], a[col]
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
    return [a[i][n] / a[i][i] for i in range(n)]


def host_cpu_fit(passes: list[tuple[int, int, int, float, float]]) -> dict[str, list[float]]:
    """CPU seconds per request and per streamed token of the router and of the client, from passes of
    ``(requests, tokens, client calls, router CPU s, client CPU s)``: the least-squares fit of ``cpu = a x
    requests + b x tokens`` over them (``benchmarks/bench_router.py``'s split), the client's with a third
    term per call (each ``asyncio.run`` of the profiler's client opens a connection pool: its own cost,
    not a request's). Passes with one token per request and passes of long streams at several batch
    sizes determine it. Coefficients below zero (noise) are refitted without that term. ``{}`` when the
    passes cannot separate the terms."""
    fit = {}
    for name, i, columns in (("router", 3, 2), ("client", 4, 3)):
        terms = list(range(columns))
        while terms:
            x = _least_squares([[p[t] for t in terms] for p in passes], [p[i] for p in passes]) \
                if len(passes) >= len(terms) else None
            if x is None:
                return {}
            if min(x) >= 0:
                break
            terms.pop(min(range(len(terms)), key=lambda k: x[k]))  # drop the term fitted below zero
        coef = dict(zip(terms, x)) if terms else {}
        fit[name] = [coef.get(0, 0.0), coef.get(1, 0.0)]
    return fit


def measure_serving(model: str, flags: list[str], kind: str, worker: dict, prefill: dict | None,
                    on_point=None, num_idle: int = 8, max_tokens: int = 48) -> dict:
    """Measure a worker kind inside a real cluster (``colocated``: ``pdserve up --colocated``; ``decode``:
    one prefill and one decode worker) with a streaming client on this machine, as a benchmark runs:

    * ``serving_decode_seconds``: the decode step grid (the profiled batches and contexts) as the clients
      see it: every overhead of the serving loop (outputs to the router, its streaming, the client's and
      router's share of the cores) on top of the engine's step;
    * ``serving_prefill_seconds``: for prompts of ``OVERHEAD_TOKENS`` tokens, the router's
      prefill-compute hop (``pdserve:request_phase_seconds``: the prefill worker's, or the colocated
      worker's local one), mean: the prompt's steps as the cluster runs them. A colocated worker's at
      idle (its steps among decodes are the cost model's mixed steps); a prefill worker's with
      ``LOADED_PROMPTS`` such prompts arriving (Poisson) at ``LOADED_UTILIZATION`` of what the idle hop
      allows, each decoding ``max_tokens`` tokens: its prompts then share its core with the previous
      ones' KV sends and the machine with the decode worker, the router and the client, which an idle
      prompt never does (on a 2-core machine the hop under load is 1.5-3x the idle one);
      ``serving_prefill_idle_seconds`` the idle hop, ``serving_prefill_utilization`` how busy the loaded
      pass kept the prefill worker (its arrivals paced by the idle hop: ``LOADED_UTILIZATION`` times
      the loaded hop over the idle one, at most 1; 0 for a colocated worker);
    * ``overhead_seconds``: those prompts' time to first token minus that hop: the router, the hops,
      HTTP, the transfer's tail, and the per-request work that grows with the prompt
      (``request_overhead_s``: the shortest's);
    * ``serving_step_cv``: the steps' jitter the clients saw (``step_jitter``, the median over the grid).
    """
    import asyncio

    from pdserve.bench.commands import quiet_http_logs
    from pdserve.bench.phases import summarize

    quiet_http_logs()
    cluster = _Cluster(model, flags, colocated=kind == "colocated")
    counter = iter(range(10**9))

    def prompt(n: int) -> list[int]:
        i = next(counter)
        return [10 + (i * 7919 + j * 104729 + 17) % 900 for j in range(n)]

    try:
        model_id = cluster.wait_ready()
        meter = _HostMeter(cluster.proc.pid)
        host_passes = []  # (requests, tokens, client calls, router CPU s, client CPU s): idle prompts, grid points
        engine = WorkerProfile(**(prefill or worker))
        hop = "local_prefill_compute" if kind == "colocated" else "prefill_compute"
        overhead_tokens, overhead_seconds, prefill_seconds, idle_seconds = [], [], [], []
        for n in OVERHEAD_TOKENS:
            if n + num_idle + 2 >= engine.max_model_len - 1:
                continue
            for k in range(2):  # the first lengths of this size: unmeasured
                asyncio.run(_stream_batch(cluster.url, model_id, [prompt(n + num_idle + k)], 1))
            before = _scrape_phases(cluster.url)
            ttfts = []
            cpu_before = meter.read()
            for k in range(num_idle):  # lengths n, n + 1, ...: each new to the cluster, as in serving
                sent, first = asyncio.run(_stream_batch(cluster.url, model_id, [prompt(n + k)], 1))[0][:2]
                ttfts.append(first - sent)
            cpu_after = meter.read()
            host_passes.append((num_idle, num_idle, num_idle, cpu_after[0] - cpu_before[0],
                                cpu_after[1] - cpu_before[1]))
            phases = summarize(before, _scrape_phases(cluster.url))
            compute = phases["phases"][hop]["mean_s"] if phases and hop in phases["phases"] else engine.prefill(n)
            served = compute
            if kind == "decode":  # the prefill worker's prompts among others (the docstring says why)
                before = _scrape_phases(cluster.url)
                prompts = [prompt(n + num_idle + 2 + k) for k in range(LOADED_PROMPTS)]
                asyncio.run(_stream_poisson(cluster.url, model_id, prompts, max_tokens,
                                            LOADED_UTILIZATION / max(compute, 1e-3)))
                phases = summarize(before, _scrape_phases(cluster.url))
                if phases and hop in phases["phases"]:
                    served = phases["phases"][hop]["mean_s"]
            overhead_tokens.append(n)
            prefill_seconds.append(served)
            idle_seconds.append(compute)
            overhead_seconds.append(max(0.0, statistics.fmean(ttfts) - compute))
        grid, jitters = [], []
        for b in worker["decode_batch"]:
            row = []
            for c in worker["decode_context"]:
                cpu_before = meter.read()
                rounds = [asyncio.run(_stream_batch(cluster.url, model_id, [prompt(c - 1) for _ in range(b)],
                                                    max_tokens)) for _ in range(2)]
                cpu_after = meter.read()
                chunks = sum(len(t) - 1 for streams in rounds for t in streams)  # the tokens, or fewer chunks
                host_passes.append((2 * b, chunks, 2, cpu_after[0] - cpu_before[0], cpu_after[1] - cpu_before[1]))
                row.append(statistics.fmean(serving_step_seconds(streams) for streams in rounds))
                jitters += [j for streams in rounds if (j := step_jitter(streams)) is not None]
                if on_point:
                    on_point()
            grid.append(row)
        return {"request_overhead_s": overhead_seconds[0], "overhead_tokens": overhead_tokens,
                "overhead_seconds": overhead_seconds, "serving_prefill_seconds": prefill_seconds,
                "serving_prefill_idle_seconds": idle_seconds,
                # how busy the loaded pass kept the prefill worker: its arrivals were paced by the idle hop
                "serving_prefill_utilization": min(1.0, LOADED_UTILIZATION * statistics.fmean(
                    s / i for s, i in zip(prefill_seconds, idle_seconds) if i > 0)) if kind == "decode" else 0.0,
                "serving_decode_seconds": grid,
                "serving_step_cv": statistics.median(jitters) if jitters else 0.0,
                "host_cpu_seconds": host_cpu_fit(host_passes) if meter.routers else {},
                "serving_stream_tokens": max_tokens}
    finally:
        cluster.close()


def run_profile(model: str, out: str, kinds: list[str], flags: list[str], repeats: int = 3,
                transfer: bool = True, serving: bool = True, disable_tqdm: bool = False) -> Profile:
    """Measure every worker kind of ``kinds`` (and the transfer, and with ``serving`` the colocated and
    decode kinds inside real clusters: ``measure_serving``) and write ``out``.

    Raises:
        ValueError: an unknown kind; RuntimeError: a measurement failed (its reason named).
    """
    from tqdm import tqdm

    from pdserve.sizing.profile import WORKER_KINDS

    bad = [k for k in kinds if k not in WORKER_KINDS]
    if bad:
        raise ValueError(f"worker kinds are {', '.join(WORKER_KINDS)}, got {', '.join(bad)}")
    start = time.monotonic()
    facts = machine_facts()
    num_cores = facts["cores"]
    total = sum(num_points(model, flags, k) for k in kinds) + (len(TRANSFER_TOKENS) if transfer else 0)
    workers = {}
    with tqdm(total=total, desc="profiling", disable=disable_tqdm, unit="point") as bar:
        for i, kind in enumerate(kinds):
            bar.set_postfix_str(kind)
            cores = kind_cores(kind, num_cores)
            workers[kind] = _run_child(_worker_main, (kind, model, flags, cores, repeats), bar)
            if len(cores) > 1:  # the same engine on one of its cores: how it slows when placed on fewer
                bar.total += len(SCALING_PROMPTS) + len(SCALING_BATCHES)
                one = _run_child(_one_core_main, (kind, model, flags, cores[:1], repeats), bar)
                workers[kind].update(one_core_ratios(WorkerProfile(**workers[kind]), one))
            # the grid fits the model's limits: the estimate of the points left is now this kind's count
            left = sum(num_points(model, flags, k) for k in kinds[i + 1:]) + (len(TRANSFER_TOKENS) if transfer else 0)
            bar.total = bar.n + left
            bar.refresh()
        transfer_figures = None
        if transfer and "prefill" in kinds and "decode" in kinds:
            bar.set_postfix_str("transfer")
            cores = kind_cores("prefill", num_cores)[:1] + kind_cores("decode", num_cores)[:1]
            transfer_figures = _run_child(_transfer_main, (model, repeats * 3, cores), bar)
    if serving:
        for kind in ("colocated", "decode"):
            if kind not in workers or (kind == "decode" and "prefill" not in workers):
                continue
            w = workers[kind]
            points = len(w["decode_batch"]) * len(w["decode_context"])
            with tqdm(total=points, desc=f"serving ({kind})", disable=disable_tqdm, unit="point") as bar:
                figures = measure_serving(model, flags, kind, w, workers.get("prefill") if kind == "decode" else None,
                                          on_point=lambda: bar.update(1))
            # the prompt's steps as the cluster ran them belong to the kind that prefilled them
            prefiller = workers["prefill" if kind == "decode" else kind]
            prefiller["serving_prefill_tokens"] = figures["overhead_tokens"]
            prefiller["serving_prefill_seconds"] = figures.pop("serving_prefill_seconds")
            prefiller["serving_prefill_idle_seconds"] = figures.pop("serving_prefill_idle_seconds")
            prefiller["serving_prefill_utilization"] = figures.pop("serving_prefill_utilization")
            w.update(figures)
    profile = Profile.from_dict({
        "kind": "pdserve-profile", "version": PROFILE_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": os.path.abspath(model), "machine": facts, "workers": workers, "transfer": transfer_figures,
        "profile_seconds": time.monotonic() - start})
    profile.profile_seconds = time.monotonic() - start
    profile.save(out)
    return profile
