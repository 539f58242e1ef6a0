"""The one set of request rules (pdserve.common.validation), shared by router, workers and LLM."""

import pytest

from pdserve.common.protocol import SamplingParams
from pdserve.common.validation import (EngineLimits, ValidationError, check_context_length, check_request,
                                       check_sampling_params, num_blocks_needed, num_kv_tokens_needed,
                                       prefill_sampling_params)

LIMITS = EngineLimits(max_model_len=64, vocab_size=100, num_blocks=8, block_size=4)  # 32 KV tokens


@pytest.mark.parametrize("kwargs,param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=0), "top_k"),
    (dict(n=0), "n"),
    (dict(n=17), "n"),
    (dict(seed=2 ** 63), "seed"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(max_tokens=3, min_tokens=4), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"),
    (dict(presence_penalty=float("inf")), "presence_penalty"),
    (dict(stop_token_ids=[100]), "stop_token_ids"),
])
def test_each_sampling_field_out_of_range_names_itself(kwargs, param):
    with pytest.raises(ValidationError) as info:
        check_sampling_params(SamplingParams(**kwargs), vocab_size=100)
    assert info.value.param == param and isinstance(info.value, ValueError)


def test_edges_of_every_range_are_accepted():
    check_sampling_params(SamplingParams(max_tokens=1, temperature=0.0, top_p=1.0, top_k=1, n=16, seed=-(2 ** 63),
                                         min_tokens=1, logprobs=20, frequency_penalty=-2.0, presence_penalty=2.0,
                                         stop_token_ids=[0, 99]), vocab_size=100)


def test_context_length_uses_vllms_wording():
    check_context_length(60, 4, 64)
    with pytest.raises(ValidationError, match=r"maximum context length is 64 tokens\. However, you requested "
                                             r"65 tokens \(60 in the prompt, 5 for the completion\)") as info:
        check_context_length(60, 5, 64)
    assert info.value.param == "max_tokens"
    check_context_length(63, None, 64)  # max_tokens left out: one token of room is enough
    with pytest.raises(ValidationError, match="leaves no room for the completion"):
        check_context_length(64, None, 64)


def test_one_kv_formula_one_sequence_capped_at_max_model_len():
    assert num_kv_tokens_needed(10, 5, 64) == 15
    assert num_kv_tokens_needed(60, 50, 64) == 64
    assert num_blocks_needed(17, 16) == 2 and num_blocks_needed(16, 16) == 1
    check_request([1] * 20, SamplingParams(max_tokens=12, n=4), LIMITS)  # 32 tokens; n shares the prompt
    with pytest.raises(ValidationError, match="needs 9 KV cache blocks of 4 tokens .* only 8 blocks"):
        check_request([1] * 20, SamplingParams(max_tokens=13), LIMITS)


def test_check_request_prompt_rules_and_the_offline_rule():
    with pytest.raises(ValidationError, match="must not be empty"):
        check_request([], SamplingParams(), LIMITS)
    with pytest.raises(ValidationError, match="token id 100 is out of range"):
        check_request([1, 100], SamplingParams(), LIMITS)
    big = EngineLimits(max_model_len=64, vocab_size=100)  # KV capacity unknown: no capacity check
    with pytest.raises(ValidationError, match="maximum context length"):
        check_request([1] * 60, SamplingParams(max_tokens=10), big)
    check_request([1] * 60, SamplingParams(max_tokens=10), big, stop_at_max_model_len=True)  # stops at 64
    with pytest.raises(ValidationError, match="no room"):
        check_request([1] * 64, SamplingParams(max_tokens=10), big, stop_at_max_model_len=True)


def test_prefill_params_sample_one_first_token_under_the_same_rules():
    params = SamplingParams(max_tokens=50, n=3, min_tokens=5, temperature=0.7, seed=3, logprobs=2)
    first = prefill_sampling_params(params)
    assert (first.max_tokens, first.n, first.min_tokens) == (1, 1, 1)  # min_tokens >= 1 still bans EOS first
    assert (first.temperature, first.seed, first.logprobs) == (0.7, 3, 2)
    check_sampling_params(first, vocab_size=100)
