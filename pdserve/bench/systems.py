"""The systems ``pdserve bench compare`` measures, each started, measured and stopped in turn.

* ``pdserve-disagg``: a local cluster, ``num_prefill`` prefill + ``num_decode`` decode workers,
  the prefill pool on ``prefill_cores`` and the decode pool on ``decode_cores``.
* ``pdserve-colocated``: no prefill workers (``pdserve up --colocated``), decode workers on
  ``colocated_cores``.
* ``vllm-cpu``: vLLM's OpenAI server from another interpreter (its own venv).
* ``transformers-serve``: ``transformers serve --continuous-batching``.
* ``hf-generate``: Hugging Face ``generate`` in this process, static batches (throughput only;
  ``pdserve.bench.hf_static``).

A system that cannot run is a row that says why (``not installed: ...`` / ``failed: ...``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field

import httpx

SYSTEMS = ("pdserve-disagg", "pdserve-colocated", "vllm-cpu", "transformers-serve", "hf-generate")
DEFAULT_VLLM_PYTHON = "/work/vllm-venv/bin/python"


class SystemUnavailable(Exception):
    """The system is not installed here (the row reads ``not installed: <reason>``)."""


class SystemFailed(Exception):
    """The system is installed but did not serve (the row reads ``failed: <reason>``)."""


@dataclass
class SystemResult:
    """One row of the comparison.

    Args:
        name: the system (one of ``SYSTEMS``).
        status: ``ok``, ``not installed: <reason>`` or ``failed: <reason>``.
        setup: how it ran (workers, cores, versions), in words.
        metrics: ``compute_metrics``' dict (hf-generate: throughput fields only, latencies None).
        notes: caveats about how comparable its numbers are.
        errors: the first few request errors.
        sweep: with ``--request-rates``, one ``SweepPoint`` (as a dict) per rate served.
    """

    name: str
    status: str
    setup: str = ""
    metrics: dict | None = None
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    sweep: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def available_cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def default_core_split() -> tuple[list[int], list[int]]:
    """(prefill cores, decode cores): the first half of the cores and the rest (2 cores: 0 and 1)."""
    cores = available_cores()
    if len(cores) == 1:
        return cores, cores
    half = len(cores) // 2
    return cores[:half], cores[half:]


# --- processes ------------------------------------------------------------------------------------

def failure_reason(log_path: str, first: bool = False) -> str:
    """One line saying why a server failed: from the last (``first``: the first) ``SomeError: ...`` in its
    log, with the line after it; without one, its last lines."""
    try:
        with open(log_path, errors="replace") as f:
            lines = [line.rstrip() for line in f.read().splitlines() if line.strip()]
    except OSError:
        return ""
    found = [(i, m.start()) for i, line in enumerate(lines)
             if (m := re.search(r"\b[\w.]*(Error|Exception)\b[^:\s]*: ", line))
             and not re.search(r"\b(WARNING|INFO|DEBUG)\b", line[:m.start()])]  # not a logged warning
    if not found:
        return " | ".join(line.strip() for line in lines[-3:])[-400:]
    i, col = found[0] if first else found[-1]
    reason = lines[i][col:]
    if i + 1 < len(lines) and lines[i + 1][:1].isspace():  # an indented continuation (pydantic's reason)
        reason += " " + lines[i + 1].strip()
    return reason[:400]


class ServerProcess:
    """A server subprocess in its own process group, logging to ``log_path``.

    ``with ServerProcess(cmd, url, log_path, env) as s:`` starts it and waits until
    ``GET url/health`` answers 200 (raises SystemFailed if it exits first or ``timeout_s`` passes);
    leaving the block sends SIGTERM to the group, then SIGKILL after ``stop_timeout_s``, and waits.
    """

    def __init__(self, cmd: list[str], url: str, log_path: str, env: dict | None = None,
                 timeout_s: float = 600.0, stop_timeout_s: float = 30.0):
        self.cmd, self.url, self.log_path = cmd, url, log_path
        self.env = {**os.environ, **(env or {})}
        self.timeout_s, self.stop_timeout_s = timeout_s, stop_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        os.makedirs(os.path.dirname(self.log_path) or ".", exist_ok=True)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {shlex.join(self.cmd)}\n".encode())
            log.flush()
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemFailed(f"server exited with code {self.proc.returncode}: {failure_reason(self.log_path)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise SystemFailed(f"no healthy /health within {self.timeout_s:.0f} s: {failure_reason(self.log_path)}")

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it if still there after ``stop_timeout_s``; wait for the leader."""
        if self.proc is None or self.proc.returncode is not None:
            return
        pgid = self.proc.pid  # start_new_session: the leader's pid is the group id
        for sig, wait_s in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 30.0)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=wait_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # children left in the group after the leader exited
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def __exit__(self, *exc) -> None:
        self.stop()


# --- pdserve --------------------------------------------------------------------------------------

def pdserve_cluster_spec(model: str, num_prefill: int, num_decode: int, prefill_cores: list[int],
                         decode_cores: list[int], worker_args: list[str], router_args: list[str] = (),
                         core_lending: bool = False):
    """A ``ClusterSpec`` for a local cluster whose pools run on the given cores (one torch thread each)."""
    from pdserve.common.utils import format_cpu_list, free_port
    from pdserve.cluster.launcher import ClusterSpec

    prefill_args = ["--cpu-cores", format_cpu_list(prefill_cores), "--num-threads", str(len(prefill_cores))]
    decode_args = ["--cpu-cores", format_cpu_list(decode_cores), "--num-threads", str(len(decode_cores))]
    return ClusterSpec(model=model, num_prefill=num_prefill, num_decode=num_decode, port=free_port(),
                       worker_args=list(worker_args), prefill_args=prefill_args, decode_args=decode_args,
                       router_args=list(router_args), core_lending=core_lending)


def pin_cluster(cluster, prefill_cores: list[int], decode_cores: list[int]) -> str:
    """Keep the router off the workers' cores where a core is left over (as vLLM's API server runs
    beside its pinned model worker); otherwise it floats. The workers pin themselves (``--cpu-cores``).
    Returns where the router runs, in words."""
    spare = set(available_cores()) - set(prefill_cores if cluster.spec.num_prefill else []) - set(decode_cores)
    if not spare or not hasattr(os, "sched_setaffinity"):
        return "router unpinned"
    for name, proc in cluster.procs:
        if name == "router":
            os.sched_setaffinity(proc.pid, spare)
    return f"router on {_cores_text(sorted(spare))}"


def _cores_text(cores: list[int]) -> str:
    from pdserve.common.utils import format_cpu_list

    return f"core{'s' if len(cores) > 1 else ''} {format_cpu_list(cores)}"


def run_pdserve(cfg, requests, bench, colocated: bool) -> SystemResult:
    """Start a local pdserve cluster, run ``bench(url, model, backend)`` against it, stop it."""
    from pdserve.cluster.launcher import LocalCluster

    name = "pdserve-colocated" if colocated else "pdserve-disagg"
    if colocated:
        num_prefill, num_decode = 0, cfg.colocated_num_decode
        prefill_cores, decode_cores = cfg.colocated_cores, cfg.colocated_cores
        setup = f"{num_decode} decode worker(s), no prefill workers, on {_cores_text(decode_cores)}"
    else:
        num_prefill, num_decode = cfg.num_prefill, cfg.num_decode
        prefill_cores, decode_cores = cfg.prefill_cores, cfg.decode_cores
        setup = (f"{num_prefill}P on {_cores_text(prefill_cores)} + {num_decode}D on "
                 f"{_cores_text(decode_cores)}")
    # pdserve up's own KV budget and max_num_seqs unless asked: the defaults are what is benchmarked
    kv = ["--kv-cache-memory", cfg.kv_cache_memory] if cfg.kv_cache_memory else []
    worker_args = [*kv, "--dtype", cfg.dtype, *cfg.pdserve_args]
    spec = pdserve_cluster_spec(cfg.model, num_prefill, num_decode, prefill_cores, decode_cores, worker_args,
                                cfg.pdserve_router_args, core_lending=cfg.core_lending and not colocated)
    log_dir = os.path.join(cfg.out_dir, "logs", name)
    cluster = LocalCluster(spec, log_dir=log_dir)
    try:
        cluster.__enter__()  # waits until every worker is live; stops what it started if not
    except Exception as e:  # noqa: BLE001  the row says why
        raise SystemFailed(f"cluster did not start: {e} (logs in {log_dir})") from None
    try:
        router_place = pin_cluster(cluster, prefill_cores, decode_cores)
        # steady-state speed: the decode steps compiled, as vLLM's are before it serves (a worker serves
        # at once, with eager steps while it compiles: /workers' decode_step)
        if not cluster.wait_decode_steps_compiled(timeout_s=cfg.server_timeout_s):
            raise SystemFailed(f"decode steps still compiling after {cfg.server_timeout_s:.0f} s (logs in {log_dir})")
        result = bench(cluster.url, None, "openai")
    finally:
        cluster.__exit__(None, None, None)
    extra = f"; worker args: {shlex.join([*kv, *cfg.pdserve_args])}" if kv or cfg.pdserve_args else ""
    if cfg.pdserve_router_args:
        extra += f"; router args: {shlex.join(cfg.pdserve_router_args)}"
    if spec.core_lending:
        extra += "; core lending"
    return _row(name, f"{setup}, {router_place}{extra}",
                result)


def _row(name: str, setup: str, result, notes: list[str] | None = None, log_path: str | None = None) -> SystemResult:
    """The row of a system that served: ``ok``, or ``failed`` when not one request completed (with the
    first error, and the first error its server logged)."""
    status = "ok"
    if result.metrics["completed"] == 0:
        status = f"failed: all {result.metrics['failed']} requests failed: {result.errors[0][:200]}"
        if log_path and (reason := failure_reason(log_path, first=True)):
            status += f"; server log: {reason}"
    return SystemResult(name, status, setup, result.metrics, notes or [], result.errors[:5])


# --- vLLM -----------------------------------------------------------------------------------------

def default_vllm_kv_gib() -> int:
    """vLLM's KV budget when not given (``VLLM_CPU_KVCACHE_SPACE``, whole GiB): what ``--kv-cache-memory
    auto`` gives a lone pdserve worker, ``DEFAULT_MEMORY_UTILIZATION`` of the host's memory less ~1 GiB
    of weights and runtime. Not vLLM's own default: its CPU worker takes 92% of the machine's memory, and
    on a 24 GiB VM that left 9 MiB free under load (the kernel reclaiming pages, 9 generated tokens/s)."""
    from pdserve.common.utils import host_memory_limit
    from pdserve.engine.config import DEFAULT_MEMORY_UTILIZATION

    return max(1, int(DEFAULT_MEMORY_UTILIZATION * host_memory_limit() / 2**30 - 1))


def run_vllm(cfg, requests, bench) -> SystemResult:
    """vLLM's OpenAI server from ``cfg.vllm_python``. Raises SystemUnavailable / SystemFailed."""
    from pdserve.common.utils import free_port

    python = cfg.vllm_python
    if not python or not os.path.exists(python):
        raise SystemUnavailable(f"no interpreter at {python} (see benchmarks/setup_vllm_cpu.sh)")
    try:
        probe = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True,
                               text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemUnavailable(f"{python} could not import vllm: {e}") from None
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemUnavailable(f"vllm does not import in {python}: {last[:300]}")
    version = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else "?"
    port = free_port()
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model, "--dtype", cfg.dtype,
           "--port", str(port), "--host", "127.0.0.1", *cfg.vllm_args]
    env = {"VLLM_CPU_KVCACHE_SPACE": str(cfg.vllm_kv_gib or default_vllm_kv_gib()), **cfg.vllm_env}
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(cfg.out_dir, "logs", "vllm-cpu.log")
    with ServerProcess(cmd, url, log_path, env, timeout_s=cfg.server_timeout_s):
        result = bench(url, None, "openai")
    binding = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
    setup = f"vLLM {version}, {cfg.dtype}, KV {env['VLLM_CPU_KVCACHE_SPACE']} GiB, OMP threads bind {binding}"
    if cfg.vllm_args:
        setup += f"; args: {shlex.join(cfg.vllm_args)}"
    return _row("vllm-cpu", setup, result, log_path=log_path)


# --- transformers serve ---------------------------------------------------------------------------

def run_transformers_serve(cfg, requests, bench) -> SystemResult:
    """``transformers serve --continuous-batching`` on ``cfg.model``. Raises SystemUnavailable / SystemFailed."""
    from pdserve.common.utils import free_port

    exe = shutil.which("transformers")
    if exe is None:
        raise SystemUnavailable("no `transformers` command on PATH")
    try:
        help_text = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise SystemUnavailable(f"`transformers serve --help` failed: {e}") from None
    if "--host" not in help_text:
        raise SystemUnavailable("this transformers has no `serve` command")
    import transformers

    notes = ["text prompts: the workload's token ids are decoded and the server re-tokenizes them, so "
             "prompt lengths differ a little (its usage counts are used); EOS is turned off through "
             "`generation_config` (its API has no `ignore_eos`); it streams text in chunks as its "
             "detokenizer releases them"]
    flags = []
    if "--continuous-batching" in help_text:
        flags.append("--continuous-batching")
    else:
        notes.append("this version has no --continuous-batching flag: ran without it")
    port = free_port()
    cmd = [exe, "serve", *flags, "--host", "127.0.0.1", "--port", str(port), "--dtype", cfg.dtype,
           "--device", "cpu", *cfg.transformers_args, cfg.model]
    url = f"http://127.0.0.1:{port}"
    env = {"OMP_NUM_THREADS": str(len(available_cores()))}
    log_path = os.path.join(cfg.out_dir, "logs", "transformers-serve.log")
    try:
        with ServerProcess(cmd, url, log_path, env, timeout_s=cfg.server_timeout_s):
            result = bench(url, cfg.model, "transformers-serve")
    except SystemFailed as e:
        if "requires `accelerate`" in str(e):  # it loads with a device_map, which needs accelerate
            raise SystemUnavailable("transformers serve needs the `accelerate` package (pip install "
                                    "accelerate)") from None
        raise
    setup = f"transformers {transformers.__version__} serve {' '.join(flags)}, {cfg.dtype}, all cores"
    return _row("transformers-serve", setup, result, notes, log_path)


def describe_failure(exc: BaseException) -> str:
    """The status line of a system that did not produce numbers."""
    if isinstance(exc, SystemUnavailable):
        return f"not installed: {exc}"
    if isinstance(exc, SystemFailed):
        return f"failed: {exc}"
    return f"failed: {type(exc).__name__}: {exc}"[:700]
