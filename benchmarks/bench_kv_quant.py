"""Quantized KV cache: what ``--kv-cache-dtype`` costs in accuracy and saves in bytes and time.

For each KV cache dtype (float32 = ``auto`` for the float32 default model, bfloat16, int8,
fp8_e4m3, fp8_e5m2) this prints:

* **greedy agreement** with the float32 cache on the shipped default model
  (``pdserve/default_model/weights/stdlib-llama-v1``): ``--num-prompts`` (200) prompts cut from the
  standard-library files the model was *not* trained on (64-192 tokens each), ``--max-tokens``
  (32) greedy tokens each (eager decode steps, so every dtype runs the same code); the share of
  prompts whose output is identical, and the share of output tokens identical up to each
  prompt's first divergence;
* **logit error**: every prompt extended by the float32 cache's greedy output and scored
  teacher-forced (so every dtype sees the same tokens), the max and mean |logit - float32
  logit| over all those positions, and the share of positions with the same argmax. Scored
  with ``batch_invariant=True``, so every query row reads its K/V from the cache, a
  plain bf16 cache's included (the default path attends a fresh prompt over its
  unrounded K/V, which would hide bf16's rounding);
* **bytes per prompt token** the KV transfer moves: from the cache's real bytes per token
  (K and V, every layer and KV head, a quantized row's float32 scale included), for the
  default model and the bench preset, and measured through a real transfer between an
  in-process prefill and decode worker (KV over a gloo pair) on the default model;
* **decode attention time** of the native kernel alone, one thread, one layer at bench-preset
  shapes, 256 and 1024 tokens of context;
* **decode tok/s** on the bench preset (12 layers, 4 KV heads of 64): ``--batch`` (32)
  sequences of 256-512 prompt tokens, eager decode steps (``--compile`` for the compiled
  step), median over ``--steps`` steps.

    python benchmarks/bench_kv_quant.py                 # everything (about 10 minutes on 2 busy cores)
    python benchmarks/bench_kv_quant.py --skip-speed    # accuracy and bytes only
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

import torch

from pdserve import LLM, SamplingParams
from pdserve.bench.agreement import greedy_outputs, teacher_forced_logits
from pdserve.engine.execution.kv_cache import kv_cache_block_bytes

DTYPES = ["float32", "bfloat16", "int8", "fp8_e4m3", "fp8_e5m2"]


def heldout_prompts(tokenizer, num_prompts: int, seed: int = 0) -> list[list[int]]:
    """Token windows of 64-192 tokens from the standard-library files held out of training."""
    from pdserve.default_model.train import read_texts, stdlib_files

    _, heldout = stdlib_files()
    docs = [tokenizer.encode(t) for t in read_texts(heldout)]
    docs = [d for d in docs if len(d) > 400]
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        doc = rng.choice(docs)
        n = rng.randint(64, 192)
        start = rng.randrange(0, len(doc) - n)
        prompts.append(doc[start:start + n])
    return prompts


def accuracy(model: str, num_prompts: int, max_tokens: int, dtypes: list[str]) -> dict[str, dict]:
    results: dict[str, dict] = {}
    base_llm = LLM(model, kv_cache_dtype="float32", kv_cache_memory="256MiB", enforce_eager=True)
    prompts = heldout_prompts(base_llm.tokenizer, num_prompts)
    base = greedy_outputs(base_llm, prompts, max_tokens)
    base_llm.close()
    sequences = [p + o for p, o in zip(prompts, base)]
    ref_llm = LLM(model, kv_cache_dtype="float32", kv_cache_memory="256MiB", batch_invariant=True,
                  enable_prefix_caching=False)
    ref = teacher_forced_logits(ref_llm, sequences)
    ref_llm.close()
    for name in dtypes:
        t0 = time.perf_counter()
        llm = LLM(model, kv_cache_dtype=name, kv_cache_memory="256MiB", enforce_eager=True)
        outs = greedy_outputs(llm, prompts, max_tokens)
        llm.close()
        agreed = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(base, outs)]
        scorer = LLM(model, kv_cache_dtype=name, kv_cache_memory="256MiB", batch_invariant=True,
                     enable_prefix_caching=False)
        logits = teacher_forced_logits(scorer, sequences)
        scorer.close()
        err = torch.cat([(a - b).abs().flatten() for a, b in zip(logits, ref)])
        same_top1 = torch.cat([a.argmax(-1) == b.argmax(-1) for a, b in zip(logits, ref)]).float().mean()
        results[name] = {
            "prompts_identical_pct": 100.0 * sum(a == b for a, b in zip(base, outs)) / len(base),
            "tokens_identical_to_divergence_pct": 100.0 * sum(agreed) / sum(map(len, base)),
            "max_logit_error": err.max().item(),
            "mean_logit_error": err.mean().item(),
            "teacher_forced_top1_pct": 100.0 * same_top1.item(),
        }
        print(f"  {name:9s} {json.dumps({k: round(v, 4) for k, v in results[name].items()})} "
              f"({time.perf_counter() - t0:.0f} s)", flush=True)
    spread = torch.cat([r.amax(-1) - r.amin(-1) for r in ref]).mean().item()
    results["_float32_logit_spread"] = {"mean_max_minus_min": spread}
    return results


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, name: str) -> float:
    """KV bytes one token takes (and the transfer moves), scales included."""
    return kv_cache_block_bytes(num_layers, 16, num_kv_heads, head_dim, name) / 16


def measured_transfer(model: str, name: str, prompt: list[int]) -> tuple[int, int]:
    """(bytes received, prompt tokens) for one request through an in-process prefill and decode
    worker: KV over a real gloo pair, as a cluster moves it."""
    import zmq

    from pdserve.common.config import WorkerConfig
    from pdserve.common.protocol import GenerateRequest, RequestOutputs
    from pdserve.common.transport import bind_pull, decode, encode
    from pdserve.decode_worker.worker import DecodeWorker
    from pdserve.engine.config import EngineConfig
    from pdserve.prefill_worker.worker import PrefillWorker

    ctx = zmq.Context()
    router, router_addr = bind_pull(ctx, "127.0.0.1")
    engine = EngineConfig(model=model, kv_cache_memory=64 * 2**20, remote_prefill_threshold=0, kv_cache_dtype=name,
                          enforce_eager=True)
    workers = [cls(engine, WorkerConfig(role=cls.role.name.lower(), router_addr=router_addr, transfer_timeout_s=60))
               for cls in (DecodeWorker, PrefillWorker)]
    dw, pw = workers
    loops = [threading.Thread(target=w.run, daemon=True) for w in workers]
    for loop in loops:
        loop.start()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(dw.mailbox.address)
    try:
        push.send_multipart(encode(GenerateRequest(
            request_id="r", prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=2, temperature=0.0),
            prefill_worker_id=pw.worker_id, prefill_addr=pw.mailbox.address, prefill_layout=pw.runner.kv_layout())))
        deadline = time.monotonic() + 120
        done = False
        while not done and time.monotonic() < deadline:
            if router.poll(100):
                msg = decode(router.recv_multipart())
                if isinstance(msg, RequestOutputs):
                    done = any(d.request_id == "r" and d.finish_reason is not None for d in msg.deltas)
        if not done:
            raise RuntimeError("the request did not finish")
        if dw.stats.num_kv_transfers != 1:
            raise RuntimeError("the KV was not transferred")
        return dw.stats.kv_transfer_bytes, len(prompt)
    finally:
        for w in workers:
            w.stop()
        for loop in loops:
            loop.join(timeout=10)
        ctx.destroy(linger=0)


def decode_speeds(model: str, names: list[str], batch: int, steps: int, compile_step: bool) -> dict[str, float]:
    """Decode tokens/s per KV dtype: ``batch`` sequences (the same prompts of 256-512 tokens) in one
    engine per dtype, all built and prefilled first; then their decode steps are timed in turn (one
    step of each engine per round), so a busy machine's drift hits every dtype alike. Median step."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.core import EngineCore

    cores = {}
    try:
        for name in names:
            config = EngineConfig(model=model, kv_cache_memory=512 * 2**20, kv_cache_dtype=name, max_num_seqs=batch,
                                  max_num_batched_tokens=4096, enable_prefix_caching=False,
                                  enforce_eager=not compile_step)
            core = cores[name] = EngineCore(config)
            rng = random.Random(0)
            params = SamplingParams(max_tokens=1024, temperature=0.0, ignore_eos=True)
            vocab = core.runner.vocab_size
            for i in range(batch):
                core.add_request(f"r{i}", [rng.randrange(10, vocab) for _ in range(rng.randint(256, 512))], params)
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) \
                    or core.scheduler.waiting:
                core.step()
            for _ in range(2):  # warm-up
                core.step()
        times: dict[str, list[float]] = {name: [] for name in names}
        for _ in range(steps):
            for name, core in cores.items():
                t0 = time.perf_counter()
                core.step()
                times[name].append(time.perf_counter() - t0)
        return {name: batch / statistics.median(t) for name, t in times.items()}
    finally:
        for core in cores.values():
            core.close()


def attention_speeds(names: list[str], batch: int, context: int, repeats: int = 20) -> dict[str, float]:
    """Microseconds of one decode attention call of the native kernel per KV dtype, on one thread
    (bench preset shapes: 12 query heads, 4 KV heads of 64; ``batch`` sequences of ``context`` tokens
    in shuffled blocks of 16; the new tokens' K/V written, quantized, first). The dtypes take turns
    call by call, so a busy machine's drift hits all alike; median."""
    from pdserve.engine.layers.attention import AttentionMetadata, paged_attention
    from pdserve.engine.execution.kv_cache import allocate_kv_cache
    from pdserve.common.kv_quant import kv_cache_format, quantize_rows

    num_heads, num_kv_heads, head_dim, block_size = 12, 4, 64, 16
    blocks_per_seq = -(-context // block_size)
    num_blocks = batch * blocks_per_seq + 1
    order = list(range(1, num_blocks))
    random.Random(0).shuffle(order)
    tables = [order[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    values = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim)
    q = torch.randn(batch, num_heads, head_dim)
    k, v = torch.randn(2, batch, num_kv_heads, head_dim)
    runs = {}
    for name in names:
        fmt = kv_cache_format(name)
        cache = allocate_kv_cache(1, num_blocks, block_size, num_kv_heads, head_dim, name, "cpu")[0]
        cache.copy_(quantize_rows(values, fmt) if fmt.quantized else values.to(fmt.storage_dtype))
        md = AttentionMetadata.build(tables, [context - 1] * batch, [1] * batch, block_size, backend="paged",
                                     kv_cache_dtype=name)
        runs[name] = (cache, md)
    times: dict[str, list[float]] = {name: [] for name in names}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for i in range(repeats + 3):
                for name, (cache, md) in runs.items():
                    t0 = time.perf_counter()
                    paged_attention(q, k, v, cache, md, head_dim ** -0.5)
                    if i >= 3:
                        times[name].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return {name: 1e6 * statistics.median(t) for name, t in times.items()}


def main(argv: list[str] | None = None) -> None:
    from pdserve.default_model.tiny_model import ensure_default_model
    from pdserve.default_model.train import shipped_model_dir

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="accuracy model (default: the shipped stdlib-llama-v1)")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtypes", nargs="+", default=DTYPES)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--compile", action="store_true", help="time the compiled decode step (default: eager)")
    ap.add_argument("--skip-accuracy", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--skip-decode", action="store_true", help="no decode tok/s (the kernel timing still runs)")
    ap.add_argument("--skip-bytes", action="store_true")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    model = args.model or str(shipped_model_dir())
    figures: dict = {"model": model}
    torch.manual_seed(0)

    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(model)
    shape = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    bench = str(ensure_default_model("bench"))
    bcfg = AutoConfig.from_pretrained(bench)
    bshape = (bcfg.num_hidden_layers, bcfg.num_key_value_heads, bcfg.hidden_size // bcfg.num_attention_heads)
    from transformers import AutoTokenizer
    prompt = heldout_prompts(AutoTokenizer.from_pretrained(model), 1, seed=7)[0] * 2  # 2 windows
    figures["bytes_per_token"] = {}
    if not args.skip_bytes:
        print(f"bytes per prompt token moved by the KV transfer (default model {shape}, bench preset {bshape}):")
    for name in [] if args.skip_bytes else args.dtypes:
        moved, num_tokens = measured_transfer(model, name, prompt)
        row = {"default_model": bytes_per_token(*shape, name), "bench_preset": bytes_per_token(*bshape, name),
               "measured_default_model": moved / num_tokens}
        figures["bytes_per_token"][name] = row
        f32 = bytes_per_token(*shape, "float32"), bytes_per_token(*bshape, "float32")
        print(f"  {name:9s} default {row['default_model']:7.0f} B ({f32[0] / row['default_model']:.2f}x less than "
              f"float32), measured {row['measured_default_model']:7.1f} B over {num_tokens} tokens (block padding "
              f"included); bench preset {row['bench_preset']:7.0f} B ({f32[1] / row['bench_preset']:.2f}x)",
              flush=True)

    if not args.skip_accuracy:
        print(f"accuracy against the float32 cache: {args.num_prompts} prompts, {args.max_tokens} greedy tokens")
        figures["accuracy"] = accuracy(model, args.num_prompts, args.max_tokens, args.dtypes)
    if not args.skip_speed:
        figures["attention_us"] = {}
        for context in (256, 1024):
            print(f"decode attention alone (native kernel, one thread, one layer, batch {args.batch}, {context} "
                  f"tokens of context, bench preset heads), median, dtypes in turn:")
            figures["attention_us"][context] = attention_speeds(args.dtypes, args.batch, context)
            for name, us in figures["attention_us"][context].items():
                print(f"  {name:9s} {us:8.0f} us", flush=True)
    if not args.skip_speed and not args.skip_decode:
        print(f"decode tok/s on the bench preset, batch {args.batch}, prompts 256-512 tokens "
              f"({'compiled' if args.compile else 'eager'}), median of {args.steps} steps, dtypes in turn:")
        figures["decode_tok_s"] = decode_speeds(bench, args.dtypes, args.batch, args.steps, args.compile)
        for name, tok_s in figures["decode_tok_s"].items():
            print(f"  {name:9s} {tok_s:6.1f} tok/s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
