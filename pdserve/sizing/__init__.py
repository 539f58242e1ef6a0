"""Sizing a cluster before running it: profile real workers, simulate the cluster, plan its pools.

The room above the router (it imports the engine's scheduling core and the router's policies; nothing
below imports it):

* ``profile``: the versioned profile file and the cost model read from it (a step's seconds from its
  batch, a KV transfer's seconds from its bytes), pure Python.
* ``profiler``: ``pdserve profile``, which measures real engines built from the workers' own flags.
* ``workload``: the requests a simulation replays (``pdserve bench serve``'s synthetic workloads, or a
  JSONL trace with Mooncake's or Azure's columns), made lazily so a million of them fit in memory.
* ``simulator``: ``pdserve simulate``, a discrete-event simulation that runs pdserve's own scheduler,
  block manager and routing policies with the model runner replaced by the cost model.
* ``planner``: ``pdserve plan``, DistServe's placement search over the simulator.

The SLA autoscaler that uses a profile while the cluster runs lives with the cluster
(``pdserve.cluster.autoscaler``); the command line hands it the profile's sizing.
"""
