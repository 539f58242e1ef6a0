"""The cluster: the processes a deployment runs and how they join, leave and are kept alive.

- ``launcher``: ``pdserve up``'s local launcher (``ClusterSpec``, ``LocalCluster``): starts the
  router tier and the pools, supervises them (restart with back-off), reconciles pool sizes.
- ``ray_launcher``: the same cluster placed on a Ray cluster's nodes (``pdserve up --ray``).
- ``scale``: the client side of live scaling (``pdserve scale``: ``/admin/scale``, ``/admin/pools``).
- ``worker_base``: the worker side of membership, shared by the prefill and decode workers:
  registration with every router of the tier, liveness (heartbeats), drain and exit, around the
  engine core's loop.

The engine imports nothing from here; the workers, the CLI and the benchmarks do.
"""
