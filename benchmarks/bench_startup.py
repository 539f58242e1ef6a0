"""What a new user waits for: `pdserve up` to its first answer, with a cold and a warm compile cache.

    python benchmarks/bench_startup.py                         # the built-in default model
    python benchmarks/bench_startup.py --model DIR             # e.g. pdserve tiny-model DIR --preset bench
    python benchmarks/bench_startup.py --until-compiled        # also: when decode steps run compiled

Each run starts ``python -m pdserve up`` as a user does (its own process group, default flags but
``--port``), sends a 16-token completion every 0.25 s until one is answered, and prints the seconds
from the command's start to that answer. ``--until-compiled`` keeps it up until a decode worker logs
``decode step compiled in``, and prints when that was and the latency of a 64-token completion before
and after. Then it stops the cluster as a terminal's Ctrl-C does (SIGINT to the process group) and
prints the exit status and what the stop printed (a clean stop: exit 0, at most a line a process).

The first run of each model uses an empty inductor cache (``$TORCHINDUCTOR_CACHE_DIR`` set to a
fresh directory) and no kept probe choices (``$PDSERVE_MEASURED_CHOICES`` in it): a first start on a
machine; the next ``--warm-runs`` what that run left (a restart).
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import httpx

from pdserve.common.utils import free_port


def one_run(model: str | None, cache_dir: str, until_compiled: bool, timeout_s: float, keep_log: bool) -> dict:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="pdserve-up-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "pdserve", "up", "--port", str(port)] + (["--model", model] if model else [])
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache_dir,
               PDSERVE_MEASURED_CHOICES=os.path.join(cache_dir, "pdserve-measured"))
    env.pop("PDSERVE_ENFORCE_EAGER", None)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1/completions"
    name = os.path.basename(os.path.normpath(model)) if model else "stdlib-llama-v1"
    result: dict = {}

    def complete(max_tokens: int) -> float | None:
        t0 = time.perf_counter()
        try:
            r = httpx.post(url, timeout=60, json={"model": name, "prompt": "import os\n", "max_tokens": max_tokens,
                                                  "temperature": 0, "ignore_eos": True})
        except httpx.HTTPError:
            return None
        return time.perf_counter() - t0 if r.status_code == 200 else None

    try:
        while complete(16) is None:
            if proc.poll() is not None or time.perf_counter() - started > timeout_s:
                raise RuntimeError(f"pdserve up never answered (log: {log.name})")
            time.sleep(0.25)
        result["first_answer_s"] = time.perf_counter() - started
        if until_compiled:
            result["latency_64_before_s"] = complete(64)
            while (m := re.search(r"decode step compiled in ([0-9.]+) s", open(log.name).read())) is None:
                if proc.poll() is not None or time.perf_counter() - started > timeout_s:
                    raise RuntimeError(f"the decode step never compiled (log: {log.name})")
                time.sleep(0.5)
            result["compiled_after_s"] = time.perf_counter() - started
            result["compile_s"] = float(m.group(1))
            complete(64)  # the first compiled step of a new batch size
            result["latency_64_after_s"] = complete(64)
        before_stop = len(open(log.name).read().splitlines())
        os.killpg(proc.pid, signal.SIGINT)
        result["exit_status"] = proc.wait(timeout=60)
        result["stop_lines"] = open(log.name).read().splitlines()[before_stop:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    if keep_log:
        result["log"] = log.name
    else:
        os.unlink(log.name)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the built-in model)")
    parser.add_argument("--warm-runs", type=int, default=1, help="runs after the cold one, on its cache")
    parser.add_argument("--until-compiled", action="store_true", help="also wait for the compiled decode step")
    parser.add_argument("--timeout-s", type=float, default=600.0, help="give up on a run after this long")
    parser.add_argument("--cache-dir", default=None, help="inductor cache to start from (default: a new, empty one)")
    parser.add_argument("--keep-logs", action="store_true", help="keep each run's log (its path is printed)")
    args = parser.parse_args()
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="pdserve-inductor-")
    cold = args.cache_dir is None
    for i in range(int(cold) + args.warm_runs):
        r = one_run(args.model, cache_dir, args.until_compiled, args.timeout_s, args.keep_logs)
        figures = f"first answer {r['first_answer_s']:.1f} s"
        if args.until_compiled:
            figures += (f"; compiled decode step from {r['compiled_after_s']:.1f} s (compile {r['compile_s']:.1f} s); "
                        f"64 tokens {r['latency_64_before_s']:.2f} s before, {r['latency_64_after_s']:.2f} s after")
        traceback = " (a traceback)" if any("Traceback" in line for line in r["stop_lines"]) else ""
        log = f"; log {r['log']}" if args.keep_logs else ""
        print(f"{'cold' if cold and i == 0 else 'warm'} cache: {figures}; stop: exit {r['exit_status']}, "
              f"{len(r['stop_lines'])} lines{traceback}{log}", flush=True)


if __name__ == "__main__":
    main()
