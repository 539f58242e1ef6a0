import pytest
import torch

from pdserve.common.protocol import SamplingParams
from pdserve.engine.execution.sampler import Sampler, SamplingRow, _apply_penalties, row_seed


def rows(n, **kw):
    return [SamplingRow(SamplingParams(**kw), 0) for _ in range(n)]


def sample(sampler, logits, sampling_rows):
    return sampler(logits, sampling_rows).token_ids


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert sample(Sampler(), logits.clone(), rows(4, temperature=0.0)) == logits.argmax(-1).tolist()


def test_top_k_1_is_argmax_even_at_high_temperature():
    logits = torch.randn(3, 50)
    assert sample(Sampler(), logits.clone(), rows(3, temperature=5.0, top_k=1)) == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.full((1, 10), -10.0)
    logits[0, 3] = 5.0
    logits[0, 6] = 4.0  # p(3) ~ 0.73, p(6) ~ 0.27, rest ~ 0
    sampler = Sampler(seed=1)
    seen = {sample(sampler, logits.clone(), rows(1, temperature=1.0, top_p=0.5))[0] for _ in range(50)}
    assert seen == {3}
    seen = {sample(sampler, logits.clone(), rows(1, temperature=1.0, top_p=0.9))[0] for _ in range(200)}
    assert seen == {3, 6}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3])
    logits = probs.log().repeat(4000, 1)
    tokens = torch.tensor(sample(Sampler(seed=0), logits, rows(4000, temperature=1.0)))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seed_reproducible_per_position_and_independent_of_batch():
    logits = torch.randn(1, 100)
    a = sample(Sampler(seed=1), logits.clone(), [SamplingRow(SamplingParams(seed=42), 3)])
    other = torch.randn(1, 100)
    b = sample(Sampler(seed=2), torch.cat([other, logits]), [SamplingRow(SamplingParams(), 0),
                                                            SamplingRow(SamplingParams(seed=42), 3)])[1:]
    assert a == b
    draws = {sample(Sampler(), logits.clone(), [SamplingRow(SamplingParams(seed=s), 0)])[0] for s in range(30)}
    assert len(draws) > 1  # different seeds do differ


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(1, 5)
    logits[0, 2] = 100.0
    out = sample(Sampler(), logits, [SamplingRow(SamplingParams(temperature=0.0), 0, banned_token_ids=(2,))])
    assert out[0] != 2


def test_sampler_leaves_the_callers_logits_alone():
    logits = torch.randn(2, 8)
    before = logits.clone()
    params = SamplingParams(temperature=0.0, frequency_penalty=1.0, logprobs=2)
    Sampler()(logits, [SamplingRow(params, 2, banned_token_ids=(0,), output_token_ids=(1, 1)),
                       SamplingRow(params, 0, banned_token_ids=(3,))])
    assert torch.equal(logits, before)


# --- frequency / presence penalties ---------------------------------------------------------------

def test_penalties_match_hand_computed_logits():
    logits = torch.tensor([[2.0, 1.5, 0.0, 1.0],
                           [2.0, 1.5, 0.0, 1.0]])
    penalized = SamplingRow(SamplingParams(frequency_penalty=0.5, presence_penalty=1.0), 3, output_token_ids=(0, 3, 0))
    plain = SamplingRow(SamplingParams(), 3, output_token_ids=(0, 3, 0))
    out = _apply_penalties(logits, [penalized, plain])
    # counts = [2, 0, 0, 1]: 2 - 0.5*2 - 1 = 0; 1 - 0.5*1 - 1 = -0.5; unseen tokens untouched
    assert torch.allclose(out[0], torch.tensor([0.0, 1.5, 0.0, -0.5]))
    assert torch.equal(out[1], logits[1])  # a row with zero penalties is untouched


def test_penalty_flips_the_greedy_argmax():
    logits = torch.tensor([[2.0, 1.5, 0.0, 1.0]])
    greedy = dict(temperature=0.0)
    assert sample(Sampler(), logits, [SamplingRow(SamplingParams(**greedy), 1, output_token_ids=(0,))]) == [0]
    presence = SamplingParams(presence_penalty=1.0, **greedy)
    assert sample(Sampler(), logits, [SamplingRow(presence, 1, output_token_ids=(0,))]) == [1]
    frequency = SamplingParams(frequency_penalty=0.4, **greedy)  # 2 - 0.4 = 1.6 still wins; 2 - 0.8 = 1.2 does not
    assert sample(Sampler(), logits, [SamplingRow(frequency, 1, output_token_ids=(0,))]) == [0]
    assert sample(Sampler(), logits, [SamplingRow(frequency, 2, output_token_ids=(0, 0))]) == [1]


def test_negative_penalty_rewards_repetition():
    logits = torch.tensor([[2.0, 1.5, 0.0, 1.0]])
    params = SamplingParams(temperature=0.0, presence_penalty=-2.5)  # 0 + 2.5 beats 2.0
    assert sample(Sampler(), logits, [SamplingRow(params, 1, output_token_ids=(2,))]) == [2]


def test_zero_penalties_or_no_output_skip_all_work():
    logits = torch.randn(2, 10)
    assert _apply_penalties(logits, rows(2, temperature=0.0)) is logits
    no_output = [SamplingRow(SamplingParams(frequency_penalty=2.0, presence_penalty=2.0), 0)]
    assert torch.equal(_apply_penalties(logits[:1], no_output), logits[:1])  # the prompt never counts


# --- logprobs --------------------------------------------------------------------------------------

def test_logprobs_are_raw_log_softmax_at_sampled_and_top_ids():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    raw = logits.log_softmax(-1)
    batch = [
        SamplingRow(SamplingParams(temperature=0.7, top_k=5, logprobs=3, frequency_penalty=1.5, seed=1), 2,
                    banned_token_ids=(int(logits[0].argmax()),), output_token_ids=(4, 4)),
        SamplingRow(SamplingParams(temperature=0.7), 0),
        SamplingRow(SamplingParams(temperature=0.0, logprobs=0), 0),
    ]
    out = Sampler()(logits.clone(), batch)
    first, second, third = out.logprobs
    assert second is None
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(raw[0, first.token_id].item(), abs=1e-6)
    top = raw[0].topk(3)
    assert first.top_token_ids == top.indices.tolist()  # raw: the banned argmax is still listed first
    assert first.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    assert first.top_logprobs == sorted(first.top_logprobs, reverse=True)
    assert third.token_id == out.token_ids[2] == int(logits[2].argmax())
    assert third.logprob == pytest.approx(raw[2].max().item(), abs=1e-6)
    assert third.top_token_ids == [] and third.top_logprobs == []


def test_logprobs_do_not_depend_on_temperature_or_penalties():
    logits = torch.randn(1, 30)
    plain = Sampler()(logits.clone(), [SamplingRow(SamplingParams(temperature=1.0, logprobs=5), 0)]).logprobs[0]
    skewed = SamplingParams(temperature=0.2, top_p=0.5, presence_penalty=2.0, logprobs=5)
    shaped = Sampler()(logits.clone(), [SamplingRow(skewed, 3, output_token_ids=(1, 2, 3))]).logprobs[0]
    assert shaped.top_token_ids == plain.top_token_ids
    assert shaped.top_logprobs == pytest.approx(plain.top_logprobs)


def test_logprobs_top_k_is_clamped_to_the_vocab():
    lp = Sampler()(torch.randn(1, 6), [SamplingRow(SamplingParams(logprobs=20), 0)]).logprobs[0]
    assert sorted(lp.top_token_ids) == list(range(6))
    assert sum(torch.tensor(lp.top_logprobs).exp().tolist()) == pytest.approx(1.0, abs=1e-5)


def test_no_logprobs_requested_gives_none():
    out = Sampler()(torch.randn(3, 10), rows(3, temperature=0.0))
    assert out.logprobs == [None, None, None]


# --- parallel samples (n choices of one seeded prompt) ---------------------------------------------

def seeded(seed, sample_index, position):
    return SamplingRow(SamplingParams(seed=seed), position, sample_index=sample_index)


def test_sample_index_changes_the_draw_for_the_same_seed():
    logits = torch.zeros(1, 1000)  # uniform: independent draws rarely collide
    for position in range(3):
        draws = [sample(Sampler(), logits, [seeded(7, i, position)])[0] for i in range(4)]
        assert len(set(draws)) > 1, draws


def test_same_seed_index_and_position_reproduce_across_samplers_and_batches():
    logits = torch.randn(1, 200)
    alone = sample(Sampler(seed=1), logits.clone(), [seeded(7, 2, 5)])
    batched = sample(Sampler(seed=9), torch.cat([torch.randn(2, 200), logits]),
                     [SamplingRow(SamplingParams(), 0), seeded(7, 1, 5), seeded(7, 2, 5)])
    assert batched[2:] == alone
    assert row_seed(7, 2, 5) == row_seed(7, 2, 5) != row_seed(7, 1, 5)
    assert row_seed(7, 0, 5) == 7 * 1_000_003 + 5  # choice 0 keeps the single-sample stream


# --- model runner ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.execution.model_runner import ModelRunner
    from pdserve.default_model.tiny_model import write_tiny_model

    model_dir = write_tiny_model(tmp_path_factory.mktemp("tiny"), preset="tiny")
    return ModelRunner(EngineConfig(model=str(model_dir), device="cpu", kv_cache_memory=4 * 2**20))


def test_model_runner_returns_logprobs_only_for_requests_that_ask(runner):
    from pdserve.engine.scheduling.request import Request

    bs = runner.block_size
    asking = Request("asking", [5, 6, 7, 8, 9], SamplingParams(temperature=0.0, logprobs=2, presence_penalty=0.5))
    quiet = Request("quiet", [5, 6, 7], SamplingParams(temperature=0.0))
    asking.block_table, quiet.block_table = [0, 1], [2, 3]
    assert 2 * bs > asking.num_prompt_tokens + 2
    seen_rows = []
    sampler = runner.sampler
    runner.sampler = lambda logits, sampling_rows: seen_rows.append(sampling_rows) or sampler(logits, sampling_rows)
    try:
        out = runner.execute([(asking, asking.num_prompt_tokens), (quiet, quiet.num_prompt_tokens)])
        sampled = out.sampled_token_ids
        assert set(out.logprobs) == {"asking"}
        lp = out.logprobs["asking"]
        assert lp.token_id == sampled["asking"] == lp.top_token_ids[0]  # greedy: no penalty on the first token
        assert len(lp.top_token_ids) == 2 and lp.logprob == pytest.approx(lp.top_logprobs[0])
        for r in (asking, quiet):
            r.num_computed_tokens = r.num_tokens
            r.append_token(sampled[r.request_id])

        out = runner.execute([(asking, 1), (quiet, 1)])
        sampled = out.sampled_token_ids
        assert set(out.logprobs) == {"asking"}
        assert out.logprobs["asking"].token_id == sampled["asking"]
        assert list(seen_rows[-1][0].output_token_ids) == asking.output_token_ids  # outputs only, not the prompt
        assert [r.sample_index for r in seen_rows[-1]] == [0, 0]

        quiet.num_computed_tokens = quiet.num_tokens
        quiet.append_token(sampled["quiet"])
        assert runner.execute([(quiet, 1)]).logprobs == {}  # nothing for a request that did not ask
    finally:
        runner.sampler = sampler
