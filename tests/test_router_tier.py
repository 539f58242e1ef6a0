"""A router tier: two routers share one HTTP port and one worker pool (``pdserve up --num-routers 2``).

Real processes, faults by signal: SIGKILL one router mid-stream and the other router's streams
finish token-exact (against transformers' ``generate``), the workers drop the dead router's
requests within 2 s (their KV blocks free again), a retry on the shared URL succeeds at once and
the launcher restarts the router; SIGKILL both and the workers register with the restarted ones.
"""

from __future__ import annotations

import re
import signal
import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.common.config import WorkerConfig, resolve_router_addrs
from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import wait_all_blocks_free
from tests.helpers.cluster import stream_until_cut

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def tier(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tier-logs")
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       num_routers=2, worker_args=["--kv-cache-memory", "16MiB"])
    with LocalCluster(spec, log_dir=str(logs)) as cluster:  # supervised: routers are restarted
        cluster.logs = logs
        yield cluster
    assert not [p for _, p in cluster.procs if p.poll() is None], "a cluster process outlived stop()"


def complete(url: str, prompt: str, max_tokens: int = 4) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True})


def wait_router_serves(url: str, timeout_s: float = 40.0) -> None:
    """Until the router at ``url`` lists both workers (they registered with it) and serves a request."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            health = httpx.get(f"{url}/health", timeout=2).json()
            if (health["num_prefill"], health["num_decode"]) == (1, 1):
                break
        except (httpx.HTTPError, ValueError):
            pass
        assert time.monotonic() < deadline, f"the workers did not register with the router at {url}"
        time.sleep(0.2)
    resp = complete(url, "hello again")
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


def test_both_routers_serve_one_pool_and_one_keeps_the_pool_targets(tier):
    r0, r1 = tier.router_urls()
    for url, router_id in ((r0, "router-0"), (r1, "router-1")):
        assert httpx.get(f"{url}/info", timeout=5).json()["router_id"] == router_id
        workers = httpx.get(f"{url}/workers", timeout=5).json()
        assert sorted(w["id"] for w in workers) == ["decode-0", "prefill-0"]  # each worker registered with both
        resp = complete(url, f"served by {router_id}")
        assert resp.status_code == 200 and resp.json()["id"].startswith(f"cmpl-{router_id}-")
    # the targets live in router-0: router-1 forwards /admin/scale and /admin/pools there
    body = httpx.post(f"{r1}/admin/scale", json={"decode": 1}, timeout=10).json()
    assert body["pools"]["decode"]["desired"] == 1
    assert httpx.get(f"{r0}/admin/pools", timeout=5).json()["decode"]["desired"] == 1
    assert httpx.get(f"{tier.url}/admin/pools", timeout=5).json()["decode"]["desired"] == 1


def test_a_router_killed_mid_stream_loses_only_its_own_requests(tier, model_dir):
    r0, r1 = tier.router_urls()
    tok = AutoTokenizer.from_pretrained(model_dir)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = [f"the quick brown fox {i} jumps over" for i in range(4)]
    wait_all_blocks_free(tier)  # the KV level before: every block free

    doomed_streaming, survivors_streaming = threading.Barrier(5), threading.Barrier(5)
    texts: dict[int, str] = {}
    errors: list[str] = []

    def survivor(i):  # greedy streams on router-0, which must finish untouched
        try:
            with httpx.stream("POST", f"{r0}/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": prompts[i], "max_tokens": 48, "temperature": 0,
                                    "stream": True}) as resp:
                assert resp.status_code == 200
                parts, waited = [], False
                for line in resp.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = httpx.Response(200, content=line[6:]).json()
                    assert "error" not in chunk, chunk
                    parts.append(chunk["choices"][0]["text"])
                    if not waited:
                        waited = True
                        survivors_streaming.wait(timeout=60)
                texts[i] = "".join(parts)
        except Exception as e:  # noqa: BLE001  reported by the main thread
            errors.append(f"stream {i}: {type(e).__name__}: {e}")

    # long streams on router-1, cut off when it dies
    threads = [threading.Thread(target=stream_until_cut, args=(r1, f"a river bank {i}", doomed_streaming), daemon=True)
               for i in range(4)]
    for t in threads:
        t.start()
    doomed_streaming.wait(timeout=60)
    survivors = [threading.Thread(target=survivor, args=(i,), daemon=True) for i in range(4)]
    for t in survivors:
        t.start()
    survivors_streaming.wait(timeout=60)  # all 8 stream: router-0's 4 are mid-stream
    victim = tier.routers["router-1"].handle
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    victim.wait(timeout=10)

    resp = complete(tier.url, "a client retries")  # the shared port now leads to router-0 alone
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4

    log = tier.logs / "decode-0.log"
    while not re.search(r"router at tcp://127\.0\.0\.1:\d+ has been down [\d.]+ s; dropped [1-4] requests",
                        log.read_text()):
        assert time.monotonic() - killed_at < 2.0, "the decode worker kept the dead router's requests"
        time.sleep(0.05)

    for t in survivors:
        t.join(timeout=60)
    assert not errors, errors
    for i, prompt in enumerate(prompts):
        ids = tok(prompt).input_ids
        out = ref.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False)[0, len(ids):]
        assert texts[i] == tok.decode(out, skip_special_tokens=True), f"router-0's stream {i} changed"
    wait_all_blocks_free(tier)  # router-1's requests are gone from the workers, their KV free

    wait_router_serves(r1)  # the launcher restarted router-1 and the workers registered with it
    assert tier.routers["router-1"].num_restarts == 1
    for t in threads:
        t.join(timeout=10)


def test_workers_register_again_when_every_router_restarts(tier):
    for r in tier.routers.values():
        r.handle.send_signal(signal.SIGKILL)
    for r in tier.routers.values():
        r.handle.wait(timeout=10)
    for url in tier.router_urls():
        wait_router_serves(url)  # restarted by the launcher; the workers' next registration finds them
    assert tier.workers["decode-0"].handle.poll() is None  # the workers lived on


def test_router_addresses_are_a_list_or_a_name_resolved_to_every_router():
    config = WorkerConfig(role="decode", router_addr="tcp://127.0.0.1:8001, tcp://localhost:8002")
    assert config.router_addrs == ["tcp://127.0.0.1:8001", "tcp://localhost:8002"]
    assert resolve_router_addrs(config.router_addrs) == ["tcp://127.0.0.1:8001", "tcp://127.0.0.1:8002"]
    unresolved = "tcp://no-such-router.invalid:8001"  # not resolvable now: ZMQ resolves it when it connects
    assert resolve_router_addrs([unresolved, "tcp://[::1]:8001"]) == [unresolved, "tcp://[::1]:8001"]
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        WorkerConfig(role="decode", router_addr="tcp://127.0.0.1:8001,http://x:1")


def test_a_decode_worker_streams_to_each_requests_router_and_drops_a_dead_routers_requests(model_dir):
    """In this process, two fake routers: each request's outputs go to the router that sent it; the
    worker registers with both; when one router's socket closes while the other is up, that router's
    request is dropped (its blocks freed) within ``ROUTER_LOST_S`` and the other one's goes on."""
    from pdserve.common.protocol import GenerateRequest, RegisterWorker, SamplingParams
    from pdserve.decode_worker.worker import DecodeWorker
    from pdserve.cluster.worker_base import ROUTER_LOST_S
    from tests.helpers.fake_peers import FakeRouter, make_worker

    a, b = FakeRouter(), FakeRouter()
    worker = make_worker(DecodeWorker, model_dir, f"{a.addr},{b.addr}")
    try:
        worker.start_liveness()
        regs = {r.addr: r.wait_for(RegisterWorker)[0] for r in (a, b)}
        assert {addr: reg.router_addr for addr, reg in regs.items()} == {a.addr: a.addr, b.addr: b.addr}
        params = SamplingParams(max_tokens=1500, temperature=0.0, ignore_eos=True)  # unfinished at the end
        for name, router in (("a", a), ("b", b)):
            worker.handle(GenerateRequest(request_id=f"from-{name}", prompt_token_ids=[5, 6, 7, 8],
                                          sampling_params=params, router_addr=router.addr))
        for _ in range(3):
            worker.run_once()
        time.sleep(0.2)  # the deltas on their way
        assert a.tokens("from-a") and not a.deltas("from-b")
        assert b.tokens("from-b") and not b.deltas("from-a")
        blocks = worker.core.block_manager
        held = lambda rid: len(worker.core.scheduler.requests[rid].block_table)  # noqa: E731
        assert blocks.num_free_blocks == blocks.num_blocks - held("from-a") - held("from-b")
        b.close()  # router b dies
        deadline = time.monotonic() + ROUTER_LOST_S + 2.0
        while "from-b" in worker.core.scheduler.groups:
            assert time.monotonic() < deadline, "the dead router's request was kept"
            worker.run_once()
            time.sleep(0.01)  # a few hundred steps at most: router a's request must still be running after
        assert "from-a" in worker.core.scheduler.groups  # router a's request goes on
        assert blocks.num_free_blocks == blocks.num_blocks - held("from-a")  # router b's blocks are free
        time.sleep(0.2)  # the deltas already sent arrive
        n = len(a.tokens("from-a"))
        worker.run_once()
        deadline = time.monotonic() + 5.0
        while len(a.tokens("from-a")) <= n:  # the new token's delta on its way to router a
            assert time.monotonic() < deadline, "router a's request stopped streaming"
            time.sleep(0.01)
    finally:
        worker.close()
        a.close()


def test_up_starts_a_tier_sharing_one_port_with_router_0_keeping_the_targets(model_dir, monkeypatch):
    """What ``pdserve up --num-routers 3`` runs (command lines only; no process is started)."""
    from pdserve.cli import build_parser
    from pdserve.router.config import RouterConfig

    args = build_parser().parse_args(["up", "--num-routers", "3", "--ray"])
    assert args.num_routers == 3  # up --ray takes it too
    spawned: dict[str, list[str]] = {}
    monkeypatch.setattr(LocalCluster, "_spawn", lambda self, name, argv: spawned.setdefault(name, argv))
    cluster = LocalCluster(ClusterSpec(model=model_dir, num_prefill=0, num_decode=1, port=18000, num_routers=3))
    cluster._start_router(0), cluster._start_router(1), cluster._start_router(2)
    cluster._start_worker("decode", "decode-0")
    parser = build_parser()
    routers = [RouterConfig.from_cli_args(parser.parse_args(spawned[f"router-{i}"])) for i in range(3)]
    assert [r.port for r in routers] == [18000] * 3 and all(r.reuse_port for r in routers)
    assert len({r.zmq_port for r in routers}) == len({r.direct_port for r in routers}) == 3
    assert [r.router_id for r in routers] == ["router-0", "router-1", "router-2"]
    owner = f"http://127.0.0.1:{routers[0].direct_port}"
    assert [r.pool_owner for r in routers] == [None, owner, owner]
    assert cluster.router_urls()[0] == owner and cluster.url == "http://127.0.0.1:18000"
    worker = parser.parse_args(spawned["decode-0"])
    assert worker.router_addr == ",".join(f"tcp://127.0.0.1:{r.zmq_port}" for r in routers)


def test_pool_owner_none_refuses_scale_and_an_unreachable_owner_is_a_503(model_dir):
    from fastapi.testclient import TestClient

    from pdserve.router import RouterConfig, build_app

    with pytest.raises(ValueError, match="pool_owner"):
        RouterConfig(model=model_dir, pool_owner="router-0")
    with TestClient(build_app(RouterConfig(model=model_dir, zmq_port=0, pool_owner="none"))) as client:
        resp = client.post("/admin/scale", json={"decode": 2})
        assert resp.status_code == 409 and "kubectl scale" in resp.json()["error"]["message"]
        assert client.get("/admin/pools").json()["decode"]["desired"] is None
    gone = f"http://127.0.0.1:{free_port()}"
    with TestClient(build_app(RouterConfig(model=model_dir, zmq_port=0, pool_owner=gone))) as client:
        resp = client.post("/admin/scale", json={"decode": 2})
        assert resp.status_code == 503 and gone in resp.json()["error"]["message"]


def test_a_drain_waits_for_every_connected_router(model_dir):
    """DrainWorker from one router: the worker tells the other (WorkerDraining) and exits only once
    that one has answered DrainWorker too."""
    from pdserve.common.protocol import DrainWorker, RegisterWorker, WorkerDraining, WorkerExiting
    from pdserve.decode_worker.worker import DecodeWorker
    from tests.helpers.fake_peers import FakeRouter, make_worker

    a, b = FakeRouter(), FakeRouter()
    worker = make_worker(DecodeWorker, model_dir, f"{a.addr},{b.addr}")
    try:
        worker.start_liveness()
        a.wait_for(RegisterWorker), b.wait_for(RegisterWorker)
        worker.mailbox.inject(DrainWorker(reason="pool scaled to 0", router_addr=a.addr))
        worker.run_once()
        assert b.wait_for(WorkerDraining) and not a.of_type(WorkerDraining)
        for _ in range(5):
            worker.run_once()
        assert not worker._stop.is_set()  # idle, but router b has not answered
        worker.mailbox.inject(DrainWorker(reason="draining", router_addr=b.addr))
        worker.run_once()  # handles it
        worker.run_once()  # sees the drain acknowledged by both
        assert worker._stop.is_set()
        assert a.wait_for(WorkerExiting) and b.wait_for(WorkerExiting)
    finally:
        worker.close()
        a.close()
        b.close()


def test_a_prefill_worker_drops_the_requests_of_a_dead_router(model_dir):
    """A prefill worker knows each request's router (``RemotePrefillRequest.router_addr``): one
    router's death drops that router's requests here too, and only those."""
    from pdserve.common.protocol import RegisterWorker, RemotePrefillRequest, SamplingParams
    from pdserve.cluster.worker_base import ROUTER_LOST_S
    from pdserve.prefill_worker.worker import PrefillWorker
    from tests.helpers.fake_peers import FakeRouter, make_worker

    a, b = FakeRouter(), FakeRouter()
    worker = make_worker(PrefillWorker, model_dir, f"{a.addr},{b.addr}", transfer_timeout_s=30.0)
    try:
        worker.start_liveness()
        a.wait_for(RegisterWorker), b.wait_for(RegisterWorker)
        for name, router in (("a", a), ("b", b)):  # the pairs never connect (no decode worker): they wait
            worker.handle(RemotePrefillRequest(
                request_id=f"from-{name}", prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(max_tokens=4),
                decode_worker_id="decode-x", decode_addr=f"tcp://127.0.0.1:{free_port()}", transfer_host="127.0.0.1",
                transfer_port=free_port(), pair_generation=0, dest_block_ids=[0], router_addr=router.addr))
        worker.run_once()
        assert set(worker.source.pending_pair) == {"from-a", "from-b"}
        b.close()
        deadline = time.monotonic() + ROUTER_LOST_S + 2.0
        while "from-b" in worker.source.pending_pair:
            assert time.monotonic() < deadline, "the dead router's request was kept"
            worker.run_once()
            time.sleep(0.01)  # a few hundred steps at most: router a's request must still be running after
        assert set(worker.source.pending_pair) == {"from-a"}
    finally:
        worker.close()
        a.close()
