"""Overload: 10x the cluster's capacity for 60 s; admission must keep memory and latency bounded (issue 10, item 5).

    python benchmarks/overload.py [--model DIR] [--factor 10] [--burst-s 60] [--max-waiting 32]

Starts ``pdserve up`` (1 prefill + 1 decode worker) with the router's
``--max-num-waiting-requests`` and ``--request-timeout 30``; measures the
cluster's capacity (requests/s at concurrency 8, 64 new tokens each), then
offers ``--factor`` times that rate, open loop, for ``--burst-s`` seconds, and
prints: answers by status (200, 503 with ``Retry-After``, anything else must be
0), the slowest accepted request (must stay under the request timeout), router
and worker RSS before, at the peak and after, and the median latency of single
requests before the burst and in the seconds after it. Loopback only.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import statistics
import threading
import time

import httpx
import psutil

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.default_model.tiny_model import ensure_default_model


def rss(cluster) -> dict[str, float]:
    out = {}
    for name, proc in cluster.procs:
        try:
            out[name] = psutil.Process(proc.pid).memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--factor", type=float, default=10.0)
    ap.add_argument("--burst-s", type=float, default=60.0)
    ap.add_argument("--max-waiting", type=int, default=32)
    args = ap.parse_args()
    model = args.model or str(ensure_default_model("tiny"))
    spec = ClusterSpec(model=model, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "64MiB"],
                       router_args=["--max-num-waiting-requests", str(args.max_waiting), "--request-timeout", "30"])
    with LocalCluster(spec) as cluster:
        url = cluster.url
        client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=1024))
        name = client.get(f"{url}/v1/models").json()["data"][0]["id"]
        body = {"model": name, "prompt": "the quick brown fox jumps over the lazy dog " * 4, "max_tokens": 64,
                "ignore_eos": True, "temperature": 0}

        def one() -> tuple[int, float, str | None]:
            t = time.monotonic()
            try:
                r = client.post(f"{url}/v1/completions", json=body)
                return r.status_code, time.monotonic() - t, r.headers.get("retry-after")
            except httpx.HTTPError as e:
                return -1, time.monotonic() - t, type(e).__name__

        def single_latency(n: int) -> float:
            return statistics.median(one()[1] for _ in range(n))

        before_latency = single_latency(10)
        with cf.ThreadPoolExecutor(8) as pool:  # capacity at concurrency 8
            t = time.monotonic()
            list(pool.map(lambda _: one(), range(48)))
            capacity = 48 / (time.monotonic() - t)
        rate = capacity * args.factor
        rss_before = rss(cluster)
        print(f"capacity {capacity:.1f} req/s; single request p50 {before_latency * 1000:.0f} ms; offering "
              f"{rate:.0f} req/s for {args.burst_s:.0f} s", flush=True)
        results: list[tuple[int, float, str | None]] = []
        peak: dict[str, float] = dict(rss_before)
        stop = threading.Event()

        def sample_rss():
            while not stop.wait(1.0):
                for k, v in rss(cluster).items():
                    peak[k] = max(peak.get(k, 0.0), v)

        sampler = threading.Thread(target=sample_rss, daemon=True)
        sampler.start()
        slots = threading.BoundedSemaphore(256)  # the load generator's own limit (it shares the 2 cores)
        skipped = 0

        def fire():
            try:
                return one()
            finally:
                slots.release()

        with cf.ThreadPoolExecutor(256) as pool:
            futures = []
            start = time.monotonic()
            i = 0
            while (now := time.monotonic()) - start < args.burst_s:
                due = start + i / rate
                if now < due:
                    time.sleep(min(due - now, 0.01))
                    continue
                i += 1
                if not slots.acquire(blocking=False):
                    skipped += 1  # the generator could not send it: counted, not queued
                    continue
                futures.append(pool.submit(fire))
            results = [f.result() for f in futures]
        stop.set()
        burst_end = time.monotonic()
        after = []
        while time.monotonic() - burst_end < 10:
            after.append((time.monotonic() - burst_end, one()[1]))
        rss_after = rss(cluster)
        by_status = collections.Counter(s for s, _, _ in results)
        with_retry_after = sum(1 for s, _, h in results if s == 503 and h is not None)
        accepted = [lat for s, lat, _ in results if s == 200]
        client_errors = collections.Counter(h for s, _, h in results if s == -1)
        print(f"client-side errors (no HTTP answer): {dict(client_errors) or 0}")
        print(f"sent {len(results)} requests ({len(results) / args.burst_s:.0f} req/s; {skipped} more the load "
              f"generator could not send): {dict(by_status)}; 503s with Retry-After: {with_retry_after}")
        print(f"accepted: {len(accepted)}, latency p50 {statistics.median(accepted):.2f} s, "
              f"max {max(accepted):.2f} s (request timeout 30 s)" if accepted else "accepted: 0")
        first_normal = next((t for t, lat in after if lat < 2 * before_latency), None)
        print(f"single request p50 before {before_latency * 1000:.0f} ms; after the burst: "
              + (f"back under 2x within {first_normal:.1f} s" if first_normal is not None else "not back in 10 s")
              + f" (p50 over the 10 s after: {statistics.median(l for _, l in after) * 1000:.0f} ms)")
        for k in sorted(rss_before):
            print(f"  {k}: RSS {rss_before[k]:.0f} MiB before, {peak.get(k, 0):.0f} peak, "
                  f"{rss_after.get(k, 0):.0f} after")


if __name__ == "__main__":
    main()
