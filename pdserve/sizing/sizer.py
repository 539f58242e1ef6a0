"""How many workers each pool needs for a load, from a profile: the SLA autoscaler's sizing.

Closed-form, so the autoscaler decides in microseconds each interval (``pdserve plan`` simulates;
this estimates), as Dynamo's SLA planner sizes pools from its profile's interpolated TTFT and ITL:

* **prefill pool**: each prefill worker is a queue serving prompts in ``s = prefill(mean input)``
  seconds (times the slowdown the profile measured in a serving cluster). With Poisson arrivals and
  fixed service (M/D/1), a prompt waits ``rho * s / (2 (1 - rho))`` on average at utilisation ``rho``;
  the TTFT SLO leaves ``a = ttft - s - request_overhead`` for that wait, so a worker may run at
  ``rho <= 2a / (s + 2a)`` (capped at ``max_utilization``), and the pool needs ``ceil(rate * s / rho)``
  workers.
* **decode pool**: the largest batch ``B`` whose step ``decode(B, mean context)`` stays within the TPOT
  SLO (and whose sequences fit the KV cache and ``max_num_seqs``) is what one worker can hold; by
  Little's law the cluster holds ``rate * mean output * step`` requests at once, so it needs
  ``ceil(rate * mean output * decode(B, C) / B)`` workers.
* **colocated**: every worker does both: the prefill time share ``rate * s`` and the decode share add up.
"""

from __future__ import annotations

import math

from pdserve.sizing.profile import Profile, WorkerProfile

MAX_UTILIZATION = 0.8  # no pool is sized to run busier than this


class ProfileSizer:
    """``(request rate, mean input tokens, mean output tokens) -> (prefill workers, decode workers)``.

    Args:
        profile: the workers' measurements.
        slos_ms: ``{"ttft": ms, "tpot": ms}``; a missing one does not bind.
        colocated: size a colocated pool (prefill workers always 0).

    Raises:
        ValueError: the profile lacks the worker kinds sizing needs.
    """

    def __init__(self, profile: Profile, slos_ms: dict[str, float], colocated: bool = False,
                 max_utilization: float = MAX_UTILIZATION):
        self.profile = profile
        self.ttft_s = slos_ms.get("ttft", math.inf) / 1000
        self.tpot_s = slos_ms.get("tpot", math.inf) / 1000
        self.colocated = colocated
        self.max_utilization = max_utilization
        self.decode = profile.worker("colocated" if colocated else "decode")
        self.prefill = self.decode if colocated else profile.worker("prefill")

    def prefill_utilization(self, service_s: float) -> float:
        """The busiest a prefill queue with ``service_s`` per prompt may run and keep the TTFT SLO (M/D/1)."""
        slack = self.ttft_s - service_s - self.profile.request_overhead_s
        if slack <= 0:
            return 0.05  # the SLO is out of reach even at idle: run the pool nearly empty
        return min(self.max_utilization, 2 * slack / (service_s + 2 * slack)) if math.isfinite(slack) \
            else self.max_utilization

    def decode_batch(self, worker: WorkerProfile, mean_input: float, mean_output: float) -> tuple[int, float]:
        """(The largest batch within the TPOT SLO, the KV cache and max_num_seqs, its step seconds)."""
        context = mean_input + mean_output / 2
        tokens_per_seq = mean_input + mean_output
        kv_cap = max(1, int(worker.num_blocks * worker.block_size // max(1.0, tokens_per_seq)))
        best = 1
        for batch in range(1, min(worker.max_num_seqs, kv_cap) + 1):
            if worker.decode(batch, context) <= self.tpot_s:
                best = batch
            else:
                break
        return best, worker.decode(best, context)

    def __call__(self, rate: float, mean_input: float, mean_output: float) -> tuple[int, int]:
        if rate <= 0:
            return (0 if self.colocated else 1), 1
        service = self.prefill.prefill(mean_input) * self.prefill.prefill_slowdown(mean_input)  # as served
        batch, step = self.decode_batch(self.decode, mean_input, mean_output)
        decode_share = rate * max(0.0, mean_output - 1) * step / batch  # busy workers' worth of decoding
        if self.colocated:
            prefill_share = rate * service / self.prefill_utilization(service)
            return 0, max(1, math.ceil(prefill_share + decode_share / self.max_utilization))
        prefill_workers = math.ceil(rate * service / self.prefill_utilization(service))
        return max(1, prefill_workers), max(1, math.ceil(decode_share / self.max_utilization))
