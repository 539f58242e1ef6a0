"""A router or worker on the other end of a real socket, played by the test (fake peers), and waits."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest
import zmq
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from pdserve.cluster.worker_base import WorkerBase
from pdserve.common.config import WorkerConfig
from pdserve.common.curve import Gatekeeper, secure_client
from pdserve.common.protocol import (
    AbortRequest,
    ErrorKind,
    FinishReason,
    GenerateRequest,
    Heartbeat,
    RegisterWorker,
    RequestDelta,
    RequestOutputs,
    SamplingParams,
    TokenLogprob,
    WorkerRole,
    WorkerStats,
)
from pdserve.common.transport import bind_pull, decode, encode
from pdserve.engine.config import EngineConfig
from pdserve.router import RouterConfig, build_app


@pytest.fixture(scope="module")
def tok(model_dir):
    return AutoTokenizer.from_pretrained(model_dir)


def fake_logprob(token_id: int, position: int, index: int, num_top: int) -> TokenLogprob:
    """What FakeDecodeWorker reports for token ``token_id`` at ``position`` of choice ``index``:
    the sampled token first among ``num_top`` alternatives, each 1.0 below the previous."""
    logprob = -0.25 * (index + 1) - 0.01 * position
    top_ids = [(token_id + j) % 2048 for j in range(num_top)]
    return TokenLogprob(token_id=token_id, logprob=logprob, top_token_ids=top_ids,
                        top_logprobs=[logprob - j for j in range(num_top)])


class FakeDecodeWorker:
    """Registers with the router, heartbeats, and answers each GenerateRequest as a
    real decode worker would: every ``delay_s`` one step, which sends one token
    per unfinished choice (choice i follows ``scripts[i]``, else ``script``) in
    one ``RequestOutputs``; a choice finishes with ``finish_reason`` after its
    script or ``max_tokens`` (None = never finishes on its own). With
    ``sampling_params.logprobs`` set, each token carries ``fake_logprob``."""

    def __init__(self, router_addr, worker_id="fake-d0", num_blocks=1000, block_size=16, max_model_len=0,
                 vocab_size=None, script=(), keys=None):
        self.ctx = zmq.Context()
        self.gatekeeper = Gatekeeper(self.ctx, keys)  # keys: a cluster's CURVE keys (pdserve.common.curve)
        self.pull, self.addr = bind_pull(self.ctx, "127.0.0.1", keys=keys)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.setsockopt(zmq.SNDTIMEO, 200)  # a router that refuses our handshake never takes a message
        secure_client(self.push, keys)
        self.push.connect(router_addr)
        self.worker_id, self.num_blocks, self.block_size = worker_id, num_blocks, block_size
        self.max_model_len, self.vocab_size = max_model_len, vocab_size
        self.loop_stall_s = 0.0  # what heartbeats report about the (fake) step loop
        self.error: tuple[str, ErrorKind | None] | None = None  # answer every request with this error
        self.script: list[int] = list(script)  # set before the thread starts: a request may come at once
        self.scripts: dict[int, list[int]] = {}
        self.finish_reason: FinishReason | None = FinishReason.LENGTH
        self.delay_s = 0.0
        self.heartbeating = True
        self.send_logprobs = True
        self.stats = WorkerStats()
        self.num_waiting, self.num_free_blocks = 0, num_blocks
        self.received: list = []
        self.outbox: list = []  # messages for the worker's thread to send (sockets stay on one thread)
        self.aborted: dict[str, float] = {}  # request_id -> time the AbortRequest arrived
        self.finished_at: dict[tuple[str, int], float] = {}  # (request_id, index) -> time
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _send(self, msg):
        try:
            self.push.send_multipart(encode(msg))
        except zmq.Again:
            pass  # refused (another cluster's keys): dropped, as a real PUSH with nobody to take it

    def _heartbeat(self, num_running):
        self._send(Heartbeat(worker_id=self.worker_id, role=WorkerRole.DECODE, num_running=num_running,
                             num_waiting=self.num_waiting, num_blocks=self.num_blocks,
                             num_free_blocks=self.num_free_blocks, max_step_batch_size=3,
                             stats=self.stats, loop_stall_s=self.loop_stall_s))

    def _step(self, req, sent: list[int], now: float) -> list[RequestDelta]:
        """One step of ``req``: a delta per unfinished choice; marks finished ones with -1."""
        deltas = []
        sp = req.sampling_params
        for i in range(sp.n):
            if sent[i] < 0:
                continue
            script = self.scripts.get(i, self.script)
            last = sent[i] + 1 >= min(len(script), sp.max_tokens)
            reason = self.finish_reason if last else None
            if sent[i] < len(script):
                token = script[sent[i]]
                logprobs = None
                if sp.logprobs is not None and self.send_logprobs:
                    logprobs = [fake_logprob(token, sent[i], i, sp.logprobs)]
                deltas.append(RequestDelta(request_id=req.request_id, new_token_ids=[token], index=i,
                                           finish_reason=reason, logprobs=logprobs))
            sent[i] = -1 if reason is not None else sent[i] + 1
            if reason is not None:
                self.finished_at[(req.request_id, i)] = now
        return deltas

    def _run(self):
        reg = RegisterWorker(worker_id=self.worker_id, role=WorkerRole.DECODE, input_addr=self.addr,
                             model_name="tiny", num_blocks=self.num_blocks, block_size=self.block_size,
                             max_model_len=self.max_model_len, vocab_size=self.vocab_size)
        self._send(reg)
        pending: list[tuple[GenerateRequest, list[int], float]] = []  # (request, sent per choice, due)
        next_beat = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if self.heartbeating and now >= next_beat:
                self._heartbeat(len(pending))
                next_beat = now + 0.1
            while self.outbox:
                self._send(self.outbox.pop(0))
            while self.pull.poll(0):
                msg = decode(self.pull.recv_multipart())
                self.received.append(msg)
                if isinstance(msg, GenerateRequest) and self.error is not None:
                    message, kind = self.error
                    self._send(RequestOutputs(worker_id=self.worker_id, deltas=[RequestDelta(
                        request_id=msg.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
                        error=message, error_kind=kind)]))
                elif isinstance(msg, GenerateRequest):
                    pending.append((msg, [0] * msg.sampling_params.n, now))
                elif isinstance(msg, AbortRequest):
                    self.aborted[msg.request_id] = now
            still, deltas = [], []
            for req, sent, due in pending:
                if req.request_id in self.aborted:
                    continue
                if now < due or not self.heartbeating:
                    still.append((req, sent, due))
                    continue
                deltas += self._step(req, sent, now)
                if any(k >= 0 for k in sent):
                    still.append((req, sent, now + self.delay_s))
            if deltas:
                self._send(RequestOutputs(worker_id=self.worker_id, deltas=deltas))
            pending = still
            time.sleep(0.002)

    def requests(self) -> list[GenerateRequest]:
        return [m for m in self.received if isinstance(m, GenerateRequest)]

    def close(self):
        self._stop.set()
        self._thread.join(timeout=5)
        self.gatekeeper.stop()
        self.ctx.destroy(linger=0)


def wait_for(pred, timeout_s=5.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError("condition not met in time")


@contextmanager
def fake_worker_router(config: RouterConfig):
    """A router app (``TestClient``) built from ``config`` with one ``FakeDecodeWorker`` registered and live:
    yields (client, worker); the worker is closed after."""
    with TestClient(build_app(config)) as client:
        worker = FakeDecodeWorker(client.get("/info").json()["zmq_address"])
        try:
            wait_for(lambda: client.get("/health").json()["num_decode"] == 1)
            yield client, worker
        finally:
            worker.close()


@pytest.fixture
def router(model_dir):
    config = RouterConfig(model=model_dir, zmq_port=0, worker_timeout_s=1.0, worker_wait_s=0)
    with TestClient(build_app(config)) as client:
        yield client


@pytest.fixture
def worker(router):
    w = FakeDecodeWorker(router.get("/info").json()["zmq_address"])
    wait_for(lambda: router.get("/health").json()["num_decode"] == 1)
    yield w
    w.close()


COMPLETION = {"model": "tiny", "prompt": "hello"}


HOST = "127.0.0.1"


GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class Peer:
    """A bound PULL socket standing in for the router or a prefill worker."""

    def __init__(self):
        self.ctx = zmq.Context()
        self.pull, self.addr = bind_pull(self.ctx, HOST)
        self.received: list = []

    def poll(self, timeout_s: float = 0.0) -> list:
        """Receive what arrived (waiting up to ``timeout_s`` for the first message)."""
        got = []
        if self.pull.poll(int(timeout_s * 1000)):
            while self.pull.poll(0):
                got.append(decode(self.pull.recv_multipart()))
        self.received += got
        return got

    def of_type(self, kind) -> list:
        self.poll()
        return [m for m in self.received if isinstance(m, kind)]

    def wait_for(self, kind, num: int = 1, timeout_s: float = 5.0) -> list:
        """The messages of ``kind`` received so far, once there are at least ``num``."""
        deadline = time.monotonic() + timeout_s
        while len(found := self.of_type(kind)) < num and time.monotonic() < deadline:
            self.poll(0.05)
        return found

    def close(self):
        self.ctx.destroy(linger=0)


class FakeRouter(Peer):
    def deltas(self, request_id: str) -> list:
        return [d for m in self.of_type(RequestOutputs) for d in m.deltas if d.request_id == request_id]

    def tokens(self, request_id: str) -> list[int]:
        return [t for d in self.deltas(request_id) for t in d.new_token_ids]

    def finished(self, request_id: str):
        return next((d for d in self.deltas(request_id) if d.finish_reason is not None), None)


def make_worker(cls, model_dir, router_addr, **worker_kw):
    engine = EngineConfig(model=model_dir, kv_cache_memory=4 * 2**20, remote_prefill_threshold=0)
    worker_kw.setdefault("transfer_timeout_s", 30.0)
    return cls(engine, WorkerConfig(role=cls.role.name.lower(), router_addr=router_addr, **worker_kw))


def drive(worker: WorkerBase, until, timeout_s: float = 20.0) -> None:
    """Run the worker's loop by hand until ``until()`` is true."""
    deadline = time.monotonic() + timeout_s
    while not until():
        assert time.monotonic() < deadline, "condition not reached"
        worker.periodic(time.monotonic())
        worker.drain_inbox(wait=0.01)
        worker.step()


def all_blocks_free(worker: WorkerBase) -> bool:
    bm = worker.core.block_manager
    return bm.num_free_blocks == bm.num_blocks
