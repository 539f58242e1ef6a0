"""Router: detokenizer, registry, request checks and the HTTP API against a fake decode worker.

No real workers are needed: ``FakeDecodeWorker`` speaks the wire protocol from
a thread (register, heartbeats, scripted token deltas) and records what the
router sent it.
"""

from __future__ import annotations

import json
import threading
import time

import pytest
import zmq
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from pdserve.common.protocol import (AbortRequest, DrainWorker, ErrorKind, FinishReason, Heartbeat,
                                     RegisterWorker, RequestDelta, RequestOutputs, WorkerDraining, WorkerExiting, WorkerRole)
from pdserve.common.auth import registration_token
from pdserve.common.curve import cluster_keys
from pdserve.common.transport import encode
from pdserve.common.validation import num_blocks_needed
from pdserve.router import RouterConfig, build_app
from pdserve.router.registry import WorkerRegistry
from pdserve.router.routing import RoundRobinPolicy
from pdserve.tokenizer.detokenizer import IncrementalDetokenizer
from tests.helpers.fake_peers import fake_logprob, FakeDecodeWorker, wait_for, fake_worker_router, COMPLETION, router, tok, worker  # noqa: F401

MULTIBYTE = "naïve café: 日本語 🙂 € ok"


# --- detokenizer --------------------------------------------------------------------------

def stream(tok, ids, step=1, **kw):
    detok = IncrementalDetokenizer(tok, **kw)
    deltas = [detok.add_tokens(ids[i:i + step]) for i in range(0, len(ids), step)]
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("step", [1, 2, 3])
def test_detokenizer_deltas_concatenate_to_full_decode(tok, step):
    ids = tok.encode(MULTIBYTE)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids), "want a char split across tokens"
    detok, deltas = stream(tok, ids, step)
    assert "".join(deltas) == tok.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in d for d in deltas)
    assert detok.num_output_tokens == len(ids)


def test_detokenizer_prompt_context_and_special_tokens(tok):
    prompt = tok.encode("hello there")
    ids = tok.encode(" general kenobi") + [tok.eos_token_id]
    _, deltas = stream(tok, ids, prompt_token_ids=prompt)
    assert "".join(deltas) == " general kenobi"


@pytest.mark.parametrize("step", [1, 2])
def test_stop_string_split_across_tokens_never_leaks(tok, step):
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok.encode(text)
    for stop in ["fox jumps", "o", "lazy dog", "日本", "x never"]:
        detok, deltas = stream(tok, ids, step, stop=[stop, "zzz-unused"])
        out = "".join(deltas)
        expected = text[:text.index(stop)] if stop in text else text
        assert out == expected == detok.text, stop
        assert detok.stopped == (stop in text)
        for i in range(len(deltas)):  # no prefix of the stream ever contains the stop string
            assert stop not in "".join(deltas[:i + 1])


def test_stop_string_earliest_of_several_and_multibyte(tok):
    ids = tok.encode(MULTIBYTE)
    detok, deltas = stream(tok, ids, stop=["🙂", "語"])
    assert "".join(deltas) == "naïve café: 日本" and detok.stop_str == "語"


def test_stop_string_holds_back_only_possible_prefix(tok):
    detok = IncrementalDetokenizer(tok, stop=["STOPX"])
    out = detok.add_tokens(tok.encode("abc ST"))
    assert out == "abc "  # "ST" might start "STOPX": held back
    out += detok.add_tokens(tok.encode("ONE"))
    assert out == "abc STONE"
    assert detok.add_tokens(tok.encode(" more STOPX tail")) == " more "
    assert detok.stopped and detok.add_tokens(tok.encode("again")) == "" and detok.flush() == ""


def test_stop_string_respects_min_tokens(tok):
    ids = tok.encode("a b a b")
    detok, deltas = stream(tok, ids, stop=["a"], min_tokens=2)
    assert "".join(deltas) == "a b "


# --- config -------------------------------------------------------------------------------

def test_config_defaults_and_cli(model_dir):
    import argparse

    parser = RouterConfig.add_cli_args(argparse.ArgumentParser())
    config = RouterConfig.from_cli_args(parser.parse_args(["--model", model_dir, "--zmq-port", "0"]))
    assert (config.served_model_name, config.max_model_len, config.port, config.zmq_port) == ("tiny", 2048, 8000, 0)
    assert config.worker_timeout_s == 10
    with pytest.raises(ValueError, match="worker_timeout_s"):
        RouterConfig(model=model_dir, worker_timeout_s=0)
    with pytest.raises(ValueError, match="directory"):
        RouterConfig(model=model_dir + "/missing")


# --- registry -----------------------------------------------------------------------------

def reg_msg(worker_id, role=WorkerRole.DECODE, num_blocks=0, block_size=16, addr=None):
    return RegisterWorker(worker_id=worker_id, role=role, input_addr=addr or f"tcp://127.0.0.1:1{worker_id[-1]}",
                          model_name="tiny", num_blocks=num_blocks, block_size=block_size)


def picker(reg):
    """``pick(role, accepts=None)``: round robin over ``reg``'s candidates, as the router's default policy."""
    round_robin = RoundRobinPolicy()

    def pick(role, accepts=None):
        candidates = reg.candidates(role, accepts)
        return round_robin.pick(role, candidates)[0] if candidates else None
    return pick


def test_registry_round_robin_and_roles():
    reg = WorkerRegistry(worker_timeout_s=5)
    pick = picker(reg)
    for w in ("d0", "d1", "d2"):
        reg.register(reg_msg(w), now=0)
    reg.register(reg_msg("p0", role=WorkerRole.PREFILL), now=0)
    picks = [pick(WorkerRole.DECODE).worker_id for _ in range(6)]
    assert picks == ["d0", "d1", "d2", "d0", "d1", "d2"]
    assert pick(WorkerRole.PREFILL).worker_id == "p0"
    assert reg.num_live(WorkerRole.DECODE) == 3 and reg.num_live(WorkerRole.PREFILL) == 1


def test_registry_timeout_expiry_and_heartbeats():
    reg = WorkerRegistry(worker_timeout_s=5)
    pick = picker(reg)
    reg.register(reg_msg("d0"), now=0)
    reg.register(reg_msg("d1"), now=0)
    assert reg.heartbeat(Heartbeat(worker_id="d0", role=WorkerRole.DECODE, max_step_batch_size=7), now=4)
    assert not reg.heartbeat(Heartbeat(worker_id="ghost", role=WorkerRole.DECODE), now=4)
    assert reg.register(reg_msg("d1"), now=1) is None  # idempotent re-register refreshes
    assert [w.worker_id for w, _ in reg.expire(now=5)] == []
    [(expired, reason)] = reg.expire(now=6.5)
    assert expired.worker_id == "d1" and "stopped responding" in reason
    assert [w["id"] for w in reg.snapshot(now=6.5)] == ["d0"]
    assert reg.snapshot(now=6.5)[0]["max_step_batch_size"] == 7
    assert [w.worker_id for w, _ in reg.expire(now=9.5)] == ["d0"]
    assert pick(WorkerRole.DECODE) is None


def test_registry_stalled_step_loop_is_not_routed_and_reported_once():
    reg = WorkerRegistry(worker_timeout_s=5, step_timeout_s=30)
    pick = picker(reg)
    reg.register(reg_msg("d0"), now=0)
    reg.register(reg_msg("d1"), now=0)
    reg.heartbeat(Heartbeat(worker_id="d0", role=WorkerRole.DECODE, loop_stall_s=29.0), now=1)
    assert reg.expire(now=1) == [] and reg.num_live(WorkerRole.DECODE) == 2  # a long step is not a stall
    reg.heartbeat(Heartbeat(worker_id="d0", role=WorkerRole.DECODE, loop_stall_s=31.0), now=2)
    [(stuck, reason)] = reg.expire(now=2)
    assert stuck.worker_id == "d0" and "step loop" in reason
    assert reg.expire(now=3) == []  # reported once per stall; still registered (heartbeats arrive)
    assert {pick(WorkerRole.DECODE).worker_id for _ in range(4)} == {"d1"}
    assert reg.snapshot(now=3)[0]["stalled"] is True
    reg.heartbeat(Heartbeat(worker_id="d0", role=WorkerRole.DECODE, loop_stall_s=0.01), now=4)
    assert {pick(WorkerRole.DECODE).worker_id for _ in range(4)} == {"d0", "d1"}  # moving again


def test_registry_routes_by_advertised_limits_and_restart():
    reg = WorkerRegistry(worker_timeout_s=5)
    pick = picker(reg)
    reg.register(reg_msg("d0", num_blocks=4), now=0)  # 64 tokens
    reg.register(reg_msg("d1", num_blocks=10), now=0)  # 160 tokens
    limits = {w.worker_id: w.limits(fallback_vocab_size=100) for w in reg.live()}
    assert limits["d1"].num_kv_tokens == 160 and limits["d1"].vocab_size == 100

    def fits(num_tokens):
        return lambda w: num_blocks_needed(num_tokens, 16) <= limits[w.worker_id].num_blocks

    assert {pick(WorkerRole.DECODE, fits(100)).worker_id for _ in range(3)} == {"d1"}
    assert pick(WorkerRole.DECODE, fits(161)) is None
    old = reg.register(reg_msg("d0", num_blocks=4, addr="tcp://127.0.0.1:9999"), now=1)
    assert old is not None and old.input_addr != reg.get("d0").input_addr


# --- HTTP API against a fake decode worker ------------------------------------------------


def error_of(resp, status):
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def test_models_health_workers_shapes(router, model_dir):
    models = router.get("/v1/models").json()
    assert models["object"] == "list"
    assert [(m["id"], m["object"], m["max_model_len"]) for m in models["data"]] == [("tiny", "model", 2048)]
    assert router.get("/health").json() == {"status": "ok", "num_prefill": 0, "num_decode": 0}
    assert router.get("/workers").json() == []


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "n": 0}, 400, "n"),
    ("/v1/completions", {**COMPLETION, "n": 17}, 400, "n"),
    ("/v1/completions", {**COMPLETION, "n": 2, "best_of": 3}, 400, "best_of"),
    ("/v1/completions", {**COMPLETION, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {**COMPLETION, "logprobs": -1}, 400, "logprobs"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"99999": 1}}, 400, "logit_bias"),
    ("/v1/completions", {**COMPLETION, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ("/v1/chat/completions", {**CHAT, "repetition_penalty": -1}, 400, "repetition_penalty"),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("/v1/completions", {**COMPLETION, "frequency_penalty": -2.01}, 400, "frequency_penalty"),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": -3}, 400, "presence_penalty"),
    ("/v1/chat/completions", {**CHAT, "frequency_penalty": 7}, 400, "frequency_penalty"),
    ("/v1/completions", {**COMPLETION, "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"]}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [99999]}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "temperature": -0.5}, 400, "temperature"),
    ("/v1/completions", {**COMPLETION, "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {**COMPLETION, "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {**COMPLETION, "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {**COMPLETION, "seed": 2 ** 70}, 400, "seed"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 20}, 400, "min_tokens"),
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "model": "nope"}, 404, "model"),
    ("/v1/chat/completions", {"model": "tiny", "messages": "hello"}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "tools"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": False, "top_logprobs": 0}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "n": 17}, 400, "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages.0.content"),
])
def test_bad_requests_get_openai_errors(router, path, body, status, param):
    err = error_of(router.post(path, json=body), status)
    assert err["param"] == param and err["code"] == status
    assert err["type"] == ("NotFoundError" if status == 404 else "invalid_request_error")
    if "not supported" in err["message"]:
        assert err["message"].endswith("is not supported yet")


def test_malformed_json_and_unknown_model_messages(router):
    err = error_of(router.post("/v1/completions", content=b"{not json",
                               headers={"content-type": "application/json"}), 400)
    assert err["type"] == "invalid_request_error" and "JSON" in err["message"]
    err = error_of(router.post("/v1/completions", json={"model": "x", "prompt": "hi"}), 404)
    assert err["message"] == "The model `x` does not exist."


def test_too_long_names_the_limit(router):
    err = error_of(router.post("/v1/completions", json={**COMPLETION, "prompt": [5] * 2000, "max_tokens": 100}), 400)
    assert "maximum context length is 2048 tokens" in err["message"]
    assert "2100 tokens (2000 in the prompt, 100 for the completion)" in err["message"]
    err = error_of(router.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5000}), 400)
    assert "2048" in err["message"]


def test_no_decode_worker_is_503(router):
    for path, body in [("/v1/completions", COMPLETION), ("/v1/chat/completions", {**CHAT, "stream": True})]:
        err = error_of(router.post(path, json=body), 503)
        assert "decode worker" in err["message"]


def test_completion_non_stream(router, worker, tok):
    worker.script = tok.encode(" café 🙂 done")
    resp = router.post("/v1/completions", json={**COMPLETION, "max_tokens": 50, "temperature": 0,
                                                 "top_k": 5, "seed": 7, "stop_token_ids": [1]})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    assert body["choices"][0]["text"] == " café 🙂 done"
    assert body["choices"][0]["finish_reason"] == "length"
    n, p = len(worker.script), len(tok.encode("hello"))
    assert body["usage"] == {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
    (req,) = worker.requests()
    assert req.prompt_token_ids == tok.encode("hello") and req.prefill_worker_id is None
    sp = req.sampling_params
    assert (sp.max_tokens, sp.temperature, sp.top_k, sp.seed, sp.stop_token_ids) == (50, 0.0, 5, 7, [1])
    assert body["id"] == f"cmpl-{req.request_id}"
    assert router.get("/workers").json()[0]["max_step_batch_size"] == 3


def sse_events(resp):
    lines = [ln for ln in resp.text.split("\n\n") if ln]
    assert all(ln.startswith("data: ") for ln in lines), lines
    return [ln[len("data: "):] for ln in lines]


def test_chat_stream_with_usage(router, worker, tok):
    worker.script = tok.encode("hi there, 日本") + [tok.eos_token_id]
    worker.finish_reason = FinishReason.STOP
    resp = router.post("/v1/chat/completions", json={**CHAT, "stream": True,
                                                      "stream_options": {"include_usage": True}})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"].startswith("chatcmpl-") for c in chunks)
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "hi there, 日本"
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == len(worker.script)
    prompt = tok.apply_chat_template(CHAT["messages"], add_generation_prompt=True, tokenize=False)
    assert worker.requests()[0].prompt_token_ids == tok.encode(prompt, add_special_tokens=False)


def test_stop_string_finishes_and_aborts_worker(router, worker, tok):
    worker.script = tok.encode("the quick brown fox jumps over the lazy dog" * 5)
    worker.finish_reason = None  # the worker would go on; the router must abort it
    worker.delay_s = 0.005
    resp = router.post("/v1/completions", json={**COMPLETION, "max_tokens": 200, "stop": "fox jumps",
                                                 "stream": True})
    chunks = [json.loads(e) for e in sse_events(resp)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == "the quick brown "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    rid = worker.requests()[0].request_id
    wait_for(lambda: rid in worker.aborted)
    resp = router.post("/v1/completions", json={**COMPLETION, "max_tokens": 200, "stop": ["lazy"]})
    assert resp.json()["choices"][0] == {"index": 0, "text": "the quick brown fox jumps over the ",
                                         "logprobs": None, "finish_reason": "stop"}


def test_kv_capacity_limit(router, model_dir, tok):
    w = FakeDecodeWorker(router.get("/info").json()["zmq_address"], num_blocks=4, block_size=16)
    try:
        wait_for(lambda: router.get("/health").json()["num_decode"] == 1)
        err = error_of(router.post("/v1/completions", json={**COMPLETION, "max_tokens": 64}), 400)
        assert "5 KV cache blocks" in err["message"] and "only 4 blocks" in err["message"]
        w.script = tok.encode("ok")
        resp = router.post("/v1/chat/completions", json=CHAT)  # default max_tokens shrinks to fit
        assert resp.status_code == 200, resp.text
        req = w.requests()[0]
        assert len(req.prompt_token_ids) + req.sampling_params.max_tokens == 64
    finally:
        w.close()


def test_limits_come_from_the_workers_registration(router, tok):
    """``pdserve up --max-model-len 64``: the workers advertise 64 and the router holds requests to it."""
    addr = router.get("/info").json()["zmq_address"]
    w = FakeDecodeWorker(addr, max_model_len=64, vocab_size=2000)  # the tokenizer has 2048
    try:
        wait_for(lambda: router.get("/health").json()["num_decode"] == 1)
        assert router.get("/v1/models").json()["data"][0]["max_model_len"] == 64
        long_prompt = {**COMPLETION, "prompt": [5] * 150}
        err = error_of(router.post("/v1/completions", json={**long_prompt, "max_tokens": 4}), 400)
        assert err["message"].startswith("This model's maximum context length is 64 tokens. However, you "
                                         "requested 154 tokens (150 in the prompt, 4 for the completion).")
        long_chat = {**CHAT, "messages": [{"role": "user", "content": "the quick brown fox " * 40}]}
        err = error_of(router.post("/v1/chat/completions", json=long_chat), 400)  # max_tokens left out
        assert "tokens, which leaves no room for the completion" in err["message"]
        p = len(tok.encode("hello"))
        err = error_of(router.post("/v1/completions", json={**COMPLETION, "max_tokens": 200}), 400)
        assert err["param"] == "max_tokens" and f"requested {p + 200} tokens" in err["message"]
        err = error_of(router.post("/v1/completions", json={**COMPLETION, "prompt": [1999, 2000]}), 400)
        assert "token id 2000 is out of range [0, 2000)" in err["message"]  # the worker's vocabulary
        w.script = tok.encode("fits")
        assert router.post("/v1/completions", json={**COMPLETION, "max_tokens": 64 - p}).status_code == 200
        assert router.post("/v1/chat/completions", json=CHAT).status_code == 200  # no max_tokens
        (last,) = w.requests()[-1:]
        assert len(last.prompt_token_ids) + last.sampling_params.max_tokens == 64  # filled to the worker's limit
        assert not router.app.state.engine.num_inflight
    finally:
        w.close()


def test_router_routes_only_to_workers_that_hold_the_request(router, tok):
    addr = router.get("/info").json()["zmq_address"]
    small = FakeDecodeWorker(addr, worker_id="small-d", max_model_len=32)
    large = FakeDecodeWorker(addr, worker_id="large-d", max_model_len=512)
    try:
        wait_for(lambda: router.get("/health").json()["num_decode"] == 2)
        large.script = small.script = tok.encode("ok")
        for _ in range(4):
            resp = router.post("/v1/completions", json={**COMPLETION, "prompt": [5] * 40, "max_tokens": 2})
            assert resp.status_code == 200, resp.text
        assert len(large.requests()) == 4 and small.requests() == []
    finally:
        small.close()
        large.close()


@pytest.mark.parametrize("kind,status", [(ErrorKind.INVALID_REQUEST, 400), (ErrorKind.UNAVAILABLE, 503),
                                         (ErrorKind.INTERNAL, 500), (None, 500)])
def test_worker_errors_map_to_their_status(router, worker, kind, status):
    worker.error = ("the worker says no", kind)
    for stream in (False, True):
        resp = router.post("/v1/completions", json={**COMPLETION, "stream": stream})
        if not stream:
            err = error_of(resp, status)
        else:  # headers went out before the error: it arrives as the last event
            assert resp.status_code == 200
            err = json.loads(resp.text.strip().split("data: ")[-1])["error"]
            assert err["code"] == status
        assert "the worker says no" in err["message"]


def test_deltas_for_forgotten_requests_are_aborted_at_their_worker(router, worker):
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(router.get("/info").json()["zmq_address"])
    try:
        for token in range(3):  # a worker still decoding for a request the router dropped
            push.send_multipart(encode(RequestOutputs(worker_id=worker.worker_id, deltas=[
                RequestDelta(request_id="ghost", new_token_ids=[token])])))
        push.send_multipart(encode(RequestOutputs(worker_id=worker.worker_id, deltas=[
            RequestDelta(request_id="finished-ghost", new_token_ids=[1], finish_reason=FinishReason.STOP)])))
        wait_for(lambda: "ghost" in worker.aborted)
        time.sleep(0.3)
        aborts = [m.request_id for m in worker.received if isinstance(m, AbortRequest)]
        assert aborts == ["ghost"]  # once, and nothing for a request that already finished there
        assert router.app.state.engine.num_orphan_aborts == 1
    finally:
        ctx.destroy(linger=0)


def test_stuck_step_loop_fails_inflight_requests_and_takes_no_more(model_dir, tok):
    # no other decode worker to migrate to: the request fails once worker_wait_s has passed
    config = RouterConfig(model=model_dir, zmq_port=0, worker_timeout_s=5.0, step_timeout_s=0.5, worker_wait_s=0.5)
    with fake_worker_router(config) as (client, w):
        w.script = tok.encode("never arrives")
        w.delay_s = 60.0  # the first token comes only after the stall is noticed
        result = {}
        thread = threading.Thread(target=lambda: result.update(
            resp=client.post("/v1/completions", json=COMPLETION)))
        thread.start()
        wait_for(lambda: w.requests())
        w.loop_stall_s = 2.0  # heartbeats keep coming: the loop, not the process, is stuck
        thread.join(timeout=10)
        err = error_of(result["resp"], 503)
        assert "step loop has not moved" in err["message"] and "no other decode worker" in err["message"]
        assert w.aborted  # the stuck worker must not keep the request's blocks when it wakes up
        assert client.get("/health").json()["num_decode"] == 0
        assert client.get("/workers").json()[0]["stalled"] is True
        assert error_of(client.post("/v1/completions", json=COMPLETION), 503)
        w.loop_stall_s, w.delay_s = 0.0, 0.0  # it recovers
        wait_for(lambda: client.get("/health").json()["num_decode"] == 1)
        assert client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_worker_timeout_fails_inflight_requests(router, worker, tok):
    worker.script = tok.encode("never arrives")
    worker.heartbeating = False  # goes silent: no heartbeats, no tokens
    resp = router.post("/v1/completions", json=COMPLETION)
    err = error_of(resp, 503)
    assert "stopped responding" in err["message"]
    assert router.get("/health").json()["num_decode"] == 0
    assert router.get("/workers").json() == []


# --- n > 1, logprobs, penalties -----------------------------------------------------------

def by_index(chunks):
    """Stream chunks -> {index: (text, [finish_reasons], [chunk choices])}."""
    out = {}
    for c in chunks:
        for ch in c["choices"]:
            text, finishes, choices = out.setdefault(ch["index"], ["", [], []])
            out[ch["index"]][0] = text + ch.get("text", ch.get("delta", {}).get("content") or "")
            if ch["finish_reason"]:
                finishes.append(ch["finish_reason"])
            choices.append(ch)
    return out


def test_penalties_seed_and_n_pass_through(router, worker, tok):
    worker.script = tok.encode(" ok")
    resp = router.post("/v1/chat/completions", json={**CHAT, "max_tokens": 4, "n": 2, "best_of": 2,
                                                      "frequency_penalty": 0.5, "presence_penalty": -2,
                                                      "seed": 11})
    assert resp.status_code == 200, resp.text
    sp = worker.requests()[0].sampling_params
    assert (sp.n, sp.frequency_penalty, sp.presence_penalty, sp.seed, sp.logprobs) == (2, 0.5, -2.0, 11, None)
    assert [c["index"] for c in resp.json()["choices"]] == [0, 1]


def test_n3_non_stream_choices_and_usage(router, worker, tok):
    texts = [" one", " two two", " three three three"]
    worker.scripts = {i: tok.encode(t) for i, t in enumerate(texts)}
    resp = router.post("/v1/completions", json={**COMPLETION, "n": 3, "max_tokens": 20})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert [(c["index"], c["text"], c["finish_reason"], c["logprobs"]) for c in body["choices"]] == [
        (i, t, "length", None) for i, t in enumerate(texts)]
    n = sum(len(s) for s in worker.scripts.values())
    p = len(tok.encode("hello"))
    assert body["usage"] == {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}
    (req,) = worker.requests()
    assert req.sampling_params.n == 3
    time.sleep(0.05)
    assert req.request_id not in worker.aborted  # the worker finished every choice itself


def test_n3_stream_completions_and_chat(router, worker, tok):
    texts = [" a b c d", " e", " f g"]
    worker.scripts = {i: tok.encode(t) for i, t in enumerate(texts)}
    resp = router.post("/v1/completions", json={**COMPLETION, "n": 3, "max_tokens": 20, "stream": True,
                                                 "stream_options": {"include_usage": True}})
    events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(len(c["choices"]) == 1 for c in chunks[:-1])
    got = by_index(chunks[:-1])
    assert {i: (t, f) for i, (t, f, _) in got.items()} == {i: (t, ["length"]) for i, t in enumerate(texts)}
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == sum(len(s) for s in worker.scripts.values())

    resp = router.post("/v1/chat/completions", json={**CHAT, "n": 3, "max_tokens": 20, "stream": True})
    chunks = [json.loads(e) for e in sse_events(resp)[:-1]]
    roles = [c["choices"][0] for c in chunks if "role" in c["choices"][0]["delta"]]
    assert [(r["index"], r["delta"]) for r in roles] == [(i, {"role": "assistant", "content": ""})
                                                        for i in range(3)]
    assert chunks[:3] == [chunks[i] for i in range(3) if "role" in chunks[i]["choices"][0]["delta"]]
    got = by_index(chunks)
    assert {i: (t, f) for i, (t, f, _) in got.items()} == {i: (t, ["length"]) for i, t in enumerate(texts)}


def test_stop_string_on_one_choice_aborts_only_when_all_done(router, worker, tok):
    worker.scripts = {0: tok.encode(" and so on" * 6),  # 24 tokens, ends by length
                      1: tok.encode(" the quick brown fox jumps over the lazy dog" * 5),  # stops early
                      2: tok.encode(" short")}
    worker.delay_s = 0.005
    resp = router.post("/v1/completions", json={**COMPLETION, "n": 3, "max_tokens": 100, "stop": "fox"})
    assert resp.status_code == 200, resp.text
    choices = resp.json()["choices"]
    assert [(c["text"], c["finish_reason"]) for c in choices] == [
        (" and so on" * 6, "length"), (" the quick brown ", "stop"), (" short", "length")]
    rid = worker.requests()[0].request_id
    wait_for(lambda: rid in worker.aborted)  # choice 1 was still running on the worker
    assert worker.aborted[rid] >= worker.finished_at[(rid, 0)]  # not before choice 0 ended
    assert (rid, 1) not in worker.finished_at


def test_completion_logprobs(router, worker, tok):
    text = " café 🙂 ok"
    worker.script = ids = tok.encode(text)
    resp = router.post("/v1/completions", json={**COMPLETION, "logprobs": 2, "max_tokens": 30})
    assert resp.status_code == 200, resp.text
    assert worker.requests()[0].sampling_params.logprobs == 2
    (choice,) = resp.json()["choices"]
    assert choice["text"] == text
    lp = choice["logprobs"]
    assert lp["tokens"] == [tok.decode([t]) for t in ids]
    assert lp["token_logprobs"] == pytest.approx([fake_logprob(t, i, 0, 2).logprob for i, t in enumerate(ids)])
    for i, (t, top) in enumerate(zip(ids, lp["top_logprobs"])):
        expected = fake_logprob(t, i, 0, 2)
        want = {}
        for tid, value in zip(expected.top_token_ids, expected.top_logprobs):
            want.setdefault(tok.decode([tid]), value)
        assert top == pytest.approx(want) and 1 <= len(top) <= 3
    offsets = lp["text_offset"]
    assert offsets[0] == 0 and offsets == sorted(offsets) and len(offsets) == len(ids)
    # Stream: the chunks' entries add up to the same lists, text and entries in step.
    resp = router.post("/v1/completions", json={**COMPLETION, "logprobs": 2, "max_tokens": 30, "stream": True})
    chunks = [json.loads(e)["choices"][0] for e in sse_events(resp)[:-1]]
    assert "".join(c["text"] for c in chunks) == text
    merged = {k: [x for c in chunks if c["logprobs"] for x in c["logprobs"][k]] for k in lp}
    assert merged == lp
    for c in chunks:  # every chunk with text carries the entries of its tokens
        assert bool(c["text"]) <= bool(c["logprobs"])


def test_chat_logprobs_bytes_and_top(router, worker, tok):
    text = "naïve 日本 ok"
    worker.script = ids = tok.encode(text)
    body = {**CHAT, "logprobs": True, "top_logprobs": 3, "max_tokens": 30, "n": 2}
    resp = router.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    assert worker.requests()[0].sampling_params.logprobs == 3
    for index, choice in enumerate(resp.json()["choices"]):
        content = choice["logprobs"]["content"]
        assert len(content) == len(ids)
        assert b"".join(bytes(e["bytes"]) for e in content).decode() == text  # real token bytes
        for i, (t, e) in enumerate(zip(ids, content)):
            expected = fake_logprob(t, i, index, 3)
            assert e["token"] == tok.decode([t]) and e["logprob"] == pytest.approx(expected.logprob)
            assert [x["logprob"] for x in e["top_logprobs"]] == pytest.approx(expected.top_logprobs)
            assert [x["token"] for x in e["top_logprobs"]] == [tok.decode([x]) for x in expected.top_token_ids]
            assert set(e) == {"token", "logprob", "bytes", "top_logprobs"}
    resp = router.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "max_tokens": 30})
    content = resp.json()["choices"][0]["logprobs"]["content"]
    assert len(content) == len(ids) and all(e["top_logprobs"] == [] for e in content)
    resp = router.post("/v1/chat/completions", json={**CHAT, "logprobs": True, "max_tokens": 30, "stream": True})
    chunks = [json.loads(e)["choices"][0] for e in sse_events(resp)[:-1]]
    streamed = [e for c in chunks if c["logprobs"] for e in c["logprobs"]["content"]]
    assert streamed == content
    resp = router.post("/v1/chat/completions", json=CHAT)
    assert resp.json()["choices"][0]["logprobs"] is None


def test_missing_logprobs_fail_loudly(router, worker, tok):
    worker.script = tok.encode(" hi")
    worker.send_logprobs = False
    err = error_of(router.post("/v1/completions", json={**COMPLETION, "logprobs": 1}), 500)
    assert "logprobs" in err["message"] and "fake-d0" in err["message"]


def choice_output(tok, stop=(), logprobs=True):
    from pdserve.router.outputs import ChoiceOutput
    return ChoiceOutput(0, IncrementalDetokenizer(tok, stop=stop), logprobs)


def feed(choice, ids, finish_at_end=True):
    """Feed ids one delta each; return the ChoiceDeltas."""
    outs = []
    for i, t in enumerate(ids):
        last = finish_at_end and i == len(ids) - 1
        delta = RequestDelta(request_id="r", new_token_ids=[t], logprobs=[fake_logprob(t, i, 0, 1)],
                             finish_reason=FinishReason.LENGTH if last else None)
        out = choice.add(delta)
        if out is not None:
            outs.append(out)
        if choice.finished:
            break
    return outs


def test_logprob_entries_follow_emitted_text(tok):
    ids = tok.encode(MULTIBYTE)
    outs = feed(choice_output(tok), ids)
    assert "".join(o.text for o in outs) == MULTIBYTE
    assert [e.token_id for o in outs for e in o.tokens] == ids
    for o in outs:  # an entry never comes before its token's text
        assert bool(o.tokens) == bool(o.text) or o.finish_reason
    # A token ending mid-character has no text of its own: it goes out with the one completing it.
    split = next(i for i, t in enumerate(ids) if tok.decode([t]).endswith("\ufffd"))
    carrier = next(o for o in outs if any(e.token_id == ids[split] for e in o.tokens))
    assert len(carrier.tokens) >= 2 and "\ufffd" not in carrier.text


def test_logprob_entries_cut_at_stop_string(tok):
    text = "the quick brown fox jumps over"
    ids = tok.encode(text)
    choice = choice_output(tok, stop=["fox j"])
    outs = feed(choice, ids)
    assert choice.finish_reason == "stop" and choice.text == "the quick brown "
    kept = [e for o in outs for e in o.tokens]
    assert kept == choice.entries
    starts = [e.start for e in kept]
    assert all(s < len(choice.text) for s in starts)
    # Exactly the tokens whose text starts before the cut survive.
    prefix_lens = [len(tok.decode(ids[:i])) for i in range(len(ids))]
    assert [e.token_id for e in kept] == [t for t, s in zip(ids, prefix_lens) if s < len(choice.text)]
    assert "".join(o.text for o in outs) == choice.text


# --- authentication -----------------------------------------------------------------------

def test_api_key_guards_v1_and_leaves_health_and_metrics_open(model_dir):
    config = RouterConfig(model=model_dir, zmq_port=0, api_key="sk-test-123", worker_wait_s=0)
    with TestClient(build_app(config)) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sk-test-123"}):
            err = error_of(client.get("/v1/models", headers=headers), 401)
            assert "API key" in err["message"]
            error_of(client.post("/v1/completions", json=COMPLETION, headers=headers), 401)
        ok = {"Authorization": "Bearer sk-test-123"}
        assert client.get("/v1/models", headers=ok).status_code == 200
        error_of(client.post("/v1/completions", json=COMPLETION, headers=ok), 503)  # past the key: no worker
        assert client.get("/health").status_code == 200 and client.get("/metrics").status_code == 200


def test_api_key_from_the_environment(model_dir, monkeypatch):
    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert RouterConfig(model=model_dir).api_key == "from-env"
    assert RouterConfig(model=model_dir, api_key="flag").api_key == "flag"


class _SecretWorker(FakeDecodeWorker):
    """A fake decode worker whose registration carries ``auth`` (None, wrong or right), and whose sockets
    use the CURVE keys of ``curve_secret`` (default: the same secret; None: plain TCP)."""

    def __init__(self, router_addr, auth_secret, curve_secret="same", **kw):
        self.auth_secret = auth_secret
        super().__init__(router_addr, keys=cluster_keys(auth_secret if curve_secret == "same" else curve_secret),
                         **kw)

    def _send(self, msg):
        if isinstance(msg, RegisterWorker) and self.auth_secret is not None:
            msg.auth = registration_token(self.auth_secret, msg.worker_id, msg.role, msg.input_addr)
        super()._send(msg)


def test_workers_must_know_the_cluster_secret_to_join(model_dir):
    config = RouterConfig(model=model_dir, zmq_port=0, worker_timeout_s=2.0, cluster_secret="s3cret")
    with TestClient(build_app(config)) as client:
        addr = client.get("/info").json()["zmq_address"]
        strangers = [_SecretWorker(addr, None, worker_id="stranger-d0"),  # plain TCP: no handshake
                     _SecretWorker(addr, "guess", worker_id="stranger-d1"),  # another secret's keys: no handshake
                     _SecretWorker(addr, "guess", curve_secret="s3cret", worker_id="stranger-d2")]  # keys, no token
        member = None
        try:
            wait_for(lambda: client.app.state.engine.num_refused_registrations >= 1)
            time.sleep(0.5)
            # only the one that got past CURVE was heard at all (and refused); heartbeats are ignored too
            assert client.app.state.engine.num_refused_registrations == 1
            assert client.get("/health").json()["num_decode"] == 0
            member = _SecretWorker(addr, "s3cret", worker_id="member-d0")
            wait_for(lambda: client.get("/health").json()["num_decode"] == 1)
            assert [w["id"] for w in client.get("/workers").json()] == ["member-d0"]
        finally:
            for w in strangers + ([member] if member else []):
                w.close()


# --- pools: waiting for a worker, scaling, draining -------------------------------------------

def test_request_waits_for_a_decode_worker_to_register(model_dir, tok):
    config = RouterConfig(model=model_dir, zmq_port=0, worker_wait_s=10)
    with TestClient(build_app(config)) as client:
        addr = client.get("/info").json()["zmq_address"]
        workers = []

        script = tok.encode(" one two")

        def join():  # the request is already waiting: the worker must know its script when it registers
            workers.append(FakeDecodeWorker(addr, script=script))

        timer = threading.Timer(0.5, join)
        timer.start()
        try:
            started = time.monotonic()
            resp = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 2})
            assert resp.status_code == 200, resp.text
            assert time.monotonic() - started >= 0.4  # it did wait for the worker
        finally:
            timer.join()
            for w in workers:
                w.close()


def _drains(worker) -> list[DrainWorker]:
    return [m for m in worker.received if isinstance(m, DrainWorker)]


def test_scale_down_drains_the_idle_surplus_and_routes_nothing_new_to_it(router, tok):
    addr = router.get("/info").json()["zmq_address"]
    pair = [FakeDecodeWorker(addr, worker_id="w-d0"), FakeDecodeWorker(addr, worker_id="w-d1")]
    try:
        wait_for(lambda: router.get("/health").json()["num_decode"] == 2)
        for w in pair:
            w.script, w.delay_s = tok.encode(" one two three four five six"), 0.3
        result = {}
        thread = threading.Thread(target=lambda: result.update(resp=router.post(
            "/v1/completions", json={**COMPLETION, "max_tokens": 6})))
        thread.start()
        wait_for(lambda: any(w.requests() for w in pair))
        # the surplus is the worker holding the fewest requests: the one without it
        busy, idle = pair if pair[0].requests() else pair[::-1]
        resp = router.post("/admin/scale", json={"decode": 1})
        assert resp.status_code == 200 and resp.json()["draining"] == [idle.worker_id]
        pools = router.get("/admin/pools").json()["decode"]
        assert (pools["desired"], pools["num_serving"], pools["num_draining"]) == (1, 1, 1)
        wait_for(lambda: _drains(idle))
        assert not _drains(busy)
        idle.delay_s = busy.delay_s = 0.0
        for _ in range(3):  # nothing new goes to the draining worker
            assert router.post("/v1/completions", json={**COMPLETION, "max_tokens": 1}).status_code == 200
        assert not idle.requests() and len(busy.requests()) == 4
        idle.outbox.append(WorkerExiting(worker_id=idle.worker_id, role=WorkerRole.DECODE, input_addr=idle.addr))
        wait_for(lambda: [w["id"] for w in router.get("/admin/pools").json()["decode"]["workers"]] == [busy.worker_id])
        thread.join(timeout=10)
        assert result["resp"].status_code == 200
    finally:
        for w in pair:
            w.close()


def test_drain_waits_until_the_worker_holds_nothing(router, tok):
    addr = router.get("/info").json()["zmq_address"]
    worker = FakeDecodeWorker(addr, worker_id="d0")
    try:
        wait_for(lambda: router.get("/health").json()["num_decode"] == 1)
        worker.script, worker.delay_s = tok.encode(" one two three four"), 0.3
        result = {}
        thread = threading.Thread(target=lambda: result.update(resp=router.post(
            "/v1/completions", json={**COMPLETION, "max_tokens": 4})))
        thread.start()
        wait_for(lambda: worker.requests())
        resp = router.post("/admin/workers/d0/drain")
        assert resp.status_code == 200 and resp.json() == {"id": "d0", "state": "draining", "num_outstanding": 1}
        time.sleep(0.3)
        assert not _drains(worker)  # its request still streams
        thread.join(timeout=10)
        assert result["resp"].status_code == 200 and result["resp"].json()["usage"]["completion_tokens"] == 4
        wait_for(lambda: _drains(worker))
        assert router.get("/health").json()["num_decode"] == 0  # draining: not counted as serving
        error_of(router.post("/admin/workers/nobody/drain"), 404)
    finally:
        worker.close()


def test_scale_request_is_validated(router):
    for body in ({"decode": 0}, {"prefill": -1}, {"decode": 2, "replicas": 3}, {"decode": "many"},
                 {"decode": "1"}, {"prefill": True}):  # a string or a boolean is not a pool size (the schema's integer)
        error_of(router.post("/admin/scale", json=body), 400)
    assert router.post("/admin/scale", json={}).json()["draining"] == []


def test_a_worker_shutting_down_asks_to_drain_and_strangers_cannot_remove_it(model_dir):
    config = RouterConfig(model=model_dir, zmq_port=0, worker_timeout_s=2.0, cluster_secret="s3cret",
                          api_key="sk-admin")
    with TestClient(build_app(config)) as client:
        assert client.get("/admin/pools").status_code == 401
        key = {"Authorization": "Bearer sk-admin"}
        member = _SecretWorker(client.get("/info").json()["zmq_address"], "s3cret", worker_id="member-d0")
        try:
            wait_for(lambda: client.get("/health").json()["num_decode"] == 1)
            member.outbox.append(WorkerExiting(worker_id="member-d0", role=WorkerRole.DECODE,
                                               input_addr=member.addr, auth="forged"))
            wait_for(lambda: client.app.state.engine.num_refused_registrations >= 1)
            assert client.get("/health").json()["num_decode"] == 1
            member.outbox.append(WorkerDraining(worker_id="member-d0", role=WorkerRole.DECODE,
                                                input_addr=member.addr, auth=registration_token(
                                                    "s3cret", "member-d0", WorkerRole.DECODE, member.addr)))
            wait_for(lambda: _drains(member))
            pools = client.get("/admin/pools", headers=key).json()
            assert [w["state"] for w in pools["decode"]["workers"]] == ["draining"]
        finally:
            member.close()


def test_bounded_admission_answers_503_with_retry_after_at_once(model_dir, tok):
    config = RouterConfig(model=model_dir, zmq_port=0, worker_timeout_s=30, max_num_waiting_requests=2)
    with fake_worker_router(config) as (client, worker):
        worker.script = tok.encode(" one two")
        worker.heartbeating = False  # holds every request before its first token
        results = []
        threads = [threading.Thread(target=lambda: results.append(client.post(
            "/v1/completions", json={**COMPLETION, "max_tokens": 2}))) for _ in range(2)]
        for t in threads:
            t.start()
        wait_for(lambda: len(worker.requests()) == 2)
        started = time.monotonic()
        resp = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 2})
        assert time.monotonic() - started < 1.0  # refused at once, not queued
        err = error_of(resp, 503)
        assert "overloaded" in err["message"] and resp.headers["retry-after"] == "1"
        assert len(worker.requests()) == 2  # the refused request never reached a worker
        assert 'pdserve:requests_rejected_total{model_name="tiny"} 1.0' in client.get("/metrics").text
        worker.heartbeating = True
        for t in threads:
            t.join(timeout=10)
        assert [r.status_code for r in results] == [200, 200]
        assert client.post("/v1/completions", json={**COMPLETION, "max_tokens": 2}).status_code == 200


def test_request_timeout_aborts_at_the_worker_and_answers_504(model_dir, tok):
    config = RouterConfig(model=model_dir, zmq_port=0, request_timeout_s=0.5)
    with fake_worker_router(config) as (client, worker):
        worker.script, worker.delay_s = tok.encode(" one two three"), 1.0  # 2 s: past the timeout
        started = time.monotonic()
        err = error_of(client.post("/v1/completions", json={**COMPLETION, "max_tokens": 3}), 504)
        assert "--request-timeout" in err["message"] and time.monotonic() - started < 2.0
        wait_for(lambda: len(worker.aborted) == 1)  # its blocks are freed at the worker
        body = client.post("/v1/completions", json={**COMPLETION, "max_tokens": 3, "stream": True}).text
        assert body.count("data: ") >= 2 and '"code":504' in body.replace(" ", "")
        worker.delay_s = 0.0
        assert client.post("/v1/completions", json={**COMPLETION, "max_tokens": 3}).status_code == 200


def test_body_and_list_bounds_are_400_or_413_with_clear_messages(router):
    err = error_of(router.post("/v1/completions", json={**COMPLETION, "stop": ["x"] * 65}), 400)
    assert err["param"].startswith("stop") and "64" in err["message"]
    error_of(router.post("/v1/completions", json={**COMPLETION, "stop_token_ids": list(range(1025))}), 400)
    big = json.dumps({**COMPLETION, "prompt": "a" * (16 * 2**20)})
    err = error_of(router.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
    assert "at most" in err["message"]


def test_ready_means_a_request_can_be_served_end_to_end(model_dir, tok):
    """/health is liveness (200 with no worker); /ready waits for a decode worker, and for a prefill
    worker where the deployment starts some."""
    config = RouterConfig(model=model_dir, zmq_port=0, worker_wait_s=0, expect_prefill_workers=1)
    with TestClient(build_app(config)) as client:
        assert client.get("/health").status_code == 200
        resp = client.get("/ready")
        assert resp.status_code == 503
        assert resp.json()["missing"] == ["no decode worker is live", "no prefill worker is live"]
        worker = FakeDecodeWorker(client.get("/info").json()["zmq_address"])
        try:
            wait_for(lambda: client.get("/health").json()["num_decode"] == 1)
            assert client.get("/ready").json()["missing"] == ["no prefill worker is live"]
        finally:
            worker.close()
    config = RouterConfig(model=model_dir, zmq_port=0, worker_wait_s=0)  # colocated: decode workers suffice
    with TestClient(build_app(config)) as client:
        worker = FakeDecodeWorker(client.get("/info").json()["zmq_address"], script=tok.encode(" ok"))
        try:
            wait_for(lambda: client.get("/ready").status_code == 200)
            assert client.get("/ready").json()["status"] == "ready"
            assert client.post("/v1/completions", json={**COMPLETION, "max_tokens": 1}).status_code == 200
        finally:
            worker.close()


THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
                     "not enable_thinking %}<no-think>{% endif %}{% endif %}")


@pytest.fixture
def thinking_model_dir(model_dir, tmp_path):
    """The tiny checkpoint with a chat template that reads ``enable_thinking`` (as Qwen3's does)."""
    import shutil
    out = tmp_path / "thinking"
    shutil.copytree(model_dir, out)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = THINKING_TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    for extra in out.glob("chat_template.jinja"):
        extra.unlink()
    return str(out)


def test_chat_template_kwargs_and_continue_final_message_reach_the_template(thinking_model_dir):
    tok = AutoTokenizer.from_pretrained(thinking_model_dir)
    config = RouterConfig(model=thinking_model_dir, zmq_port=0, worker_timeout_s=1.0, worker_wait_s=0)
    with fake_worker_router(config) as (client, w):
        w.script = tok.encode("ok")
        name = client.get("/v1/models").json()["data"][0]["id"]
        messages = [{"role": "user", "content": "hi"}]
        for kwargs, expected in ((None, "<|user|>hi<|end|><|assistant|>"),
                                 ({"enable_thinking": False}, "<|user|>hi<|end|><|assistant|><no-think>")):
            body = {"model": name, "messages": messages, "max_tokens": 2}
            if kwargs is not None:
                body["chat_template_kwargs"] = kwargs
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            assert w.requests()[-1].prompt_token_ids == tok.encode(expected, add_special_tokens=False)
        # continue the assistant's own opening instead of starting a new turn
        body = {"model": name, "max_tokens": 2, "add_generation_prompt": False, "continue_final_message": True,
                "messages": messages + [{"role": "assistant", "content": "Sure,"}]}
        assert client.post("/v1/chat/completions", json=body).status_code == 200
        assert w.requests()[-1].prompt_token_ids == tok.encode("<|user|>hi<|end|><|assistant|>Sure,",
                                                               add_special_tokens=False)
        # bad combinations: 400s naming the field, nothing sent to the worker
        sent = len(w.requests())
        err = error_of(client.post("/v1/chat/completions", json={**body, "add_generation_prompt": True}), 400)
        assert err["param"] == "continue_final_message" and "cannot both" in err["message"]
        err = error_of(client.post("/v1/chat/completions", json={
            "model": name, "messages": messages, "chat_template_kwargs": {"tokenize": True}}), 400)
        assert err["param"] == "chat_template_kwargs" and "tokenize" in err["message"]
        assert len(w.requests()) == sent
