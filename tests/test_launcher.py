"""`pdserve up` (the README's main command): default model, serves, stops every child on SIGTERM or a
terminal's Ctrl-C, cleanly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from pdserve.common.utils import free_port
from pdserve.default_model.train import DEFAULT_MODEL_NAME

pytestmark = pytest.mark.cluster


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_pdserve_up_default_model_serves_and_stops_all_children(tmp_path, mode):
    port = free_port()
    env = dict(os.environ, PDSERVE_CACHE=str(tmp_path / "cache"))
    extra = ["--colocated"] if mode == "colocated" else []
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--port", str(port), *extra],  # default KV: auto
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    children: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        line = ""
        while "pdserve is up" not in line:
            assert time.monotonic() < deadline and proc.poll() is None, "pdserve up did not come up"
            line = proc.stdout.readline()
        assert f"http://127.0.0.1:{port}/v1" in line
        # the launcher itself never loads torch (2-3 s of a small machine's start-up, before any child starts)
        assert "libtorch" not in open(f"/proc/{proc.pid}/maps").read()
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) == (2 if extra else 3)  # router, [prefill,] decode
        assert not (tmp_path / "cache").exists()  # the default model ships in the package: nothing is written
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                          json={"model": DEFAULT_MODEL_NAME, "prompt": "def ", "max_tokens": 5, "temperature": 0,
                                "ignore_eos": True})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 5
        health = httpx.get(f"http://127.0.0.1:{port}/health").json()
        assert health["num_prefill"] == (0 if extra else 1) and health["num_decode"] == 1
        # Each worker is pinned to its own share of the cores (a colocated worker gets them all).
        cores = sorted(os.sched_getaffinity(0))
        workers = {c.cmdline()[3]: c for c in children if c.cmdline()[3] in ("prefill", "decode")}
        # the workers split half the host's memory (--kv-cache-memory auto), and each sized its KV cache from its share
        shares = {name: c.cmdline()[c.cmdline().index("--memory-utilization") + 1] for name, c in workers.items()}
        assert shares == ({"decode": "0.5"} if extra else {"prefill": "0.25", "decode": "0.25"})
        plans = {w["role"]: w["plan"]["kv_cache"] for w in httpx.get(f"http://127.0.0.1:{port}/workers").json()}
        assert all("--kv-cache-memory auto: max_num_seqs x max_model_len" in p for p in plans.values()), plans
        pinned = {name: c.cpu_affinity() for name, c in workers.items()}  # each one's driving thread
        if extra and len(cores) >= 2:  # a thread a core, its OpenMP threads bound one to each (thread_affinity)
            assert pinned == {"decode": cores[:1]}
            bound = [os.sched_getaffinity(t.id) for t in workers["decode"].threads()]
            assert all({core} in bound for core in cores), bound
        elif extra:
            assert pinned == {"decode": cores}
        elif len(cores) >= 2:
            assert pinned["prefill"] and pinned["decode"] and not set(pinned["prefill"]) & set(pinned["decode"])
        if extra:  # Ctrl-C in a terminal: SIGINT to the whole process group, then the launcher's own to each
            os.killpg(proc.pid, signal.SIGINT)
        else:  # a supervisor's stop
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        gone, alive = psutil.wait_procs(children, timeout=15)
        assert not alive, f"children still running after the stop: {alive}"
        said = proc.stdout.read()  # a clean stop: no traceback, a line per process at most
        assert "Traceback" not in said and "Error" not in said, said
        assert len(said.splitlines()) <= len(children) + 1, said
    finally:
        for p in [*children, psutil.Process(proc.pid) if proc.poll() is None else None]:
            if p is not None and p.is_running():
                p.kill()


def test_up_parallel_flags_size_each_pool():
    from pdserve.cli import build_parser, pool_parallel_sizes
    from pdserve.cluster.launcher import ClusterSpec

    args, extra = build_parser().parse_known_args(["up", "--tensor-parallel-size", "2",
                                                   "--decode-tensor-parallel-size", "1",
                                                   "--prefill-pipeline-parallel-size", "2", "--kv-cache-memory", "1GiB"])
    sizes = pool_parallel_sizes(args)
    assert sizes == {"prefill_tensor_parallel_size": 2, "prefill_pipeline_parallel_size": 2,
                     "decode_tensor_parallel_size": 1, "decode_pipeline_parallel_size": 1}
    assert extra == ["--kv-cache-memory", "1GiB"]  # unknown flags still go to every worker
    spec = ClusterSpec(model="m", num_prefill=1, num_decode=2, **sizes)
    assert spec.num_ranks == 4 + 2 and spec.parallel_args("prefill") == [
        "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"]
    # the workers' short spellings size the pools too (they once reached the workers as extra flags, where
    # the pool's own --tensor-parallel-size 1 after them won: pdserve up -tp 2 ran TP-1 workers)
    args, extra = build_parser().parse_known_args(["up", "--colocated", "-tp", "2", "-pp", "2"])
    assert extra == [] and pool_parallel_sizes(args) == {
        "prefill_tensor_parallel_size": 2, "prefill_pipeline_parallel_size": 2,
        "decode_tensor_parallel_size": 2, "decode_pipeline_parallel_size": 2}


def test_cpu_lists_and_core_shares():
    from pdserve.common.utils import format_cpu_list, parse_cpu_list
    from pdserve.cluster.launcher import ClusterSpec, LocalCluster

    assert parse_cpu_list("0-3,6") == [0, 1, 2, 3, 6] and format_cpu_list([6, 0, 1, 2, 3]) == "0-3,6"
    for bad in ("", "a", "3-1", "1,,2"):
        with pytest.raises(ValueError, match="cpu list"):
            parse_cpu_list(bad)
    cluster = LocalCluster(ClusterSpec(model="m", num_prefill=1, num_decode=1))
    cores = sorted(os.sched_getaffinity(0))
    prefill, _ = cluster._cores_for("prefill", "prefill-0")
    decode, threads = cluster._cores_for("decode", "decode-0")
    assert len(prefill) == len(decode) == max(1, len(cores) // 2) and threads == len(decode)
    if len(cores) >= 2:
        assert not set(prefill) & set(decode)
    assert cluster._cores_for("decode", "decode-0")[0] == decode  # a restart keeps its share
    colocated = LocalCluster(ClusterSpec(model="m", num_prefill=0, num_decode=1))
    assert colocated._cores_for("decode", "decode-0")[0] == cores


def test_dtype_auto_follows_the_checkpoint_and_the_cpu():
    import torch

    from pdserve.common.utils import cpu_has_native_bf16, resolve_dtype

    cpu = torch.device("cpu")
    assert resolve_dtype("float16", cpu)[0] == torch.float16
    assert resolve_dtype("auto", cpu, "float32") == (torch.float32, "auto: the checkpoint's float32")
    assert resolve_dtype("auto", cpu, None)[0] == torch.float32
    dtype, why = resolve_dtype("auto", cpu, "bfloat16")
    if cpu_has_native_bf16():
        assert dtype == torch.bfloat16 and "native" in why
    else:
        assert dtype == torch.float32 and "no native bf16" in why
    assert resolve_dtype("auto", torch.device("cuda"), "float32")[0] == torch.bfloat16
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("int8", cpu)


@pytest.mark.parametrize("command,after_s", [("decode", 0.0), ("decode", 1.5), ("router", 0.0), ("router", 1.5)])
def test_ctrl_c_while_a_process_starts_is_a_clean_stop(model_dir, command, after_s):
    """A stop can come before a process's own signal handling is up (still importing, loading the model):
    still no traceback, one line, exit 0."""
    args = ["--router", "tcp://127.0.0.1:9"] if command == "decode" else ["--port", str(free_port())]
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", command, "--model", model_dir, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    while "libtorch" not in open(f"/proc/{proc.pid}/maps").read():  # past main(): loading torch now
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(after_s)  # 0: importing torch; 1.5 s: later, importing transformers or loading the model
    if proc.poll() is None:  # (a router with no workers keeps serving; a worker keeps waiting for one)
        proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    if after_s == 0:  # surely still starting: the start-up stop's one line
        assert out.strip().splitlines()[-1] == f"pdserve {command}: stopped", out
