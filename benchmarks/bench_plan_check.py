"""Is ``pdserve plan``'s recommendation right? The plan's splits, then each one run for real.

``pdserve plan`` splits ``--workers`` workers every way (all colocated; P prefill + D decode; in each
layout of the profiles given, one per layout) on this machine's cores and simulates each split's
goodput: the highest request rate at which at least 90% of requests meet the SLOs. This benchmark
then starts each split as a real ``pdserve up`` cluster (warm: decode steps compiled, one unmeasured
pass of the workload first) and measures the SLO attainment with ``pdserve bench serve --goodput`` at
fractions of that split's planned goodput (fresh prompts each run, at least ``--min-duration`` seconds
of arrivals, as the plan's own runs), simulating the same runs beside them. It prints, per split, the planned goodput, the real and
simulated attainment at each rate, the real goodput (where the real attainment crosses the target,
interpolated between the rates run; "<" the lowest rate when even that one misses it), and the router's
hops to the first token, so one can see whether the split the plan recommends is the one that serves
most for real, and where the simulation and the cluster part.

    python benchmarks/bench_plan_check.py --profile /tmp/profile.json [/tmp/profile-tp2.json] [--workers 2]
        [--slo ttft:200 tpot:25] [--factors 0.25 0.5 0.75 1 1.5 2] [--num-prompts 100] [--out F]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_sim_calibration import PDSERVE, run_json, stop, wait_up  # noqa: E402

WORKLOAD = ["--dataset", "random", "--random-input-len", "256", "--random-range-ratio", "0.5",
            "--prefix-len", "64", "--random-output-len", "48", "--vocab-size", "4096"]


def parse_layout(name: str) -> tuple[int, int]:
    """(TP, PP) of a layout named ``tp{T}pp{P}`` (``planner.layout_name``)."""
    tp, pp = name[2:].split("pp")
    return int(tp), int(pp)


def split_flags(entry: dict) -> list[str]:
    """``pdserve up``'s flags for a plan entry: the pools' sizes and each pool's layout (a colocated
    pool is ``pdserve up``'s decode pool)."""
    p, d, layout = entry["num_prefill"], entry["num_decode"], entry.get("layout", {})
    flags = ["--colocated", "--num-decode", str(d)] if p == 0 else ["--num-prefill", str(p), "--num-decode", str(d)]
    for kind, name in layout.items():
        tp, pp = parse_layout(name)
        role = "prefill" if kind == "prefill" else "decode"
        flags += [f"--{role}-tensor-parallel-size", str(tp), f"--{role}-pipeline-parallel-size", str(pp)]
    return flags


def split_name(entry: dict) -> str:
    p, d, layout = entry["num_prefill"], entry["num_decode"], entry.get("layout", {})

    def suffix(kind: str) -> str:
        return "" if layout.get(kind, "tp1pp1") == "tp1pp1" else f" {layout[kind]}"

    return f"{d} colocated{suffix('colocated')}" if p == 0 else f"{p}P{suffix('prefill')}+{d}D{suffix('decode')}"


def entry_profiles(profiles: list[str], entries: list[dict], workers: int, directory: str) -> dict[str, str]:
    """The profile file the simulator reads for each plan entry (by ``split_name``): the planner's own
    candidate profile (two layouts' profiles joined where the pools come from different files)."""
    from pdserve.sizing.planner import candidates
    from pdserve.sizing.profile import load_profile

    found = {}
    for c in candidates([load_profile(path) for path in profiles], workers):
        name = split_name({"num_prefill": c.num_prefill, "num_decode": c.num_decode, "layout": c.layout})
        if any(split_name(e) == name for e in entries):
            path = os.path.join(directory, f"profile-{name.replace(' ', '_').replace('+', '_')}.json")
            c.profile.save(path)
            found[name] = path
    return found


def crossing(rates: list[float], attainments: list[float], target: float) -> float:
    """The rate where attainment falls through ``target``, linear between the measured rates (0 when the
    lowest rate misses it; the highest rate when none does)."""
    if not attainments or attainments[0] < target:
        return 0.0
    for (r0, a0), (r1, a1) in zip(zip(rates, attainments), zip(rates[1:], attainments[1:])):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return rates[-1]


def bound(rates: list[float], attainments: list[float], target: float) -> str:
    """The goodput the runs show: the crossing, or a bound when every rate met (or missed) the target."""
    lo, hi = interval(rates, attainments, target)
    return f">= {lo:g}" if hi == float("inf") else f"< {hi:g}" if lo == 0 else f"{lo:.2f}"


def interval(rates: list[float], attainments: list[float], target: float) -> tuple[float, float]:
    """(Lowest, highest) goodput the runs allow."""
    if all(a >= target for a in attainments):
        return rates[-1], float("inf")
    if attainments[0] < target:
        return 0.0, rates[0]
    point = crossing(rates, attainments, target)
    return point, point


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--profile", required=True, nargs="+", help="profile files, one per layout (pdserve plan's)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--slo", nargs="+", default=["ttft:200", "tpot:25"])
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--factors", type=float, nargs="+", default=[0.25, 0.5, 0.75, 1.0, 1.5, 2.0],
                    help="rates run, as fractions of each split's planned goodput")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--min-duration", type=float, default=10.0,
                    help="seconds of arrivals each run (real, simulated, planned) spans at least (plan's flag)")
    ap.add_argument("--port", type=int, default=8331)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="pdserve-plan-check-")
    model = args.model or subprocess.run(PDSERVE + ["default-model"], check=True, capture_output=True,
                                         text=True).stdout.strip().splitlines()[-1]
    cores = str(len(os.sched_getaffinity(0)))
    line = [*WORKLOAD, "--num-prompts", str(args.num_prompts)]

    def line_at(rate: float) -> list[str]:  # as plan sizes its runs: at least --min-duration s of arrivals
        return [*WORKLOAD, "--num-prompts", str(max(args.num_prompts, math.ceil(rate * args.min_duration)))]

    planned = run_json(PDSERVE + ["plan", "--profile", *args.profile, "--workers", str(args.workers),
                                  "--machine-cores", cores, "--host-load", "router+client", "--slo", *args.slo,
                                  "--attainment", str(args.attainment),
                                  "--min-duration", str(args.min_duration), "--disable-tqdm", *line],
                       os.path.join(tmp, "plan.json"))
    best = planned["recommended"]
    print(f"plan: recommended {split_name(best)} at {best['goodput_rps']:.2f} req/s "
          f"(searched in {planned['seconds']:.1f} s)", flush=True)
    sim_profiles = entry_profiles(args.profile, planned["tried"], args.workers, tmp)
    goodput = ["--goodput", *args.slo]
    url = f"http://127.0.0.1:{args.port}"
    rows = []
    for entry in planned["tried"]:
        p, d = entry["num_prefill"], entry["num_decode"]
        tag = split_name(entry).replace(" ", "_").replace("+", "_")
        log = open(os.path.join(tmp, f"{tag}.log"), "w")
        proc = subprocess.Popen(PDSERVE + ["--log-level", "warning", "up", "--model", model, "--port", str(args.port),
                                           *split_flags(entry)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        rates = [round(f * entry["goodput_rps"], 3) for f in sorted(args.factors)]
        if not rates[0]:
            print(f"  {split_name(entry)}: planned goodput 0, not run", flush=True)
            continue
        row = {"split": split_name(entry), "num_prefill": p, "num_decode": d,
               "planned_goodput_rps": entry["goodput_rps"], "rates": rates, "real": [], "sim": []}
        try:
            wait_up(url, p + d, proc)
            subprocess.run(PDSERVE + ["bench", "serve", "--url", url, "--seed", "99", "--disable-tqdm", *line,
                                      "--request-rate", str(rates[-1])], check=True, stdout=subprocess.DEVNULL)
            for i, rate in enumerate(rates):
                seed = str(100 + i)
                real = run_json(PDSERVE + ["bench", "serve", "--url", url, "--num-warmups", "4", "--seed", seed,
                                           "--disable-tqdm", *line_at(rate), *goodput, "--request-rate", str(rate)],
                                os.path.join(tmp, f"{tag}-{rate}-real.json"))
                sim = run_json(PDSERVE + ["simulate", "--profile", sim_profiles[row["split"]], "--prefill", str(p),
                                          "--decode",
                                          str(d), "--machine-cores", cores, "--host-load", "router+client",
                                          "--seed", seed, "--disable-tqdm",
                                          *line_at(rate),
                                          *goodput, "--request-rate", str(rate)],
                               os.path.join(tmp, f"{tag}-{rate}-sim.json"))
                row["real"].append(real["slo_attainment"])
                row["sim"].append(sim["slo_attainment"])
                hops = (real.get("ttft_phases") or {}).get("phases", {})
                row.setdefault("real_hops_mean_ms", []).append({k: 1000 * v["mean_s"] for k, v in hops.items()})
                print(f"  {row['split']} @ {rate} req/s: attainment real {100 * real['slo_attainment']:.0f}% "
                      f"sim {100 * sim['slo_attainment']:.0f}%; TTFT p50 real {real['median_ttft_ms']:.1f} "
                      f"sim {sim['median_ttft_ms']:.1f} ms; TPOT p50 real {real['median_tpot_ms']:.1f} "
                      f"sim {sim['median_tpot_ms']:.1f} ms\n    real hops (mean ms): "
                      + ", ".join(f"{k} {1000 * v['mean_s']:.1f}" for k, v in hops.items())
                      + "\n    sim hops (mean ms):  "
                      + ", ".join(f"{k} {v:.1f}" for k, v in sim["sim"].get("ttft_hops_mean_ms", {}).items()),
                      flush=True)
                row.setdefault("sim_hops_mean_ms", []).append(sim["sim"].get("ttft_hops_mean_ms", {}))
        finally:
            stop(proc)
            log.close()
        row["real_goodput_rps"] = crossing(rates, row["real"], args.attainment)
        row["sim_goodput_rps"] = crossing(rates, row["sim"], args.attainment)
        rows.append(row)
    # each split's real goodput as an interval (a bound where every rate met, or missed, the target)
    spans = {r["split"]: interval(r["rates"], r["real"], args.attainment) for r in rows}
    winners = [name for name, (lo, _) in spans.items()
               if all(lo >= hi for other, (_, hi) in spans.items() if other != name)]
    print("\n| split | planned goodput (req/s) | rates run (req/s) | attainment real / sim | real goodput | "
          "sim goodput |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        cells = ", ".join(f"{100 * a:.0f}% / {100 * s:.0f}%" for a, s in zip(r["real"], r["sim"]))
        real, sim = (bound(r["rates"], r[k], args.attainment) for k in ("real", "sim"))
        print(f"| {r['split']} | {r['planned_goodput_rps']:.2f} | {', '.join(f'{x:g}' for x in r['rates'])} "
              f"| {cells} | {real} | {sim} |")
    if winners:
        verdict = "agrees" if winners[0] == split_name(best) else "disagrees"
        print(f"plan recommended {split_name(best)}; the real runs' best: {winners[0]} ({verdict})")
    else:
        print(f"plan recommended {split_name(best)}; the real runs do not rank the splits (their goodput "
              f"intervals overlap: {spans}); widen --factors")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"plan": planned, "rows": rows, "workload": line, "slos": args.slo, "cores": cores}, f,
                      indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
