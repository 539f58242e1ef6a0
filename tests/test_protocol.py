import msgspec
import pytest

from pdserve.common import protocol as p
from pdserve.common.transport import ProtocolError, decode, encode

SAMPLES = [
    p.RankReport(rank=1, kind=p.RankReportKind.RECEIVED, peer="prefill-0#0", generation=2, request_id="r1",
                 num_bytes=4096, checksum=12345),
    p.RegisterWorker(worker_id="d0", role=p.WorkerRole.DECODE, input_addr="tcp://127.0.0.1:5555", model_name="m",
                     transfer_host="127.0.0.1", transfer_port=4242, num_blocks=10, block_size=16, max_model_len=2048,
                     vocab_size=32000, kv_layout=p.KVLayout(tensor_parallel_size=2, num_layers=32, num_kv_heads=8)),
    p.Heartbeat(worker_id="p0", role=p.WorkerRole.PREFILL, num_running=3, max_step_batch_size=7),
    p.Heartbeat(worker_id="d0", role=p.WorkerRole.DECODE, draining=True),
    p.DrainWorker(reason="pool scaled to 1"),
    p.WorkerDraining(worker_id="d0", role=p.WorkerRole.DECODE, input_addr="tcp://127.0.0.1:5555", auth="ab12"),
    p.WorkerExiting(worker_id="d0", role=p.WorkerRole.DECODE, input_addr="tcp://127.0.0.1:5555", reason="drained"),
    p.WarmKVPair(prefill_worker_id="p0", prefill_addr="tcp://127.0.0.1:5556",
                 prefill_layout=p.KVLayout(tensor_parallel_size=2, pipeline_parallel_size=1, num_layers=4,
                                           num_kv_heads=2)),
    p.ConnectKVPair(decode_worker_id="d0", transfer_host="127.0.0.1", transfer_port=29500, pair_generation=3),
    p.KVEventBatch(worker_id="d0", instance=2**62, seq=4, ts=1.5, events=[
        p.BlockStored(block_hashes=[b"a" * 32, b"b" * 32], parent_block_hash=b"c" * 32, token_ids=list(range(32)),
                      block_size=16, lora_id=3, medium="host", group=1),
        p.BlockRemoved(block_hashes=[b"d" * 32], medium="disk"), p.AllBlocksCleared()], snapshot=True),
    p.KVEventsReplay(from_seq=7, router_addr="tcp://127.0.0.1:7000"),
    p.GenerateRequest(request_id="r1", prompt_token_ids=[1, 2, 3],
                      sampling_params=p.SamplingParams(max_tokens=5, temperature=0.0, stop=["\n"], seed=7),
                      prefill_worker_id="p0", prefill_addr="tcp://127.0.0.1:1"),
    p.GenerateRequest(request_id="r2", prompt_token_ids=[9], sampling_params=p.SamplingParams()),
    p.AbortRequest(request_id="r1"),
    p.RemotePrefillRequest(request_id="r1", prompt_token_ids=[1, 2], sampling_params=p.SamplingParams(top_k=5),
                           decode_worker_id="d0", decode_addr="tcp://x:1", transfer_host="x", transfer_port=2,
                           pair_generation=3, dest_block_ids=[4, 1]),
    p.KVTransferHeader(request_id="r1", prefill_worker_id="p0", pair_generation=0, num_layers=2, num_blocks=3,
                       block_size=16, num_kv_heads=2, head_dim=8, dtype="float32", num_tokens=40),
    p.RemotePrefillDone(request_id="r1", prefill_worker_id="p0", first_token_id=5, num_tokens=40, num_bytes=100,
                        checksum=2**61 - 5),
    p.RemotePrefillDone(request_id="r1", prefill_worker_id="p0", error="boom"),
    p.RemotePrefillDone(request_id="r1", prefill_worker_id="p0", first_token_id=5,
                        timing=p.RequestTiming(prefill_received=1.5, prefill_started=2.25, prefill_done=3.0)),
    p.RequestOutputs(worker_id="d0", deltas=[
        p.RequestDelta(request_id="r1", new_token_ids=[1, 2], finish_reason=p.FinishReason.LENGTH),
        p.RequestDelta(request_id="r2", new_token_ids=[], error="bad", finish_reason=p.FinishReason.ERROR),
        p.RequestDelta(request_id="r3", new_token_ids=[7], timing=p.RequestTiming(
            decode_received=1e9 + 0.125, remote_prefill_sent=1e9 + 0.25, prefill_started=1e9 + 0.5,
            prefill_done=1e9 + 0.75, kv_installed=1e9 + 1.0))]),
    p.Heartbeat(worker_id="d0", role=p.WorkerRole.DECODE,
                stats=p.WorkerStats(num_decode_steps=12, decode_step_seconds=0.375)),
]


@pytest.mark.parametrize("msg", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(msg):
    frames = encode(msg)
    assert frames[0] == bytes((p.KIND_OF[type(msg)],))
    assert decode(frames) == msg


def test_every_message_type_has_a_kind():
    assert set(p.MESSAGE_TYPES.values()) == {type(m) for m in SAMPLES}


def test_payload_is_decoded_only_as_its_kind():
    frames = encode(p.AbortRequest(request_id="r1"))
    with pytest.raises(ProtocolError):
        decode([bytes((p.MsgKind.GENERATE,)), frames[1]])


@pytest.mark.parametrize("frames", [[b"\x03"], [b"\xff", b""], [b"\x03", b"not msgpack"], [b"", b""]])
def test_malformed_frames_raise(frames):
    with pytest.raises(ProtocolError):
        decode(frames)


def test_non_protocol_object_is_refused():
    with pytest.raises(ProtocolError):
        encode({"request_id": "r1"})


def test_timing_is_optional_both_ways():
    """A peer without ``timing`` (older, or a delta after the first) and one with it still understand each other."""

    class OldDelta(msgspec.Struct, array_like=True, omit_defaults=True, kw_only=True):
        request_id: str
        new_token_ids: list[int]

    new = p.RequestDelta(request_id="r1", new_token_ids=[3], timing=p.RequestTiming(kv_installed=2.0))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(new), type=OldDelta) == OldDelta(request_id="r1",
                                                                                          new_token_ids=[3])
    old = msgspec.msgpack.encode(OldDelta(request_id="r1", new_token_ids=[3]))
    assert msgspec.msgpack.decode(old, type=p.RequestDelta).timing is None
