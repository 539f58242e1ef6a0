"""Prompt logprobs and completions ``echo`` against transformers' log-softmax on the same checkpoint:
through ``LLM`` (chunked prefill, prefix cache warm) and through a disaggregated cluster over HTTP
(prefill worker computes them; a decode worker prefilling locally too), and an lm-evaluation-harness
style loglikelihood (echo, max_tokens 0, logprobs 1, temperature 0)."""

from __future__ import annotations

import json
import math
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve import LLM, SamplingParams
from pdserve.common.utils import free_port
from pdserve.common.protocol import ExecuteModel
from pdserve.engine.execution.prompt_logprobs import add_prompt_logprob_rows, token_logprobs_with_rank
from pdserve.engine.scheduling.request import Request
from pdserve.cluster.launcher import ClusterSpec, LocalCluster

WORDS = "the quick brown fox jumps over a lazy dog while seven small birds sing in the old oak tree".split()
PROMPTS = [" ".join(WORDS[i % len(WORDS)] for i in range(k)) for k in (2, 9, 40)]  # the last: 3+ chunks of 16
ATOL = 1e-4


def test_rows_follow_the_sampled_ones_and_accumulate_over_chunks():
    """Prompt t0..t4 in chunks of 3 and 2 (positions 0-2, then 3-4), beside a decode of another request."""
    request = Request("a", [10, 11, 12, 13, 14], SamplingParams(prompt_logprobs=1))
    other = Request("b", [1, 2], SamplingParams())
    other.num_computed_tokens = 2

    def step(scheduled):
        starts = [0]
        for _, n in scheduled:
            starts.append(starts[-1] + n)
        return ExecuteModel(query_start_loc=starts, sample_indices=[starts[1] - 1])  # "b" is sampled

    first = step([(other, 1), (request, 3)])
    (span,) = add_prompt_logprob_rows(first, [(other, 1), (request, 3)])
    assert (span.first, span.last) == (0, 3) and first.sample_indices == [0, 1, 2, 3]
    request.prompt_logprobs = [None] * 3  # entries of t1, t2, t3 (as EngineCore collects them)
    request.num_computed_tokens = 3
    second = step([(request, 2)])
    (span,) = add_prompt_logprob_rows(second, [(request, 2)])
    assert (span.first, span.last) == (3, 4) and second.sample_indices == [1, 0]  # position 3 -> t4
    request.prompt_logprobs.append(None)
    request.num_computed_tokens = 1  # recomputed after a preemption: nothing is taken twice
    assert add_prompt_logprob_rows(step([(request, 3)]), [(request, 3)]) == []
    assert add_prompt_logprob_rows(step([(other, 1)]), [(other, 1)]) == []


def test_token_logprobs_with_rank():
    logprobs = torch.tensor([[0.1, 0.5, 0.2, 0.2], [0.7, 0.1, 0.1, 0.1]]).log()
    a, b = token_logprobs_with_rank(logprobs, torch.tensor([2, 0]), 2)
    assert (a.token_id, a.rank, a.top_token_ids[0]) == (2, 3, 1)  # ties count: 0.5, 0.2 and itself
    assert a.logprob == pytest.approx(math.log(0.2)) and a.top_logprobs[0] == pytest.approx(math.log(0.5))
    assert (b.rank, b.top_token_ids[0]) == (1, 0)


@pytest.fixture(scope="module")
def hf(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab]: row p is log p(. | ids[:p+1])."""
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return tok, logprobs


def check_against_hf(ids: list[int], prompt_logprobs: list, ref: torch.Tensor, k: int) -> None:
    """``prompt_logprobs`` in vLLM's shape (None, then {token_id: {logprob, rank, ...}}) against HF."""
    assert len(prompt_logprobs) == len(ids) and prompt_logprobs[0] is None
    for p in range(1, len(ids)):
        step = {int(t): v for t, v in prompt_logprobs[p].items()}
        row = ref[p - 1]
        want = row[ids[p]].item()
        got = step[ids[p]]
        logprob = got["logprob"] if isinstance(got, dict) else got.logprob
        rank = got["rank"] if isinstance(got, dict) else got.rank
        assert logprob == pytest.approx(want, abs=ATOL)
        assert rank == int((row > want + 1e-6).sum()) + 1
        top = row.topk(k)
        for value, token_id in zip(top.values.tolist(), top.indices.tolist()):
            entry = step[token_id]
            assert (entry["logprob"] if isinstance(entry, dict) else entry.logprob) == pytest.approx(value, abs=ATOL)
        assert len(step) in (k, k + 1)


def test_llm_prompt_logprobs_match_hf_with_chunked_prefill(model_dir, hf):
    tok, ref = hf
    llm = LLM(model_dir, max_num_batched_tokens=16, kv_cache_memory="1MiB")
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)  # warm the prefix cache
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outputs):
        ids = tok.encode(prompt)
        assert out.prompt_token_ids == ids and out.num_cached_tokens == 0  # no prefix hits for these
        check_against_hf(ids, out.prompt_logprobs, ref(ids), 3)
        assert out.prompt_logprobs[1][ids[1]].decoded_token == tok.decode([ids[1]])
    plain = llm.generate(PROMPTS, SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)
    assert all(o.prompt_logprobs is None for o in plain)
    assert [o.outputs[0].token_ids for o in plain] == [o.outputs[0].token_ids for o in outputs]
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks


# --- the disaggregated cluster over HTTP ------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    """1 prefill + 1 decode worker; 16-token steps (prompts prefill in chunks); prompts of fewer than
    8 uncached tokens are prefilled by the decode worker itself."""
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "4MiB", "--max-num-batched-tokens", "16",
                                    "--remote-prefill-threshold", "8"])
    with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("logs"))) as c:
        yield c


def post(cluster, body: dict, path: str = "/v1/completions") -> httpx.Response:
    return httpx.post(f"{cluster.url}{path}", json={"model": "tiny", **body}, timeout=120)


def prefill_steps(cluster) -> int:
    (worker,) = [w for w in httpx.get(f"{cluster.url}/workers", timeout=10).json() if w["role"] == "prefill"]
    return worker["num_steps"]


def test_cluster_prompt_logprobs_match_hf(cluster, hf):
    tok, ref = hf
    for prompt in PROMPTS:  # warm both prefix caches: they must not be used for prompt logprobs
        post(cluster, {"prompt": prompt, "max_tokens": 1})
    time.sleep(2.5)  # a heartbeat sent after the warm-up
    before = prefill_steps(cluster)
    for prompt in PROMPTS:  # the first is prefilled by the decode worker, the others by the prefill worker
        resp = post(cluster, {"prompt": prompt, "max_tokens": 3, "temperature": 0, "prompt_logprobs": 2})
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        ids = tok.encode(prompt)
        check_against_hf(ids, choice["prompt_logprobs"], ref(ids), 2)
        assert choice["prompt_logprobs"][1][str(ids[1])]["decoded_token"] == tok.decode([ids[1]])
        assert "prompt_logprobs" not in post(cluster, {"prompt": prompt, "max_tokens": 1}).json()["choices"][0]
    # The long prompt's blocks were all cached on the decode worker, which would have prefilled it
    # itself (no prefix hits for prompt logprobs, so the prefill worker computed it, in chunks).
    deadline = time.monotonic() + 10
    while prefill_steps(cluster) < before + 4 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert prefill_steps(cluster) >= before + 4
    chat = post(cluster, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 1,
                          "prompt_logprobs": 0}, "/v1/chat/completions").json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


def test_echo_with_max_tokens_0_returns_the_prompt(cluster, hf):
    tok, ref = hf
    prompt = PROMPTS[2]
    ids = tok.encode(prompt)
    body = post(cluster, {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1, "temperature": 0}).json()
    choice = body["choices"][0]
    assert choice["text"] == prompt
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = ref(ids)
    for p in range(1, len(ids)):
        assert lp["token_logprobs"][p] == pytest.approx(want[p - 1, ids[p]].item(), abs=ATOL)
        assert max(lp["top_logprobs"][p].values()) == pytest.approx(want[p - 1].max().item(), abs=ATOL)
    assert lp["text_offset"][:2] == [0, len(lp["tokens"][0])]
    # echo with generation: the prompt, then the output (text and logprobs)
    body = post(cluster, {"prompt": prompt, "echo": True, "max_tokens": 3, "logprobs": 0, "temperature": 0}).json()
    plain = post(cluster, {"prompt": prompt, "max_tokens": 3, "logprobs": 0, "temperature": 0}).json()
    assert body["choices"][0]["text"] == prompt + plain["choices"][0]["text"]
    # the echoed request prefills on the decode worker (prompt logprobs), the plain one on the prefill worker,
    # whose GEMMs run on oneDNN-packed weights (--linear-weight-format): equal to float rounding, not bit for bit
    assert body["choices"][0]["logprobs"]["token_logprobs"][len(ids):] == pytest.approx(
        plain["choices"][0]["logprobs"]["token_logprobs"], abs=ATOL)
    assert post(cluster, {"prompt": prompt, "max_tokens": 0}).status_code == 400  # 0 only with echo
    # streamed: the first chunk brings the prompt; the whole equals the non-stream answer
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": prompt, "echo": True, "max_tokens": 3, "logprobs": 0, "temperature": 0,
            "stream": True}) as resp:
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e)["choices"][0] for e in events[:-1]]
    assert events[-1] == "[DONE]" and chunks[0]["text"].startswith(prompt)
    assert "".join(c["text"] for c in chunks) == body["choices"][0]["text"]
    assert sum((c["logprobs"]["token_logprobs"] for c in chunks), []) == \
        body["choices"][0]["logprobs"]["token_logprobs"]
    assert sum((c["logprobs"]["text_offset"] for c in chunks), []) == body["choices"][0]["logprobs"]["text_offset"]


def test_return_token_ids_gives_the_prompt_and_output_ids(cluster, hf):
    """vLLM's ``return_token_ids``: the prompt's ids and each choice's output ids, which decode to its text
    (cut at a stop string: no id past the one that completed it); absent unless asked; a 400 with
    ``stream``, which does not carry them yet."""
    tok, _ = hf
    prompt = PROMPTS[1]
    body = post(cluster, {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True}).json()
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == tok.encode(prompt)
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"] == 6
    assert tok.decode(choice["token_ids"]) == choice["text"]
    plain = post(cluster, {"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()["choices"][0]
    assert "token_ids" not in plain and "prompt_token_ids" not in plain and plain["text"] == choice["text"]
    stop = tok.decode(choice["token_ids"][2:4])
    cut = post(cluster, {"prompt": prompt, "max_tokens": 6, "temperature": 0, "return_token_ids": True,
                         "stop": [stop]}).json()["choices"][0]
    assert cut["finish_reason"] == "stop" and cut["token_ids"] == choice["token_ids"][:len(cut["token_ids"])]
    assert tok.decode(cut["token_ids"]).startswith(cut["text"] + stop[:1]) and len(cut["token_ids"]) <= 4
    chat = post(cluster, {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 3,
                          "temperature": 0, "return_token_ids": True}, "/v1/chat/completions").json()
    assert len(chat["prompt_token_ids"]) == chat["usage"]["prompt_tokens"]
    assert tok.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    streamed = post(cluster, {"prompt": prompt, "max_tokens": 2, "stream": True, "return_token_ids": True})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "return_token_ids"


def test_lm_eval_loglikelihood_matches_hf(cluster, hf):
    """lm-evaluation-harness ``local-completions``: token prompt, echo, max_tokens 1, logprobs 1,
    temperature 0; the continuation's loglikelihood is the sum of token_logprobs[ctxlen:-1]."""
    tok, ref = hf
    context = tok.encode("the quick brown fox jumps over a lazy")
    continuation = tok.encode(" dog while seven", add_special_tokens=False)
    ids = context + continuation
    body = post(cluster, {"prompt": [ids], "echo": True, "max_tokens": 1, "logprobs": 1, "temperature": 0,
                          "seed": 1234}).json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) + 1
    got = sum(lp["token_logprobs"][len(context):-1])
    want_rows = ref(ids)
    want = sum(want_rows[p - 1, ids[p]].item() for p in range(len(context), len(ids)))
    assert got == pytest.approx(want, abs=1e-3)
    is_greedy = all(t == max(top.values()) for t, top in zip(lp["token_logprobs"][len(context):-1],
                                                             lp["top_logprobs"][len(context):-1]))
    assert is_greedy == all(want_rows[p - 1].argmax().item() == ids[p] for p in range(len(context), len(ids)))


def test_cluster_sampling_controls(cluster, model_dir, hf):
    tok, _ = hf
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompt = PROMPTS[2]

    def hf_greedy(ids: list[int], **kw) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=2, **kw)
        return out[0, len(ids):].tolist()

    ids = tok.encode(prompt)
    ids += hf_greedy(ids)  # the prompt holds the tokens the model favours: the penalty must bite
    body = post(cluster, {"prompt": ids, "max_tokens": 12, "temperature": 0, "repetition_penalty": 1.3,
                          "ignore_eos": True}).json()
    want = hf_greedy(ids, repetition_penalty=1.3)
    assert body["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    assert want != hf_greedy(ids)
    forced = tok.encode(" oak", add_special_tokens=False)
    body = post(cluster, {"prompt": prompt, "max_tokens": 4, "seed": 5, "ignore_eos": True,
                          "logit_bias": {str(forced[-1]): 100}}).json()
    assert body["choices"][0]["text"] == tok.decode(forced[-1:] * 4)
    plain = post(cluster, {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}).json()
    word = plain["choices"][0]["text"].split()[0]
    banned = post(cluster, {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True,
                            "bad_words": [word]}).json()
    assert word not in banned["choices"][0]["text"].split()
    assert banned["choices"][0]["text"] != plain["choices"][0]["text"]
    err = post(cluster, {"prompt": prompt, "logit_bias": {"99999": 5}})
    assert err.status_code == 400 and err.json()["error"]["param"] == "logit_bias"
    assert set(err.json()["error"]) == {"message", "type", "param", "code"}


def test_llm_prompt_logprobs_pipeline_parallel_under_preemption(model_dir, hf):
    """Two pipeline stages (the prompt rows travel with the sampled ones) and a 6-block cache: requests
    are preempted mid-prefill and recomputed; every entry is still there once, and equal to HF's."""
    tok, ref = hf
    prompts = [" ".join(WORDS[i % len(WORDS)] for i in range(k)) for k in (3, 8, 14, 20)]
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    with LLM(model_dir, pipeline_parallel_size=2, max_num_batched_tokens=16, kv_cache_memory=6 * 4096) as llm:
        assert llm.block_manager.num_blocks == 6
        outputs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.scheduler.stats.num_preemptions > 0
    for prompt, out in zip(prompts, outputs):
        ids = tok.encode(prompt)
        check_against_hf(ids, out.prompt_logprobs, ref(ids), 1)
