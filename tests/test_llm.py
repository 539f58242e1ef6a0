"""The offline API (pdserve.LLM) against Hugging Face generate, and its bookkeeping."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pdserve import LLM, SamplingParams
from tests.helpers.reference import WORDS, GREEDY, hf_greedy, prompts, token_ids, assert_all_blocks_free  # noqa: F401


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_num_batched_tokens=32, kv_cache_memory="1MiB")


def test_import_is_light():
    code = "import sys, pdserve; pdserve.SamplingParams; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_greedy_matches_hf_with_chunked_prefill(llm, prompts, hf_greedy):
    tokens_before, seconds_before = llm.core.prefill_compute_tokens, llm.core.prefill_compute_seconds
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    # the measured prefill speed (heartbeats carry it to the router) counts the prompt tokens computed
    computed = sum(len(o.prompt_token_ids) - o.num_cached_tokens for o in outputs)  # prefix-cache hits are not
    assert llm.core.prefill_compute_tokens - tokens_before >= computed > 0  # (more: a preempted prompt again)
    assert llm.core.prefill_compute_seconds > seconds_before
    assert max(len(o.prompt_token_ids) for o in outputs) > 3 * 32  # chunked into 4 prefill steps
    assert token_ids(outputs) == hf_greedy
    for o in outputs:
        choice = o.outputs[0]
        assert o.finished and choice.finish_reason in ("stop", "length")
        assert choice.text == llm.tokenizer.decode(choice.token_ids, skip_special_tokens=True)
    assert_all_blocks_free(llm)


def test_only_sampled_rows_run_past_the_last_attention(model_dir, prompts, hf_greedy):
    """A prefill step's last layer runs its feed-forward on the rows it samples, not on all its rows
    (``ModelRunner._out_rows``), and the tokens stay transformers'."""
    llm = LLM(model_dir, max_num_batched_tokens=32, kv_cache_memory="1MiB", enforce_eager=True)
    try:
        layers = llm.core.runner.model.model.layers
        first, last = [], []
        layers[0].mlp.register_forward_hook(lambda module, args, out: first.append(args[0].shape[0]))
        layers[-1].mlp.register_forward_hook(lambda module, args, out: last.append(args[0].shape[0]))
        assert token_ids(llm.generate(prompts, GREEDY, use_tqdm=False)) == hf_greedy
        prefills = [(f, n) for f, n in zip(first, last) if f > len(prompts)]  # steps of more rows than requests
        assert prefills and all(n <= len(prompts) for _, n in prefills)
        assert_all_blocks_free(llm)
    finally:
        llm.close()


def test_greedy_matches_hf_under_preemption(model_dir, prompts, hf_greedy):
    # 10 blocks of 16 tokens: the longest request alone needs 9, so running ones get preempted.
    small = LLM(model_dir, max_num_batched_tokens=32, kv_cache_memory="80KiB")
    assert small.block_manager.num_blocks == 10
    outputs = small.generate(prompts, GREEDY, use_tqdm=True)
    assert small.scheduler.stats.num_preemptions > 0
    assert token_ids(outputs) == hf_greedy
    assert_all_blocks_free(small)


def test_prefix_caching(model_dir, llm):
    prefix = " ".join(WORDS * 3)  # well over two 16-token blocks
    prompts = [f"{prefix} {w}" for w in ("red", "green", "blue")]
    first = llm.generate(prompts, GREEDY, use_tqdm=False)
    second = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens > 0 for o in second)
    assert all(o.num_cached_tokens % llm.block_manager.block_size == 0 for o in second)
    no_cache = LLM(model_dir, max_num_batched_tokens=32, enable_prefix_caching=False)
    reference = no_cache.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens == 0 for o in reference)
    assert token_ids(first) == token_ids(second) == token_ids(reference)
    assert_all_blocks_free(llm)
    assert_all_blocks_free(no_cache)


def test_parallel_sampling(llm, prompts):
    params = SamplingParams(max_tokens=16, temperature=1.0, n=3, seed=7)
    a = llm.generate(prompts[:3], params, use_tqdm=False)
    b = llm.generate(prompts[:3], params, use_tqdm=False)
    for out_a, out_b in zip(a, b):
        assert [c.index for c in out_a.outputs] == [0, 1, 2]
        assert [c.token_ids for c in out_a.outputs] == [c.token_ids for c in out_b.outputs]
        assert [c.text for c in out_a.outputs] == [c.text for c in out_b.outputs]
    assert any(len({tuple(c.token_ids) for c in o.outputs}) > 1 for o in a)  # choices draw their own noise
    assert_all_blocks_free(llm)

    greedy = llm.generate(prompts[:3], GREEDY, use_tqdm=False)
    greedy_n3 = llm.generate(prompts[:3], SamplingParams(max_tokens=24, temperature=0.0, n=3), use_tqdm=False)
    for one, three in zip(greedy, greedy_n3):
        assert [c.token_ids for c in three.outputs] == [one.outputs[0].token_ids] * 3
    assert_all_blocks_free(llm)


def test_stop_string_and_logprobs(llm, prompts):
    plain = llm.generate(prompts[3], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    stop = plain.text[8:11]
    assert len(stop) == 3
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop], logprobs=2)
    choice = llm.generate([prompts[3]], params, use_tqdm=False)[0].outputs[0]
    assert choice.finish_reason == "stop"
    assert choice.text == plain.text[:plain.text.index(stop)]
    assert choice.token_ids == plain.token_ids[:len(choice.token_ids)] and len(choice.token_ids) < 24
    assert len(choice.logprobs) == len(choice.token_ids)
    for token_id, lp in zip(choice.token_ids, choice.logprobs):
        assert lp.token_id == token_id and lp.logprob <= 0
        assert len(lp.top_token_ids) == len(lp.top_logprobs) == 2
        assert lp.top_token_ids[0] == token_id  # greedy: the sampled token is the most likely
    assert_all_blocks_free(llm)


def test_chat_and_token_prompts(llm):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    out = llm.chat([{"role": "user", "content": "hello there"}], params, use_tqdm=False)
    assert len(out) == 1 and "<|im_start|>assistant" in out[0].prompt
    assert out[0].outputs[0].text and out[0].outputs[0].token_ids
    two = llm.chat([[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]], params,
                   use_tqdm=False)
    assert len(two) == 2

    by_text = llm.generate("a lazy dog", params, use_tqdm=False)[0]
    by_ids = llm.generate([by_text.prompt_token_ids], params, use_tqdm=False)[0]
    assert by_ids.prompt is None and by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    per_prompt = llm.generate(["a", "b"], [params, SamplingParams(max_tokens=3, temperature=0.0)], use_tqdm=False)
    assert len(per_prompt[1].outputs[0].token_ids) <= 3
    assert_all_blocks_free(llm)


def test_rejects_before_any_work(model_dir, llm):
    short = LLM(model_dir, max_model_len=64, kv_cache_memory="64KiB")  # 8 blocks of 16 tokens
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        short.generate(["ok", [5] * 64], use_tqdm=False)
    with pytest.raises(ValueError, match="KV cache has only 8 blocks"):
        LLM(model_dir, kv_cache_memory="64KiB").generate([[5] * 100], SamplingParams(max_tokens=50),
                                                         use_tqdm=False)
    assert_all_blocks_free(short)
    assert short.scheduler.stats.num_prompt_tokens == 0  # "ok" was never queued
    bad = [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(n=0)]
    for kwargs in bad:
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            llm.generate("hi", SamplingParams(**kwargs), use_tqdm=False)
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([[llm.vocab_size]], use_tqdm=False)
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate(["hi"], [GREEDY, GREEDY], use_tqdm=False)
    assert_all_blocks_free(llm)
