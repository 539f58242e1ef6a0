"""Structured outputs (pdserve.engine.execution.structured_output): grammars from JSON schema, regex, choice and
Lark constrain sampling, in the offline LLM (batches mixing grammars, n > 1, preemption, resume)
and through a real disaggregated cluster over HTTP (the prefill worker samples the first token
under the grammar, the decode worker replays it).

Outputs are checked by tools no one here wrote: ``jsonschema`` for JSON, Python's ``re`` for
regexes, and a hand-written parse for the Lark grammar's language.
"""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve import StructuredOutputsParams as SO
from pdserve.common.validation import ValidationError
from pdserve.engine.execution.sampler import Sampler, SamplingRow, apply_token_bitmask
from pdserve.engine.execution.structured_output import (StructuredOutputManager, build_token_bitmask,
                                              check_structured_outputs)
from tests.helpers.schemas import SCHEMA  # noqa: F401

REGEX = r"[a-z]{2,5}-[0-9]{3}"
CHOICES = ["yes", "no", 'say "maybe"', "a|b\\c"]
# Sums of one to four numbers of one to three digits in parentheses, e.g. "(12+7)": bounded, so a
# random model cannot run past max_tokens.
LARK = 'start: "(" NUM ("+" NUM) ~ 0..3 ")"\nNUM: /[0-9]{1,3}/'
LARK_RE = re.compile(r"\(\d{1,3}(\+\d{1,3}){0,3}\)")


def json_params(**kwargs) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=120,
                          structured_outputs=SO(json=json.dumps(SCHEMA), disable_any_whitespace=True), **kwargs)


def assert_valid_json(text: str) -> None:
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, kv_cache_memory="8MiB", max_num_seqs=256, max_num_batched_tokens=512)


def assert_all_blocks_free(llm: LLM) -> None:
    assert llm.block_manager.num_free_blocks == llm.block_manager.num_blocks
    assert not llm.scheduler.has_unfinished()


# ---- grammars and the bitmask, without a model ----------------------------------------------------

def test_one_valid_constraint_or_a_named_error():
    check_structured_outputs(SO(json=json.dumps(SCHEMA)))
    check_structured_outputs(SO(regex=REGEX))
    check_structured_outputs(SO(choice=CHOICES))
    check_structured_outputs(SO(grammar=LARK))
    check_structured_outputs(SO(json_object=True))
    for bad, match in [(SO(), "exactly one"), (SO(regex="a", choice=["a"]), "regex, choice"),
                       (SO(json='{"type": "strin"}'), "strin"), (SO(json="{not json"), "json"),
                       (SO(regex="a(b"), "unclosed group"), (SO(grammar="start: foo"), "foo"),
                       (SO(choice=[]), "at least one")]:
        with pytest.raises(ValidationError, match=match) as info:
            check_structured_outputs(bad)
        assert info.value.param == "structured_outputs"


def test_bitmask_masks_only_constrained_rows_and_ids_past_the_tokenizer(model_dir):
    manager = StructuredOutputManager(model_dir, eos_token_ids=frozenset({1}))
    state = manager.new_request(SO(choice=["yes", "no"]))
    tok_vocab = manager.tokenizer_vocab_size
    vocab_size = tok_vocab + 40  # the model embeds ids the tokenizer lacks
    bitmask = build_token_bitmask([None, state, None], vocab_size)
    assert bitmask.dtype == torch.int32 and bitmask.shape[1] * 32 >= vocab_size
    logits = torch.randn(3, vocab_size)
    masked = apply_token_bitmask(logits, bitmask)
    assert torch.equal(masked[0], logits[0]) and torch.equal(masked[2], logits[2])
    allowed = torch.isfinite(masked[1]).nonzero().flatten().tolist()
    assert allowed and all(t < tok_vocab for t in allowed)
    assert all(state.validate_tokens([t]) == 1 for t in allowed)  # exactly the tokens the grammar accepts
    assert 1 not in allowed  # EOS only where the grammar may end
    assert state.accept_tokens(manager.tokenizer.tokenize_str("no")) and state.is_terminated()
    assert build_token_bitmask([None, None], vocab_size) is None


def test_raw_logprobs_come_before_the_mask(model_dir):
    manager = StructuredOutputManager(model_dir, eos_token_ids=frozenset({1}))
    state = manager.new_request(SO(regex="[0-9]+"))
    logits = torch.randn(1, manager.tokenizer_vocab_size)
    bitmask = build_token_bitmask([state], logits.shape[1])
    out = Sampler(seed=0)(logits, [SamplingRow(SamplingParams(temperature=1.0, logprobs=3), 0)], bitmask)
    token = out.token_ids[0]
    assert state.validate_tokens([token]) == 1
    lp = out.logprobs[0]
    assert lp.logprob == pytest.approx(logits.log_softmax(-1)[0, token].item(), abs=1e-5)
    assert lp.top_token_ids == logits.topk(3).indices[0].tolist()  # unmasked: the model's own top 3


def test_draft_token_helpers(model_dir):
    manager = StructuredOutputManager(model_dir, eos_token_ids=frozenset({1}))
    tokenizer = manager.tokenizer
    state = manager.new_request(SO(regex="ab+c"))
    good = tokenizer.tokenize_str("abbbc")
    bad = tokenizer.tokenize_str("abx")
    assert state.validate_tokens(good) == len(good)
    assert state.validate_tokens(bad) < len(bad)
    assert state.accept_tokens(good) and state.is_terminated()
    state.rollback(len(good))
    assert not state.is_terminated() and state.validate_tokens(good) == len(good)
    fresh = state.fresh()
    assert fresh.validate_tokens(good) == len(good) and manager.num_compiles == 1  # compiled once, copied
    assert not state.accept_tokens(bad) and state.error


def test_router_maps_every_spelling_to_one_constraint():
    from pdserve.router.errors import APIError
    from pdserve.router.openai_protocol import ChatCompletionRequest, CompletionRequest
    from pdserve.router.structured_outputs import structured_outputs_of

    def chat(**kw):
        return structured_outputs_of(ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}],
                                                           **kw))

    def completion(**kw):
        return structured_outputs_of(CompletionRequest(model="m", prompt="x", **kw))

    assert chat() is None and chat(response_format={"type": "text"}) is None
    assert chat(response_format={"type": "json_object"}) == SO(json_object=True)
    got = chat(response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": SCHEMA}})
    assert json.loads(got.json) == SCHEMA
    assert json.loads(completion(structured_outputs={"json": json.dumps(SCHEMA)}).json) == SCHEMA
    assert completion(structured_outputs={"choice": CHOICES}) == SO(choice=CHOICES)
    assert completion(structured_outputs={"json_object": True, "disable_any_whitespace": True}) == \
        SO(json_object=True, disable_any_whitespace=True)
    assert completion(guided_regex=REGEX) == SO(regex=REGEX)
    assert completion(guided_grammar=LARK) == SO(grammar=LARK)
    assert json.loads(completion(guided_json=SCHEMA).json) == SCHEMA
    for kw, param in [(dict(guided_regex="a", structured_outputs={"regex": "b"}), "guided_regex"),
                      (dict(response_format={"type": "json_object"}, guided_choice=["a"]), "guided_choice"),
                      (dict(structured_outputs={"json": "{nope"}), "structured_outputs"),
                      (dict(structured_outputs={"choice": "abc"}), "structured_outputs"),
                      (dict(guided_regex="(("), "guided_regex"),
                      (dict(response_format={"type": "json_schema", "json_schema": {"name": "r"}}),
                       "response_format")]:
        with pytest.raises(APIError) as info:
            completion(**kw)
        assert info.value.status_code == 400 and info.value.param == param, (kw, info.value.message)


# ---- the offline LLM -----------------------------------------------------------------------------

def test_200_sampled_json_outputs_match_a_nested_schema(llm):
    prompts = [f"record number {i}:" for i in range(25)]
    outputs = llm.generate(prompts, json_params(n=8), use_tqdm=False)
    texts = [c for o in outputs for c in o.outputs]
    assert len(texts) == 200
    for c in texts:
        assert c.finish_reason == "stop", c.text
        assert_valid_json(c.text)
    assert len({c.text for c in texts}) > 100  # temperature 1: really sampled
    assert_all_blocks_free(llm)


def test_a_batch_mixes_grammars_and_unconstrained_rows(llm):
    kinds = [SO(regex=REGEX), SO(choice=CHOICES), SO(grammar=LARK), None, SO(regex=REGEX)]
    params = [SamplingParams(temperature=1.0, max_tokens=40, n=4, structured_outputs=k) for k in kinds]
    outputs = llm.generate(["one", "two", "three", "four", "five"], params, use_tqdm=False)
    regex, choice, lark, free, regex2 = ([c.text for c in o.outputs] for o in outputs)
    assert all(re.fullmatch(REGEX, t) for t in regex + regex2), regex + regex2
    assert all(t in CHOICES for t in choice), choice
    assert all(LARK_RE.fullmatch(t) for t in lark), lark
    assert all(c.finish_reason == "length" for c in outputs[3].outputs)  # the free rows ran on, unmasked
    assert not any(re.fullmatch(REGEX, t) or t in CHOICES or LARK_RE.fullmatch(t) for t in free), free
    assert all(c.finish_reason == "stop" for o in (outputs[0], outputs[1], outputs[2], outputs[4]) for c in o.outputs)
    assert_all_blocks_free(llm)


def test_json_object_and_seeded_reproducibility(llm):
    params = SamplingParams(temperature=1.0, max_tokens=60, n=3, seed=11,
                            structured_outputs=SO(json='{"type": "object", "properties": {"k": {"enum": [1, 2]}}, '
                                                       '"required": ["k"], "additionalProperties": false}',
                                                  disable_any_whitespace=True))
    a = llm.generate(["seeded"], params, use_tqdm=False)[0]
    b = llm.generate(["seeded"], params, use_tqdm=False)[0]
    assert [c.text for c in a.outputs] == [c.text for c in b.outputs]
    assert all(json.loads(c.text)["k"] in (1, 2) for c in a.outputs)
    obj = llm.generate(["x"], SamplingParams(temperature=0, max_tokens=8,
                                             structured_outputs=SO(json_object=True)), use_tqdm=False)[0]
    assert obj.outputs[0].text.startswith("{")


def test_grammar_survives_preemption(model_dir):
    small = LLM(model_dir, max_num_batched_tokens=32, kv_cache_memory="96KiB")  # 12 blocks of 16 tokens
    # 4 samples of ~60 tokens need ~16 blocks: some are preempted and recomputed, keeping their output
    outputs = small.generate([f"prompt {i}" for i in range(2)], json_params(n=2), use_tqdm=False)
    assert small.scheduler.stats.num_preemptions > 0
    for o in outputs:
        for c in o.outputs:
            assert_valid_json(c.text)
    assert_all_blocks_free(small)


def test_resume_replays_output_into_a_fresh_matcher(llm):
    from pdserve.common.protocol import ResumedChoice

    core = llm.core
    prompt = llm.tokenizer.encode("resume me")
    params = json_params(n=2, seed=3)
    head = llm.tokenizer.encode('{"id":12,"name":"')
    core.add_request("resumed", prompt, params, resume=[ResumedChoice(index=1, output_token_ids=head)])
    tokens = list(head)
    while core.has_unfinished():
        _, outputs = core.step()
        tokens += [t for o in outputs for t in o.new_token_ids]
    assert_valid_json(llm.tokenizer.decode(tokens, skip_special_tokens=True))
    bad = llm.tokenizer.encode("not json")
    with pytest.raises(ValidationError, match="does not match"):
        core.add_request("bad-resume", prompt, params, resume=[ResumedChoice(index=0, output_token_ids=bad)])
    assert_all_blocks_free(llm)


def test_invalid_grammar_is_a_value_error_before_any_work(llm):
    num_prompt_tokens = llm.scheduler.stats.num_prompt_tokens
    for so in (SO(json='{"type": "object", "properties": 5}'), SO(regex="(("), SO(regex="a", grammar=LARK)):
        with pytest.raises(ValueError, match="structured outputs"):
            llm.generate(["fine", "also fine"], SamplingParams(structured_outputs=so), use_tqdm=False)
    assert_all_blocks_free(llm)
    assert llm.scheduler.stats.num_prompt_tokens == num_prompt_tokens  # "fine" was never queued either


# ---- a disaggregated cluster over HTTP -----------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    from pdserve.common.utils import free_port
    from pdserve.cluster.launcher import ClusterSpec, LocalCluster

    # Threshold 0: every prompt is prefilled by the prefill worker, which samples the first token.
    spec = ClusterSpec(model=model_dir, num_prefill=1, num_decode=1, port=free_port(), threads_per_worker=1,
                       worker_args=["--kv-cache-memory", "8MiB", "--max-num-seqs", "64",
                                    "--remote-prefill-threshold", "0"])
    with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("logs"))) as c:
        yield c


def kv_transfers(cluster) -> float:
    text = httpx.get(f"{cluster.url}/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:kv_transfers_total"))


@pytest.mark.cluster
def test_cluster_structured_outputs_over_http(cluster):
    import concurrent.futures as cf
    import time

    api = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)
    before = kv_transfers(cluster)
    # response_format has no whitespace option: the schema carries llguidance's own (vLLM's default allows
    # any JSON whitespace between tokens, which a random model may pile up past max_tokens)
    compact = {**SCHEMA, "x-guidance": {"whitespace_flexible": False}}
    schema_format = {"type": "json_schema", "json_schema": {"name": "record", "schema": compact, "strict": True}}

    def chat(i):
        return api.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": f"record {i}"}], n=4, max_tokens=120,
            temperature=1.0, response_format=schema_format)

    def completion(i):  # vLLM's field, with its compact-JSON option
        return api.completions.create(
            model="tiny", prompt=f"record {i}", n=4, max_tokens=120, temperature=1.0,
            extra_body={"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}})

    with cf.ThreadPoolExecutor(6) as pool:
        chats = [pool.submit(chat, i) for i in range(3)]
        completions = [pool.submit(completion, i) for i in range(3)]
        texts = [c.message.content for f in chats for c in f.result().choices]
        texts += [c.text for f in completions for c in f.result().choices]
    assert len(texts) == 24
    for t in texts:
        assert_valid_json(t)
    regex = api.completions.create(model="tiny", prompt="code:", max_tokens=30, temperature=1.0, n=3,
                                   extra_body={"structured_outputs": {"regex": REGEX}})
    assert all(re.fullmatch(REGEX, c.text) and c.finish_reason == "stop" for c in regex.choices)
    choice = api.completions.create(model="tiny", prompt="answer:", max_tokens=30, temperature=1.0,
                                    extra_body={"guided_choice": CHOICES})
    assert choice.choices[0].text in CHOICES
    stream = api.completions.create(model="tiny", prompt="sum:", max_tokens=40, temperature=1.0, stream=True,
                                    extra_body={"structured_outputs": {"grammar": LARK}})
    assert LARK_RE.fullmatch("".join(c.choices[0].text for c in stream if c.choices))
    obj = api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "obj"}], max_tokens=5,
                                      temperature=0, response_format={"type": "json_object"})
    assert obj.choices[0].message.content.startswith("{")
    deadline = time.monotonic() + 10
    # The six completion prompts are shorter than a block, so never prefix-cache hits: their first tokens
    # came from the prefill worker (chat prompts share the template's first block and may be prefilled
    # on the decode worker once it is cached: conditional disaggregation).
    while kv_transfers(cluster) - before < 6 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert kv_transfers(cluster) - before >= 6


@pytest.mark.cluster
def test_cluster_rejects_bad_constraints_with_400(cluster):
    url = cluster.url
    cases = [
        ("/v1/chat/completions", {"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "strin"}}}}}}, "response_format"),
        ("/v1/completions", {"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
        ("/v1/completions", {"structured_outputs": {"grammar": "start: nope"}}, "structured_outputs"),
        ("/v1/completions", {"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ("/v1/completions", {"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format"),
    ]
    for path, extra, param in cases:
        body = {"model": "tiny", "max_tokens": 5, **extra}
        body.update({"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"})
        resp = httpx.post(f"{url}{path}", json=body, timeout=30)
        assert resp.status_code == 400, (extra, resp.text)
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
    ok = httpx.post(f"{url}/v1/chat/completions", timeout=30, json={
        "model": "tiny", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "text"}})
    assert ok.status_code == 200


# ---- a decode worker in this process (requests sent past the router) -----------------------------

def test_decode_worker_fails_a_bad_grammar_with_400_kind_and_serves_a_good_one(model_dir):
    from pdserve.common.protocol import ErrorKind, FinishReason, GenerateRequest
    from pdserve.decode_worker.worker import DecodeWorker
    from tests.helpers.fake_peers import FakeRouter, all_blocks_free, drive, make_worker

    router = FakeRouter()
    worker = make_worker(DecodeWorker, model_dir, router.addr)
    try:
        for rid, so in (("bad-regex", SO(regex="a(b")), ("two", SO(regex="a", choice=["a"]))):
            worker.handle(GenerateRequest(request_id=rid, prompt_token_ids=[5, 6, 7],
                                          sampling_params=SamplingParams(structured_outputs=so)))
        worker.handle(GenerateRequest(request_id="good", prompt_token_ids=[5, 6, 7], sampling_params=SamplingParams(
            max_tokens=30, temperature=1.0, n=3, structured_outputs=SO(regex=REGEX))))
        drive(worker, lambda: router.finished("bad-regex") and router.finished("two") and
              sum(d.finish_reason is not None for d in router.deltas("good")) == 3)
        for rid in ("bad-regex", "two"):
            final = router.finished(rid)
            assert final.finish_reason == FinishReason.ERROR and final.error_kind == ErrorKind.INVALID_REQUEST
            assert "structured outputs" in final.error
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        texts = [tokenizer.decode([t for d in router.deltas("good") if d.index == i for t in d.new_token_ids])
                 for i in range(3)]
        assert all(re.fullmatch(REGEX, t) for t in texts), texts
        assert not worker.core.has_unfinished() and all_blocks_free(worker)
    finally:
        worker.close()
        router.close()


def test_a_request_waits_for_its_grammar_off_the_loop_while_others_run():
    """vLLM's WAITING_FOR_FSM: a request whose grammar is still compiling is passed over at admission
    (the requests behind it run), admitted once compiled; a failed compile ends it as an error."""
    from concurrent.futures import Future

    from pdserve.engine.scheduling.block_manager import BlockManager
    from pdserve.engine.scheduling.request import Request, RequestStatus
    from pdserve.engine.scheduling.scheduler import Scheduler, SchedulerConfig
    from pdserve.engine.execution.structured_output import FailedGrammar
    from tests.helpers.scheduling import fake_step

    sched = Scheduler(SchedulerConfig(8, 64, 256), BlockManager(32, 4))
    waiting = Request("waits", [1, 2, 3], SamplingParams(max_tokens=4))
    waiting.grammar_future = Future()
    other = Request("other", [4, 5, 6], SamplingParams(max_tokens=4))
    sched.add_request(waiting)
    sched.add_request(other)
    out, _ = fake_step(sched)
    assert [r.request_id for r, _ in out.scheduled] == ["other"]
    out, _ = fake_step(sched)
    assert [r.request_id for r, _ in out.scheduled] == ["other"]
    waiting.grammar_future.set_result(FailedGrammar(None, "resource limit"))
    out, results = fake_step(sched)
    assert "waits" in [r.request_id for r, _ in out.scheduled] and waiting.grammar_future is None
    [failed] = [o for o in results if o.request is waiting]
    assert failed.finished == RequestStatus.FINISHED_ERROR and "resource limit" in waiting.error
