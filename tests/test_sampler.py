import torch

from pdserve.common.protocol import SamplingParams
from pdserve.engine.sampler import Sampler, SamplingRow


def rows(n, **kw):
    return [SamplingRow(SamplingParams(**kw), 0) for _ in range(n)]


def test_greedy_is_argmax():
    logits = torch.randn(4, 50)
    assert Sampler()(logits.clone(), rows(4, temperature=0.0)) == logits.argmax(-1).tolist()


def test_top_k_1_is_argmax_even_at_high_temperature():
    logits = torch.randn(3, 50)
    assert Sampler()(logits.clone(), rows(3, temperature=5.0, top_k=1)) == logits.argmax(-1).tolist()


def test_top_p_keeps_only_the_nucleus():
    logits = torch.full((1, 10), -10.0)
    logits[0, 3] = 5.0
    logits[0, 6] = 4.0  # p(3) ~ 0.73, p(6) ~ 0.27, rest ~ 0
    sampler = Sampler(seed=1)
    seen = {sampler(logits.clone(), rows(1, temperature=1.0, top_p=0.5))[0] for _ in range(50)}
    assert seen == {3}
    seen = {sampler(logits.clone(), rows(1, temperature=1.0, top_p=0.9))[0] for _ in range(200)}
    assert seen == {3, 6}


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.1, 0.6, 0.3])
    logits = probs.log().repeat(4000, 1)
    tokens = torch.tensor(Sampler(seed=0)(logits, rows(4000, temperature=1.0)))
    freq = torch.bincount(tokens, minlength=3).float() / 4000
    assert torch.allclose(freq, probs, atol=0.03), freq


def test_seed_reproducible_per_position_and_independent_of_batch():
    logits = torch.randn(1, 100)
    a = Sampler(seed=1)(logits.clone(), [SamplingRow(SamplingParams(seed=42), 3)])
    other = torch.randn(1, 100)
    b = Sampler(seed=2)(torch.cat([other, logits]), [SamplingRow(SamplingParams(), 0),
                                                       SamplingRow(SamplingParams(seed=42), 3)])[1:]
    assert a == b
    draws = {Sampler()(logits.clone(), [SamplingRow(SamplingParams(seed=s), 0)])[0] for s in range(30)}
    assert len(draws) > 1  # different seeds do differ


def test_banned_tokens_are_never_sampled():
    logits = torch.zeros(1, 5)
    logits[0, 2] = 100.0
    out = Sampler()(logits, [SamplingRow(SamplingParams(temperature=0.0), 0, banned_token_ids=(2,))])
    assert out[0] != 2
