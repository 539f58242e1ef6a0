"""``pdserve bench compare``: one workload against each serving system in turn, on one machine and checkpoint.

Every system gets the same requests (same seed), arrival schedule and warm-up; one system's
server is stopped before the next starts. ``--out-dir`` receives ``results.json``,
``results.md`` (a table, the settings, and each system's caveats), ``throughput.png``,
``latency.png``, each system's full result under ``raw/`` and the servers' logs under ``logs/``.
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from dataclasses import dataclass, field

from pdserve.bench.datasets import BenchRequest, DatasetConfig, build_requests, vocab_size_of
from pdserve.bench.hf_static import run_hf_generate
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
        kv_cache_memory: pdserve's KV budget per worker; ``pdserve_args``: more worker flags.
        vllm_python: the interpreter with vLLM (default /work/vllm-venv/bin/python);
            ``vllm_kv_gib``: ``VLLM_CPU_KVCACHE_SPACE``; ``vllm_args`` / ``vllm_env``: more.
        transformers_args: more ``transformers serve`` flags.
        hf_batch_size: hf-generate's static batch size.
        server_timeout_s: how long a server may take to answer /health.
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
    kv_cache_memory: str = "1GiB"
    pdserve_args: list[str] = field(default_factory=list)
    vllm_python: str | None = DEFAULT_VLLM_PYTHON
    vllm_kv_gib: int = 1
    vllm_args: list[str] = field(default_factory=list)
    vllm_env: dict[str, str] = field(default_factory=dict)
    transformers_args: list[str] = field(default_factory=list)
    hf_batch_size: int = 8
    server_timeout_s: float = 600.0

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
        if self.dataset.vocab_size is None:
            self.dataset = dataclasses.replace(self.dataset, vocab_size=vocab_size_of(self.model))


def run_system(cfg: CompareConfig, name: str, requests: list[BenchRequest]) -> SystemResult:
    """Run one system; never raises (but KeyboardInterrupt): a system that could not run is a row saying why."""
    from pdserve.bench.serve import ServeConfig, run_benchmark_sync, write_result

    def bench(url: str, model: str | None, backend: str):
        serve_cfg = ServeConfig(url=url, model=model, backend=backend, dataset=cfg.dataset, tokenizer=cfg.model,
                                request_rate=cfg.request_rate, burstiness=cfg.burstiness,
                                max_concurrency=cfg.max_concurrency, seed=cfg.seed, goodput_slos=cfg.goodput_slos,
                                percentiles=cfg.percentiles, num_warmups=cfg.num_warmups,
                                disable_tqdm=cfg.disable_tqdm)
        result = run_benchmark_sync(serve_cfg, requests)
        write_result(result, os.path.join(cfg.out_dir, "raw", f"{name}.json"), detailed=True)
        return result

    try:
        if name in ("pdserve-disagg", "pdserve-colocated"):
            return run_pdserve(cfg, requests, bench, colocated=name == "pdserve-colocated")
        if name == "vllm-cpu":
            return run_vllm(cfg, requests, bench)
        if name == "transformers-serve":
            return run_transformers_serve(cfg, requests, bench)
        return run_hf_generate(cfg, requests)
    except Exception as e:  # noqa: BLE001  one system's failure is its row, the others still run
        return SystemResult(name, describe_failure(e))


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
