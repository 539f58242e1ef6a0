"""`pdserve up --ray` on a local Ray cluster of two simulated nodes (ray.cluster_utils.Cluster).

The prefill pool (one worker of two tensor-parallel ranks) is pinned to the node that has the
``prefill_node`` resource, the decode pool to the other one; requests through the router are
token-identical to transformers; the decode pool grows and shrinks (``pdserve scale``), each
worker its own placement group; SIGTERM removes every actor and placement group. Everything
stays on loopback: Ray is told not to look for a "reachable" address.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.common.utils import free_port
from pdserve.cluster.scale import scale_pools

# Ray's node address = 127.0.0.1 (read once, when ray is imported): nothing leaves loopback.
LOOPBACK_ONLY = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
os.environ.update(LOOPBACK_ONLY)
ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.cluster


@pytest.fixture
def two_nodes():
    assert ray._private.services.get_node_ip_address() == "127.0.0.1"
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 4, "resources": {"prefill_node": 4}, "node_ip_address": "127.0.0.1",
        "include_dashboard": False})
    cluster.add_node(num_cpus=4, resources={"decode_node": 4}, node_ip_address="127.0.0.1")
    try:
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


def created_groups() -> dict[str, dict]:
    return {g["name"]: g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"}


def listening_hosts(port: int) -> set[str]:
    """The IPv4 addresses a socket of this network namespace listens on at TCP ``port`` (/proc/net/tcp)."""
    hosts = set()
    for line in open("/proc/net/tcp").read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        addr, lport = local.split(":")
        if state == "0A" and int(lport, 16) == port:  # LISTEN
            hosts.add(".".join(str(int(addr[i:i + 2], 16)) for i in (6, 4, 2, 0)))
    return hosts


def test_pools_placed_on_their_nodes_serve_exactly_scale_and_sigterm_removes_everything(model_dir, two_nodes,
                                                                                        tmp_path):
    port = free_port()
    out = tmp_path / "up.out"
    up = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--ray", "--address", two_nodes.address,
                           "--model", model_dir, "--host", "0.0.0.0", "--port", str(port),
                           "--prefill-tensor-parallel-size", "2",
                           "--prefill-resources", '{"prefill_node": 1}', "--decode-resources", '{"decode_node": 1}',
                           "--remote-prefill-threshold", "0"], env={**os.environ, **LOOPBACK_ONLY},
                          stdout=out.open("wb"))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert up.poll() is None, "pdserve up --ray exited"
            assert time.monotonic() < deadline, "the Ray cluster never became healthy"
            try:
                health = httpx.get(f"{url}/health", timeout=2).json()
                if (health["num_prefill"], health["num_decode"]) == (1, 1):
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)

        # --host means what it means without Ray: the router binds every interface, as asked (it bound the
        # node's address whatever --host said), and the address printed works from this machine
        assert listening_hosts(port) == {"0.0.0.0"}
        deadline = time.monotonic() + 10
        while "pdserve is up" not in out.read_text():
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert f"pdserve is up: http://127.0.0.1:{port}/v1" in out.read_text()
        ray.init(address=two_nodes.address)
        node_resources = {n["NodeID"]: n["Resources"] for n in ray.nodes()}
        groups = created_groups()
        assert set(groups) == {"pdserve-prefill-0", "pdserve-decode-0"}
        prefill_nodes = set(groups["pdserve-prefill-0"]["bundles_to_node_id"].values())
        decode_nodes = set(groups["pdserve-decode-0"]["bundles_to_node_id"].values())
        assert len(groups["pdserve-prefill-0"]["bundles"]) == 2 and groups["pdserve-prefill-0"]["strategy"] == \
            "STRICT_PACK"
        assert all("prefill_node" in node_resources[n] for n in prefill_nodes)
        assert all("decode_node" in node_resources[n] for n in decode_nodes) and prefill_nodes != decode_nodes
        # each rank may hold half its node's memory times its part of the node's CPUs (--kv-cache-memory auto):
        # a thread of a 4-CPU node, times the worker's ranks (the auto budget splits it among them)
        ranks = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
                 if "--master-port" in (p.info["cmdline"] or []) and "pdserve" in p.info["cmdline"]]
        shares = {(c[c.index("--rank") + 1] if c[3] == "prefill" else "decode"): c[c.index("--memory-utilization") + 1]
                  for c in ranks}
        assert shares == {"0": "0.25", "1": "0.25", "decode": "0.125"}, ranks

        tok = AutoTokenizer.from_pretrained(model_dir)
        ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", timeout=120, max_retries=0)
        for prompt in ["the quick brown fox jumps over the lazy dog", "seven wizards quietly pack boxes of jugs"]:
            text = api.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].text
            ids = torch.tensor([tok.encode(prompt)])
            with torch.no_grad():
                out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False,
                                   pad_token_id=2)
            assert text == tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        deadline = time.monotonic() + 10  # the KV did cross the nodes (counters come with heartbeats)
        while 'pdserve:kv_transfers_total{model_name="tiny",role="decode",worker="decode-0"} 2.0' not in \
                httpx.get(f"{url}/metrics").text:
            assert time.monotonic() < deadline, "no KV transfer from the prefill node to the decode node"
            time.sleep(0.3)

        # the decode pool grows by a worker (its own placement group on the decode node), then shrinks
        grown = scale_pools(url, decode=2, wait=True, timeout_s=120)
        assert [w["id"] for w in grown["decode"]["workers"]] == ["decode-0", "decode-1"]
        groups = created_groups()
        assert set(groups) == {"pdserve-prefill-0", "pdserve-decode-0", "pdserve-decode-1"}
        assert set(groups["pdserve-decode-1"]["bundles_to_node_id"].values()) <= decode_nodes
        for _ in range(2):  # round-robin: one request on each decode worker
            assert api.completions.create(model="tiny", prompt="hi", max_tokens=3).usage.completion_tokens == 3
        shrunk = scale_pools(url, decode=1, wait=True, timeout_s=120)
        assert [w["id"] for w in shrunk["decode"]["workers"]] == ["decode-0"]  # the newest idle one drained
        deadline = time.monotonic() + 30  # the launcher removes a drained worker's actors and group
        while "pdserve-decode-1" in created_groups():
            assert time.monotonic() < deadline, "the drained worker's placement group was not removed"
            time.sleep(0.5)
        with pytest.raises(ValueError):
            ray.get_actor("pdserve-decode-1-rank0")

        up.send_signal(signal.SIGTERM)
        assert up.wait(timeout=60) == 0
        left = [g["name"] for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
        assert left == []
        for name in ("pdserve-router", "pdserve-prefill-0-rank0", "pdserve-prefill-0-rank1", "pdserve-decode-0-rank0"):
            with pytest.raises(ValueError):
                ray.get_actor(name)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
