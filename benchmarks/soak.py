"""Soak: thousands of mixed requests with a worker killed in the middle; nothing may leak (issue 10, item 9).

    python benchmarks/soak.py [--model DIR] [--num-requests 2000] [--concurrency 16]

Starts ``pdserve up`` (1 prefill + 2 decode workers, the local launcher, which
restarts a killed worker) and sends ``--num-requests`` requests through the
``openai`` client: completions and chat, streaming or not, ``n`` from 1 to 4,
prompts of 4..200 tokens, 4..96 new tokens, greedy or seeded sampling; 10% of
the streams are closed by the client mid-way. Half-way through, ``decode-0`` is
SIGKILLed (the router migrates its requests, the launcher restarts it). Prints:
requests by outcome (errors other than the client's own closes must be 0), KV
blocks still allocated on every worker afterwards (must be 0), and each
worker's RSS at the middle and the end of the second half (flat within 5%).
Loopback only; every process is stopped at the end.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures as cf
import random
import signal
import threading
import time

import httpx
import openai
import psutil

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.default_model.tiny_model import ensure_default_model

WORDS = ("the quick brown fox jumps over lazy dogs while seven wizards quietly pack boxes of liquor near a "
         "river bank in autumn light").split()


def rss_mib(cluster) -> dict[str, float]:
    """Resident memory of every worker process and its rank children, MiB."""
    out = {}
    for name, w in cluster.workers.items():
        try:
            proc = psutil.Process(w.handle.pid)
            out[name] = sum(p.memory_info().rss for p in [proc, *proc.children(recursive=True)]) / 2**20
        except psutil.NoSuchProcess:
            pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint (default: the built-in tiny model)")
    ap.add_argument("--num-requests", type=int, default=2000)
    ap.add_argument("--concurrency", type=int, default=16)
    args = ap.parse_args()
    model = args.model or str(ensure_default_model("tiny"))
    spec = ClusterSpec(model=model, num_prefill=1, num_decode=2, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "64MiB", "--max-num-seqs", "64"])
    outcomes: collections.Counter = collections.Counter()
    errors: list[str] = []
    done = 0
    lock = threading.Lock()
    with LocalCluster(spec) as cluster:
        url = cluster.url
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=300, max_retries=0)
        model_name = api.models.list().data[0].id

        def one(i: int) -> str:
            rng = random.Random(i)
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 150)))
            common = dict(model=model_name, max_tokens=rng.randint(4, 96), n=rng.choice([1, 1, 1, 2, 4]),
                          temperature=rng.choice([0.0, 1.0]), seed=i)
            stream = rng.random() < 0.6
            close_early = stream and rng.random() < 1 / 6  # 10% of all requests
            chat = rng.random() < 0.5
            if chat:
                resp = api.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=stream,
                                                   **common)
            else:
                resp = api.completions.create(prompt=prompt, stream=stream, **common)
            if not stream:
                return "ok"
            for k, _ in enumerate(resp):
                if close_early and k >= 2:
                    resp.close()
                    return "closed by client"
            return "ok"

        def run(i: int) -> None:
            nonlocal done
            try:
                outcome = one(i)
            except Exception as e:  # noqa: BLE001  every error is counted and shown
                outcome = "error"
                with lock:
                    errors.append(f"{type(e).__name__}: {e}")
            with lock:
                outcomes[outcome] += 1
                done += 1

        started = time.monotonic()
        rss: dict[str, dict[str, float]] = {}
        with cf.ThreadPoolExecutor(args.concurrency) as pool:
            futures = [pool.submit(run, i) for i in range(args.num_requests)]
            killed = False
            while not all(f.done() for f in futures):
                if not killed and done >= args.num_requests // 2:
                    proc = cluster.workers["decode-0"].handle
                    proc.send_signal(signal.SIGKILL)
                    killed = True
                    print(f"{time.monotonic() - started:6.1f} s: SIGKILL decode-0 after {done} requests", flush=True)
                if "mid" not in rss and done >= args.num_requests * 2 // 3:
                    rss["mid"] = rss_mib(cluster)
                time.sleep(0.2)
        rss["end"] = rss_mib(cluster)
        elapsed = time.monotonic() - started
        time.sleep(3)  # the heartbeats after the last request
        workers = httpx.get(f"{url}/workers", timeout=10).json()
        allocated = {w["id"]: w["num_blocks"] - w["num_free_blocks"] for w in workers}
        migrations = sum(float(line.rsplit(" ", 1)[1]) for line in httpx.get(f"{url}/metrics").text.splitlines()
                         if line.startswith("pdserve:request_migrations_total{"))
        print(f"{args.num_requests} requests in {elapsed:.0f} s: {dict(outcomes)}; migrations {migrations:.0f}")
        print(f"KV blocks still allocated: {allocated}")
        for name in sorted(rss["end"]):
            mid, end = rss.get("mid", {}).get(name), rss["end"][name]
            change = f"{100 * (end - mid) / mid:+.1f}%" if mid else "n/a (restarted)"
            print(f"  {name}: RSS {mid or 0:.0f} -> {end:.0f} MiB over the last third ({change})")
        for e in errors[:5]:
            print("  error:", e)


if __name__ == "__main__":
    main()
