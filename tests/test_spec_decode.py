"""Speculative decoding: n-gram lookup, rejection sampling's distribution, KV rollback in the
scheduler, and greedy exactness / metrics through ``LLM`` and a disaggregated cluster."""

import json
import time

import pytest
import torch

from pdserve.common.protocol import SamplingParams
from pdserve.engine.scheduling.block_manager import BlockManager
from pdserve.engine.scheduling.outputs import ModelRunnerOutput
from pdserve.engine.scheduling.request import Request
from pdserve.engine.execution.sampler import Sampler, SamplingRow
from pdserve.engine.scheduling.scheduler import Scheduler, SchedulerConfig
from pdserve.engine.speculative_config import SpeculativeConfig
from pdserve.engine.execution.spec_decode.ngram import NgramProposer
from pdserve.engine.execution.rejection_sampler import DraftGroup, RejectionSampler

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'


# ---- config and proposer ----------------------------------------------------------------------

def test_config_parses_vllm_json_and_rejects_bad_values(tmp_path):
    cfg = SpeculativeConfig.from_json(NGRAM)
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_max, cfg.prompt_lookup_min) == \
        ("ngram", 4, 3, 1)
    for bad in ['{"method": "medusa", "num_speculative_tokens": 2}', '{"method": "ngram"}',
                '{"method": "ngram", "num_speculative_tokens": 0}', '[1]', 'not json',
                '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
                '{"method": "ngram", "num_speculative_tokens": 2, "typo": 1}',
                json.dumps({"model": str(tmp_path), "num_speculative_tokens": 2})]:  # not a checkpoint
        with pytest.raises(ValueError):
            SpeculativeConfig.from_json(bad)


def test_ngram_lookup_takes_the_longest_most_recent_match():
    p = NgramProposer(4, lookup_min=1, lookup_max=3)
    #          0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 1, 2, 5, 6, 7, 3, 9, 5, 6, 7]
    # suffix (5, 6, 7) occurs at 0 and 5: the most recent earlier one (5) is followed by 3, 9, 5, 6.
    assert p.lookup(tokens, 4) == [3, 9, 5, 6]
    assert p.lookup(tokens, 2) == [3, 9]
    assert p.lookup([1, 2, 3, 4], 3) == []  # the last token never occurred before
    assert p.lookup([8, 1, 2, 9, 2], 3) == [9, 2]  # only the 1-gram (2) matches; what followed runs to the end
    assert NgramProposer(4, lookup_min=2, lookup_max=3).lookup([8, 1, 2, 9, 2], 3) == []


# ---- rejection sampling -----------------------------------------------------------------------

def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - probs).abs().sum())


@pytest.mark.parametrize("draft_kind", ["point_mass", "distribution"])
def test_rejection_sampling_keeps_the_target_distribution(draft_kind):
    """Whatever the drafts, the emitted tokens are distributed as the target's p (small vocab)."""
    torch.manual_seed(0)
    vocab, k, n = 6, 2, 6000
    target_logits = torch.randn(k + 1, vocab) * 1.5  # p_0, p_1, p_2 at the three positions
    p = torch.softmax(target_logits, dim=-1)
    q = torch.softmax(torch.randn(k, vocab), dim=-1)
    gen = torch.Generator().manual_seed(1)
    params = SamplingParams(temperature=1.0)
    rows, groups, logits = [], [], []
    for i in range(n):
        if draft_kind == "point_mass":  # a fixed guess, as prompt lookup makes (here a good one)
            drafts, draft_probs = [int(p[0].argmax()), int(p[1].argmax())], None
        else:
            drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(k)]
            draft_probs = q
        groups.append(DraftGroup(len(rows), drafts, draft_probs))
        rows += [SamplingRow(params, j) for j in range(k + 1)]
        logits.append(target_logits)
    out = RejectionSampler(Sampler(seed=3))(torch.cat(logits), rows, groups)
    first = torch.bincount(torch.tensor([(v.accepted + [v.token_id])[0] for v in out]), minlength=vocab).float()
    assert _tv(first, p[0]) < 0.03, (first / n, p[0])
    # The second token, given the first was the first draft (accepted): distributed as p_1.
    second = [(v.accepted + [v.token_id])[1] for v, g in zip(out, groups) if v.accepted]
    counts = torch.bincount(torch.tensor(second), minlength=vocab).float()
    assert len(second) > 500 and _tv(counts, p[1]) < 0.06, (counts / len(second), p[1])
    # Acceptance happens exactly as often as min(1, p/q) says, on average (not all, not none).
    assert 0 < sum(len(v.accepted) for v in out) < k * n


def test_rejection_sampling_greedy_accepts_exactly_the_argmax_prefix():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])  # argmax 1, 0, 2
    rows = [SamplingRow(SamplingParams(temperature=0, logprobs=1), j) for j in range(3)]
    sampler = RejectionSampler(Sampler())
    v = sampler(logits, rows, [DraftGroup(0, [1, 0])])[0]
    assert (v.accepted, v.token_id) == ([1, 0], 2)  # all accepted: bonus is row 2's argmax
    assert [lp.token_id for lp in v.logprobs] == [1, 0, 2]
    assert v.logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[1]))
    v = sampler(logits, rows, [DraftGroup(0, [1, 2])])[0]
    assert (v.accepted, v.token_id) == ([1], 0)  # second draft rejected: the argmax replaces it


# ---- scheduler: slots, accounting, rollback ------------------------------------------------------

class _FixedDrafts:
    drafts_at_execute = False

    def __init__(self, drafts):
        self.drafts = drafts

    def num_lookahead(self, request, max_k):
        request.spec_token_ids = self.drafts[:max_k]
        return len(request.spec_token_ids)


def test_scheduler_verifies_drafts_and_rolls_back_rejected_slots():
    bm = BlockManager(32, 4)
    sched = Scheduler(SchedulerConfig(8, 64, 256), bm)
    sched.proposer = _FixedDrafts([11, 12, 13])
    r = Request("r", [1, 2, 3, 4, 5], SamplingParams(max_tokens=6, temperature=0), eos_token_ids=frozenset({0}))
    sched.add_request(r)
    out = sched.schedule()
    assert out.scheduled == [(r, 5)]  # prefill: no drafts
    sched.update_from_output(out, ModelRunnerOutput({"r": 9}))
    out = sched.schedule()
    assert out.scheduled == [(r, 4)] and r.spec_token_ids == [11, 12, 13]  # last token + 3 drafts
    assert len(r.block_table) * 4 >= r.num_tokens + 3  # slots for every draft
    # The target accepted 11 and replaced 12 by 20: 1 + 1 tokens computed, the rest rolled back.
    [o] = sched.update_from_output(out, ModelRunnerOutput({"r": 20}, accepted_draft_ids={"r": [11]}))
    assert o.new_token_ids == [11, 20] and r.output_token_ids == [9, 11, 20]
    assert r.num_computed_tokens == 7 == r.num_tokens - 1 and r.spec_token_ids == []
    assert (sched.stats.spec_decode_num_drafts, sched.stats.spec_decode_num_draft_tokens,
            sched.stats.spec_decode_num_accepted_tokens) == (1, 3, 1)
    # max_tokens=6 with 3 out: this step may emit at most 3 tokens, so at most 2 drafts.
    out = sched.schedule()
    assert out.scheduled == [(r, 3)] and r.spec_token_ids == [11, 12]
    [o] = sched.update_from_output(out, ModelRunnerOutput({"r": 30}, accepted_draft_ids={"r": [11, 12]}))
    assert o.new_token_ids == [11, 12, 30] and o.finished is not None  # max_tokens reached
    assert bm.num_free_blocks == bm.num_blocks


def test_drafts_never_preempt_anyone():
    bm = BlockManager(4, 4)
    bm.allocate(1)  # held elsewhere: 3 blocks (12 slots) left
    sched = Scheduler(SchedulerConfig(8, 64, 256), bm)
    sched.proposer = _FixedDrafts([7, 7, 7, 7])
    r = Request("r", list(range(1, 8)), SamplingParams(max_tokens=8, temperature=0))
    sched.add_request(r)
    sched.update_from_output(sched.schedule(), ModelRunnerOutput({"r": 9}))
    out = sched.schedule()
    assert out.scheduled == [(r, 5)]  # 8 tokens + 4 drafts = 12 slots: they fit
    sched.update_from_output(out, ModelRunnerOutput({"r": 9}))  # every draft rejected
    out = sched.schedule()
    # 9 tokens + 4 drafts would need a 4th block: decode one token instead of preempting.
    assert out.scheduled == [(r, 1)] and not out.preempted and r.spec_token_ids == []


# ---- end to end ---------------------------------------------------------------------------------

REPETITIVE = ["alpha beta gamma delta alpha beta gamma delta alpha beta gamma",
              "x = 1\ny = 2\nx = 1\ny = 2\nx = 1\ny =", "one two three"]


@pytest.fixture(scope="module")
def greedy_reference(model_dir):
    from pdserve.llm import LLM

    with LLM(model_dir, kv_cache_memory="16MiB") as llm:
        return llm.generate(REPETITIVE, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
                            use_tqdm=False)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_llm_greedy_speculative_decoding_is_token_identical(model_dir, greedy_reference, method):
    from pdserve.llm import LLM

    cfg = NGRAM if method == "ngram" else json.dumps(
        {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3})
    with LLM(model_dir, kv_cache_memory="16MiB", speculative_config=cfg) as llm:
        outs = llm.generate(REPETITIVE, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2),
                            use_tqdm=False)
        stats = llm.scheduler.stats
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    for ref, out in zip(greedy_reference, outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for a, b in zip(ref.outputs[0].logprobs, out.outputs[0].logprobs):
            assert (a.token_id, a.top_token_ids) == (b.token_id, b.top_token_ids)
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert stats.spec_decode_num_draft_tokens > 0 and stats.spec_decode_num_accepted_tokens > 0
    if method == "draft_model":  # the draft is the target itself: every greedy draft is accepted
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens


def test_llm_sampled_speculative_decoding_keeps_stop_rules_and_seeds(model_dir):
    from pdserve.llm import LLM

    params = SamplingParams(max_tokens=20, temperature=0.8, seed=7, n=2, min_tokens=5)
    with LLM(model_dir, kv_cache_memory="16MiB", speculative_config=NGRAM) as llm:
        a = llm.generate(REPETITIVE, params, use_tqdm=False)
        b = llm.generate(REPETITIVE, params, use_tqdm=False)
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    for x, y in zip(a, b):  # seeded: reproducible run to run
        assert [c.token_ids for c in x.outputs] == [c.token_ids for c in y.outputs]
        for c in x.outputs:
            assert 5 <= len(c.token_ids) <= 20


@pytest.mark.cluster
def test_disaggregated_cluster_speculates_token_exactly_with_priorities(model_dir, tmp_path):
    """1 prefill + 1 decode worker: the prefill worker samples the first token, the decode worker
    speculates the rest (ngram); greedy output equals transformers', drafts show in /metrics."""
    import httpx
    import openai

    from pdserve.common.utils import free_port
    from pdserve.cluster.launcher import ClusterSpec, LocalCluster
    from tests.helpers.cluster import hf_greedy_texts

    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "16MiB", "--remote-prefill-threshold", "0",
                                    "--speculative-config", NGRAM, "--scheduling-policy", "priority"])
    expected = hf_greedy_texts(model_dir, REPETITIVE, 24)
    with LocalCluster(spec, log_dir=str(tmp_path)) as cluster:
        client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
        for i, prompt in enumerate(REPETITIVE):
            resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                             logprobs=1, extra_body={"ignore_eos": True, "priority": i - 1})
            assert resp.choices[0].text == expected[prompt]
            assert len(resp.choices[0].logprobs.tokens) == resp.usage.completion_tokens == 24
        stream = client.completions.create(model="tiny", prompt=REPETITIVE[0], max_tokens=24, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in stream if c.choices) == expected[REPETITIVE[0]]
        metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text

        def total(name):
            return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                       if line.startswith(name + "_total{") or line.startswith(name + "{"))

        deadline = time.monotonic() + 10
        while total("vllm:spec_decode_num_draft_tokens") == 0 and time.monotonic() < deadline:
            time.sleep(0.5)  # counters come with the next heartbeat
            metrics = httpx.get(f"{cluster.url}/metrics", timeout=10).text
        assert total("vllm:spec_decode_num_drafts") > 0
        assert 0 < total("vllm:spec_decode_num_accepted_tokens") <= total("vllm:spec_decode_num_draft_tokens")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_under_a_grammar_stays_valid_and_greedy_exact(model_dir, method):
    """Drafts are cut to what the grammar allows and each verified row is masked by the grammar
    state after the drafts before it: output parses, and greedy equals non-speculative greedy."""
    import jsonschema

    from pdserve.common.protocol import StructuredOutputsParams
    from pdserve.llm import LLM
    from tests.helpers.schemas import SCHEMA

    so = StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True)
    greedy = SamplingParams(max_tokens=160, temperature=0, structured_outputs=so)
    sampled = SamplingParams(max_tokens=160, temperature=1.0, n=4, seed=1, structured_outputs=so)
    prompts = REPETITIVE[:2]
    with LLM(model_dir, kv_cache_memory="16MiB") as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    cfg = NGRAM if method == "ngram" else json.dumps(
        {"method": "draft_model", "model": model_dir, "num_speculative_tokens": 3})
    with LLM(model_dir, kv_cache_memory="16MiB", speculative_config=cfg) as llm:
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)] == reference
        outs = llm.generate(prompts, sampled, use_tqdm=False)
        assert llm.scheduler.stats.spec_decode_num_accepted_tokens > 0
        assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    for out in outs:
        for choice in out.outputs:
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(choice.text), SCHEMA)
