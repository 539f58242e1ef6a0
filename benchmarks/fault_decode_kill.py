"""Kill a decode worker under load and count what is lost (issue 10's scenario).

    python benchmarks/fault_decode_kill.py [--model DIR] [--num-requests 24] [--min-tokens 300] [--max-tokens 500]

Starts ``pdserve up --num-prefill 1 --num-decode 2`` (the local launcher), sends
``--num-requests`` concurrent streaming completions of ``min..max`` tokens
(``ignore_eos``), SIGKILLs ``decode-0`` once it holds requests and has streamed
tokens, and prints: requests finished / failed, tokens streamed per request vs
asked (a lost or repeated token shows as a mismatch), migrations
(``pdserve:request_migrations_total``), the longest gap in any stream, and the
KV blocks still allocated afterwards. Loopback only; every process is stopped.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import random
import signal
import time

import httpx
import openai

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.default_model.tiny_model import ensure_default_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model)")
    ap.add_argument("--num-requests", type=int, default=24)
    ap.add_argument("--min-tokens", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=500)
    args = ap.parse_args()
    model = args.model or str(ensure_default_model("tiny"))
    spec = ClusterSpec(model=model, num_prefill=1, num_decode=2, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "256MiB"])
    rng = random.Random(0)
    lengths = [rng.randint(args.min_tokens, args.max_tokens) for _ in range(args.num_requests)]
    with LocalCluster(spec) as cluster:
        url = cluster.url
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=600, max_retries=0)
        streamed = [0] * len(lengths)
        model_name = api.models.list().data[0].id

        def run(i: int):
            gaps, last, n = [], time.monotonic(), 0
            for chunk in api.completions.create(model=model_name, prompt=f"request {i} says", max_tokens=lengths[i],
                                                stream=True, extra_body={"ignore_eos": True},
                                                stream_options={"include_usage": True}):
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                if chunk.choices:
                    streamed[i] += 1
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
            return n, max(gaps)

        started = time.monotonic()
        print(f"cluster up at {url}; sending {len(lengths)} streaming requests", flush=True)
        with cf.ThreadPoolExecutor(len(lengths)) as pool:
            futures = [pool.submit(run, i) for i in range(len(lengths))]
            while True:  # kill decode-0 once it holds requests that have streamed
                pools = httpx.get(f"{url}/admin/pools", timeout=10).json()["decode"]["workers"]
                held = next((w["num_outstanding"] for w in pools if w["id"] == "decode-0"), 0)
                if held and sum(streamed) > 5 * len(lengths) or all(f.done() for f in futures):
                    break
                time.sleep(0.05)
            proc = cluster.workers["decode-0"].handle
            proc.send_signal(signal.SIGKILL)
            print(f"SIGKILL decode-0 at {time.monotonic() - started:.1f} s, holding {held} requests", flush=True)
            results, failures = [], []
            for f in futures:
                try:
                    results.append(f.result())
                except Exception as e:  # noqa: BLE001  counted and shown
                    failures.append(f"{type(e).__name__}: {e}")
        elapsed = time.monotonic() - started
        migrated = sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                       if line.startswith("pdserve:request_migrations_total{"))
        exact = sum(1 for (n, _), want in zip(results, lengths) if n == want)
        time.sleep(3)
        workers = httpx.get(f"{url}/workers").json()
        used = sum(w["num_blocks"] - w["num_free_blocks"] for w in workers)
        print(f"requests: {len(results)} finished, {len(failures)} failed; {exact}/{len(results)} with exactly "
              f"max_tokens tokens; migrations: {migrated:.0f}; longest stream gap: "
              f"{max(g for _, g in results):.2f} s; total {elapsed:.1f} s; KV blocks still allocated: {used}")
        for f in failures[:3]:
            print("  failure:", f)


if __name__ == "__main__":
    main()
