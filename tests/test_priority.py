"""Priority scheduling (vLLM's ``--scheduling-policy priority``): waiting order, preemption victims,
and the ``priority`` field through ``LLM`` and the validation rules."""

import pytest

from pdserve.common.protocol import SamplingParams
from pdserve.common.validation import ValidationError
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.request import Request
from pdserve.engine.scheduling.request_queue import FCFSQueue, PriorityQueue, make_waiting_queue
from pdserve.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from tests.helpers.scheduling import fake_step, run_to_completion


def make(policy, num_blocks=64, block_size=4, max_num_seqs=8, budget=64):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(max_num_seqs, budget, 256, policy=policy), bm), bm


def req(rid, prompt_len, priority=0, max_tokens=4, arrival=None):
    r = Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens, priority=priority),
                eos_token_ids=frozenset({0}))
    if arrival is not None:
        r.arrival_time = arrival
    return r


def test_priority_queue_orders_by_priority_then_arrival():
    q = PriorityQueue()
    for rid, prio, t in [("late-urgent", 0, 3.0), ("bulk", 5, 1.0), ("early-urgent", 0, 2.0), ("mid", 1, 0.5)]:
        q.add(req(rid, 2, prio, arrival=t))
    assert [r.request_id for r in q] == ["early-urgent", "late-urgent", "mid", "bulk"]
    q.remove(next(r for r in q if r.request_id == "mid"))
    assert q.pop().request_id == "early-urgent" and len(q) == 2
    # A preempted request returns to its place by (priority, arrival), not to the head.
    q.prepend(req("preempted-bulk", 2, 5, arrival=0.1))
    assert [r.request_id for r in q] == ["late-urgent", "preempted-bulk", "bulk"]


def test_fcfs_queue_prepends_preempted_requests():
    q = make_waiting_queue("fcfs")
    assert isinstance(q, FCFSQueue)
    q.add(req("a", 2, 9))
    q.add(req("b", 2, 0))
    q.prepend(req("p", 2, 5))
    assert [r.request_id for r in q] == ["p", "a", "b"]  # priorities are ignored
    with pytest.raises(ValueError):
        make_waiting_queue("lifo")


def test_priority_policy_admits_lower_priority_value_first():
    sched, _ = make("priority", max_num_seqs=1)
    for rid, prio in [("bulk", 10), ("normal", 1), ("urgent", -1)]:
        sched.add_request(req(rid, 4, prio, max_tokens=2))
    order = []
    for _ in range(20):
        out, _ = fake_step(sched)
        order += [r.request_id for r, _ in out.scheduled if r.request_id not in order]
        if not sched.has_unfinished():
            break
    assert order == ["urgent", "normal", "bulk"]


def test_fcfs_policy_keeps_arrival_order_whatever_the_priority():
    sched, _ = make("fcfs", max_num_seqs=1)
    for rid, prio in [("bulk", 10), ("urgent", -1)]:
        sched.add_request(req(rid, 4, prio, max_tokens=2))
    out, _ = fake_step(sched)
    assert [r.request_id for r, _ in out.scheduled] == ["bulk"]


def test_preemption_evicts_the_lowest_priority_even_if_admitted_first():
    # 6 blocks of 4 tokens; two 8-token prompts take 2 blocks each, then both grow until one must go.
    sched, bm = make("priority", num_blocks=6)
    low = req("low", 8, priority=5, max_tokens=8)
    high = req("high", 8, priority=0, max_tokens=8)
    sched.add_request(low)
    fake_step(sched)  # low is admitted first (running order: low, high)
    sched.add_request(high)
    fake_step(sched)
    preempted = []
    for _ in range(8):
        out, _ = fake_step(sched)
        preempted += [r.request_id for r in out.preempted]
        # A victim scheduled earlier in the same step is taken out of the batch again.
        assert not {r.request_id for r, _ in out.scheduled} & {r.request_id for r in out.preempted}
    assert preempted and set(preempted) == {"low"}  # fcfs would have evicted "high" (admitted last)
    run_to_completion(sched)
    assert low.num_output_tokens == high.num_output_tokens == 8
    assert high.num_preemptions == 0 and low.num_preemptions >= 1
    assert bm.num_free_blocks == bm.num_blocks


def test_llm_priority_argument_and_fcfs_refusal(model_dir):
    from pdserve.llm import LLM

    params = SamplingParams(max_tokens=3, temperature=0)
    with LLM(model_dir, kv_cache_memory="8MiB", max_num_seqs=1, scheduling_policy="priority") as llm:
        prompts = ["alpha beta", "gamma delta", "epsilon zeta"]
        outs = llm.generate(prompts, params, use_tqdm=False, priority=[2, 0, 1])
        reference = llm.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference]
        assert [o.prompt for o in outs] == prompts  # results in input order, whatever the run order
        with pytest.raises(ValueError):
            llm.generate(prompts, params, use_tqdm=False, priority=[0, 1])
    with LLM(model_dir, kv_cache_memory="8MiB") as llm:  # fcfs: a priority is refused, as vLLM does
        with pytest.raises(ValidationError, match="priority scheduling is not enabled") as e:
            llm.generate(["alpha"], SamplingParams(max_tokens=2, priority=3), use_tqdm=False)
        assert e.value.param == "priority"
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
