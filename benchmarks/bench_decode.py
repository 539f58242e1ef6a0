"""Decode-step microbenchmark: where a decode step's time goes, and how close it runs to memory bandwidth.

Runs an ``EngineCore`` in this process on one pinned core (one torch thread), on the
``bench`` preset by default, and prints:

* **step breakdown at batch B** (default 32, prompts 64-512 tokens): median wall time of
  a decode step and its parts: ``schedule`` (scheduler + block manager), ``prepare``
  (step inputs as tensors), ``forward`` (the model, with a torch-profiler split into
  matmul / attention / the rest), ``sample`` and ``update``;
* **MBU at batch 1, 8, 32** (``--mbu-batches``): bytes a decode step must read (every
  weight once + the sequences' KV) divided by the step time, as a share of this thread's
  read bandwidth measured in the same run (a sum over a 1 GiB tensor; the copy bandwidth,
  read + written as STREAM counts it, is printed beside it);
* **KV usage at peak**: live token slots over the slots of allocated blocks.

    python benchmarks/bench_decode.py                       # bench preset, batch 32
    python benchmarks/bench_decode.py --enforce-eager       # without the compiled step
    python benchmarks/bench_decode.py --attention reference # the gathering torch path
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.core import EngineCore
from pdserve.common.protocol import SamplingParams
from pdserve.default_model.tiny_model import ensure_default_model


def copy_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> float:
    """Memory bandwidth of a large tensor copy on this thread, in bytes/s (best of ``repeats``).

    Counted as STREAM's Copy counts it: the bytes read plus the bytes written."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best


def read_bandwidth(nbytes: int = 2**30, repeats: int = 5) -> float:
    """How fast this thread reads memory, in bytes/s: a sum over a 1 GiB tensor (best of ``repeats``).

    A decode step reads weights and KV and writes almost nothing, so this, not a copy, is its
    roofline: MBU = bytes the step must read / step time / this."""
    src = torch.ones(nbytes // 4)
    src.sum()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def step_bytes(core: EngineCore) -> int:
    """Bytes a decode step of ``core``'s running batch must read: every weight once (the embedding
    one row per token, so not counted; the LM head whole) and every running sequence's K/V."""
    runner = core.runner
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    embed = runner.model.model.embed_tokens.weight
    if not runner.model.tie_word_embeddings:
        weight_bytes -= embed.numel() * embed.element_size()
    per_token = runner.kv_cache[0, 0, 0, 0].numel() * 2 * runner.num_layers * runner.kv_cache.element_size()
    return weight_bytes + sum(r.num_tokens for r in core.scheduler.running) * per_token


def make_core(args, max_num_seqs: int) -> EngineCore:
    config = EngineConfig(model=args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory,
                          max_num_seqs=max_num_seqs, max_num_batched_tokens=4096, num_threads=1,
                          enable_prefix_caching=False, enforce_eager=args.enforce_eager,
                          attention_backend=args.attention, linear_weight_format=args.linear_weight_format)
    return EngineCore(config)


def fill(core: EngineCore, batch: int, min_in: int, max_in: int, seed: int, vocab: int) -> None:
    """Add ``batch`` requests and run until every one has prefilled."""
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=4096 - max_in, temperature=0.0, ignore_eos=True)  # never finishes here
    for i in range(batch):
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(min_in, max_in))]
        core.add_request(f"r{i}", prompt, params, stop_at_max_model_len=True)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()


def timed_steps(core: EngineCore, num_steps: int) -> dict[str, list[float]]:
    """Run decode steps, timing each part (seconds per step)."""
    parts: dict[str, list[float]] = {k: [] for k in ("schedule", "execute", "update", "step")}
    for _ in range(num_steps):
        t0 = time.perf_counter()
        out = core.schedule()
        t1 = time.perf_counter()
        res = core.execute(out)
        t2 = time.perf_counter()
        core.update(out, res)
        t3 = time.perf_counter()
        parts["schedule"].append(t1 - t0)
        parts["execute"].append(t2 - t1)
        parts["update"].append(t3 - t2)
        parts["step"].append(t3 - t0)
    return parts


MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::linear", "aten::matmul", "aten::bmm", "aten::_weight_int8pack_mm",
              "pdserve::decode_linear", "pdserve::int8_linear", "pdserve::panel_linear", "pdserve::onednn_linear")


def profile_step(core: EngineCore, num_steps: int = 5) -> dict[str, float]:
    """Self CPU time per op class over ``num_steps`` decode steps (seconds per step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            core.step()
    totals = {"matmul": 0.0, "attention": 0.0, "other_ops": 0.0}
    rows = []
    for ev in prof.key_averages():
        if ev.key.startswith("ProfilerStep"):
            continue
        t = ev.self_cpu_time_total / 1e6 / num_steps
        rows.append((t, ev.key))
        if ev.key in MATMUL_OPS or "mkldnn" in ev.key.lower() and "linear" in ev.key.lower():
            totals["matmul"] += t
        elif "attention" in ev.key or "scaled_dot" in ev.key:
            totals["attention"] += t
        else:
            totals["other_ops"] += t
    rows.sort(reverse=True)
    totals["top"] = rows[:12]
    return totals


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bench preset)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--min-input", type=int, default=64)
    ap.add_argument("--max-input", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv-cache-memory", type=int, default=2 * 2**30)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--attention", default="auto", help="auto | paged | reference")
    ap.add_argument("--linear-weight-format", default="auto", help="auto | plain | onednn | panel (as the engine flag)")
    ap.add_argument("--core", type=int, default=0, help="pin to this core")
    ap.add_argument("--skip-mbu", action="store_true")
    ap.add_argument("--mbu-batches", type=int, nargs="+", default=[1, 8, 32], help="batch sizes to report MBU at")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()
    args.model = args.model or str(ensure_default_model("bench"))
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]

    result: dict = {"cpu": torch.backends.cpu.get_cpu_capability(), "dtype": args.dtype, "batch": args.batch}
    core = make_core(args, max_num_seqs=max(args.batch, 1))
    fill(core, args.batch, args.min_input, args.max_input, seed=0, vocab=vocab)
    timed_steps(core, 3)  # warm-up (and the compiled step's first calls)
    parts = timed_steps(core, args.steps)
    prof = profile_step(core)
    live = sum(r.num_tokens for r in core.scheduler.running)
    slots = sum(len(r.block_table) for r in core.scheduler.running) * core.runner.block_size
    step = med(parts["step"])
    print(f"decode step at batch {args.batch} ({args.dtype}, {result['cpu']}, one core): {step * 1e3:.1f} ms median "
          f"= {args.batch / step:.1f} tok/s")
    for k in ("schedule", "execute", "update"):
        print(f"  {k:8s} {med(parts[k]) * 1e3:7.2f} ms  {med(parts[k]) / step:6.1%}")
    prof_total = prof["matmul"] + prof["attention"] + prof["other_ops"]
    print(f"  profiler (one step, self time of ops): matmul {prof['matmul'] * 1e3:.1f} ms "
          f"({prof['matmul'] / step:.1%} of the step), attention {prof['attention'] * 1e3:.1f} ms "
          f"({prof['attention'] / step:.1%}), other ops {prof['other_ops'] * 1e3:.1f} ms "
          f"({prof['other_ops'] / step:.1%}), Python and the rest {(step - prof_total) * 1e3:.1f} ms "
          f"({(step - prof_total) / step:.1%})")
    for t, name in prof["top"]:
        print(f"      {t * 1e3:7.2f} ms  {name}")
    print(f"  KV usage: {live} live token slots of {slots} allocated = {live / slots:.1%}")
    result.update(step_ms=step * 1e3, tok_s=args.batch / step, matmul_share=prof["matmul"] / step,
                  attention_share=prof["attention"] / step,
                  python_share=(med(parts["schedule"]) + med(parts["update"])) / step,
                  kv_usage=live / slots)
    core.close()

    if not args.skip_mbu:
        read_bw, copy_bw = read_bandwidth(), copy_bandwidth()
        print(f"memory bandwidth, one thread: read {read_bw / 1e9:.2f} GB/s (sum of 1 GiB), copy {copy_bw / 1e9:.2f} "
              "GB/s (read + written); MBU below is against the read bandwidth")
        result.update(read_gb_s=read_bw / 1e9, copy_gb_s=copy_bw / 1e9, mbu={})
        for batch in args.mbu_batches:
            core = make_core(args, max_num_seqs=batch)
            fill(core, batch, args.min_input, args.max_input, seed=1, vocab=vocab)
            timed_steps(core, 3)
            step = med(timed_steps(core, args.steps)["step"])
            read = step_bytes(core)
            mbu = read / step / read_bw
            context = sum(r.num_tokens for r in core.scheduler.running) / batch
            print(f"MBU at batch {batch} (mean context {context:.0f}): {read / 2**20:.0f} MiB read per step in "
                  f"{step * 1e3:.1f} ms = {read / step / 1e9:.2f} GB/s -> MBU {mbu:.1%}")
            result["mbu"][batch] = {"step_ms": step * 1e3, "mib_read": read / 2**20, "mbu": mbu}
            core.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
