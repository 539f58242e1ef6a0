"""The whole cluster as real processes: router + 2 prefill + 2 decode workers.

Driven by the real ``openai`` client; greedy output is compared with Hugging Face
``generate`` on the same checkpoint (a reference no one here wrote). The cluster
runs with a cluster secret, so every ZMQ socket in it is CurveZMQ
(``pdserve.common.curve``); strangers' forged messages are shown to change nothing.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import random
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pdserve.common.curve import cluster_keys, secure_client
from pdserve.common.utils import free_port
from pdserve.cluster.launcher import ClusterSpec, LocalCluster
from tests.helpers.cluster import WORDS, hf_greedy_texts, prompt_text, wait_all_blocks_free, workers  # noqa: F401

pytestmark = pytest.mark.cluster

SECRET = "test-cluster-secret"
FORGED_RUN_TOKENS = 600  # long enough (> 1 s) to be still streaming when the forged abort has arrived


@pytest.fixture(scope="module")
def cluster(model_dir, tmp_path_factory):
    spec = ClusterSpec(model=model_dir, num_prefill=2, num_decode=2, port=free_port(),
                       worker_args=["--kv-cache-memory", "16MiB", "--max-num-seqs", "32",
                                    "--cluster-secret", SECRET],
                       router_args=["--cluster-secret", SECRET], threads_per_worker=1)
    with LocalCluster(spec, log_dir=str(tmp_path_factory.mktemp("logs"))) as c:
        yield c
    assert not [p for _, p in c.procs if p.poll() is None], "a cluster process outlived stop()"


@pytest.fixture(scope="module")
def reference(model_dir):
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()

    def generate(prompt_ids: list[int], max_tokens: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_tokens, do_sample=False,
                                 attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long))
        return out[0, len(prompt_ids):].tolist()

    eos = model.generation_config.eos_token_id
    generate.eos_token_ids = set(eos if isinstance(eos, list) else [eos])
    return tok, generate


def client(cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_models_and_health(cluster, model_dir):
    models = client(cluster).models.list()
    assert [m.id for m in models.data] == ["tiny"]
    health = httpx.get(f"{cluster.url}/health").json()
    assert health["num_prefill"] == 2 and health["num_decode"] == 2
    # KV sizing: num_blocks = --kv-cache-memory (16 MiB) // bytes per block (2 layers * K,V * 16 * 2 * 16 * fp32)
    assert {w["num_blocks"] for w in workers(cluster)} == {16 * 2**20 // 8192}


def test_workers_show_how_each_runner_was_planned(cluster):
    """``/workers`` shows each worker's start-up choices with their reasons (the runner's ``RunnerPlan``,
    sent at registration) and the native kernels it runs."""
    listed = workers(cluster)
    assert {w["role"] for w in listed} == {"prefill", "decode"}
    assert cluster.wait_decode_steps_compiled(timeout_s=10)  # none compiles: nothing to wait for
    for w in listed:
        plan = w["plan"]
        assert plan["dtype"].startswith("float32 ("), plan  # a value and its reason
        assert plan["device"] == "cpu" and plan["layers"].startswith("0-1 of 2"), plan
        assert plan["decode_step"].startswith("eager (--enforce-eager"), plan  # the suite runs eagerly
        assert w["decode_step"] == "eager", w  # as it runs now, from the heartbeats
        assert plan["kv_cache"].split()[0].isdigit() and "MiB" in plan["kv_cache"], plan
        assert plan["linear_weight_format"].startswith(w["linear_weight_format"]), plan
        assert set(w["kernels"].values()) <= {"native", "torch"} and "native_kernels" in plan, w


def test_concurrent_greedy_matches_transformers_and_decode_batches(cluster, reference):
    tok, generate = reference
    rng = random.Random(0)
    jobs = []
    for i in range(20):
        kind = ("completion", "completion-stream", "chat", "chat-stream")[i % 4]
        jobs.append((kind, prompt_text(rng, rng.randint(3, 90)), rng.randint(4, 48)))
    api = client(cluster)

    def run(job):
        kind, text, max_tokens = job
        if kind.startswith("completion"):
            prompt_ids = tok(text).input_ids
            if kind.endswith("stream"):
                chunks = list(api.completions.create(model="tiny", prompt=text, max_tokens=max_tokens,
                                                     temperature=0, stream=True,
                                                     stream_options={"include_usage": True}))
                out = "".join(c.choices[0].text for c in chunks if c.choices)
                usage = chunks[-1].usage
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            else:
                resp = api.completions.create(model="tiny", prompt=text, max_tokens=max_tokens, temperature=0)
                out, usage, finish = resp.choices[0].text, resp.usage, [resp.choices[0].finish_reason]
        else:
            messages = [{"role": "user", "content": text}]
            prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if hasattr(prompt_ids, "input_ids"):
                prompt_ids = prompt_ids["input_ids"]
            if kind.endswith("stream"):
                chunks = list(api.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True}))
                assert chunks[0].choices[0].delta.role == "assistant"
                out = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                usage = chunks[-1].usage
                finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            else:
                resp = api.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens,
                                                   temperature=0)
                out, usage, finish = resp.choices[0].message.content, resp.usage, [resp.choices[0].finish_reason]
        return prompt_ids, out, usage, finish

    # one job of each kind first, alone: the openai client builds its response types' pydantic schemas on
    # first use, and threads doing that at once can fail (PydanticUserError from a MockCoreSchema)
    results = [run(job) for job in jobs[:4]]
    with cf.ThreadPoolExecutor(len(jobs) - 4) as pool:
        results += list(pool.map(run, jobs[4:]))

    for (kind, _, max_tokens), (prompt_ids, out, usage, finish) in zip(jobs, results):
        expected_ids = generate(list(prompt_ids), max_tokens)
        expected = tok.decode(expected_ids, skip_special_tokens=True)
        assert out == expected, f"{kind}: {out!r} != transformers {expected!r}"
        assert usage.prompt_tokens == len(prompt_ids)
        assert usage.completion_tokens == len(expected_ids)
        assert finish == ["stop" if expected_ids[-1] in generate.eos_token_ids else "length"]
    wait_all_blocks_free(cluster)


def test_decode_workers_batch_under_load(cluster):
    """16 concurrent long generations: each decode worker runs many of them in one step."""
    api = client(cluster)
    rng = random.Random(1)

    def run(i):
        return api.completions.create(model="tiny", prompt=prompt_text(rng, 5 + i), max_tokens=96, temperature=0,
                                      extra_body={"ignore_eos": True}).usage.completion_tokens

    with cf.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(run, range(16))) == [96] * 16
    deadline = time.monotonic() + 10  # figures arrive with the next heartbeat (every second)
    while True:
        ws = workers(cluster)
        decode_batches = [w["max_step_batch_size"] for w in ws if w["role"] == "decode"]
        if min(decode_batches) >= 4 or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert min(decode_batches) >= 4, f"decode step batches were at most {decode_batches}"
    assert all(w["num_steps"] > 0 for w in ws if w["role"] == "prefill"), "a prefill worker never ran"
    wait_all_blocks_free(cluster)


def test_sampling_with_seed_is_reproducible(cluster):
    api = client(cluster)
    kw = dict(model="tiny", prompt="seven wizards pack", max_tokens=24, temperature=1.0, top_p=0.9, extra_body={"top_k": 50})
    a = api.completions.create(seed=1234, **kw).choices[0].text
    b = api.completions.create(seed=1234, **kw).choices[0].text
    assert a == b


def test_stop_string_never_leaks(cluster, reference):
    tok, generate = reference
    api = client(cluster)
    text = "the quick brown fox jumps over"
    full = tok.decode(generate(tok(text).input_ids, 30), skip_special_tokens=True)
    stop = full[10:13]
    assert stop and stop in full
    resp = api.completions.create(model="tiny", prompt=text, max_tokens=30, temperature=0, stop=[stop])
    assert resp.choices[0].text == full[:full.index(stop)]
    assert resp.choices[0].finish_reason == "stop"
    chunks = api.completions.create(model="tiny", prompt=text, max_tokens=30, temperature=0, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[:full.index(stop)]
    wait_all_blocks_free(cluster)


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}, body
    return body["error"]


def test_bad_inputs_get_openai_errors_and_leak_nothing(cluster):
    url = f"{cluster.url}/v1/completions"
    resp = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert resp.status_code == 400 and error_of(resp)["type"] == "invalid_request_error"
    resp = httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": "many"})
    assert resp.status_code == 400
    resp = httpx.post(url, json={"model": "tiny"})
    assert resp.status_code == 400
    resp = httpx.post(url, json={"model": "nope", "prompt": "hi"})
    assert resp.status_code == 404 and "nope" in error_of(resp)["message"]
    resp = httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 5000})
    assert resp.status_code == 400 and "2048" in error_of(resp)["message"]
    resp = httpx.post(f"{cluster.url}/v1/chat/completions", json={"model": "tiny", "messages": "hello"})
    assert resp.status_code == 400
    with pytest.raises(openai.BadRequestError):
        client(cluster).completions.create(model="tiny", prompt="hi", max_tokens=0)
    wait_all_blocks_free(cluster)
    ok = client(cluster).completions.create(model="tiny", prompt="still alive", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens == 3


def test_client_disconnect_aborts_and_frees_blocks(cluster):
    with httpx.stream("POST", f"{cluster.url}/v1/completions", timeout=60,
                      json={"model": "tiny", "prompt": "a river bank", "max_tokens": 1500, "temperature": 0,
                            "ignore_eos": True, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        seen = 0
        for line in lines:
            if line.startswith("data: "):
                seen += 1
            if seen >= 3:
                break
    wait_all_blocks_free(cluster)


def test_workers_survive_malformed_requests_sent_past_the_router(cluster):
    """Token ids outside the vocabulary, or an empty prompt, sent straight to the workers over ZMQ."""
    import zmq

    from pdserve.common.protocol import GenerateRequest, RemotePrefillRequest, SamplingParams
    from pdserve.common.transport import encode

    ws = workers(cluster)
    decode = next(w for w in ws if w["role"] == "decode")
    prefill = next(w for w in ws if w["role"] == "prefill")
    ctx = zmq.Context()
    try:
        to_decode = ctx.socket(zmq.PUSH)
        secure_client(to_decode, cluster_keys(SECRET))  # an insider's bad input: the cluster's own keys
        to_decode.connect(decode["address"])
        to_decode.send_multipart(encode(GenerateRequest(request_id="bad-ids", prompt_token_ids=[1, 10**9],
                                                        sampling_params=SamplingParams())))
        to_prefill = ctx.socket(zmq.PUSH)
        secure_client(to_prefill, cluster_keys(SECRET))
        to_prefill.connect(prefill["address"])
        to_prefill.send_multipart(encode(RemotePrefillRequest(
            request_id="bad-empty", prompt_token_ids=[], sampling_params=SamplingParams(),
            decode_worker_id=decode["id"], decode_addr=decode["address"], transfer_host="127.0.0.1",
            transfer_port=1, pair_generation=0, dest_block_ids=[])))
        time.sleep(1.0)
    finally:
        ctx.destroy(linger=200)
    out = client(cluster).completions.create(model="tiny", prompt="still serving after bad input", max_tokens=4,
                                             temperature=0)
    assert out.usage.completion_tokens == 4
    assert not cluster.dead(), f"a worker died: {cluster.dead()}"
    wait_all_blocks_free(cluster)


def _forge(ctx, addrs: list[str], msgs: list) -> list:
    """Send each of ``msgs`` to each of ``addrs`` as two processes without the cluster secret would: over
    plain TCP, and over CURVE with the keys of another secret. Each message goes out on a socket of its own,
    so that it is queued and offered at a handshake (a PUSH socket whose handshake failed has no connection
    left to queue on). Returns the sockets: hold them until the end (a socket collected early drops what
    it has not sent yet)."""
    import zmq

    from pdserve.common.transport import encode

    socks = []
    for addr in addrs:
        for msg in msgs:
            for keys in (None, cluster_keys("not-the-cluster-secret")):
                sock = ctx.socket(zmq.PUSH)
                secure_client(sock, keys)
                sock.connect(addr)
                sock.send_multipart(encode(msg), flags=zmq.NOBLOCK)
                socks.append(sock)
    return socks


def test_strangers_can_neither_inject_nor_abort_requests(cluster):
    """Well-formed protocol messages from outside the cluster: a request and a prefill straight to the
    workers, a registration and a worker's exit at the router, then, mid-stream, an abort at the request's
    decode and prefill workers and a fake final delta at the router. None of it is heard: no worker ran a
    step, the pools are unchanged, and the request streams to its end as an undisturbed run does."""
    import zmq

    from pdserve.common.protocol import (AbortRequest, FinishReason, GenerateRequest, RegisterWorker,
                                         RemotePrefillRequest, RequestDelta, RequestOutputs, SamplingParams,
                                         WorkerExiting, WorkerRole)

    ws = workers(cluster)
    decode = [w for w in ws if w["role"] == "decode"]
    router_zmq = httpx.get(f"{cluster.url}/info", timeout=10).json()["zmq_address"]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ctx = zmq.Context()
    try:
        to_workers = [w["address"] for w in ws]
        steps = {w["id"]: w["num_steps"] for w in workers(cluster)}
        started = time.monotonic()
        held = _forge(ctx, to_workers, [
            GenerateRequest(request_id="forged-gen", prompt_token_ids=[5, 6, 7, 8], sampling_params=params),
            RemotePrefillRequest(request_id="forged-pre", prompt_token_ids=[5, 6, 7, 8], sampling_params=params,
                                 decode_worker_id=decode[0]["id"], decode_addr=decode[0]["address"],
                                 transfer_host="127.0.0.1", transfer_port=1, pair_generation=0, dest_block_ids=[0])])
        held += _forge(ctx, [router_zmq], [
            RegisterWorker(worker_id="forged-d9", role=WorkerRole.DECODE, input_addr="tcp://127.0.0.1:9",
                           model_name="tiny", num_blocks=10**6, block_size=16, max_model_len=0),
            *(WorkerExiting(worker_id=w["id"], role=WorkerRole[w["role"].upper()], input_addr=w["address"])
              for w in ws)])

        def fresh() -> list[dict]:  # every worker heartbeated 1 s or more after the forged messages
            while time.monotonic() < started + 15:
                now = workers(cluster)
                if all(w["last_seen_s_ago"] < time.monotonic() - started - 1.0 for w in now):
                    return now
                time.sleep(0.2)
            pytest.fail(f"no fresh heartbeats: {json.dumps(workers(cluster))}")

        after = fresh()
        assert sorted(w["id"] for w in after) == sorted(w["id"] for w in ws)  # no one joined, no one left
        assert {w["id"]: w["num_steps"] for w in after} == steps  # no worker ran anything of theirs
        assert all(w["num_running"] == w["num_waiting"] == 0 for w in after)

        prompt = "seven wizards pack boxes near a river bank"
        body = {"model": "tiny", "prompt": prompt, "max_tokens": FORGED_RUN_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True}
        text, finish = [], None
        with httpx.stream("POST", f"{cluster.url}/v1/completions", json=body, timeout=60) as resp:
            assert resp.status_code == 200
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[len("data: "):])
                if not text and not finish:  # the request's id is on the wire: abort it, end it falsely
                    request_id = chunk["id"].removeprefix("cmpl-")
                    held += _forge(ctx, to_workers, [AbortRequest(request_id=request_id)])
                    held += _forge(ctx, [router_zmq], [RequestOutputs(worker_id=w["id"], deltas=[RequestDelta(
                        request_id=request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
                        error="forged")]) for w in decode])
                    time.sleep(0.2)  # loopback: delivered and acted on in milliseconds, had they been admitted
                    inflight = httpx.get(f"{cluster.url}/info", timeout=10).json()["num_inflight"]
                    assert inflight == 1, "the request ended before the forged messages could have mattered"
                text.append(chunk["choices"][0]["text"])
                finish = chunk["choices"][0]["finish_reason"] or finish
    finally:
        ctx.destroy(linger=0)
    assert finish == "length"
    undisturbed = client(cluster).completions.create(model="tiny", prompt=prompt, max_tokens=FORGED_RUN_TOKENS,
                                                     temperature=0, extra_body={"ignore_eos": True})
    assert "".join(text) == undisturbed.choices[0].text and undisturbed.usage.completion_tokens == FORGED_RUN_TOKENS
    assert not cluster.dead()
    wait_all_blocks_free(cluster)
