"""KV transfer: staging buffers, and real prefill/decode processes pairing over gloo (CPU) (checksums:
tests/test_kv_checksum.py).

Multiprocessing queues stand in for ZMQ here (test plumbing only): headers go
prefill -> decode over a queue, results come back to the test over another.
"""

from __future__ import annotations

import glob
import multiprocessing as mp
import os
import queue
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import msgspec
import pytest
import torch
import torch.distributed as dist

from pdserve.common.protocol import KVTransferHeader
from pdserve.kvtransfer.checksum import KVChecksum
from pdserve.kvtransfer.pair import PairStoreServer, transfer_backend
from pdserve.kvtransfer.receiver import DecodePairs, ReceivedKV, TransferFailed
from pdserve.kvtransfer.sender import OutgoingKV, PrefillPairs, SendCompleter
from pdserve.kvtransfer.shm import ArenaStaging, ShmArena, negotiate, shm_supported, sweep_orphans
from pdserve.kvtransfer.staging import StagingPool
import pdserve.kvtransfer.wire as wire
from pdserve.kvtransfer.wire import dtype_from_name, dtype_name

CTX = mp.get_context("spawn")
HOST = "127.0.0.1"
NUM_LAYERS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 4, 12, 4, 2, 8
SEED = 1234
# Batches of (request_id, block_ids); requests in one batch send layer by layer, interleaved.
PLAN = [[("r0", [3, 7, 1]), ("r1", [0, 5])], [("r2", [2, 4, 6, 8, 11])]]
# Per-layer block lists, as KV cache groups give them (each layer reads its group's table): layers 0 and 2 share
# one list object, as the agent passes them. g0: equal counts, other blocks per layer (the gpt-oss bug: a plan
# made for layer 0's blocks gathered them for every layer); g1: a window's layers send fewer (layer_num_blocks).
_FULL, _WINDOW = [3, 7, 1], [9, 10, 2]
GROUPS_PLAN = [[("g0", [_FULL, [0, 5, 8], _FULL, [11, 4, 6]]), ("g1", [_FULL, [10], _FULL, [5, 11]])]]
# Runs of adjacent blocks, sent from the cache (OutgoingKV's send_from_cache): with two blocks a run, a0's runs
# and a1's first are adjacent, a1's second is gathered.
ADJACENT_PLAN = [[("a0", [4, 5, 6, 7]), ("a1", [1, 2, 9, 3])]]


def layer_lists(block_ids) -> list[list[int]]:
    """A plan entry's blocks per layer (one list: every layer's)."""
    return block_ids if isinstance(block_ids[0], list) else [block_ids] * NUM_LAYERS


def layer_counts(block_ids) -> list[int]:
    """A header's ``layer_num_blocks`` for a plan entry: [] where every layer sends as many blocks."""
    counts = [len(ids) for ids in layer_lists(block_ids)]
    return counts if min(counts) != max(counts) else []


def make_cache(dtype: torch.dtype, kv_slots: int = 2) -> list[torch.Tensor]:
    """P's paged cache: NUM_LAYERS x [kv_slots, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]."""
    g = torch.Generator().manual_seed(SEED)
    shape = (kv_slots, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return [torch.randn(shape, generator=g).to(dtype) for _ in range(NUM_LAYERS)]


def make_header(request_id: str, block_ids, generation: int, dtype: torch.dtype,
                prefill_worker_id: str = "P", num_blocks: int | None = None, kv_slots: int = 2) -> KVTransferHeader:
    """``block_ids``: one list (every layer's) or a list per layer (``layer_lists``)."""
    widest = max(len(ids) for ids in layer_lists(block_ids))
    return KVTransferHeader(
        request_id=request_id, prefill_worker_id=prefill_worker_id, pair_generation=generation,
        num_layers=NUM_LAYERS, num_blocks=widest if num_blocks is None else num_blocks,
        block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=dtype_name(dtype),
        num_tokens=widest * BLOCK_SIZE, kv_slots=kv_slots, layer_num_blocks=layer_counts(block_ids))


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def stop(*procs) -> None:
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.terminate()
            p.join(5)


# -- process bodies ----------------------------------------------------------


def decode_main(ctrl, out, timeout_s: float, message_bytes: int | None = None) -> None:
    """A decode worker: DecodePairs driven by (cmd, arg) messages on ``ctrl``. Each received staging
    tensor is handed back once read, as the decode worker's install does, so later requests land in
    reused buffers. ``message_bytes``: ``wire.CPU_MESSAGE_BYTES`` here (both sides must agree)."""
    if message_bytes is not None:
        wire.CPU_MESSAGE_BYTES = message_bytes

    def on_received(r):
        if isinstance(r, ReceivedKV):
            out.put(("received", r.request_id, as_bytes(r.kv), list(r.kv.shape), str(r.kv.dtype),
                     r.num_bytes, r.checksum))
            pairs.release(r.kv)
        else:
            out.put(("failed", r.request_id, r.reason))

    pairs = DecodePairs("D", HOST, "cpu", timeout_s, on_received)
    out.put(("ready", pairs.store_port))
    while True:
        cmd, arg = ctrl.get(timeout=60)
        if cmd == "generation":
            out.put(("generation", pairs.generation_for(arg)))
        elif cmd == "header":
            pairs.submit(msgspec.msgpack.decode(arg, type=KVTransferHeader))
        elif cmd == "die":
            os._exit(1)
        elif cmd == "num_allocated":
            out.put(("num_allocated", pairs.staging.num_allocated))
        else:
            break
    pairs.close()


def prefill_main(store_port: int, generation: int, headers, out, plan, dtype: str, timeout_s: float,
                 die_at_layer: int | None = None, bad_header: str | None = None, early_meta: bool = False,
                 kv_slots: int = 2, message_bytes: int | None = None) -> None:
    """A prefill worker: pairs with D, sends ``plan``'s requests, reports on_done results.
    ``early_meta``: every request's meta goes out (``OutgoingKV.start``) before any of its batch's
    layers, as the agent does before a forward. ``message_bytes``: as ``decode_main``'s."""
    if message_bytes is not None:
        wire.CPU_MESSAGE_BYTES = message_bytes
    dtype_t = dtype_from_name(dtype)
    pairs = PrefillPairs("P", "cpu", timeout_s)
    pairs.request_pair("D", HOST, store_port, generation)
    while (pair := pairs.get("D", generation)) is None:
        if pairs.failure("D", generation):
            out.put(("connect_failed", pairs.failure("D", generation)))
            return
        time.sleep(0.01)
    done: queue.Queue = queue.Queue()
    completer = SendCompleter(timeout_s, lambda out, *rest: done.put((out.request_id, *rest)))
    cache = make_cache(dtype_t, kv_slots)
    for batch in plan:
        outgoing = []
        for rid, block_ids in batch:
            n = len(block_ids) + 1 if rid == bad_header else None
            header = make_header(rid, block_ids, generation, dtype_t, num_blocks=n, kv_slots=kv_slots)
            headers.put(("header", msgspec.msgpack.encode(header)))
            lists = layer_lists(block_ids)
            outgoing.append((OutgoingKV(pair, rid, NUM_LAYERS, layer_num_blocks=layer_counts(block_ids),
                                        send_from_cache=plan == ADJACENT_PLAN), lists))
            if early_meta:
                outgoing[-1][0].start(cache[0], max(lists, key=len))
        for layer in range(NUM_LAYERS):
            if layer == die_at_layer:
                time.sleep(0.3)  # let D take the first layers
                os._exit(1)
            for out_kv, lists in outgoing:
                out_kv.send_layer(layer, cache[layer], lists[layer])
        for out_kv, _ in outgoing:
            completer.submit(out_kv)
    for _ in range(sum(len(b) for b in plan)):
        out.put(("done",) + done.get(timeout=timeout_s + 5))
    arena_free = pair.staging.free_bytes == pair._arena.data_bytes if pair.shared_memory else None
    out.put(("staging", pairs.staging.num_allocated, pairs.staging.num_lent, pair.transport, arena_free))
    completer.close()
    pairs.close()


# -- staging pool ------------------------------------------------------------


def test_staging_pool_reuses_returned_buffers_only():
    pool = StagingPool()
    a = pool.take((2, 3, 4, 8), torch.float32, "cpu")
    b = pool.take((2, 3, 4, 8), torch.float32, "cpu")
    assert a.shape == (2, 3, 4, 8) and a.dtype == torch.float32 and a.is_contiguous()
    assert a.data_ptr() != b.data_ptr()  # both lent at once: never the same memory
    a.fill_(1.0)
    for foreign in (torch.zeros(2, 3, 4, 8), a[0], a.view(-1)):  # not what take returned: ignored
        pool.give(foreign)
    assert pool.free_bytes == 0 and pool.num_lent == 2
    pool.give(a)
    pool.give(a)  # twice: ignored
    assert pool.num_lent == 1
    c = pool.take((100,), torch.uint8, "cpu")  # smaller, other dtype: a's buffer
    assert c.data_ptr() == a.data_ptr() and pool.num_allocated == 2
    d = pool.take((2, 3, 4, 8), torch.float32, "cpu")  # a's buffer is lent again: a new one
    assert d.data_ptr() not in (b.data_ptr(), c.data_ptr()) and pool.num_allocated == 3


def test_staging_pool_bounds_idle_bytes_and_forgets_unreturned_buffers():
    pool = StagingPool(max_free_bytes=3 << 20)
    lent = [pool.take((n << 20,), torch.uint8, "cpu") for n in (1, 2, 2)]
    for t in lent:
        pool.give(t)
    assert pool.free_bytes == 2 << 20  # 5 MiB idle > 3: the smallest went first (1 MiB, then 2 MiB)
    lost = pool.take((1 << 20,), torch.uint8, "cpu")  # the idle 2 MiB buffer
    assert pool.free_bytes == 0 and pool.num_lent == 1
    del lost  # never given back (a failed transfer): the pool kept no reference, so it is freed
    assert pool.num_lent == 0 and pool.free_bytes == 0


@pytest.mark.skipif(not shm_supported(torch.device("cpu")), reason="no shared-memory transport on this machine")
def test_arena_staging_lends_first_fit_merges_freed_regions_and_falls_back():
    """The sender's staging in a pair's arena (``shm.ArenaStaging``): page-aligned regions of the data, first
    fit; a buffer given back merges with free neighbours; what does not fit comes from the fallback pool; a
    buffer that dies unreturned frees its region."""
    arena = ShmArena.create(64 << 10)
    arena.unlink()
    try:
        fallback = StagingPool()
        staging = ArenaStaging(arena, fallback)
        a, b, c = (staging.take((n, 1024), torch.uint8, "cpu") for n in (8, 4, 20))  # 8 + 4 + 20 KiB
        offsets = [t.data_ptr() - arena.data_ptr for t in (a, b, c)]
        assert offsets == [0, 8 << 10, 12 << 10] and staging.free_bytes == 32 << 10
        big = staging.take((40 << 10,), torch.uint8, "cpu")  # more than is free: the fallback's
        assert not 0 <= big.data_ptr() - arena.data_ptr < arena.data_bytes and fallback.num_lent == 1
        staging.give(b)
        e = staging.take((5 << 10,), torch.uint8, "cpu")
        assert e.data_ptr() - arena.data_ptr == 32 << 10  # not b's 4 KiB hole
        staging.give(a)  # merges with b's hole: 12 KiB at 0
        d = staging.take((3, 1024), torch.float32, "cpu")
        assert d.data_ptr() == arena.data_ptr and d.shape == (3, 1024)
        staging.give(big)
        assert fallback.num_lent == 0 and fallback.free_bytes > 0
        staging.give(d[0])  # a view at its address, not what take returned: ignored
        assert staging.free_bytes == (64 - 20 - 8 - 12) << 10
        staging.give(d)
        staging.give(d)  # twice: ignored
        assert staging.free_bytes == (64 - 20 - 8) << 10
        del c  # never given back (a failed request's): its region is free again
        assert staging.free_bytes == (64 - 8) << 10
    finally:
        arena.close()


@pytest.mark.skipif(not shm_supported(torch.device("cpu")), reason="no shared-memory transport on this machine")
@pytest.mark.parametrize("mib", ["1", "1000000"])
def test_shm_negotiation_leaves_no_file_and_sees_the_peer_go(mib, monkeypatch):
    """Both ranks agree on an arena through the pair's store, whose file is gone once both mapped it; each
    side sees the other's lock until the other closes. An arena ``/dev/shm`` cannot hold (1 TB here) is
    refused at once: both sides answer None (the pair stays on gloo), and no file is left either way."""
    monkeypatch.setenv("PDSERVE_KV_SHM_MIB", mib)
    store = dist.HashStore()
    before = set(glob.glob("/dev/shm/pdserve-kv-*"))
    with ThreadPoolExecutor(2) as pool:
        sender, receiver = pool.map(lambda rank: negotiate(store, rank, torch.device("cpu")), (0, 1))
    assert set(glob.glob("/dev/shm/pdserve-kv-*")) == before
    if mib != "1":
        assert sender is None and receiver is None
        return
    assert sender.data_bytes == receiver.data_bytes == 1 << 20
    assert sender.peer_alive() and receiver.peer_alive()
    sender.data[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert receiver.data[:4].tolist() == [1, 2, 3, 4]  # one memory
    sender.close()
    assert not receiver.peer_alive() and receiver.closed
    receiver.close()


_ARENA_HOLDER = """
import os, sys, time
from pdserve.kvtransfer.shm import ShmArena
arena = ShmArena.create(1 << 20)  # a sender's offer, never answered: its file keeps its name
if sys.argv[1] == "wait" or os.fork() == 0:  # "fork": the creator exits, its child keeps the lock
    print(arena.path, os.getpid(), flush=True)
    time.sleep(120)
os._exit(0)
"""


@pytest.mark.skipif(not shm_supported(torch.device("cpu")), reason="no shared-memory transport on this machine")
def test_an_arena_left_by_a_killed_sender_is_removed_when_the_next_is_made():
    """A sender SIGKILLed while its offer waits for the peer's answer leaves its arena file in ``/dev/shm``;
    the next ``ShmArena.create`` (any process's) removes it. A file whose creator is gone but whose lock a
    live process still holds (a forked child of the creator) stays until that process dies too."""
    def start(mode):
        proc = subprocess.Popen([sys.executable, "-c", _ARENA_HOLDER, mode], stdout=subprocess.PIPE, text=True)
        path, pid = proc.stdout.readline().split()
        return proc, path, int(pid)

    paths, holder = [], None
    try:
        killed, killed_path, _ = start("wait")
        paths.append(killed_path)
        killed.kill()
        killed.wait()
        assert os.path.exists(killed_path)  # nothing else removes it
        forked, forked_path, holder = start("fork")
        paths.append(forked_path)
        forked.wait()  # the creator exited (and is reaped); its child holds the lock
        arena = ShmArena.create(64 << 10)
        arena.unlink()
        arena.close()
        assert not os.path.exists(killed_path)
        assert os.path.exists(forked_path)
        os.kill(holder, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while forked_path not in sweep_orphans() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(forked_path)
    finally:
        if holder is not None:
            try:
                os.kill(holder, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)


def test_transfer_backend():
    assert transfer_backend("cpu") == "gloo"
    assert transfer_backend(torch.device("cuda", 1)) == "nccl"


# -- end to end ----------------------------------------------------------------


@pytest.mark.parametrize("dtype,early_meta,kv_slots,message_bytes,plan,transport",
                         [(torch.float32, False, 2, None, PLAN, "auto"), (torch.bfloat16, True, 2, None, PLAN, "auto"),
                          (torch.float32, True, 1, None, PLAN, "auto"), (torch.float32, True, 2, 512, PLAN, "auto"),
                          (torch.bfloat16, False, 2, 256, PLAN, "auto"),
                          (torch.float32, True, 2, 512, GROUPS_PLAN, "auto"),
                          (torch.float32, False, 2, None, GROUPS_PLAN, "auto"),
                          (torch.bfloat16, True, 2, 256, GROUPS_PLAN, "auto"),
                          (torch.float32, True, 2, 512, ADJACENT_PLAN, "auto"),
                          (torch.float32, False, 2, None, PLAN, "gloo"), (torch.bfloat16, False, 2, 256, PLAN, "gloo"),
                          (torch.float32, True, 2, 512, GROUPS_PLAN, "gloo"),
                          (torch.float32, True, 2, 512, ADJACENT_PLAN, "gloo")])
def test_end_to_end_layer_by_layer(dtype, early_meta, kv_slots, message_bytes, plan, transport, monkeypatch):
    """Requests interleaved layer by layer arrive whole and checked, in staging buffers the pools
    reuse (sender and receiver); with ``early_meta`` every meta of a batch goes out before its layers.
    ``kv_slots`` 1: a latent cache (MLA) ships one row per token, half the bytes of K and V.
    ``message_bytes``: a layer in runs of at most that many bytes (``wire.layer_runs``; 512: two
    256-byte float32 blocks, gathered and sent run by run; 256: two 128-byte bfloat16 blocks, which
    are not whole checksum rows, so the layer is gathered whole and sent in runs). ``GROUPS_PLAN``:
    each layer sends its own blocks (KV cache groups), with equal and with unequal counts; every layer
    arrives with its own blocks' bytes. ``ADJACENT_PLAN``: runs of adjacent blocks leave from the cache.
    ``transport``: "auto" takes shared memory where the machine has it (both processes share this host),
    "gloo" keeps the pair on gloo (``PDSERVE_KV_TRANSPORT``, inherited by the processes)."""
    monkeypatch.setenv("PDSERVE_KV_TRANSPORT", transport)
    expected_transport = "shm" if transport == "auto" and shm_supported(torch.device("cpu")) else "gloo"
    ctrl, out_d, out_p = CTX.Queue(), CTX.Queue(), CTX.Queue()
    d = CTX.Process(target=decode_main, args=(ctrl, out_d, 10.0, message_bytes), daemon=True)
    d.start()
    procs = [d]
    try:
        _, port = out_d.get(timeout=20)
        ctrl.put(("generation", "P"))
        _, generation = out_d.get(timeout=5)
        t0 = time.monotonic()
        p = CTX.Process(target=prefill_main, args=(port, generation, ctrl, out_p, plan, dtype_name(dtype), 10.0,
                                                   None, None, early_meta, kv_slots, message_bytes), daemon=True)
        p.start()
        procs.append(p)
        requests = [r for batch in plan for r in batch]
        received = {m[1]: m for m in (out_d.get(timeout=20) for _ in requests)}
        done = {m[1]: m for m in (out_p.get(timeout=20) for _ in requests)}
        print(f"\n{dtype}: {len(requests)} requests received {time.monotonic() - t0:.2f}s after P started")
        cache = make_cache(dtype, kv_slots)
        for rid, block_ids in requests:
            kind, _, kv_bytes, shape, kv_dtype, num_bytes, checksum = received[rid]
            assert kind == "received", received[rid]
            lists = layer_lists(block_ids)
            layers = [layer[:, ids] for layer, ids in zip(cache, lists)]  # each [kv_slots, its blocks, bs, H, D]
            widest = max(len(ids) for ids in lists)
            assert shape == [NUM_LAYERS, kv_slots, widest, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM]
            assert kv_dtype == str(dtype)
            staged = torch.frombuffer(bytearray(kv_bytes), dtype=dtype).view(shape)
            for i, layer in enumerate(layers):  # a layer of fewer blocks fills the front of its row
                assert as_bytes(wire.layer_prefix(staged[i], len(lists[i]))) == as_bytes(layer), f"{rid} layer {i}"
            _, _, sent_bytes, sent_checksum, error = done[rid]
            assert error is None
            assert num_bytes == sent_bytes == sum(t.nbytes for t in layers) == kv_slots * BLOCK_SIZE * \
                sum(len(ids) for ids in lists) * NUM_KV_HEADS * HEAD_DIM * dtype.itemsize
            assert checksum == sent_checksum
            reference = KVChecksum()
            for layer in layers:
                reference.update(layer)
            assert checksum == reference.value
        _, allocated, lent, seen_transport, arena_free = out_p.get(timeout=5)
        assert seen_transport == expected_transport and lent == 0
        assert not glob.glob(f"/dev/shm/pdserve-kv-{p.pid}-*")  # the arena's name went once D mapped it
        if seen_transport == "shm":  # P's staging lay in the arena, all of it given back
            assert allocated == 0 and arena_free is True
        elif plan is PLAN:  # P: r0 and r1 are gathered at once, r2 (5 blocks) fits in neither
            assert allocated == 3
        if plan is PLAN:
            # D: r1 (2 blocks) lands in r0's returned buffer (3 blocks); r2 needs a new one
            ctrl.put(("num_allocated", None))
            assert out_d.get(timeout=5) == ("num_allocated", 2)
    finally:
        ctrl.put(("stop", None))
        stop(*procs)


# -- missing peers -------------------------------------------------------------


def test_decode_header_for_absent_prefill_worker_fails_within_timeout():
    results: queue.Queue = queue.Queue()
    timeout_s = 2.0
    pairs = DecodePairs("D", HOST, "cpu", timeout_s, results.put)
    try:
        generation = pairs.generation_for("ghost")
        t0 = time.monotonic()
        pairs.submit(make_header("r-ghost", [0, 1], generation, torch.float32, prefill_worker_id="ghost"))
        failed = results.get(timeout=timeout_s + 10)
        elapsed = time.monotonic() - t0
        assert isinstance(failed, TransferFailed) and failed.request_id == "r-ghost"
        assert "ghost" in failed.reason and "r-ghost" in failed.reason, failed.reason
        assert elapsed < timeout_s + 1.5, elapsed
        assert pairs.generation_for("ghost") == generation + 1
        pairs.submit(make_header("r-stale", [0], generation, torch.float32, prefill_worker_id="ghost"))
        stale = results.get(timeout=1)
        assert isinstance(stale, TransferFailed) and "generation" in stale.reason
    finally:
        t0 = time.monotonic()
        pairs.close()
        assert time.monotonic() - t0 < 3


def test_prefill_pair_fails_within_timeout_when_nobody_joins():
    timeout_s = 2.0
    server = PairStoreServer(HOST)
    with socket.socket() as s:  # a port with no store behind it
        s.bind((HOST, 0))
        dead_port = s.getsockname()[1]
    pairs = PrefillPairs("P", "cpu", timeout_s)
    try:
        t0 = time.monotonic()
        pairs.request_pair("D", HOST, server.port, 1)
        pairs.request_pair("D2", HOST, dead_port, 0)
        while pairs.failure("D", 1) is None or pairs.failure("D2", 0) is None:
            assert time.monotonic() - t0 < timeout_s + 1, "no failure reported"
            time.sleep(0.02)
        assert pairs.get("D", 1) is None and pairs.get("D2", 0) is None
        assert "decode worker D did not join" in pairs.failure("D", 1)
        assert "D2" in pairs.failure("D2", 0)
        pairs.request_pair("D", HOST, server.port, 0)  # older than g1: refused at once
        assert "stale" in pairs.failure("D", 0)
    finally:
        pairs.close()
        server.close()


# -- broken pairs --------------------------------------------------------------


def _forward_header(headers, pairs: DecodePairs, timeout: float = 20) -> None:
    _, raw = headers.get(timeout=timeout)
    pairs.submit(msgspec.msgpack.decode(raw, type=KVTransferHeader))


def test_prefill_dies_mid_transfer_then_next_generation_works():
    results: queue.Queue = queue.Queue()
    timeout_s = 20.0  # failures below must come from the dead peer, not from this timeout
    pairs = DecodePairs("D", HOST, "cpu", timeout_s, results.put)
    headers, out_p = CTX.Queue(), CTX.Queue()
    procs = []
    try:
        generation = pairs.generation_for("P")
        p = CTX.Process(target=prefill_main, args=(pairs.store_port, generation, headers, out_p,
                                                   [[("r-dead", [1, 2, 3])]], "float32", timeout_s, 2), daemon=True)
        p.start()
        procs.append(p)
        _forward_header(headers, pairs)
        t0 = time.monotonic()
        failed = results.get(timeout=timeout_s)
        elapsed = time.monotonic() - t0
        assert isinstance(failed, TransferFailed) and failed.request_id == "r-dead"
        assert "layer" in failed.reason and "prefill worker P" in failed.reason, failed.reason
        assert elapsed < 3.0, elapsed
        print(f"\nprefill death noticed after {elapsed:.2f}s: {failed.reason}")

        next_generation = pairs.generation_for("P")
        assert next_generation == generation + 1
        p2 = CTX.Process(target=prefill_main, args=(pairs.store_port, next_generation, headers, out_p,
                                                    [[("r-ok", [4, 0])]], "float32", timeout_s), daemon=True)
        p2.start()
        procs.append(p2)
        _forward_header(headers, pairs)
        ok = results.get(timeout=timeout_s)
        assert isinstance(ok, ReceivedKV), ok
        expected = torch.stack([layer[:, [4, 0]] for layer in make_cache(torch.float32)])
        assert as_bytes(ok.kv) == as_bytes(expected)
        _, rid, _, sent_checksum, error = out_p.get(timeout=10)
        assert (rid, error, sent_checksum) == ("r-ok", None, ok.checksum)
        p2.join(10)  # P closed its pairs on the way out: D notices without another transfer
        assert pairs.generation_for("P") == next_generation + 1
    finally:
        pairs.close()
        stop(*procs)


def test_header_stream_mismatch_fails_and_resets_pair():
    results: queue.Queue = queue.Queue()
    pairs = DecodePairs("D", HOST, "cpu", 10.0, results.put)
    headers, out_p = CTX.Queue(), CTX.Queue()
    procs = []
    try:
        generation = pairs.generation_for("P")
        p = CTX.Process(target=prefill_main, args=(pairs.store_port, generation, headers, out_p,
                                                   [[("r-bad", [1, 2])]], "float32", 10.0, None, "r-bad"), daemon=True)
        p.start()
        procs.append(p)
        _forward_header(headers, pairs)
        failed = results.get(timeout=15)
        assert isinstance(failed, TransferFailed) and "num_blocks: header 3, stream 2" in failed.reason, failed
        assert pairs.generation_for("P") == generation + 1
        _, rid, _, _, error = out_p.get(timeout=15)  # P's sends fail: D closed the pair
        assert rid == "r-bad" and error is not None
    finally:
        pairs.close()
        stop(*procs)


def test_decode_dies_mid_transfer_sender_fails_fast():
    ctrl, out_d = CTX.Queue(), CTX.Queue()
    d = CTX.Process(target=decode_main, args=(ctrl, out_d, 20.0), daemon=True)
    d.start()
    timeout_s = 20.0
    pairs = PrefillPairs("P", "cpu", timeout_s)
    done: queue.Queue = queue.Queue()
    completer = SendCompleter(timeout_s, lambda out, *rest: done.put((out.request_id, *rest)))
    try:
        _, port = out_d.get(timeout=20)
        ctrl.put(("generation", "P"))
        _, generation = out_d.get(timeout=5)
        pairs.request_pair("D", HOST, port, generation)
        t0 = time.monotonic()
        while (pair := pairs.get("D", generation)) is None:
            assert pairs.failure("D", generation) is None and time.monotonic() - t0 < 10
            time.sleep(0.01)
        cache = make_cache(torch.float32)
        ctrl.put(("header", msgspec.msgpack.encode(make_header("r-x", [5, 6], generation, torch.float32))))
        out_kv = OutgoingKV(pair, "r-x", NUM_LAYERS)
        out_kv.send_layer(0, cache[0], [5, 6])
        time.sleep(0.3)
        ctrl.put(("die", None))
        d.join(10)
        for layer in range(1, NUM_LAYERS):
            out_kv.send_layer(layer, cache[layer], [5, 6])
        t0 = time.monotonic()
        completer.submit(out_kv)
        rid, _, _, error = done.get(timeout=timeout_s)
        elapsed = time.monotonic() - t0
        assert rid == "r-x" and error is not None and "decode worker D" in error, error
        assert elapsed < 3.0, elapsed
        assert pairs.get("D", generation) is None and pairs.failure("D", generation) is not None
    finally:
        completer.close()
        pairs.close()
        stop(d)


def test_meta_carries_kv_slots_and_a_mismatch_is_named():
    """A latent layer's meta says 1 slot; a header that expects K and V disagrees by name, before any
    layer receive is posted (gloo would abort on the size)."""
    from pdserve.kvtransfer import wire

    layer = torch.zeros(1, 3, BLOCK_SIZE, 1, HEAD_DIM)
    meta = wire.make_meta("r", NUM_LAYERS, layer)
    header = msgspec.structs.replace(make_header("r", [0, 1, 2], 0, torch.float32, kv_slots=1),
                                     num_kv_heads=1, num_layers=NUM_LAYERS)
    assert meta.tolist()[8] == 1 and torch.equal(meta, wire.expected_meta(header, torch.device("cpu")))
    expected = wire.expected_meta(msgspec.structs.replace(header, kv_slots=2), torch.device("cpu"))
    assert wire.describe_meta_mismatch(expected, meta) == "kv_slots: header 2, stream 1"
