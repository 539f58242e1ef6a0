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

from pdserve.common.protocol import (AbortRequest, FinishReason, GenerateRequest, Heartbeat,
                                     RegisterWorker, RequestDelta, RequestOutputs, WorkerRole)
from pdserve.common.transport import bind_pull, decode, encode
from pdserve.engine.tiny_model import write_tiny_model
from pdserve.router import RouterConfig, build_app
from pdserve.router.detokenizer import IncrementalDetokenizer
from pdserve.router.registry import WorkerRegistry

MULTIBYTE = "naïve café: 日本語 🙂 € ok"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("model") / "tiny", preset="tiny"))


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


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


def test_registry_round_robin_and_roles():
    reg = WorkerRegistry(worker_timeout_s=5)
    for w in ("d0", "d1", "d2"):
        reg.register(reg_msg(w), now=0)
    reg.register(reg_msg("p0", role=WorkerRole.PREFILL), now=0)
    picks = [reg.pick(WorkerRole.DECODE).worker_id for _ in range(6)]
    assert picks == ["d0", "d1", "d2", "d0", "d1", "d2"]
    assert reg.pick(WorkerRole.PREFILL).worker_id == "p0"
    assert reg.num_live(WorkerRole.DECODE) == 3 and reg.num_live(WorkerRole.PREFILL) == 1


def test_registry_timeout_expiry_and_heartbeats():
    reg = WorkerRegistry(worker_timeout_s=5)
    reg.register(reg_msg("d0"), now=0)
    reg.register(reg_msg("d1"), now=0)
    assert reg.heartbeat(Heartbeat(worker_id="d0", role=WorkerRole.DECODE, max_step_batch_size=7), now=4)
    assert not reg.heartbeat(Heartbeat(worker_id="ghost", role=WorkerRole.DECODE), now=4)
    assert reg.register(reg_msg("d1"), now=1) is None  # idempotent re-register refreshes
    assert [w.worker_id for w in reg.expire(now=5)] == []
    assert [w.worker_id for w in reg.expire(now=6.5)] == ["d1"]
    assert [w["id"] for w in reg.snapshot(now=6.5)] == ["d0"]
    assert reg.snapshot(now=6.5)[0]["max_step_batch_size"] == 7
    assert [w.worker_id for w in reg.expire(now=9.5)] == ["d0"]
    assert reg.pick(WorkerRole.DECODE) is None


def test_registry_kv_capacity_and_restart():
    reg = WorkerRegistry(worker_timeout_s=5)
    reg.register(reg_msg("d0", num_blocks=4), now=0)  # 64 tokens
    reg.register(reg_msg("d1", num_blocks=10), now=0)  # 160 tokens
    assert {reg.pick(WorkerRole.DECODE, 100).worker_id for _ in range(3)} == {"d1"}
    assert reg.pick(WorkerRole.DECODE, 161) is None
    assert reg.largest_decode().worker_id == "d1"
    old = reg.register(reg_msg("d0", num_blocks=4, addr="tcp://127.0.0.1:9999"), now=1)
    assert old is not None and old.input_addr != reg.get("d0").input_addr


# --- HTTP API against a fake decode worker ------------------------------------------------

class FakeDecodeWorker:
    """Registers with the router, heartbeats, and answers each GenerateRequest with
    ``script`` token ids, one per delta, every ``delay_s``; finishes with
    ``finish_reason`` (None = never finishes on its own)."""

    def __init__(self, router_addr, worker_id="fake-d0", num_blocks=1000, block_size=16):
        self.ctx = zmq.Context()
        self.pull, self.addr = bind_pull(self.ctx, "127.0.0.1")
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(router_addr)
        self.worker_id, self.num_blocks, self.block_size = worker_id, num_blocks, block_size
        self.script: list[int] = []
        self.finish_reason: FinishReason | None = FinishReason.LENGTH
        self.delay_s = 0.0
        self.heartbeating = True
        self.received: list = []
        self.aborted: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _send(self, msg):
        self.push.send_multipart(encode(msg))

    def _run(self):
        reg = RegisterWorker(worker_id=self.worker_id, role=WorkerRole.DECODE, input_addr=self.addr,
                             model_name="tiny", num_blocks=self.num_blocks, block_size=self.block_size)
        self._send(reg)
        pending: list[tuple[GenerateRequest, int, float]] = []  # (request, tokens sent, next time)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self.heartbeating and now >= next_beat:
                self._send(Heartbeat(worker_id=self.worker_id, role=WorkerRole.DECODE, num_running=len(pending),
                                     num_blocks=self.num_blocks, num_free_blocks=self.num_blocks,
                                     max_step_batch_size=3))
                next_beat = now + 0.1
            while self.pull.poll(0):
                msg = decode(self.pull.recv_multipart())
                self.received.append(msg)
                if isinstance(msg, GenerateRequest):
                    pending.append((msg, 0, now))
                elif isinstance(msg, AbortRequest):
                    self.aborted.add(msg.request_id)
            still = []
            for req, sent, due in pending:
                if req.request_id in self.aborted:
                    continue
                if now < due or not self.heartbeating:
                    still.append((req, sent, due))
                    continue
                last = sent + 1 >= min(len(self.script), req.sampling_params.max_tokens)
                reason = self.finish_reason if last else None
                if sent < len(self.script):
                    delta = RequestDelta(request_id=req.request_id, new_token_ids=[self.script[sent]],
                                         finish_reason=reason)
                    self._send(RequestOutputs(worker_id=self.worker_id, deltas=[delta]))
                if reason is None:
                    still.append((req, sent + 1, now + self.delay_s))
            pending = still
            time.sleep(0.002)

    def requests(self) -> list[GenerateRequest]:
        return [m for m in self.received if isinstance(m, GenerateRequest)]

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.ctx.destroy(linger=0)


def wait_for(pred, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@pytest.fixture
def router(model_dir):
    config = RouterConfig(model=model_dir, zmq_port=0, worker_timeout_s=1.0)
    with TestClient(build_app(config)) as client:
        yield client


@pytest.fixture
def worker(router):
    w = FakeDecodeWorker(router.get("/info").json()["zmq_address"])
    wait_for(lambda: router.get("/health").json()["num_decode"] == 1)
    yield w
    w.close()


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


COMPLETION = {"model": "tiny", "prompt": "hello"}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {**COMPLETION, "n": 2}, 400, "n"),
    ("/v1/completions", {**COMPLETION, "logprobs": 1}, 400, "logprobs"),
    ("/v1/completions", {**COMPLETION, "echo": True}, 400, "echo"),
    ("/v1/completions", {**COMPLETION, "presence_penalty": 0.5}, 400, "presence_penalty"),
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
    ("/v1/chat/completions", {**CHAT, "logprobs": True}, 400, "logprobs"),
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


def test_worker_timeout_fails_inflight_requests(router, worker, tok):
    worker.script = tok.encode("never arrives")
    worker.heartbeating = False  # goes silent: no heartbeats, no tokens
    resp = router.post("/v1/completions", json=COMPLETION)
    err = error_of(resp, 503)
    assert "stopped responding" in err["message"]
    assert router.get("/health").json()["num_decode"] == 0
    assert router.get("/workers").json() == []
