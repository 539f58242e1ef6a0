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
        [--rates colocated=2,6 1p1d=3,9 1p2d=3,9] [--num-prompts 150] [--output-len 48] [--out /tmp/calibration.json]

``--resimulate DIR [DIR ...]`` runs nothing real: it simulates again, with the code as it is now, every
cell a calibration run left in DIR (its ``profile-LAYOUT.json`` or ``profile.json``, and each real run's
result with its seed), and scores them, so a change to the cost model is judged on many real runs at once
(the runs of a noisy machine differ more between themselves than one change moves them).

Before each real run a speed probe streams three lone requests and compares their decode step with the profile's
(``speed_probe``): the table's last column, the machine's step time then over the profile's, tells a cell's miss
from the VM's drift between the profile and the run. The simulation never reads it.

A cell passes when the simulated figure is within issue 40's bound of the two real runs' mean (TTFT p50 and
TPOT p50 5%, TTFT p90 10%) or within the two runs' spread where that is wider; the count is printed last.

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


def workload(output_len: int) -> list[str]:
    """``WORKLOAD`` with ``output_len`` tokens out per request (longer outputs: larger decode batches)."""
    line = list(WORKLOAD)
    line[line.index("--random-output-len") + 1] = str(output_len)
    return line


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
BOUNDS = {"median_ttft_ms": 0.05, "p90_ttft_ms": 0.10, "median_tpot_ms": 0.05}  # issue 40 item 3
PROBES = 3  # lone streams of the speed probe before each real run
PROBE_TOKENS = 48  # each streams this many tokens (the profile's serving grid streams as many)


def speed_probe(url: str, profile: str, layout: str, probes: int = PROBES) -> float | None:
    """The machine's speed right before a real run, against the profile's: the decode step a lone stream saw
    (``serving_profiler.serving_step_seconds``; its prompt of 31 tokens computed once first, as the profile's
    grid primes its points) over the profile's serving grid point it repeats (batch 1, 32 tokens of context),
    the median over ``probes`` fresh prompts; None where the profile has no serving grid. Above 1: the
    machine runs slower now than when it was profiled. The simulation never reads it: the table reports it
    beside each cell, so a cell's miss can be told from the VM's drift between the profile and the run."""
    import asyncio
    import random
    import statistics

    import httpx

    from pdserve.bench.serve import first_model_id
    from pdserve.sizing.serving_client import stream_batch
    from pdserve.sizing.serving_profiler import serving_step_seconds

    with open(profile) as f:
        worker = json.load(f)["workers"]["colocated" if layout == "colocated" else "decode"]
    grid = worker.get("serving_decode_seconds") or []
    if not grid or worker["decode_batch"][0] != 1 or worker["decode_context"][0] != 32:
        return None
    rng = random.Random()  # fresh prompts every probe, never a cached prefix of the workload's

    async def probe() -> list[float]:
        async with httpx.AsyncClient(timeout=30) as client:
            model_id = await first_model_id(client, url)
        steps = []
        for _ in range(probes):
            prompt = [rng.randrange(10, 1000) for _ in range(31)]
            await stream_batch(url, model_id, [prompt], 1)
            streams = await stream_batch(url, model_id, [prompt], PROBE_TOKENS)
            if (step := serving_step_seconds(streams)) is not None:
                steps.append(step)
        return steps

    steps = asyncio.run(probe())
    return statistics.median(steps) / grid[0][0] if steps else None


def simulate(profile: str, layout: str, rate: float, seed: int, cores: int, num_prompts: int, path: str,
             line: list[str] = WORKLOAD) -> dict:
    """``pdserve simulate`` of one real run's workload (``line``, same seed) on ``layout`` placed on ``cores``."""
    num_prefill, num_decode = (0, 1) if layout == "colocated" else (1, int(LAYOUTS[layout][-1]))
    line = [*line, "--num-prompts", str(num_prompts), "--request-rate", str(rate)]
    return run_json(PDSERVE + ["simulate", "--profile", profile, "--prefill", str(num_prefill),
                               "--decode", str(num_decode), "--machine-cores", str(cores),
                               "--host-load", "router+client",
                               "--vocab-size", "4096", "--seed", str(seed), "--disable-tqdm", *line], path)


def score(layout: str, rate: float, profile: str, real: list[dict], sims: list[dict],
          speeds: list[float | None] | None = None) -> dict:
    """A table row: per figure the two real runs, the simulations' mean, its error against the real mean, the
    real spread, and whether it passes (within ``BOUNDS`` or the spread); ``speed``: each run's
    ``speed_probe`` (None where not probed)."""
    row = {"layout": layout, "rate": rate, "profile": profile, "speed": list(speeds or [None, None])}
    for key in KEYS:
        a, b = real[0][key], real[1][key]
        mean = (a + b) / 2
        s = (sims[0][key] + sims[1][key]) / 2
        error, spread = (s - mean) / mean, abs(a - b) / mean
        row[key] = {"real": [a, b], "sim": s, "sims": [sims[0][key], sims[1][key]], "error": error,
                    "spread": spread, "passes": abs(error) <= max(BOUNDS[key], spread)}
    row["sim_wall_s"] = sims[0]["sim"]["wall_seconds"]
    return row


def resimulate(dirs: list[str]) -> list[dict]:
    """Every cell the calibration runs in ``dirs`` left, simulated again with this code (see the docstring)."""
    rows = []
    for d in dirs:
        line = WORKLOAD
        if os.path.exists(saved := os.path.join(d, "workload.json")):  # the runs' own workload line
            with open(saved) as f:
                line = json.load(f)
        for layout in LAYOUTS:
            profile = os.path.join(d, f"profile-{layout}.json")
            if not os.path.exists(profile):
                profile = os.path.join(d, "profile.json")
            rates = sorted({float(f.split("-")[1]) for f in os.listdir(d) if f.startswith(f"{layout}-")
                            and f.endswith("-real0.json")})
            for rate in rates:
                real = []
                for run in range(2):
                    with open(os.path.join(d, f"{layout}-{rate}-real{run}.json")) as f:
                        real.append(json.load(f))
                cores = len(os.sched_getaffinity(0))
                if os.path.exists(saved := os.path.join(d, f"{layout}-{rate}-sim0.json")):
                    with open(saved) as f:
                        cores = json.load(f).get("machine_cores") or cores  # as that run placed its workers
                sims = [simulate(profile, layout, rate, r["seed"], cores, r["num_prompts"],
                                 os.path.join(d, f"{layout}-{rate}-resim{run}.json"), line)
                        for run, r in enumerate(real)]
                rows.append(score(layout, rate, profile, real, sims))
                print(f"{d}: " + format_row(rows[-1]), flush=True)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", default=None)
    ap.add_argument("--model", default=None)
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    ap.add_argument("--rates", nargs="*", default=[], metavar="LAYOUT=R1,R2")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=48,
                    help="tokens out per request (the default model's 1,024-token context allows up to ~570)")
    ap.add_argument("--port", type=int, default=8321)
    ap.add_argument("--out", default=None)
    ap.add_argument("--resimulate", nargs="+", default=None, metavar="DIR",
                    help="simulate again the cells of earlier runs' directories (nothing real runs)")
    args = ap.parse_args()
    if args.resimulate:
        rows = resimulate(args.resimulate)
        print(table(rows))
        print(passing(rows))
        return 0
    rates = dict(DEFAULT_RATES)
    for item in args.rates:
        name, _, values = item.partition("=")
        rates[name] = [float(v) for v in values.split(",")]
    tmp = tempfile.mkdtemp(prefix="pdserve-calibration-")
    line_base = workload(args.output_len)
    with open(os.path.join(tmp, "workload.json"), "w") as f:
        json.dump(line_base, f)
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
            warm = [*line_base, "--num-prompts", str(args.num_prompts), "--request-rate", str(max(rates[layout]))]
            subprocess.run(PDSERVE + ["bench", "serve", "--url", url, "--seed", "99", "--disable-tqdm", *warm],
                           check=True, stdout=subprocess.DEVNULL)
            for r, rate in enumerate(rates[layout]):
                line = [*line_base, "--num-prompts", str(args.num_prompts), "--request-rate", str(rate)]
                real, sims = [], []
                speeds = []
                for run in range(2):  # each run its own prompts and arrivals (a seed), never cached before
                    seed = 10 * r + run
                    speeds.append(speed_probe(url, profile, layout))
                    real.append(run_json(PDSERVE + ["bench", "serve", "--url", url, "--num-warmups", "4",
                                                    "--seed", str(seed), "--disable-tqdm", "--vocab-size", "4096",
                                                    *line], os.path.join(tmp, f"{layout}-{rate}-real{run}.json")))
                    sims.append(simulate(profile, layout, rate, seed, cores, args.num_prompts,
                                         os.path.join(tmp, f"{layout}-{rate}-sim{run}.json"), line_base))
                rows.append(score(layout, rate, profile, real, sims, speeds))
                print(format_row(rows[-1]), flush=True)
        finally:
            stop(proc)
            log.close()
    print(table(rows))
    print(passing(rows))
    print(f"the runs' directory (for --resimulate): {tmp}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"machine": machine, "cores": cores, "workload": line_base, "num_prompts": args.num_prompts,
                       "rows": rows}, f, indent=2)
    return 0


def passing(rows: list[dict]) -> str:
    cells = [row[key].get("passes") for row in rows for key in KEYS]
    return f"{sum(1 for c in cells if c)} of {len(cells)} cells within the bound or the real spread"


def format_row(row: dict) -> str:
    cells = []
    for key in KEYS:
        c = row[key]
        cells.append(f"{key}: real {c['real'][0]:.1f}/{c['real'][1]:.1f} sim {c['sim']:.1f} "
                     f"err {100 * c['error']:+.1f}% spread {100 * c['spread']:.1f}%")
    return f"{row['layout']} @ {row['rate']} req/s: " + "; ".join(cells) + f"; speed {speed_cell(row)}"


def speed_cell(row: dict) -> str:
    """The row's two speed probes as step-time ratios to the profile's (``speed_probe``), "-" where none."""
    return " / ".join("-" if s is None else f"{s:.2f}x" for s in row.get("speed") or [None, None])


def table(rows: list[dict]) -> str:
    lines = ["| layout | req/s | TTFT p50 real (2 runs) | sim | err | spread | TTFT p90 real | sim | err | spread "
             "| TPOT p50 real | sim | err | spread | decode step vs profile |", "|" + "---|" * 15]
    for r in rows:
        cells = [r["layout"], f"{r['rate']:g}"]
        for key in KEYS:
            c = r[key]
            cells += [f"{c['real'][0]:.1f} / {c['real'][1]:.1f}", f"{c['sim']:.1f}", f"{100 * c['error']:+.1f}%",
                      f"{100 * c['spread']:.1f}%"]
        cells.append(speed_cell(r))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
