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


def make_request(rid: str, tokens: list[int], max_tokens: int = 4):
    """A request for ``tokens`` (the scheduler's own ``Request``), no model needed."""
    from pdserve.common.protocol import SamplingParams
    from pdserve.engine.scheduling.request import Request

    return Request(rid, tokens, SamplingParams(max_tokens=max_tokens))


def compute_prompt(kv, request) -> int:
    """Admit ``request`` through ``kv`` (a KVCacheManager) with its prefix hit, 'compute' the rest of its
    prompt and cache its full blocks; returns the tokens the hit covered."""
    hit = kv.find_prefix(request)
    assert kv.allocate_slots(request, request.num_tokens, [], hit=hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return hit.num_blocks * kv.block_size
