"""A worker's OpenMP threads are bound one to a core (pdserve.common.thread_affinity), in a process of their own:
the binding is per thread and lasts, so it must not touch the test process."""

import json
import os
import subprocess
import sys

import pytest

# Pins itself as a two-core worker does, runs parallel torch ops, and reports each thread's cores and CPU time.
_PROBE = r"""
import json, os, sys
import torch
from pdserve.common.utils import pin_to_cores

def threads():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        out[tid] = (sorted(os.sched_getaffinity(int(tid))), int(fields[11]) + int(fields[12]))
    return out

share = pin_to_cores(sys.argv[1], int(sys.argv[2]))
before = threads()
x, w = torch.randn(256, 1024), torch.randn(1024, 1024)
for _ in range(400):
    torch.tanh(x @ w)
after = threads()
print(json.dumps({"share": share, "main": sorted(os.sched_getaffinity(0)), "main_tid": str(os.getpid()),
                  "threads": {t: [cores, ticks - before.get(t, (None, 0))[1]] for t, (cores, ticks) in after.items()}}))
"""


def _probe(cores: str, threads: int, **env: str) -> dict:
    run_env = {k: v for k, v in os.environ.items()
               if k not in ("GOMP_CPU_AFFINITY", "OMP_PROC_BIND", "OMP_PLACES", "KMP_AFFINITY",
                            "PDSERVE_NO_THREAD_BINDING")}
    out = subprocess.run([sys.executable, "-c", _PROBE, cores, str(threads)], env={**run_env, **env},
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_two_cores = pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
                                     reason="needs two cores")


@needs_two_cores
def test_each_openmp_thread_of_a_two_core_worker_runs_on_a_core_of_its_own():
    a, b = sorted(os.sched_getaffinity(0))[:2]
    report = _probe(f"{a},{b}", 2)
    assert report["share"] == [a, b]
    assert report["main"] == [a]  # the driving thread (OpenMP's thread 0) on the first core
    # the thread that shared the parallel work is bound to the second core alone
    workers = [t for t, (cores, ticks) in report["threads"].items() if t != report["main_tid"] and ticks > 0]
    assert workers, report
    assert all(report["threads"][t][0] == [b] for t in workers), report


@needs_two_cores
def test_a_binding_in_the_environment_or_the_opt_out_leaves_the_threads_unbound():
    a, b = sorted(os.sched_getaffinity(0))[:2]
    for env in ({"PDSERVE_NO_THREAD_BINDING": "1"}, {"OMP_PROC_BIND": "false"}):
        report = _probe(f"{a},{b}", 2, **env)
        assert report["main"] == [a, b], env
        assert all(cores == [a, b] for cores, _ in report["threads"].values()), (env, report)


def test_one_thread_or_more_threads_than_cores_binds_nothing():
    from pdserve.common.thread_affinity import bind_openmp_threads

    assert bind_openmp_threads([0], 1) is None
    assert bind_openmp_threads([0, 1], 3) is None  # oversubscribed: binding would only pair threads up
