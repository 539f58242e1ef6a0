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
  headers, per-layer checksums, layer runs), from every rank of a prefill worker to every rank of a
  decode worker, each rank a process of its own, for a range of prompt lengths, timed from the first
  layer sent until every rank holds its bytes and checksum (``transfer_profiler``): for the profiled
  workers' own layouts, and for each further layout pair asked for (``--transfer-layouts``);
* **serving**: the colocated and decode kinds again inside a real cluster (``pdserve up``: router,
  workers, a streaming client on the same machine, as a benchmark runs): the decode grid as the
  clients see it (``serving_decode_seconds``), the fixed latency of a request outside the steps
  (``request_overhead_s``), and the router's and the client's CPU (``serving_profiler``).

Steps are timed around ``EngineCore.step`` (schedule, forward, sample, update): what a worker's loop
spends per step besides its sockets.
"""

from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import platform
import statistics
import time

from pdserve.sizing.profile import PROFILE_VERSION, Profile, WorkerProfile, fit_attention_pair_seconds
from pdserve.sizing.serving_profiler import GRID_PASSES, measure_serving
from pdserve.sizing.transfer_profiler import TRANSFER_TOKENS, transfer_main

PREFILL_CACHED = (256, 512)
CACHED_NEW_TOKENS = (64, 256)
DECODE_CONTEXTS = (32, 256, 768, 2048)
SCALING_PROMPTS = (64, 256, 512)  # the prompt lengths and decode batches a worker of several cores is also
SCALING_BATCHES = (1, 8, 32)  # timed on one of them (``one_core_ratios``)
_CTX = mp.get_context("spawn")


def _greedy(max_tokens: int):
    """A profiled request's sampling: ``pdserve bench serve``'s (greedy, EOS ignored), as the serving passes
    send it (``serving_client.request_body``)."""
    from pdserve.common.protocol import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


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
                core.add_request(rid, prefix + prompt(fresh_length(n)), _greedy(1))
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
            core.add_request(f"prefix{k}", prefix + [5], _greedy(1))
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
                core.add_request(rid, prompt(c - 1), _greedy(max_len - c))
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


def _layout(model: str, flags: list[str]) -> str:
    """The parallel layout (``tpTppP``) the worker flags ``flags`` give a worker."""
    from pdserve.engine.config import EngineConfig

    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--model", model, *flags])
    return f"tp{args.tensor_parallel_size}pp{args.pipeline_parallel_size}"


def _transfer_pairs(model: str, flags: list[str], kinds: list[str],
                    extra: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """The (prefill, decode) layouts whose transfer to measure: the prefill and decode kinds' own first (when
    both are measured), then ``extra``'s, each once."""
    from pdserve.sizing.transfer_profiler import parse_layout

    pairs = []
    if "prefill" in kinds and "decode" in kinds:
        pairs.append((_layout(model, flags),) * 2)  # the flags are both kinds'
    for pair in extra:
        for name in pair:
            parse_layout(name)
        if tuple(pair) not in pairs:
            pairs.append(tuple(pair))
    return pairs


def run_profile(model: str, out: str, kinds: list[str], flags: list[str], repeats: int = 3,
                transfer: bool = True, serving: bool = True, disable_tqdm: bool = False,
                transfer_layouts: list[tuple[str, str]] = ()) -> Profile:
    """Measure every worker kind of ``kinds`` (and the transfer, and with ``serving`` the colocated and
    decode kinds inside real clusters: ``measure_serving``) and write ``out``. With ``transfer``, the KV
    transfer between the prefill and decode kinds' own layouts (when both are measured), and between each
    (prefill layout, decode layout) of ``transfer_layouts`` (``"tp2pp1"``, ...) besides.

    Raises:
        ValueError: an unknown kind; RuntimeError: a measurement failed (its reason named).
    """
    from tqdm import tqdm

    from pdserve.sizing.loaded_fit import fit_loaded_overhead
    from pdserve.sizing.profile import WORKER_KINDS

    bad = [k for k in kinds if k not in WORKER_KINDS]
    if bad:
        raise ValueError(f"worker kinds are {', '.join(WORKER_KINDS)}, got {', '.join(bad)}")
    start = time.monotonic()
    facts = machine_facts()
    num_cores = facts["cores"]
    pairs = _transfer_pairs(model, flags, kinds, transfer_layouts) if transfer else []
    transfer_points = len(TRANSFER_TOKENS) * len(pairs)
    total = sum(num_points(model, flags, k) for k in kinds) + transfer_points
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
            left = sum(num_points(model, flags, k) for k in kinds[i + 1:]) + transfer_points
            bar.total = bar.n + left
            bar.refresh()
        transfers = []
        cores = sorted(set(kind_cores("prefill", num_cores) + kind_cores("decode", num_cores)))
        for prefill_layout, decode_layout in pairs:
            bar.set_postfix_str(f"transfer {prefill_layout}->{decode_layout}")
            transfers.append(_run_child(transfer_main, (model, repeats * 3, cores, prefill_layout, decode_layout), bar))
        own = "prefill" in kinds and "decode" in kinds  # the first pair is the workers' own
        transfer_figures = transfers[0] if own and transfers else None
    if serving:
        for kind in ("colocated", "decode"):
            if kind not in workers or (kind == "decode" and "prefill" not in workers):
                continue
            w = workers[kind]
            points = len(w["decode_batch"]) * len(w["decode_context"]) * GRID_PASSES
            with tqdm(total=points, desc=f"serving ({kind})", disable=disable_tqdm, unit="point") as bar:
                figures = measure_serving(model, flags, kind, w, workers.get("prefill") if kind == "decode" else None,
                                          on_point=lambda: bar.update(1))
            # the prompt's steps as the cluster ran them belong to the kind that prefilled them
            prefiller = workers["prefill" if kind == "decode" else kind]
            prefiller["serving_prefill_tokens"] = figures["overhead_tokens"]
            prefiller["serving_prefill_seconds"] = figures.pop("serving_prefill_seconds")
            prefiller["serving_prefill_idle_seconds"] = figures.pop("serving_prefill_idle_seconds")
            prefiller["serving_prefill_utilization"] = figures.pop("serving_prefill_utilization")
            prefiller["serving_prefill_cv"] = figures.pop("serving_prefill_cv")
            w.update(figures)
    profile = Profile.from_dict({
        "kind": "pdserve-profile", "version": PROFILE_VERSION,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": os.path.abspath(model), "machine": facts, "workers": workers, "transfer": transfer_figures,
        "transfers": transfers[1:] if own else transfers,
        "profile_seconds": time.monotonic() - start})
    for kind, worker in profile.workers.items():  # what a request pays under load (loaded_fit's doc)
        if worker.loaded_pass:
            worker.loaded_overhead_s, worker.overhead_per_stream_s = fit_loaded_overhead(profile, kind)
    profile.profile_seconds = time.monotonic() - start
    profile.save(out)
    return profile
