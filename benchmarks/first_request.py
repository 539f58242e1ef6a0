"""The first requests after a cluster comes up: how long a client waits right after start-up.

    python benchmarks/first_request.py [--model DIR] [--wait-s 2] [--requests 3] [--max-tokens 64]

Starts a local cluster in ``pdserve up``'s layout (1 prefill + 1 decode worker; the built-in
default model unless ``--model``), waits until it is healthy plus ``--wait-s``, then sends
``--requests`` completions one after another and prints each one's latency. Before warm pairs
and the compiled step's warm-up fix the first took seconds (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import tempfile
import time

import httpx

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--wait-s", type=float, default=2.0)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.model is None:
        from pdserve.default_model.train import shipped_model_dir

        args.model = str(shipped_model_dir())
    spec = ClusterSpec(model=args.model, num_prefill=1, num_decode=1, port=free_port())
    started = time.perf_counter()
    with LocalCluster(spec, log_dir=tempfile.mkdtemp(prefix="pdserve-first-")) as cluster:
        print(f"cluster healthy after {time.perf_counter() - started:.1f} s; waiting {args.wait_s:g} s")
        time.sleep(args.wait_s)
        model = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"][0]["id"]
        for i in range(args.requests):
            prompt = "def parse(path):\n    with open(path) as f:" + " x" * i  # fresh: no prefix-cache hit
            t = time.perf_counter()
            resp = httpx.post(f"{cluster.url}/v1/completions", timeout=300,
                              json={"model": model, "prompt": prompt, "max_tokens": args.max_tokens,
                                    "ignore_eos": True})
            print(f"request {i + 1}: HTTP {resp.status_code}, {time.perf_counter() - t:.2f} s")


if __name__ == "__main__":
    main()
