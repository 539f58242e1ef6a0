"""hf-generate: Hugging Face ``generate`` on static batches, the baseline continuous batching is measured against."""

from __future__ import annotations

import time

from pdserve.bench.systems import SystemResult, available_cores


def hf_static_generate(model_dir: str, requests, batch_size: int,
                       num_threads: int | None = None) -> tuple[float, int]:
    """Run HF ``generate`` (greedy, float32) over ``requests`` in static batches of ``batch_size``: each
    batch left-padded and run until its longest output is done (EOS suppressed). Returns the seconds
    it took (model loading excluded) and the prompt tokens. Text prompts are tokenized without special
    tokens; ``num_threads`` defaults to every core this process may use."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    prompts = [r.prompt for r in requests]
    if any(isinstance(p, str) for p in prompts):
        tok = AutoTokenizer.from_pretrained(model_dir)
        prompts = [tok(p, add_special_tokens=False)["input_ids"] if isinstance(p, str) else p for p in prompts]
    old_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads or len(available_cores()))
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, **_dtype_kwarg(torch.float32)).eval()
        pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
        start = time.perf_counter()
        for i in range(0, len(requests), batch_size):
            batch = list(zip(prompts[i:i + batch_size], requests[i:i + batch_size]))
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch])  # (B, T) left-padded
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            max_new = max(r.output_len for _, r in batch)
            with torch.no_grad():
                model.generate(ids, attention_mask=mask, max_new_tokens=max_new, min_new_tokens=max_new,
                               do_sample=False, pad_token_id=pad)
        return time.perf_counter() - start, sum(len(p) for p in prompts)
    finally:
        torch.set_num_threads(old_threads)


def run_hf_generate(cfg, requests) -> SystemResult:
    """hf-generate's row: ``hf_static_generate`` on all cores; throughputs count the asked output tokens
    (and the prompts' tokens), latencies n/a."""
    from pdserve.bench.metrics import compute_metrics

    duration, num_in = hf_static_generate(cfg.model, requests, cfg.hf_batch_size)
    metrics = compute_metrics([], duration, cfg.percentiles)
    num_out = sum(r.output_len for r in requests)
    metrics.update(completed=len(requests), total_input_tokens=num_in, total_output_tokens=num_out,
                   request_throughput=len(requests) / duration, output_throughput=num_out / duration,
                   total_token_throughput=(num_in + num_out) / duration)
    notes = ["in-process `generate`, static batches: only the asked output tokens count as useful; "
             "latencies n/a"]
    return SystemResult("hf-generate", "ok", f"static batches of {cfg.hf_batch_size}, float32, "
                        f"{len(available_cores())} threads", metrics, notes)


def _dtype_kwarg(dtype) -> dict:
    """``dtype=`` for transformers >= 4.56, ``torch_dtype=`` before (the old name warns in 5.x)."""
    import transformers
    from packaging.version import Version

    return {"dtype" if Version(transformers.__version__) >= Version("4.56") else "torch_dtype": dtype}
