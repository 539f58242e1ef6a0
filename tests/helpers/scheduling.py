"""Driving a Scheduler without a model: fake steps to completion."""

from __future__ import annotations

from pdserve.engine.scheduling.outputs import ModelRunnerOutput


def fake_step(sched, token=7):
    """Schedule, pretend to run the model, sample ``token`` wherever a token is due."""
    out = sched.schedule()
    for r, n in out.scheduled:  # the invariant the model runner relies on
        assert len(r.block_table) * sched.block_manager.block_size >= r.num_computed_tokens + n
    sampled = {r.request_id: token for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    return out, sched.update_from_output(out, ModelRunnerOutput(sampled))


def run_to_completion(sched, max_steps=1000):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return finished
        _, results = fake_step(sched)
        for o in results:
            if o.finished is not None:
                finished[o.request.request_id] = o.request
    raise AssertionError("requests did not finish")
