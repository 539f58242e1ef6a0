"""Ray placement that fits or says why (issue 21): pdserve's own Ray declares the CPUs its workers
ask for; against a cluster that cannot hold a worker, start-up fails at once naming what is missing."""

from __future__ import annotations

import os
import time

import pytest

from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec
from pdserve.cluster.ray_launcher import RayCluster, placement_unfit

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only


def test_placement_unfit_names_what_is_missing():
    two_cpu_nodes = [{"CPU": 2.0}, {"CPU": 2.0}]
    assert placement_unfit({"CPU": 1}, 2, "STRICT_PACK", two_cpu_nodes) is None
    why = placement_unfit({"CPU": 1}, 3, "STRICT_PACK", two_cpu_nodes)  # TP 3 needs one node of 3 CPUs
    assert "{'CPU': 3} on one node" in why and "largest node has 2 CPU" in why and "--num-cpus" in why
    assert placement_unfit({"CPU": 1}, 3, "PACK", two_cpu_nodes) is None  # pipeline stages may spread
    why = placement_unfit({"CPU": 2, "gpu_node": 1}, 2, "PACK", [{"CPU": 8.0, "gpu_node": 1.0}, {"CPU": 8.0}])
    assert "nodes hold 1" in why


@pytest.mark.cluster
def test_ray_start_fails_at_once_when_a_worker_cannot_fit_and_declares_cpus_it_starts(model_dir):
    ray = pytest.importorskip("ray")
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       prefill_tensor_parallel_size=2)
    assert RayCluster(spec).needed_cpus() == 3
    ray.init(num_cpus=1, include_dashboard=False)  # an existing cluster of one CPU: prefill-0 needs 2 on one node
    cluster = RayCluster(spec, address="auto")
    try:
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=r"prefill-0 cannot be placed on this Ray cluster: .*'CPU': 2.* on one "
                                               r"node.*largest node has 1 CPU"):
            cluster.start()
        assert time.monotonic() - started < 60  # at once, not after ready_timeout_s
    finally:
        cluster.stop()
        ray.shutdown()
    own = RayCluster(spec)  # pdserve starts Ray itself: enough logical CPUs for its workers, whatever the cores
    try:
        own.connect()
        assert ray.cluster_resources()["CPU"] >= 3
    finally:
        ray.shutdown()
