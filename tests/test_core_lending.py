"""Core lending (``pdserve up --core-lending``): a decode worker runs its steps on an idle prefill worker's cores
too. The flag and the borrower's thread count, the launcher's rule for who lends to whom, and a real 1P+1D
cluster whose decode worker borrows the prefill core and still gives transformers' greedy tokens."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from pdserve.cluster.core_lending import CoreBorrower, LenderFlag, gomp_cpu_affinity
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from pdserve.cluster.supervisor import LaunchedWorker
from pdserve.common.utils import free_port


def test_a_borrower_adds_threads_only_while_its_lender_says_idle(tmp_path):
    path = str(tmp_path / "prefill-0.idle")
    threads = torch.get_num_threads()
    borrower = CoreBorrower(path, own_threads=1, borrowed_threads=2)  # opens (creates) the file first
    lender = LenderFlag(path)
    try:
        assert borrower.before_step() == 1 and torch.get_num_threads() == 1  # a new flag reads busy
        lender.set_idle(True)
        assert borrower.before_step() == 3 and torch.get_num_threads() == 3
        lender.set_idle(False)
        assert borrower.before_step() == 1
        lender.set_idle(True)
        lender.close()  # a lender leaving gives its cores back
        assert borrower.before_step() == 1
    finally:
        borrower.close()
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="own and borrowed"):
        CoreBorrower(path, 1, 0)
    assert gomp_cpu_affinity([1], [0]) == "1 0" and gomp_cpu_affinity([2, 3], [0, 1]) == "2 3 0 1"


def _placed(cluster: LocalCluster, role: str, name: str):
    """What ``_start_worker`` decides for a worker: its cores, then core lending's flags and environment."""
    cluster._cores_for(role, name)
    lending = cluster._lending(role, name)
    cluster.workers[name] = LaunchedWorker(name, role, None)
    return lending


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_decode_worker_borrows_only_a_prefill_worker_whose_cores_no_one_else_uses():
    cores = sorted(os.sched_getaffinity(0))
    cluster = LocalCluster(ClusterSpec(model="m", num_prefill=1, num_decode=1, core_lending=True))
    flags, env = _placed(cluster, "prefill", "prefill-0")
    assert flags[0] == "--lend-flag" and flags[1].endswith("prefill-0.idle") and env is None
    flags, env = _placed(cluster, "decode", "decode-0")
    prefill, decode = cluster.worker_cores["prefill-0"], cluster.worker_cores["decode-0"]
    assert flags == ["--borrow-flag", os.path.join(cluster._flag_dir, "prefill-0.idle"),
                     "--borrow-threads", str(len(prefill))]
    assert env == {"GOMP_CPU_AFFINITY": gomp_cpu_affinity(decode, prefill)}
    assert cluster.lent == {"prefill-0": "decode-0"}
    assert _placed(cluster, "decode", "decode-0") == (flags, env)  # a restarted borrower borrows the same cores
    cluster.workers.clear()  # no processes here: stop() has only the flags' directory to remove
    cluster.stop()
    assert not os.path.exists(cluster._flag_dir)

    # more ranks than cores: the workers share cores, nothing idle is lent
    crowded = LocalCluster(ClusterSpec(model="m", num_prefill=1, num_decode=len(cores), core_lending=True))
    assert _placed(crowded, "prefill", "prefill-0") == ([], None)
    assert all(_placed(crowded, "decode", f"decode-{i}") == ([], None) for i in range(len(cores)))
    tp = LocalCluster(ClusterSpec(model="m", num_prefill=1, num_decode=1, decode_tensor_parallel_size=2,
                                  core_lending=True))
    assert _placed(tp, "decode", "decode-0") == ([], None)  # a multi-rank worker neither lends nor borrows


@pytest.mark.parametrize("flags", [["--ray"], ["--colocated"], ["--num-prefill", "0"]])
def test_core_lending_is_refused_where_no_local_prefill_worker_could_lend(flags):
    done = subprocess.run([sys.executable, "-m", "pdserve", "up", "--core-lending", *flags], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2 and "--core-lending" in done.stderr


def _thread_cores(pid: int) -> list[str]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/status") as f:
            out.append(re.search(r"Cpus_allowed_list:\s*(\S+)", f.read())[1])
    return out


@pytest.mark.cluster
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_a_decode_worker_borrowing_the_idle_prefill_core_gives_transformers_greedy_tokens(model_dir, tmp_path):
    """1P on core 0 + 1D on core 1, lending: the decode worker's steps run a second thread bound to core 0 while
    the prefill worker is idle (``pdserve:borrowed_steps``), its main thread stays on core 1, and greedy outputs
    are transformers' token for token."""
    c0, c1 = sorted(os.sched_getaffinity(0))[:2]
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), core_lending=True,
                       worker_args=["--kv-cache-memory", "16MiB", "--max-num-seqs", "8"],
                       prefill_args=["--cpu-cores", str(c0)], decode_args=["--cpu-cores", str(c1)])
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    prompts = [[5 + (7 * i + 3 * j) % 200 for j in range(12 + 9 * i)] for i in range(4)]
    with LocalCluster(spec, log_dir=str(tmp_path / "logs")) as cluster:
        decode_pid = dict(cluster.procs)["decode-0"].pid
        assert cluster.wait_decode_steps_compiled(timeout_s=300)  # no borrowing while the step compiles
        name = os.path.basename(model_dir.rstrip("/"))
        for prompt in prompts:
            r = httpx.post(f"{cluster.url}/v1/completions", timeout=60,
                           json={"model": name, "prompt": prompt, "max_tokens": 24, "temperature": 0,
                                 "ignore_eos": True, "return_token_ids": True})
            assert r.status_code == 200, r.text
            with torch.no_grad():
                expected = model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, min_new_tokens=24,
                                          attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            assert r.json()["choices"][0]["token_ids"] == expected[0, len(prompt):].tolist()
        borrowed: list[float] = []
        deadline = time.monotonic() + 10
        while not (borrowed and borrowed[0] > 0) and time.monotonic() < deadline:  # counters come with heartbeats
            time.sleep(0.5)
            metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
            borrowed = [float(v) for v in re.findall(r'^pdserve:borrowed_steps_total\{[^}]*decode-0[^}]*\} (\S+)',
                                                     metrics, re.M)]
        assert borrowed and borrowed[0] > 0, metrics[:2000]
        threads = _thread_cores(decode_pid)
        assert str(c0) in threads and threads.count(str(c1)) >= 1  # a thread on the lent core, the rest on its own
        assert all(t in (str(c0), str(c1)) for t in threads), threads
