"""How close ``pdserve simulate`` comes to the real cluster: the calibration table of docs/benchmarks.md.

For each layout (colocated, 1P+1D, 1P+2D on this machine's cores, placed by ``pdserve up``) and each
request rate, the same workload line runs twice through ``pdserve bench serve`` against a real
``pdserve up`` cluster (warm: its decode steps compiled, one unmeasured pass of the workload with other
prompts first, and a few warm-up requests before each run) and once through
``pdserve simulate`` with the profile; the table gives TTFT p50 / p90 and TPOT p50 of each, the
simulator's error against the mean of the two real runs, and the spread between the two real runs
(the noise floor a simulator cannot beat on this machine).

The workload has varying lengths and prefix-cache hits (a shared prefix), which Dynamo's profile
leaves out.

    python benchmarks/bench_sim_calibration.py --profile /tmp/profile.json [--layouts colocated 1p1d 1p2d]
        [--rates colocated=2,6 1p1d=3,9 1p2d=3,9] [--num-prompts 150] [--out /tmp/calibration.json]

Without ``--profile`` each layout is profiled right before its real runs, the kinds it needs only
(``pdserve profile --kinds colocated``, or ``prefill,decode`` with the transfer; about a minute or two
each), so a shared machine's drift between a profile and the runs it prices spans minutes, not the
whole benchmark (this project's Xeon drifted 20-40% over a session); ``--profile P`` prices every
layout from P.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

LAYOUTS = {"colocated": ["--colocated"], "1p1d": ["--num-prefill", "1", "--num-decode", "1"],
           "1p2d": ["--num-prefill", "1", "--num-decode", "2"]}
DEFAULT_RATES = {"colocated": [2.0, 6.0], "1p1d": [3.0, 9.0], "1p2d": [3.0, 9.0]}
# the worker kinds each layout's simulation reads from the profile
KINDS = {"colocated": "colocated", "1p1d": "prefill,decode", "1p2d": "prefill,decode"}
WORKLOAD = ["--dataset", "random", "--random-input-len", "256", "--random-range-ratio", "0.5",
            "--prefix-len", "64", "--random-output-len", "48", "--goodput", "ttft:200", "tpot:25"]
PDSERVE = [sys.executable, "-m", "pdserve"]


def wait_up(url: str, num_workers: int, proc: subprocess.Popen, timeout_s: float = 600) -> None:
    """Until every worker is live and every decode worker's decode step compiled (or eager: several ranks)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"pdserve up exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/workers", timeout=5) as resp:
                workers = json.load(resp)
            if len(workers) >= num_workers and all(w.get("decode_step") in ("compiled", "eager") for w in workers
                                                   if w.get("role") == "decode"):
                return
        except (OSError, ValueError):
            pass
        time.sleep(1)
    raise RuntimeError("the cluster did not come up")


def stop(proc: subprocess.Popen) -> None:
    """Stop a ``pdserve up`` started in its own session: Ctrl-C, then SIGKILL after a minute."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def run_json(cmd: list[str], path: str) -> dict:
    subprocess.run(cmd + ["--result-file", path], check=True, stdout=subprocess.DEVNULL)
    with open(path) as f:
        return json.load(f)


KEYS = ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--rates", nargs="*", default=[], metavar="LAYOUT=R1,R2")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rates = dict(DEFAULT_RATES)
    for item in args.rates:
        name, _, values = item.partition("=")
        rates[name] = [float(v) for v in values.split(",")]
    tmp = tempfile.mkdtemp(prefix="pdserve-calibration-")
    model = args.model or subprocess.run(PDSERVE + ["default-model"], check=True, capture_output=True,
                                         text=True).stdout.strip().splitlines()[-1]
    cores = len(os.sched_getaffinity(0))
    machine = None
    rows = []
    url = f"http://127.0.0.1:{args.port}"
    for layout in args.layouts:
        profile = args.profile
        if profile is None:  # this layout's kinds, measured now: the runs below follow within minutes
            profile = os.path.join(tmp, f"profile-{layout}.json")
            subprocess.run(PDSERVE + ["profile", "--model", model, "--kinds", KINDS[layout], "--out", profile,
                                      "--disable-tqdm"], check=True)
        with open(profile) as f:
            machine = json.load(f)["machine"]
        print(f"CPU: {machine.get('cpu')} ({machine.get('isa')}), {cores} cores; {layout}: profile {profile}",
              flush=True)
        flags = LAYOUTS[layout]
        num_workers = 1 if layout == "colocated" else 1 + int(flags[-1])
        log = open(os.path.join(tmp, f"{layout}.log"), "w")
        proc = subprocess.Popen(PDSERVE + ["--log-level", "warning", "up", "--model", model, "--port", str(args.port),
                                           *flags], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_up(url, num_workers, proc)
            # warm: one unmeasured pass of the workload (its own prompts) at the highest rate, so every
            # shape the measured runs meet has its kernels built (oneDNN primitives are made per shape)
            warm = [*WORKLOAD, "--num-prompts", str(args.num_prompts), "--request-rate", str(max(rates[layout]))]
            subprocess.run(PDSERVE + ["bench", "serve", "--url", url, "--seed", "99", "--disable-tqdm", *warm],
                           check=True, stdout=subprocess.DEVNULL)
            for r, rate in enumerate(rates[layout]):
                line = [*WORKLOAD, "--num-prompts", str(args.num_prompts), "--request-rate", str(rate)]
                num_prefill, num_decode = (0, 1) if layout == "colocated" else (1, int(flags[-1]))
                real, sims = [], []
                for run in range(2):  # each run its own prompts and arrivals (a seed), never cached before
                    seed = str(10 * r + run)
                    real.append(run_json(PDSERVE + ["bench", "serve", "--url", url, "--num-warmups", "4",
                                                    "--seed", seed, "--disable-tqdm", "--vocab-size", "4096", *line],
                                         os.path.join(tmp, f"{layout}-{rate}-real{run}.json")))
                    sims.append(run_json(PDSERVE + ["simulate", "--profile", profile, "--prefill", str(num_prefill),
                                                    "--decode", str(num_decode), "--machine-cores", str(cores),
                                                    "--host-load", "router+client",
                                                    "--vocab-size", "4096", "--seed", seed, "--disable-tqdm", *line],
                                         os.path.join(tmp, f"{layout}-{rate}-sim{run}.json")))
                row = {"layout": layout, "rate": rate, "profile": profile}
                for key in KEYS:
                    a, b = real[0][key], real[1][key]
                    mean = (a + b) / 2
                    s = (sims[0][key] + sims[1][key]) / 2
                    row[key] = {"real": [a, b], "sim": s, "sims": [sims[0][key], sims[1][key]],
                                "error": (s - mean) / mean, "spread": abs(a - b) / mean}
                row["sim_wall_s"] = sims[0]["sim"]["wall_seconds"]
                rows.append(row)
                print(format_row(row), flush=True)
        finally:
            stop(proc)
            log.close()
    print(table(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "cores": cores, "workload": WORKLOAD, "num_prompts": args.num_prompts,
                       "rows": rows}, f, indent=2)
    return 0


def format_row(row: dict) -> str:
    cells = []
    for key in KEYS:
        c = row[key]
        cells.append(f"{key}: real {c['real'][0]:.1f}/{c['real'][1]:.1f} sim {c['sim']:.1f} "
                     f"err {100 * c['error']:+.1f}% spread {100 * c['spread']:.1f}%")
    return f"{row['layout']} @ {row['rate']} req/s: " + "; ".join(cells)


def table(rows: list[dict]) -> str:
    lines = ["| layout | req/s | TTFT p50 real (2 runs) | sim | err | spread | TTFT p90 real | sim | err | spread "
             "| TPOT p50 real | sim | err | spread |", "|" + "---|" * 14]
    for r in rows:
        cells = [r["layout"], f"{r['rate']:g}"]
        for key in KEYS:
            c = r[key]
            cells += [f"{c['real'][0]:.1f} / {c['real'][1]:.1f}", f"{c['sim']:.1f}", f"{100 * c['error']:+.1f}%",
                      f"{100 * c['spread']:.1f}%"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
