"""Worker state machines in this process, with fake peers: fast and exact.

A real ``DecodeWorker`` (or ``PrefillWorker``) is built here; the test plays the
router and the other worker over real ZMQ sockets on loopback and drives the
worker's loop by hand (``drain_inbox`` / ``periodic`` / ``step``), so every
state change can be checked as it happens. The KV a fake prefill worker
"sends" is the real prompt KV computed by an offline ``LLM`` on the same
checkpoint, handed to the decode worker as the ``ReceivedKV`` its receiver
thread would deliver; the KV path over gloo itself is tested in
test_kvtransfer.py and, with both workers real, at the end of this file.
"""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch
import zmq

from pdserve.common.protocol import (AbortRequest, ErrorKind, FinishReason, GenerateRequest, Heartbeat,
                                     KVPieceSum, KVTransferHeader, RegisterWorker, RemotePrefillDone,
                                     RemotePrefillRequest, RequestOutputs, SamplingParams)
from pdserve.common.transport import Mailbox, encode
from pdserve.common.validation import prefill_sampling_params
from pdserve.decode_worker.worker import DecodeWorker
from pdserve.engine.scheduling.request import RequestStatus
from pdserve.common.sharding import endpoint
from pdserve.kvtransfer.checksum import KVChecksum
from pdserve.kvtransfer.receiver import ReceivedKV
from pdserve.llm import LLM
from pdserve.prefill_worker.worker import PrefillWorker
from tests.helpers.fake_peers import HOST, FakeRouter, make_worker, Peer, drive, GREEDY, all_blocks_free  # noqa: F401

PREFILL_ID = "fake-prefill"


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, kv_cache_memory="8MiB")


@pytest.fixture
def peers():
    router, prefill = FakeRouter(), Peer()
    yield router, prefill
    router.close()
    prefill.close()


@pytest.fixture
def decode_worker(model_dir, peers, request):
    worker = make_worker(DecodeWorker, model_dir, peers[0].addr, **getattr(request, "param", {}))
    yield worker
    worker.close()


def prompt_ids(llm: LLM, text: str) -> list[int]:
    return llm.tokenizer.encode(text)


def reference_prefill(llm: LLM, ids: list[int], params: SamplingParams):
    """What a prefill worker computes: the prompt's KV blocks, the first token and its logprob.

    Returns (kv [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], token id, TokenLogprob|None).
    """
    core = llm.core
    request = core.add_request("reference", ids, prefill_sampling_params(params))
    scheduler_output = core.schedule()
    runner_output = core.execute(scheduler_output)
    kv = core.runner.kv_cache[:, :, request.block_table].clone()
    core.update(scheduler_output, runner_output)
    core.block_manager.reset_prefix_cache()  # the next reference starts cold too
    return kv, runner_output.sampled_token_ids["reference"], runner_output.logprobs.get("reference")


def header(request_id: str, kv: torch.Tensor, ask: RemotePrefillRequest) -> KVTransferHeader:
    """The one piece a single-rank prefill worker sends a single-rank decode worker."""
    num_layers, _, num_blocks, block_size, num_kv_heads, head_dim = kv.shape
    return KVTransferHeader(request_id=request_id, prefill_worker_id=PREFILL_ID, pair_generation=ask.pair_generation,
                            num_layers=num_layers, num_blocks=num_blocks, block_size=block_size,
                            num_kv_heads=num_kv_heads, head_dim=head_dim, dtype="float32",
                            num_tokens=len(ask.prompt_token_ids), first_block=0)


def received(request_id: str, kv: torch.Tensor) -> ReceivedKV:
    """What the decode rank's receiver thread hands its agent once the piece arrived."""
    checksum = KVChecksum()
    for layer in kv:
        checksum.update(layer)
    return ReceivedKV(request_id, kv, checksum.num_bytes, checksum.value, source=endpoint(PREFILL_ID, 0))


def done(request_id: str, kv: torch.Tensor, first_token: int, **kw) -> RemotePrefillDone:
    r = received(request_id, kv)
    return RemotePrefillDone(request_id=request_id, prefill_worker_id=PREFILL_ID, first_token_id=first_token,
                             num_tokens=0, num_bytes=r.num_bytes, checksum=r.checksum, pieces=[KVPieceSum(
                                 prefill_rank=0, decode_rank=0, num_bytes=r.num_bytes, checksum=r.checksum)], **kw)


def deliver(worker: DecodeWorker, msg) -> None:
    """``msg`` reaches the worker as through its mailbox: its receiving thread's tap sees it first (a
    header goes to its lane there), then the step loop handles it."""
    worker.mailbox.inject(msg)
    worker.drain_inbox()


def arrive(worker: DecodeWorker, result: ReceivedKV) -> None:
    """A piece arrives: the decode rank's lane would call its agent exactly so."""
    worker.runner.kv_agent.received(result)


def generate(request_id: str, ids: list[int], prefill: Peer | None, params: SamplingParams = GREEDY):
    return GenerateRequest(request_id=request_id, prompt_token_ids=ids, sampling_params=params,
                           prefill_worker_id=PREFILL_ID if prefill else None,
                           prefill_addr=prefill.addr if prefill else None)


def park(worker: DecodeWorker, prefill: Peer, msg: GenerateRequest) -> RemotePrefillRequest:
    """Hand ``msg`` to the worker and step until it asked the prefill worker for the KV."""
    worker.handle(msg)
    worker.step()
    assert worker.core.scheduler.requests[msg.request_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    deadline = time.monotonic() + 5
    while not (asks := [m for m in prefill.of_type(RemotePrefillRequest) if m.request_id == msg.request_id]):
        assert time.monotonic() < deadline
        prefill.poll(0.05)
    return asks[0]


def greedy_reference(llm: LLM, ids: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return llm.generate([ids], params, use_tqdm=False)[0].outputs[0].token_ids


# ---- the decode worker's remote-prefill state machine ------------------------------------------


def test_remote_kv_then_done_and_done_then_kv_both_decode_exactly(llm, peers, decode_worker):
    router, prefill = peers
    for order, text in (("kv first", "the quick brown fox jumps over"), ("done first", "a lazy dog sleeps in the sun")):
        ids = prompt_ids(llm, text)
        rid = f"r-{order}"
        ask = park(decode_worker, prefill, generate(rid, ids, prefill))
        assert ask.dest_block_ids and ask.num_cached_tokens == 0
        kv, first, _ = reference_prefill(llm, ids, GREEDY)
        deliver(decode_worker, header(rid, kv, ask))
        decode_worker.step()  # the header reaches the rank's agent
        if order == "kv first":
            arrive(decode_worker, received(rid, kv))
            decode_worker.drain_inbox()
            decode_worker.handle(done(rid, kv, first))
        else:
            decode_worker.handle(done(rid, kv, first))
            decode_worker.step()
            arrive(decode_worker, received(rid, kv))
        drive(decode_worker, lambda: router.finished(rid) is not None)
        assert router.tokens(rid) == greedy_reference(llm, ids), order
    assert decode_worker.stats.num_kv_transfers == 2 and decode_worker.stats.kv_transfer_failures == 0
    assert all_blocks_free(decode_worker)


def push(addr: str, msg) -> None:
    """Send ``msg`` to a mailbox over ZMQ, as a prefill worker would (its mailbox threads see it first)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.connect(addr)
    sock.send_multipart(encode(msg))
    sock.close(linger=2000)
    ctx.term()


@pytest.mark.parametrize("good", [True, False])
def test_first_token_leaves_when_its_kv_is_verified_not_at_the_next_step(llm, peers, decode_worker, good):
    """The piece and the done message arrive while the step loop is busy (not driven here): the first token
    reaches the router from the mailbox's threads (``FirstTokenWatch``), with the workers' stamps; the
    step loop then installs the KV and sends the rest, never that token twice. A checksum that does not
    match sends nothing early: the step loop fails the transfer over and recomputes, as before."""
    router, prefill = peers
    ids = prompt_ids(llm, "early tokens travel while the step runs")
    rid = f"early-{good}"
    ask = park(decode_worker, prefill, generate(rid, ids, prefill))
    kv, first, _ = reference_prefill(llm, ids, GREEDY)
    deliver(decode_worker, header(rid, kv, ask))
    decode_worker.step()  # the header reaches the rank's agent (the lane may now receive the piece)
    got = received(rid, kv)
    if not good:
        got.checksum ^= 1
    arrive(decode_worker, got)
    push(decode_worker.mailbox.address, done(rid, kv, first))
    if good:
        early = router.wait_for(RequestOutputs)
        assert [d.new_token_ids for m in early for d in m.deltas] == [[first]]
        timing = early[0].deltas[0].timing
        assert timing is not None and timing.kv_installed >= timing.remote_prefill_sent
    else:
        router.poll(0.5)
        assert router.tokens(rid) == []
    drive(decode_worker, lambda: router.finished(rid) is not None)
    assert router.tokens(rid) == greedy_reference(llm, ids)
    assert sum(d.timing is not None for d in router.deltas(rid)) == 1  # the stamps go once
    assert decode_worker.stats.kv_transfer_failures == (0 if good else 1)
    assert all_blocks_free(decode_worker) and not decode_worker.first_tokens._watched


@pytest.mark.parametrize("decode_worker", [{"prefill_failure_policy": "fail"}], indirect=True)
def test_policy_fail_fails_the_request_with_503_and_frees_its_blocks(llm, peers, decode_worker):
    router, prefill = peers
    ids = prompt_ids(llm, "seven wizards quietly pack boxes")
    park(decode_worker, prefill, generate("doomed", ids, prefill))
    decode_worker.handle(RemotePrefillDone(request_id="doomed", prefill_worker_id=PREFILL_ID, error="out of memory"))
    drive(decode_worker, lambda: router.finished("doomed") is not None)
    final = router.finished("doomed")
    assert final.finish_reason == FinishReason.ERROR and final.error_kind == ErrorKind.UNAVAILABLE
    assert "out of memory" in final.error and router.tokens("doomed") == []
    assert all_blocks_free(decode_worker) and not decode_worker.remote
    assert [m.request_id for m in prefill.wait_for(AbortRequest)] == ["doomed"]  # P is told to drop it


@pytest.mark.parametrize("bad", ["checksum", "shape", "first_block", "num_tokens"])
def test_checksum_or_shape_mismatch_resets_the_pair_and_recomputes(llm, peers, decode_worker, bad):
    """A corrupted piece (checksum), or a header whose blocks are not the ones the request's block table
    expects (one block short, another first block, another prompt length): the pair is reset and the
    decode worker recomputes the prompt itself, exactly."""
    router, prefill = peers
    ids = prompt_ids(llm, "pack my box with five dozen liquor jugs")
    ask = park(decode_worker, prefill, generate("r", ids, prefill))
    kv, first, _ = reference_prefill(llm, ids, GREEDY)
    if bad == "checksum":
        deliver(decode_worker, header("r", kv, ask))
        decode_worker.step()
        corrupted = kv.clone()
        corrupted[0, 0, 0, 0, 0, 0] += 1.0
        arrive(decode_worker, received("r", corrupted))
        decode_worker.handle(done("r", kv, first))
    elif bad == "shape":  # a header one block short: caught before any byte is installed
        deliver(decode_worker, header("r", kv[:, :, :-1], ask))
    else:  # the blocks' count is right, but they would start a block later / cover another prompt
        wrong = {"first_block": dict(first_block=1), "num_tokens": dict(num_tokens=len(ids) + 16)}[bad]
        deliver(decode_worker, msgspec.structs.replace(header("r", kv, ask), **wrong))
    drive(decode_worker, lambda: router.finished("r") is not None)
    assert router.tokens("r") == greedy_reference(llm, ids)  # recomputed here, exactly
    assert decode_worker.stats.kv_transfer_failures == 1 and decode_worker.stats.num_kv_transfers == 0
    # The pair of that generation can no longer be trusted: the next request uses a new one.
    ask2 = park(decode_worker, prefill, generate("r2", prompt_ids(llm, "another prompt for a new pair"), prefill))
    assert ask2.pair_generation == ask.pair_generation + 1
    decode_worker.handle(AbortRequest(request_id="r2"))
    assert all_blocks_free(decode_worker)


@pytest.mark.parametrize("decode_worker", [{"remote_prefill_timeout_s": 0.3}], indirect=True)
def test_deadline_with_a_slow_live_prefill_worker_recomputes_and_drops_the_late_kv(llm, peers, decode_worker):
    router, prefill = peers
    ids = prompt_ids(llm, "the slow prefill worker is still computing")
    park(decode_worker, prefill, generate("slow", ids, prefill))
    assert decode_worker.remote["slow"].deadline is not None
    drive(decode_worker, lambda: router.finished("slow") is not None)  # the deadline passes meanwhile
    assert router.tokens("slow") == greedy_reference(llm, ids)
    assert [m.request_id for m in prefill.wait_for(AbortRequest)] == ["slow"]
    num_deltas = len(router.deltas("slow"))
    kv, first, _ = reference_prefill(llm, ids, GREEDY)  # the KV arrives late, after all
    arrive(decode_worker, received("slow", kv))
    decode_worker.handle(done("slow", kv, first))
    drive(decode_worker, lambda: True)
    router.poll(0.2)
    assert len(router.deltas("slow")) == num_deltas  # nothing emitted twice
    assert all_blocks_free(decode_worker)


def test_abort_while_waiting_for_remote_kvs_then_late_transfer(llm, peers, decode_worker):
    router, prefill = peers
    ids = prompt_ids(llm, "a request the client gives up on")
    park(decode_worker, prefill, generate("gone", ids, prefill))
    assert not all_blocks_free(decode_worker)
    decode_worker.handle(AbortRequest(request_id="gone"))
    assert all_blocks_free(decode_worker) and "gone" not in decode_worker.remote
    assert [m.request_id for m in prefill.wait_for(AbortRequest)] == ["gone"]
    kv, first, _ = reference_prefill(llm, ids, GREEDY)
    decode_worker.handle(done("gone", kv, first))
    arrive(decode_worker, received("gone", kv))
    for _ in range(3):
        decode_worker.step()
    router.poll(0.2)
    assert router.deltas("gone") == [] and all_blocks_free(decode_worker)
    # The worker still serves: a local request right after decodes exactly.
    ids2 = prompt_ids(llm, "still alive")
    decode_worker.handle(generate("next", ids2, None))
    drive(decode_worker, lambda: router.finished("next") is not None)
    assert router.tokens("next") == greedy_reference(llm, ids2)


@pytest.mark.parametrize("params,param", [
    (SamplingParams(temperature=-1.0), "temperature"),
    (SamplingParams(top_p=0.0), "top_p"),
    (SamplingParams(max_tokens=0), "max_tokens"),
    (SamplingParams(n=0), "n"),
    (SamplingParams(logprobs=99), "logprobs"),
    (SamplingParams(frequency_penalty=5.0), "frequency_penalty"),
    (SamplingParams(stop_token_ids=[10 ** 9]), "stop token id"),
    (SamplingParams(max_tokens=5000), "maximum context length"),
])
def test_bad_requests_sent_past_the_router_get_a_400_kind_error(llm, peers, decode_worker, params, param):
    router, _ = peers
    decode_worker.handle(generate("bad", prompt_ids(llm, "hello there"), None, params))
    decode_worker.handle(generate("bad-vocab", [10 ** 9], None))
    decode_worker.step()
    router.poll(1.0)
    for rid, words in (("bad", param), ("bad-vocab", "out of range")):
        final = router.finished(rid)
        assert final is not None and final.finish_reason == FinishReason.ERROR, rid
        assert final.error_kind == ErrorKind.INVALID_REQUEST and words in final.error
    assert not decode_worker.core.has_unfinished() and all_blocks_free(decode_worker)


# ---- liveness off the step loop -------------------------------------------------------------------


class _SlowStepWorker(DecodeWorker):
    """A decode worker whose next step takes ``step_s`` seconds (a long CPU prefill, or a hang)."""

    step_s = 0.0

    def step(self) -> bool:
        if self.step_s:
            time.sleep(self.step_s)
            self.step_s = 0.0
        return super().step()


def test_heartbeats_continue_during_a_long_step_and_report_the_stall(model_dir, peers, tmp_path):
    router, _ = peers
    health = tmp_path / "alive"
    worker = make_worker(_SlowStepWorker, model_dir, router.addr, heartbeat_interval_s=0.1,
                         health_file=str(health), health_stall_s=0.5)
    worker.step_s = 1.5
    loop = threading.Thread(target=worker.run, daemon=True)
    loop.start()
    try:
        time.sleep(0.3)
        router.poll(0.5)
        assert router.of_type(RegisterWorker)[0].vocab_size == worker.core.limits.vocab_size
        start = len(router.of_type(Heartbeat))
        time.sleep(1.0)  # inside the 1.5 s step
        beats = router.of_type(Heartbeat)[start:]
        assert len(beats) >= 5  # the IO thread kept beating while the loop was busy
        assert max(b.loop_stall_s for b in beats) > 0.8  # ... and said the loop is not moving
        assert time.time() - health.stat().st_mtime > 0.4  # the liveness-probe file went stale with it
        time.sleep(0.8)  # the step ended: the loop moves again
        router.poll(0.3)
        assert router.of_type(Heartbeat)[-1].loop_stall_s < 0.5
        assert time.time() - health.stat().st_mtime < 0.5  # fresh again
    finally:
        worker.stop()
        loop.join(timeout=10)
    assert not loop.is_alive()


# ---- Mailbox ------------------------------------------------------------------------------------


def test_mailbox_keeps_order_injects_events_and_drops_malformed_frames():
    box = Mailbox(HOST)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(box.address)
    try:
        for i in range(50):
            push.send_multipart(encode(AbortRequest(request_id=f"r{i}")))
        push.send_multipart([b"\x63", b"not a message"])  # unknown kind
        push.send_multipart([bytes((1,)), b"\xc1"])  # a known kind, a broken payload
        push.send_multipart([b"only one frame"])
        push.send_multipart(encode(AbortRequest(request_id="last")))
        got = [box.get(timeout=5) for _ in range(51)]
        assert [m.request_id for m in got] == [f"r{i}" for i in range(50)] + ["last"]
        assert box.get(timeout=0.2) is None and box.get_nowait() is None
        event = object()
        box.inject(event)
        assert box.get_nowait() is event
        # put(): messages to one peer arrive in order.
        peer = Peer()
        for i in range(20):
            box.put(peer.addr, AbortRequest(request_id=str(i)))
        deadline = time.monotonic() + 5
        while len(peer.received) < 20 and time.monotonic() < deadline:
            peer.poll(0.1)
        assert [m.request_id for m in peer.received] == [str(i) for i in range(20)]
        peer.close()
    finally:
        ctx.destroy(linger=0)
        box.close()


# ---- a real prefill worker and a real decode worker, one process ------------------------------------


def test_remote_first_token_and_logprob_equal_the_local_path(model_dir, llm, peers):
    """The prefill worker samples the first token exactly as the decode worker would have.

    Same prompt, seed and temperature: once prefilled remotely (real PrefillWorker, KV over a
    real gloo pair), once locally on the same decode worker; the tokens and logprobs agree,
    and both agree with the offline ``LLM``.
    """
    router, _ = peers
    decode = make_worker(DecodeWorker, model_dir, router.addr)
    prefill = make_worker(PrefillWorker, model_dir, router.addr)
    loops = [threading.Thread(target=w.run, daemon=True) for w in (decode, prefill)]
    for loop in loops:
        loop.start()
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(decode.mailbox.address)
    params = SamplingParams(max_tokens=4, temperature=0.9, seed=1234, logprobs=3, ignore_eos=True)
    ids = prompt_ids(llm, "seven wizards quietly pack boxes of the quick brown fox")
    try:
        results = {}
        for rid, remote in (("remote", True), ("local", False)):
            push.send_multipart(encode(GenerateRequest(
                request_id=rid, prompt_token_ids=ids, sampling_params=params,
                prefill_worker_id=prefill.worker_id if remote else None,
                prefill_addr=prefill.mailbox.address if remote else None)))
            deadline = time.monotonic() + 60
            while router.finished(rid) is None:
                assert time.monotonic() < deadline, f"{rid} did not finish"
                router.poll(0.1)
            results[rid] = router.deltas(rid)
    finally:
        for w in (decode, prefill):
            w.stop()
        for loop in loops:
            loop.join(timeout=10)
        ctx.destroy(linger=0)
    assert decode.stats.num_kv_transfers == 1  # the first request's KV did come from P
    remote, local = results["remote"], results["local"]
    assert [d.new_token_ids for d in remote] == [d.new_token_ids for d in local]
    offline = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    assert [t for d in remote for t in d.new_token_ids] == offline.token_ids
    for r, lo, off in zip([d.logprobs[0] for d in remote], [d.logprobs[0] for d in local], offline.logprobs):
        assert r.token_id == lo.token_id == off.token_id
        assert r.top_token_ids == lo.top_token_ids
        assert r.logprob == pytest.approx(lo.logprob, abs=1e-4) == pytest.approx(off.logprob, abs=1e-4)


def test_registration_proves_the_cluster_secret_without_sending_it(model_dir, peers):
    from pdserve.common.auth import token_matches

    router, _ = peers
    worker = make_worker(DecodeWorker, model_dir, router.addr, cluster_secret="s3cret")
    try:
        reg = worker.registration()
        assert reg.auth and "s3cret" not in reg.auth
        assert token_matches("s3cret", reg.auth, reg.worker_id, reg.role, reg.input_addr)
        assert not token_matches("s3cret", reg.auth, reg.worker_id, reg.role, "tcp://10.0.0.9:1")  # replayed elsewhere
        assert not token_matches("other", reg.auth, reg.worker_id, reg.role, reg.input_addr)
    finally:
        worker.close()
