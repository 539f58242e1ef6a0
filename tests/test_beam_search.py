"""Beam search (pdserve.beam_search) against transformers' ``generate(num_beams=...)``.

Offline through ``LLM.beam_search`` and over HTTP (``use_beam_search``) on a real
disaggregated cluster (router + 1 prefill + 1 decode worker). The tiny random
checkpoint rarely ranks EOS high, so a variant whose ``lm_head`` row for EOS is
aimed at the mean final hidden state makes hypotheses end on EOS at varying
lengths (the finishing, length-penalty and early-stopping rules then matter).
"""

from __future__ import annotations

import math
import shutil
import time

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve import LLM
from pdserve.beam_search import BeamSearch, BeamSearchParams
from pdserve.common.protocol import TokenLogprob
from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster

PROMPTS = ["the quick brown fox", "hello", "seven small birds sing in the old oak tree while a lazy dog sleeps"]
# (beam_width, max_tokens, length_penalty, early_stopping)
CASES = [(2, 8, 1.0, False), (4, 10, 0.5, False), (3, 12, -1.0, True), (4, 10, 2.0, "never"), (1, 9, 1.0, False)]


@pytest.fixture(scope="module")
def eos_model_dir(model_dir, tmp_path_factory):
    """The tiny checkpoint with EOS (id 1) made likely: its lm_head row points along the mean
    final hidden state of some text, scaled to 0.9 of the typical top logit."""
    out = tmp_path_factory.mktemp("eos_model") / "tiny-eos"
    shutil.copytree(model_dir, out)
    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode(" ".join(PROMPTS))])
    with torch.no_grad():
        res = hf(ids, output_hidden_states=True)
    h = res.hidden_states[-1][0].mean(0)  # [hidden] after the final norm
    weights = load_file(str(out / "model.safetensors"))
    weights["lm_head.weight"][1] = 0.9 * h / h.norm() ** 2 * res.logits[0].max(-1).values.mean()
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


class HFBeams:
    """transformers' beam search on one checkpoint, one prompt at a time (no padding)."""

    def __init__(self, model_dir: str):
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        eos = self.model.generation_config.eos_token_id
        self.eos = set(eos if isinstance(eos, list) else [eos])

    def __call__(self, prompt_ids: list[int], width: int, max_tokens: int, length_penalty: float,
                 early_stopping) -> list[list[int]]:
        """The ``width`` returned sequences' generated tokens (up to and including an EOS), best first."""
        with torch.no_grad():
            out = self.model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids),
                                      dtype=torch.long), num_beams=width, num_return_sequences=width,
                                      do_sample=False, max_new_tokens=max_tokens, length_penalty=length_penalty,
                                      early_stopping=early_stopping, pad_token_id=2)
        result = []
        for row in out[:, len(prompt_ids):].tolist():
            end = next((i + 1 for i, t in enumerate(row) if t in self.eos), len(row))  # after EOS: padding
            result.append(row[:end])
        return result


def assert_blocks_back(llm: LLM) -> None:
    assert not llm.scheduler.has_unfinished()
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


# ---- the algorithm alone -------------------------------------------------------------------------

def _row(table: dict[int, float]) -> TokenLogprob:
    ranked = sorted(table.items(), key=lambda kv: -kv[1])
    return TokenLogprob(token_id=ranked[0][0], logprob=ranked[0][1], top_token_ids=[t for t, _ in ranked],
                        top_logprobs=[lp for _, lp in ranked])


def _run(search: BeamSearch, model) -> int:
    steps = 0
    while not search.done:
        search.step([_row(model(ids[len(search.prompt_token_ids):])) for ids in search.beam_token_ids()])
        steps += 1
    return steps


def _toy(out: list[int]) -> dict[int, float]:
    """A toy model over tokens {1 (EOS), 5, 6, 7, 8, 9}: EOS is likely only right after token 6."""
    if out and out[-1] == 6:
        return {1: math.log(0.6), 5: math.log(0.1), 6: math.log(0.1), 7: math.log(0.1), 8: math.log(0.05),
                9: math.log(0.05)}
    return {6: math.log(0.4), 5: math.log(0.3), 7: math.log(0.1), 1: math.log(0.1), 8: math.log(0.05),
            9: math.log(0.05)}


def test_scores_divide_by_generated_length_excluding_the_prompt():
    params = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=1.0)
    for prompt in ([3], [3] * 40):  # the prompt's length changes nothing
        search = BeamSearch(prompt, params, {1})
        _run(search, _toy)
        best = search.output().sequences[0]
        assert best.output_token_ids == [6, 1] and best.finish_reason == "stop"
        assert best.cum_logprob == pytest.approx(math.log(0.4) + math.log(0.6))
        assert best.score == pytest.approx(best.cum_logprob / 2)
        assert best.tokens == prompt + [6, 1]


class _ToyProcessor:
    """A transformers logits processor that replaces the model's logprobs with ``_toy``'s."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        out = torch.full_like(scores, -math.inf)
        for row, ids in enumerate(input_ids.tolist()):
            for token_id, lp in _toy(ids[self.prompt_len:]).items():
                out[row, token_id] = lp
        return out


@pytest.fixture(scope="module")
def tiny_hf(model_dir):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("length_penalty", [1.0, 2.0, 0.0, -1.0])
def test_rules_match_transformers_on_a_toy_distribution(tiny_hf, length_penalty):
    """Same toy distribution in both: every finishing / stopping rule must give transformers' result."""
    from transformers import LogitsProcessorList

    hf = tiny_hf
    steps = {}
    for mode in (True, False, "never"):
        search = BeamSearch([3], BeamSearchParams(beam_width=2, max_tokens=8, length_penalty=length_penalty,
                                                  early_stopping=mode), {1})
        steps[mode] = _run(search, _toy)
        got = search.output().sequences
        with torch.no_grad():
            out = hf.generate(torch.tensor([[3]]), attention_mask=torch.ones(1, 1, dtype=torch.long), num_beams=2,
                              num_return_sequences=2, do_sample=False, max_new_tokens=8, eos_token_id=1,
                              pad_token_id=2, length_penalty=length_penalty, early_stopping=mode,
                              logits_processor=LogitsProcessorList([_ToyProcessor(1)]),
                              return_dict_in_generate=True, output_scores=True)
        expected = [row[:next((i + 1 for i, t in enumerate(row) if t == 1), len(row))]
                    for row in out.sequences[:, 1:].tolist()]
        assert [s.output_token_ids for s in got] == expected, mode
        assert [s.score for s in got] == pytest.approx(out.sequences_scores.tolist(), abs=1e-5)
    assert steps[True] <= steps[False] <= steps["never"]
    if length_penalty == 2.0:  # "never" looks up to max_tokens for longer, better-scored hypotheses
        assert steps[False] < steps["never"] == 8


def test_ignore_eos_runs_to_max_tokens_and_bad_params_are_refused():
    search = BeamSearch([3], BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True), {1})
    assert search.num_logprobs == 6  # 2 * beam_width without EOS ids; 3 * beam_width with two
    _run(search, _toy)
    assert all(len(s.output_token_ids) == 5 and s.finish_reason == "length" for s in search.output().sequences)
    assert BeamSearch([3], BeamSearchParams(beam_width=3, max_tokens=5), {1, 4}).num_logprobs == 9


# ---- offline: LLM.beam_search --------------------------------------------------------------------

@pytest.fixture(scope="module")
def eos_llm(eos_model_dir):
    return LLM(eos_model_dir, kv_cache_memory="2MiB", block_size=4)


@pytest.fixture(scope="module")
def eos_hf(eos_model_dir):
    return HFBeams(eos_model_dir)


@pytest.mark.parametrize("width,max_tokens,length_penalty,early_stopping", CASES)
def test_llm_beam_search_matches_transformers(eos_llm, eos_hf, width, max_tokens, length_penalty, early_stopping):
    hits_before = eos_llm.scheduler.stats.prefix_cache_hits
    outputs = eos_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=width, max_tokens=max_tokens,
                                                            length_penalty=length_penalty,
                                                            early_stopping=early_stopping))
    for prompt, output in zip(PROMPTS, outputs):
        ids = eos_llm.tokenizer.encode(prompt)
        expected = eos_hf(ids, width, max_tokens, length_penalty, early_stopping)
        assert [s.output_token_ids for s in output.sequences] == expected, (prompt, width, length_penalty)
        scores = [s.score for s in output.sequences]
        assert scores == sorted(scores, reverse=True)
        for s in output.sequences:
            assert s.tokens[:len(ids)] == ids
            assert s.finish_reason == ("stop" if s.output_token_ids[-1] in eos_hf.eos else "length")
            ending = s.output_token_ids[:-1] if s.finish_reason == "stop" else s.output_token_ids
            assert s.text == eos_llm.tokenizer.decode(ending, skip_special_tokens=True)
    assert eos_llm.scheduler.stats.prefix_cache_hits > hits_before  # beams reuse their prefixes' blocks
    assert_blocks_back(eos_llm)


def test_some_cases_end_on_eos(eos_llm):
    """The variant checkpoint really exercises EOS: several hypotheses finish with "stop"."""
    outputs = eos_llm.beam_search(PROMPTS, BeamSearchParams(beam_width=4, max_tokens=10))
    reasons = [s.finish_reason for o in outputs for s in o.sequences]
    assert "stop" in reasons and "length" in reasons


def test_llm_beam_search_on_the_plain_checkpoint(model_dir):
    llm = LLM(model_dir, kv_cache_memory="1MiB", max_num_batched_tokens=32)
    hf = HFBeams(model_dir)
    prompts = [PROMPTS[0], {"prompt": PROMPTS[2]}, {"prompt_token_ids": [5, 17, 99, 300]}]
    outputs = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=0.7))
    for prompt, output in zip([PROMPTS[0], PROMPTS[2], [5, 17, 99, 300]], outputs):
        ids = llm.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
        assert [s.output_token_ids for s in output.sequences] == hf(ids, 3, 12, 0.7, False)
    single = llm.beam_search(PROMPTS[0], BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=0.7))
    assert [s.tokens for s in single[0].sequences] == [s.tokens for s in outputs[0].sequences]
    assert_blocks_back(llm)


@pytest.mark.parametrize("kwargs,param", [
    (dict(beam_width=0), "n"), (dict(beam_width=7), "n"),  # two EOS ids: K = 3 * width <= 20 logprobs
    (dict(length_penalty=float("nan")), "length_penalty"), (dict(early_stopping="sometimes"), "early_stopping"),
    (dict(max_tokens=0), "max_tokens")])
def test_llm_rejects_bad_params_before_any_work(eos_llm, kwargs, param):
    params = BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, **kwargs})
    with pytest.raises(ValueError) as info:
        eos_llm.beam_search(["hi"], params)
    assert info.value.param == param
    with pytest.raises(ValueError):
        eos_llm.beam_search([[eos_llm.vocab_size]], BeamSearchParams(beam_width=2, max_tokens=4))
    assert_blocks_back(eos_llm)


# ---- over HTTP on a disaggregated cluster ------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(eos_model_dir, tmp_path_factory):
    spec = ClusterSpec(model=eos_model_dir, num_prefill=1, num_decode=1, port=free_port(),
                       worker_args=["--kv-cache-memory", "2MiB", "--block-size", "4"],
                       decode_args=["--remote-prefill-threshold", "0"], threads_per_worker=1)
    with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("logs"))) as c:
        yield c


def _post(cluster, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{cluster.url}/v1/{path}", json={"model": "tiny-eos", **body}, timeout=120)


def test_router_beam_search_matches_transformers(cluster, eos_hf):
    from tests.helpers.cluster import wait_all_blocks_free, workers
    from tests.helpers.cluster import metric_totals, wait_metric_increase

    before = metric_totals(cluster)
    for (width, max_tokens, length_penalty, early_stopping), prompt in zip(CASES[:4], PROMPTS + PROMPTS):
        resp = _post(cluster, "completions", dict(prompt=prompt, n=width, max_tokens=max_tokens,
                                                  use_beam_search=True, length_penalty=length_penalty,
                                                  early_stopping=early_stopping, temperature=0.7))
        assert resp.status_code == 200, resp.text
        body = resp.json()
        ids = eos_hf.tok.encode(prompt)
        expected = eos_hf(ids, width, max_tokens, length_penalty, early_stopping)
        texts = [eos_hf.tok.decode([t for t in e if t not in eos_hf.eos], skip_special_tokens=True)
                 for e in expected]
        assert [c["text"] for c in body["choices"]] == texts
        assert [c["index"] for c in body["choices"]] == list(range(width))
        assert [c["finish_reason"] for c in body["choices"]] == [
            "stop" if e[-1] in eos_hf.eos else "length" for e in expected]
        assert body["usage"]["completion_tokens"] == sum(map(len, expected))
    # Step 1 of each search went through the prefill worker (its KV sent to the decode worker);
    # later steps found their beams' full blocks in the decode worker's prefix cache.
    assert wait_metric_increase(cluster, "pdserve:kv_transfers_total", before, 4) >= 4
    assert wait_metric_increase(cluster, "vllm:prefix_cache_hits_total", before, 10) >= 10

    messages = [{"role": "user", "content": "hello there"}]
    resp = _post(cluster, "chat/completions", dict(messages=messages, n=3, max_tokens=8, use_beam_search=True))
    assert resp.status_code == 200, resp.text
    ids = eos_hf.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding in transformers 5
    assert resp.json()["usage"]["prompt_tokens"] == len(ids)
    expected = eos_hf(ids, 3, 8, 1.0, False)
    assert [c["message"]["content"] for c in resp.json()["choices"]] == [
        eos_hf.tok.decode([t for t in e if t not in eos_hf.eos], skip_special_tokens=True) for e in expected]
    wait_all_blocks_free(cluster)
    assert all(w["num_free_blocks"] == w["num_blocks"] for w in workers(cluster))


@pytest.mark.parametrize("path,body,param", [
    ("completions", dict(prompt="hi", n=0), "n"),
    ("completions", dict(prompt="hi", n=7), "n"),
    ("completions", dict(prompt="hi", n=2, stream=True), "stream"),
    ("completions", dict(prompt="hi", n=2, logprobs=2), "logprobs"),
    ("completions", dict(prompt="hi", n=2, stop=["x"]), "stop"),
    ("completions", dict(prompt="hi", n=2, early_stopping="sometimes"), "early_stopping"),
    ("chat/completions", dict(messages=[{"role": "user", "content": "hi"}], n=2, stream=True), "stream"),
    ("chat/completions", dict(messages=[{"role": "user", "content": "hi"}], n=-1), "n"),
])
def test_router_rejects_bad_beam_requests(cluster, path, body, param):
    resp = _post(cluster, path, dict(use_beam_search=True, max_tokens=4, **body))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == param


def test_router_client_disconnect_mid_search_frees_blocks(cluster):
    from tests.helpers.cluster import wait_all_blocks_free
    from tests.helpers.cluster import metric_totals

    with pytest.raises(httpx.ReadTimeout):  # the client gives up (0.5 s: a faster decode step finished the 400-token search within 1.5 s once); the router must stop the search
        httpx.post(f"{cluster.url}/v1/completions", timeout=httpx.Timeout(10, read=0.5),
                   json={"model": "tiny-eos", "prompt": "a long search", "n": 4, "max_tokens": 400,
                         "ignore_eos": True, "use_beam_search": True})
    wait_all_blocks_free(cluster)
    before = metric_totals(cluster)["vllm:generation_tokens_total"]
    time.sleep(2.5)  # > 2 heartbeats: a search still running would have sampled more tokens
    assert metric_totals(cluster)["vllm:generation_tokens_total"] == before
    ok = _post(cluster, "completions", dict(prompt="still alive", n=2, max_tokens=3, use_beam_search=True))
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
