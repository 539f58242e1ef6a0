"""The KV transfer's integrity checksum (``pdserve.kvtransfer.checksum``): what it catches, and the native
one-pass gather and checksum (``kernels/kv_gather.cpp``) against the torch reductions."""

from __future__ import annotations

import pytest
import torch

import pdserve.kvtransfer.checksum as checksum_mod
import pdserve.kvtransfer.wire as wire
from pdserve.kvtransfer.checksum import BlockGather, KVChecksum, combine_checksums, join_sums, kv_checksum
from pdserve.kvtransfer.sender import OutgoingKV
from pdserve.kvtransfer.staging import StagingPool
from pdserve.kvtransfer.wire import KVTransferError

SEED = 1234


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checksum_equal_bytes_and_sensitivity(dtype):
    a = torch.randn(2, 6, 4, 2, 8).to(dtype)
    assert kv_checksum(a) == kv_checksum(a.clone())
    assert kv_checksum(a) == kv_checksum(a.view(torch.int16) if dtype == torch.bfloat16 else a.view(torch.int32))
    one = a.clone()
    one[1, 3, 2, 1, 5] += 1
    assert kv_checksum(one) != kv_checksum(a)
    swapped = a.clone()
    swapped[:, [1, 4]] = a[:, [4, 1]]
    assert kv_checksum(swapped) != kv_checksum(a)
    assert kv_checksum(a[:, :5]) != kv_checksum(a)  # truncation


def test_checksum_rows_tails_and_offsets():
    data = torch.randint(0, 256, (4096 + 100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(SEED))
    base = kv_checksum(data)
    assert kv_checksum(data[1:]) == kv_checksum(data[1:].clone())  # a view at an odd byte offset
    moved = data.clone()
    moved[:256], moved[256:512] = data[256:512].clone(), data[:256].clone()  # two 256-byte rows swapped
    assert kv_checksum(moved) != base
    tail = data.clone()
    tail[-50:] = 0  # the partial last row: a cut that left other bytes behind
    assert kv_checksum(tail) != base
    assert kv_checksum(data[:-1]) != base
    assert kv_checksum(torch.empty(0)) == kv_checksum(torch.empty(0, dtype=torch.uint8))


def test_checksum_fold_is_order_sensitive():
    x, y = torch.randn(100), torch.randn(100)
    cs = KVChecksum()
    cs.update(x)
    cs.update(y)
    assert cs.value == combine_checksums(combine_checksums(0, kv_checksum(x)), kv_checksum(y))
    assert cs.value != combine_checksums(combine_checksums(0, kv_checksum(y)), kv_checksum(x))
    assert cs.num_bytes == 800
    assert 0 <= cs.value < 2**63


def _torch_checksum(t: torch.Tensor) -> int:
    """The checksum from the torch reductions alone (the path without the native kernel)."""
    return checksum_mod._to_int(*checksum_mod._word_sums(t).tolist(), t.numel() * t.element_size())


def gather_with_checksum(kv_layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor):
    """One layer through a ``BlockGather`` planned for it: its sums, or None where no plan is made."""
    plan = BlockGather.plan(kv_layer, block_ids, out)
    return plan(kv_layer, out) if plan is not None else None


needs_kernel = pytest.mark.skipif(checksum_mod._kernel() is None, reason="the native kv_gather kernel is not built here")


@needs_kernel
def test_native_checksum_equals_the_torch_reductions():
    g = torch.Generator().manual_seed(SEED)
    data = torch.randint(0, 256, (3 * 4096 + 77,), dtype=torch.uint8, generator=g)
    for n in [0, 1, 7, 8, 255, 256, 257, 4096, 4096 + 100, data.numel()]:
        assert kv_checksum(data[:n]) == _torch_checksum(data[:n]), n
        assert kv_checksum(data[3:3 + n]) == _torch_checksum(data[3:3 + n]), n  # unaligned start
    x = torch.randn(5, 7, 3, generator=g)
    cs = KVChecksum()
    cs.update(x)
    cs.update(x[1:].transpose(0, 1))  # not contiguous: the bytes of its contiguous copy
    assert cs.value == combine_checksums(combine_checksums(0, _torch_checksum(x)),
                                         _torch_checksum(x[1:].transpose(0, 1).contiguous()))


@needs_kernel
@pytest.mark.parametrize("case", ["float32", "head_slice", "quantized_rows", "latent"])
def test_gather_with_checksum_equals_index_select_then_checksum(case):
    g = torch.Generator().manual_seed(SEED)
    if case == "quantized_rows":  # 1 head of 64 + 4 scale bytes: 1088-byte blocks, rows straddle blocks
        cache = torch.randint(0, 256, (2, 9, 16, 1, 68), dtype=torch.uint8, generator=g)
    elif case == "latent":
        cache = torch.randn(1, 9, 4, 1, 24, generator=g)
    else:
        cache = torch.randn(2, 9, 4, 4, 8, generator=g)
    layer = cache[:, :, :, 1:3] if case == "head_slice" else cache  # a TP piece's heads: a strided view
    index = torch.tensor([7, 0, 3, 3, 8])
    out = torch.full((layer.shape[0], len(index), *layer.shape[2:]), 0, dtype=layer.dtype)
    sums = gather_with_checksum(layer, index, out)
    expected = torch.index_select(layer, 1, index)
    assert sums is not None and torch.equal(out, expected)
    cs = KVChecksum()
    cs.add(sums, out.nbytes)
    assert cs.value == combine_checksums(0, _torch_checksum(expected))
    with pytest.raises(IndexError):
        gather_with_checksum(layer, torch.tensor([1, 9]), out[:, :2].contiguous())
    # shapes it does not take: the caller falls back to index_select (nothing written)
    assert gather_with_checksum(layer, index, torch.empty(out.shape, dtype=torch.float64)) is None
    assert gather_with_checksum(layer, index.to(torch.int32), out) is None


@needs_kernel
def test_gather_in_runs_equals_one_gather(monkeypatch):
    """``BlockGather.in_runs`` (a layer gathered run by run, each run handed on before the next is
    gathered) writes the bytes of one gather and returns its sums; ``join_sums`` joins ranges' sums
    the same way; a bad block id raises before any run is gathered."""
    monkeypatch.setattr(wire, "CPU_MESSAGE_BYTES", 1024)  # two of these 512-byte blocks a run
    g = torch.Generator().manual_seed(SEED)
    cache = torch.randn(2, 9, 4, 4, 8, generator=g)
    index = torch.tensor([7, 0, 3, 8, 5])
    expected = torch.index_select(cache, 1, index)
    one, by_runs = torch.zeros_like(expected), torch.zeros_like(expected)
    plan = BlockGather.plan(cache, index, one)
    whole = tuple(v & checksum_mod._U64 for v in plan(cache, one))
    runs = wire.layer_runs(2, len(index), 512, "cpu")
    assert runs == [(0, 0, 2), (0, 2, 4), (0, 4, 5), (1, 0, 2), (1, 2, 4), (1, 4, 5)]
    handed = []

    def each(i: int) -> None:  # run i is gathered, run i + 1 not yet
        slot, first, end = runs[i]
        handed.append(i)
        assert torch.equal(by_runs[slot, first:end], expected[slot, first:end])
        if i + 1 < len(runs):
            nslot, nfirst, nend = runs[i + 1]
            assert not by_runs[nslot, nfirst:nend].any()

    assert plan.in_runs(cache, by_runs, runs, each) == whole
    assert handed == list(range(len(runs))) and torch.equal(by_runs, expected)
    data = expected.reshape(-1).view(torch.uint8)
    for end in (data.numel(), data.numel() - 100):  # the last range need not be whole rows
        cuts = [0, 3 * 256, 5 * 256, end]
        parts = [(checksum_mod._native_sums(data[a:b]), b - a) for a, b in zip(cuts, cuts[1:])]
        assert join_sums(parts) == tuple(v & checksum_mod._U64 for v in checksum_mod._native_sums(data[:end]))
    assert join_sums(parts[:1] + [(checksum_mod._native_sums(data[768:]), data.numel() - 768)]) == whole
    with pytest.raises(ValueError, match="whole"):
        join_sums([(parts[0][0], 100), parts[1]])
    bad = torch.tensor([1, 9])
    fresh = torch.zeros(2, 2, 4, 4, 8)
    with pytest.raises(IndexError):
        BlockGather.plan(cache, bad, fresh).in_runs(cache, fresh, wire.layer_runs(2, 2, 512, "cpu"), handed.append)
    assert handed == list(range(len(runs))) and not fresh.any()


def test_checksums_without_the_native_kernel(monkeypatch):
    """With no kernel built, the torch path gives the sums and the gather declines (the sender then
    uses index_select)."""
    layer = torch.randn(2, 6, 4, 2, 8)
    index = torch.tensor([5, 1])
    out = torch.empty(2, 2, 4, 2, 8)
    native = kv_checksum(out.copy_(layer[:, index]))
    monkeypatch.setattr(checksum_mod, "_LIB", None)
    assert gather_with_checksum(layer, index, out) is None
    assert kv_checksum(out) == native == _torch_checksum(out)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_checksum_same_on_cuda():
    a = torch.randn(2, 40, 16, 4, 64).to(torch.bfloat16)
    assert kv_checksum(a.cuda()) == kv_checksum(a)


class _RecordingPair:
    """What OutgoingKV needs of a pair, keeping the tensors it would put on the wire, as gloo reads them
    after the call (no process group: the sender's own work is what is tested here; tests/test_kvtransfer.py
    sends over gloo)."""

    name, peer_desc = "P->D", "D"

    def __init__(self, shared_memory: bool = False):
        self.shared_memory = shared_memory  # a same-host pair's (kvtransfer.shm): every run gathered
        self.staging = StagingPool()
        self.sent: list[torch.Tensor] = []

    def register_send(self, send):
        pass

    def enqueue_send(self, send, tensors, last):
        self.sent.extend(tensors)


@pytest.mark.parametrize("native,message_bytes", [(True, None), (True, 512), (False, None)])
def test_sender_gathers_every_layer_and_checksums_what_it_sends(native, message_bytes, monkeypatch):
    """OutgoingKV's layers (planned native gather, or index_select and torch sums without the kernel): the
    blocks asked for, as each layer's messages (``wire.layer_runs``: per K/V slot, in runs of at most
    ``CPU_MESSAGE_BYTES``; 512: two of these 256-byte blocks a run, so a slot's three blocks go in two
    messages), and a checksum equal to the receiver's over the same bytes; misuse still raises."""
    if native and checksum_mod._kernel() is None:
        pytest.skip("the native kv_gather kernel is not built here")
    if not native:
        monkeypatch.setattr(checksum_mod, "_LIB", None)
    if message_bytes is not None:
        monkeypatch.setattr(wire, "CPU_MESSAGE_BYTES", message_bytes)
    g = torch.Generator().manual_seed(SEED)
    cache = torch.randn(3, 2, 10, 4, 4, 8, generator=g)  # [layers, K/V, blocks, block_size, heads, head_dim]
    blocks = [6, 2, 9]
    pair = _RecordingPair()
    out = OutgoingKV(pair, "r0", 3)
    out.start(cache[0][:, :, :, 1:3], blocks)
    assert [plan.gather is not None for plan in out._plans.values()] == [native]  # planned at start
    for layer in range(3):
        out.send_layer(layer, cache[layer][:, :, :, 1:3], blocks)  # a TP piece's heads: a strided view
    runs = wire.layer_runs(2, len(blocks), 4 * 2 * 8 * 4, "cpu")
    assert len(runs) == (4 if message_bytes == 512 else 2)
    messages = pair.sent[1:]  # after the meta
    assert len(messages) == 3 * len(runs)
    receiver = KVChecksum()
    for layer in range(3):
        expected = cache[layer][:, blocks, :, 1:3]
        for (slot, first, end), sent in zip(runs, messages[layer * len(runs):(layer + 1) * len(runs)]):
            assert torch.equal(sent, expected[slot, first:end])
        receiver.update(expected)  # the receiver sums each layer whole, once its messages are in
    assert out._checksum.value == receiver.value
    assert out.num_bytes == receiver.num_bytes

    other = OutgoingKV(pair, "r1", 3)
    other.send_layer(0, cache[0], blocks)
    with pytest.raises(KVTransferError, match="out of order"):
        other.send_layer(2, cache[2], blocks)
    with pytest.raises(KVTransferError, match="per block"):
        other.send_layer(1, cache[1][:, :, :, :2], blocks)  # fewer heads than layer 0


@needs_kernel
def test_sender_sends_runs_of_adjacent_blocks_from_the_cache(monkeypatch):
    """``send_from_cache``: a run (``wire.layer_runs``) whose blocks lie next to each other in the cache goes on
    the wire as a view of the cache itself, nothing gathered; any other run is gathered as before, and a TP
    piece's heads (not one run of memory) always are, and so is every run of a pair through shared memory (its
    staging lies in the memory the receiver maps). The bytes and the checksum are the receiver's either way."""
    monkeypatch.setattr(wire, "CPU_MESSAGE_BYTES", 1024)  # two of these 512-byte blocks a run (a piece's: four)
    g = torch.Generator().manual_seed(SEED)
    cache = torch.randn(3, 2, 10, 4, 4, 8, generator=g)  # [layers, K/V, blocks, block_size, heads, head_dim]
    blocks = [2, 3, 8, 5, 6]  # runs [2, 3] (adjacent), [8, 5] (not), [6] (one block)
    lo, hi = cache.data_ptr(), cache.data_ptr() + cache.nbytes

    def sent_from_cache(heads: slice, send_from_cache: bool, shared_memory: bool = False) -> list[bool]:
        pair = _RecordingPair(shared_memory)
        out = OutgoingKV(pair, "r0", 3, send_from_cache=send_from_cache)
        receiver = KVChecksum()
        runs = wire.layer_runs(2, 5, cache[0][0, 0, :, heads].nbytes, "cpu")
        for layer in range(3):
            out.send_layer(layer, cache[layer][:, :, :, heads], blocks)
            expected = cache[layer][:, blocks, :, heads]
            messages = pair.sent[1 + len(runs) * layer:1 + len(runs) * (layer + 1)]
            assert len(messages) == len(runs)
            for (slot, first, end), sent in zip(runs, messages):
                assert torch.equal(sent, expected[slot, first:end])
            receiver.update(expected)
        assert out._checksum.value == receiver.value and out.num_bytes == receiver.num_bytes
        from_cache = [lo <= m.data_ptr() < hi for m in pair.sent[1:]]
        assert out.num_bytes_from_cache == sum(m.nbytes for m, f in zip(pair.sent[1:], from_cache) if f)
        return from_cache[:len(runs)]  # layer 0's messages

    assert sent_from_cache(slice(None), True) == [True, False, True] * 2
    assert sent_from_cache(slice(None), False) == [False] * 6
    assert sent_from_cache(slice(None), True, shared_memory=True) == [False] * 6
    assert sent_from_cache(slice(1, 3), True) == [False] * 4  # runs of four blocks of two heads
