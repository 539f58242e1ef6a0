"""``pdserve bench compare``: one workload against each serving system in turn, on one machine and checkpoint.

Every system gets the same requests (same seed), arrival schedule and warm-up; one system's
server is stopped before the next starts. ``--out-dir`` receives ``results.json``,
``results.md`` (a table, the settings, and each system's caveats), ``throughput.png``,
``latency.png``, each system's full result under ``raw/`` and the servers' logs under ``logs/``.

With ``request_rates`` it sweeps instead (``pdserve.bench.sweep``): each system serves Poisson
arrivals at each rate in turn (fresh prompts per rate, a warm-up run of 8 requests first), and the report gives
SLO attainment per rate and SLO set, each system's goodput, and DistServe's attainment figure
(``goodput.png``).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field

from pdserve.bench.datasets import BenchRequest, DatasetConfig, build_requests, vocab_size_of
from pdserve.bench.hf_static import run_hf_generate
from pdserve.bench.sweep import parse_warmup
from pdserve.bench.systems import (DEFAULT_VLLM_PYTHON, SYSTEMS, SystemResult, default_core_split, describe_failure,
                                   run_pdserve, run_transformers_serve, run_vllm)

REPORT_PERCENTILES = (50.0, 90.0, 99.0)  # the table and plots need these, whatever else is asked


@dataclass
class CompareConfig:
    """A comparison run.

    Args:
        model: checkpoint directory every system loads.
        out_dir: where the report goes (created).
        systems: which of ``SYSTEMS`` to run, in this order.
        dataset: the workload (its vocabulary comes from the model's config.json when unset).
        request_rate, burstiness, max_concurrency, seed, goodput_slos, percentiles, num_warmups,
            disable_tqdm: as ``ServeConfig``.
        num_prefill, num_decode: pdserve-disagg's pools; ``prefill_cores`` / ``decode_cores`` their
            cores (default: the first half of the cores / the rest).
        colocated_num_decode, colocated_cores: pdserve-colocated's workers and cores (default: as
            many cores as the decode pool, from the first).
        kv_cache_memory: pdserve's KV budget per worker (None: ``pdserve up``'s own, ``auto``);
            ``pdserve_args``: more worker flags;
            ``pdserve_router_args``: more router flags; ``core_lending``: pdserve-disagg's decode workers
            borrow idle prefill workers' cores (``pdserve up --core-lending``).
        vllm_python: the interpreter with vLLM (default /work/vllm-venv/bin/python);
            ``vllm_kv_gib``: ``VLLM_CPU_KVCACHE_SPACE`` (None: ``systems.default_vllm_kv_gib``, what a
            lone pdserve worker's auto budget takes); ``vllm_args`` / ``vllm_env``: more.
        transformers_args: more ``transformers serve`` flags.
        hf_batch_size: hf-generate's static batch size.
        server_timeout_s: how long a server may take to answer /health.
        dtype: the model dtype every system runs in (``float32``; ``bfloat16`` where the CPU has native
            bf16).
        request_rates: sweep these Poisson rates (req/s) per system instead of one run (empty: no sweep);
            sweep_duration_s: seconds of arrivals per rate; sweep_warmup: each system's discarded warm-up
            (``sweep.parse_warmup``: "full", a whole pass at the lowest rate, or a request count);
            slo_sets: the SLO sets (ms per metric) whose attainment and goodput the sweep reports
            (default: ``goodput_slos``).
    """

    model: str
    out_dir: str
    systems: list[str] = field(default_factory=lambda: list(SYSTEMS))
    dataset: DatasetConfig = field(default_factory=DatasetConfig)
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    seed: int = 0
    goodput_slos: dict[str, float] = field(default_factory=dict)
    percentiles: list[float] = field(default_factory=lambda: list(REPORT_PERCENTILES))
    num_warmups: int = 2
    disable_tqdm: bool = False
    num_prefill: int = 1
    num_decode: int = 1
    prefill_cores: list[int] | None = None
    decode_cores: list[int] | None = None
    colocated_num_decode: int = 1
    colocated_cores: list[int] | None = None
    kv_cache_memory: str | None = None
    pdserve_args: list[str] = field(default_factory=list)
    pdserve_router_args: list[str] = field(default_factory=list)
    core_lending: bool = False  # pdserve-disagg as pdserve up --core-lending
    vllm_python: str | None = DEFAULT_VLLM_PYTHON
    vllm_kv_gib: int | None = None
    vllm_args: list[str] = field(default_factory=list)
    vllm_env: dict[str, str] = field(default_factory=dict)
    transformers_args: list[str] = field(default_factory=list)
    hf_batch_size: int = 8
    server_timeout_s: float = 600.0
    dtype: str = "float32"
    request_rates: list[float] = field(default_factory=list)
    sweep_duration_s: float = 45.0
    sweep_warmup: str = "full"
    slo_sets: list[dict[str, float]] = field(default_factory=list)

    @property
    def sweeping(self) -> bool:
        return bool(self.request_rates)

    def __post_init__(self):
        unknown = [s for s in self.systems if s not in SYSTEMS]
        if unknown or not self.systems:
            raise ValueError(f"unknown systems {unknown}; choose from {', '.join(SYSTEMS)}")
        if self.num_prefill < 1 or self.num_decode < 1 or self.colocated_num_decode < 1:
            raise ValueError("pdserve pools need at least one worker each")
        if self.hf_batch_size < 1:
            raise ValueError("hf_batch_size must be >= 1")
        prefill, decode = default_core_split()
        self.prefill_cores = self.prefill_cores or prefill
        self.decode_cores = self.decode_cores or decode
        self.colocated_cores = self.colocated_cores or prefill[:len(decode)] or decode
        self.percentiles = sorted(set(self.percentiles) | set(REPORT_PERCENTILES))
        if any(not (r > 0 and math.isfinite(r)) for r in self.request_rates):
            raise ValueError(f"request rates must be finite and > 0, got {self.request_rates}")
        if self.sweeping:
            if not self.slo_sets and self.goodput_slos:
                self.slo_sets = [dict(self.goodput_slos)]
            if not self.slo_sets:
                raise ValueError("a sweep (--request-rates) needs SLOs: --slo-set or --goodput")
            if not self.sweep_duration_s > 0:
                raise ValueError("sweep_duration_s must be > 0")
            self.sweep_warmup = parse_warmup(self.sweep_warmup)
            if not self.goodput_slos:
                self.goodput_slos = dict(self.slo_sets[0])
        if self.dataset.vocab_size is None:
            self.dataset = dataclasses.replace(self.dataset, vocab_size=vocab_size_of(self.model))


def run_system(cfg: CompareConfig, name: str, requests: list[BenchRequest]) -> SystemResult:
    """Run one system (one run, or with ``cfg.request_rates`` a sweep); never raises (but
    KeyboardInterrupt): a system that could not run is a row saying why."""
    from pdserve.bench.serve import ServeConfig, run_benchmark_sync, write_result
    from pdserve.bench.sweep import points_to_json, run_sweep

    sweep_points = []

    def serve_config(url, model, backend, rate, seed, num_warmups) -> ServeConfig:
        return ServeConfig(url=url, model=model, backend=backend, dataset=cfg.dataset, tokenizer=cfg.model,
                           request_rate=rate, burstiness=cfg.burstiness, max_concurrency=cfg.max_concurrency,
                           seed=seed, goodput_slos=cfg.goodput_slos, percentiles=cfg.percentiles,
                           num_warmups=num_warmups, disable_tqdm=cfg.disable_tqdm)

    def bench(url: str, model: str | None, backend: str):
        if not cfg.sweeping:
            result = run_benchmark_sync(serve_config(url, model, backend, cfg.request_rate, cfg.seed,
                                                     cfg.num_warmups), requests)
            write_result(result, os.path.join(cfg.out_dir, "raw", f"{name}.json"), detailed=True)
            return result
        last = []

        def run_at(rate: float, num_prompts: int, seed: int):
            dataset = dataclasses.replace(cfg.dataset, num_prompts=num_prompts, seed=seed)
            result = run_benchmark_sync(serve_config(url, model, backend, rate, seed, 0), build_requests(dataset))
            write_result(result, os.path.join(cfg.out_dir, "raw", f"{name}-rate{rate:g}-seed{seed}.json"),
                         detailed=True)
            last[:] = [result]
            return result

        sweep_points.extend(run_sweep(run_at, cfg.request_rates, cfg.slo_sets, cfg.sweep_duration_s, cfg.seed,
                                      warmup=cfg.sweep_warmup,
                                      log=lambda line: print(line, file=sys.stderr, flush=True)))
        return last[0]

    try:
        if name == "hf-generate" and cfg.sweeping:
            return SystemResult(name, "not swept: static batches have no request rate")
        if name in ("pdserve-disagg", "pdserve-colocated"):
            row = run_pdserve(cfg, requests, bench, colocated=name == "pdserve-colocated")
        elif name == "vllm-cpu":
            row = run_vllm(cfg, requests, bench)
        elif name == "transformers-serve":
            row = run_transformers_serve(cfg, requests, bench)
        else:
            row = run_hf_generate(cfg, requests)
    except Exception as e:  # noqa: BLE001  one system's failure is its row, the others still run
        row = SystemResult(name, describe_failure(e))
    row.sweep = points_to_json(sweep_points)
    return row


def run_compare(cfg: CompareConfig) -> list[SystemResult]:
    """Run every system of ``cfg`` in turn and write the report to ``cfg.out_dir``. Returns the rows."""
    from pdserve.bench.report import write_report

    os.makedirs(os.path.join(cfg.out_dir, "raw"), exist_ok=True)
    requests = build_requests(cfg.dataset)
    rows = []
    for name in cfg.systems:
        print(f"pdserve bench compare: {name} ...", file=sys.stderr, flush=True)
        row = run_system(cfg, name, requests)
        tps = row.metrics["output_throughput"] if row.ok else None
        print(f"pdserve bench compare: {name}: {row.status}" + (f", {tps:.1f} output tok/s" if tps else ""),
              file=sys.stderr, flush=True)
        rows.append(row)
    write_report(cfg, rows, requests)
    return rows
