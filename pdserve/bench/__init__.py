"""Serving benchmarks: ``pdserve bench serve`` (load against any OpenAI-compatible server) and
``pdserve bench compare`` (one workload against pdserve, vLLM, transformers and HF ``generate``)."""

from pdserve.bench.datasets import BenchRequest, DatasetConfig, build_requests
from pdserve.bench.metrics import RequestOutput, compute_metrics, percentile
from pdserve.bench.serve import BenchResult, ServeConfig, arrival_offsets, run_benchmark, run_benchmark_sync

__all__ = ["BenchRequest", "BenchResult", "DatasetConfig", "RequestOutput", "ServeConfig", "arrival_offsets",
           "build_requests", "compute_metrics", "percentile", "run_benchmark", "run_benchmark_sync"]
