"""repetition_penalty, logit_bias and bad_words: the processors alone, and through ``LLM``
against Hugging Face ``generate`` (repetition penalty) on the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.common.validation import ValidationError, check_sampling_params
from pdserve.engine.execution.logits_processors import (apply_bad_words, apply_logit_bias, apply_logits_processors,
                                              apply_repetition_penalty, bad_word_bans)
from pdserve.engine.execution.sampler import Sampler, SamplingRow
from pdserve.tokenizer.bad_words import bad_words_token_ids

PROMPTS = ["the quick brown fox jumps over the lazy dog and the quick brown fox",
           "seven small birds sing in the old oak tree while seven small birds"]


def row(**kw) -> SamplingRow:
    prompt = kw.pop("prompt", ())
    out = kw.pop("out", ())
    return SamplingRow(SamplingParams(**kw), len(out), output_token_ids=out, prompt_token_ids=prompt)


def test_bad_word_bans_follow_vllm():
    words = [[5], [1, 2, 3], [9, 4]]
    assert bad_word_bans(words, []) == {5}  # [9, 4] needs one output token first, [1, 2, 3] two
    assert bad_word_bans(words, [7, 1, 2]) == {5, 3}
    assert bad_word_bans(words, [1, 2, 9]) == {5, 4}
    assert bad_word_bans(words, [2, 1]) == {5}


def test_processors_alone():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0], [1.0, 1.0, 1.0, 1.0]])
    same = [row(), row()]
    assert apply_logits_processors(logits, same) is logits  # nothing asked: no copy
    out = apply_repetition_penalty(logits, [row(repetition_penalty=2.0, prompt=[0, 1], out=[1]), row()])
    assert out[0].tolist() == [1.0, -2.0, 0.5, 3.0] and out[1].tolist() == logits[1].tolist()
    out = apply_logit_bias(logits, [row(), row(logit_bias={2: 100.0, 0: -0.5})])
    assert out[1].tolist() == [0.5, 1.0, 101.0, 1.0] and logits[1, 2] == 1.0  # a copy
    out = apply_bad_words(logits, [row(bad_words_token_ids=[[3], [0, 2]], out=[0]), row()])
    assert out[0].tolist() == [2.0, -1.0, float("-inf"), float("-inf")]


def test_sampler_order_and_raw_logprobs():
    """Bias lifts a token, bad words still ban it (vLLM's order: bad words first, -inf stays -inf);
    the logprobs stay those of the raw logits."""
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    sampler = Sampler()
    r = row(temperature=0.0, logit_bias={0: 100.0}, logprobs=1)
    out = sampler(logits, [r])
    assert out.token_ids == [0]
    assert out.logprobs[0].logprob == pytest.approx(logits.log_softmax(-1)[0, 0].item())
    r = row(temperature=0.0, logit_bias={0: 100.0}, bad_words_token_ids=[[0]])
    assert sampler(logits, [r]).token_ids == [3]


def test_validation_names_the_param():
    bad = [(dict(repetition_penalty=0.0), "repetition_penalty"),
           (dict(repetition_penalty=float("nan")), "repetition_penalty"),
           (dict(logit_bias={3: 101.0}), "logit_bias"), (dict(logit_bias={1000: 1.0}), "logit_bias"),
           (dict(bad_words_token_ids=[[1, 1000]]), "bad_words"), (dict(bad_words_token_ids=[[]]), "bad_words"),
           (dict(prompt_logprobs=21), "prompt_logprobs"), (dict(prompt_logprobs=-1), "prompt_logprobs")]
    for kw, param in bad:
        with pytest.raises(ValidationError) as e:
            check_sampling_params(SamplingParams(**kw), vocab_size=512)
        assert e.value.param == param, kw
    check_sampling_params(SamplingParams(repetition_penalty=1.3, logit_bias={3: -100.0}, prompt_logprobs=20,
                                         bad_words_token_ids=[[1, 2]]), vocab_size=512)


def test_bad_words_tokenized_with_and_without_space(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = bad_words_token_ids(tok, ["fox"])
    plain = tok.encode("fox", add_special_tokens=False)
    spaced = tok.encode(" fox", add_special_tokens=False)
    assert ids[0] == plain
    assert (spaced in ids) == (spaced[0] != plain[0] and len(spaced) == len(plain))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_num_batched_tokens=16, kv_cache_memory="1MiB")


@pytest.fixture(scope="module")
def hf(model_dir):
    return (AutoTokenizer.from_pretrained(model_dir),
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval())


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_greedy_matches_hf(llm, hf, penalty):
    tok, model = hf
    greedy = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    # Prompts that end with the model's own greedy continuation: the tokens it favours are in the
    # prompt, so penalizing prompt tokens (not only output ones) changes the output.
    prompts = [o.prompt_token_ids + o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy, use_tqdm=False)]
    params = SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=penalty, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, greedy, use_tqdm=False)
    for prompt, out in zip(prompts, outputs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=20, min_new_tokens=20,
                                 do_sample=False, repetition_penalty=penalty, pad_token_id=2)
        assert out.outputs[0].token_ids == ref[0, ids.shape[1]:].tolist()
    assert [o.outputs[0].token_ids for o in outputs] != [o.outputs[0].token_ids for o in plain]


def test_logit_bias_forces_and_bad_words_ban(llm, hf):
    tok, _ = hf
    forced = tok.encode(" fox", add_special_tokens=False)[-1]
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                                                   logit_bias={forced: 100.0}), use_tqdm=False)
    assert out[0].outputs[0].token_ids == [forced] * 8
    # Ban every token greedy decoding picked, and a two-token word: none of it appears.
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    banned = sorted(set(first))[:3]
    pair = first[4:6]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            bad_words_token_ids=[[t] for t in banned] + [pair])
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    assert not set(banned) & set(again)
    assert all(again[i:i + 2] != pair for i in range(len(again) - 1))
    with pytest.raises(ValueError, match="logit_bias"):
        llm.generate(PROMPTS[:1], SamplingParams(logit_bias={llm.vocab_size: 1.0}), use_tqdm=False)


def test_router_builds_the_params(model_dir):
    """OpenAI/vLLM request fields -> wire SamplingParams (no model needed: a fake decode worker)."""
    from pdserve.router.config import RouterConfig
    from tests.helpers.fake_peers import fake_worker_router

    tok = AutoTokenizer.from_pretrained(model_dir)
    config = RouterConfig(model=model_dir, zmq_port=0, worker_timeout_s=1.0, worker_wait_s=0)
    with fake_worker_router(config) as (router, worker):
        worker.script = tok.encode(" done", add_special_tokens=False)
        resp = router.post("/v1/completions", json={
            "model": "tiny", "prompt": "hello", "max_tokens": 0, "echo": True, "logprobs": 1,
            "repetition_penalty": 1.2, "logit_bias": {"7": 300, "9": -2.5}, "bad_words": ["fox"]})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == "hello"  # echo, max_tokens 0: the prompt alone
        sp = worker.requests()[-1].sampling_params
        assert (sp.max_tokens, sp.repetition_penalty, sp.logit_bias) == (1, 1.2, {7: 100.0, 9: -2.5})
        assert sp.prompt_logprobs == 1  # echo + logprobs: prompt_logprobs defaults to logprobs (vLLM)
        assert sp.bad_words_token_ids == bad_words_token_ids(tok, ["fox"])
        resp = router.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "prompt_logprobs": 3})
        assert resp.status_code == 200 and worker.requests()[-1].sampling_params.prompt_logprobs == 3
