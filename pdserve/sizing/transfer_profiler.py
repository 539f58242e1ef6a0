"""``pdserve profile``'s KV transfer measure: one request's KV from every prefill rank to every decode rank.

A prefill worker of ``T x P`` ranks and a decode worker of ``T' x P'`` ranks exchange a request's KV as
``sharding.transfer_pieces`` cuts it: each (prefill rank -> decode rank) piece on its own pair
(``PrefillPairs`` / ``DecodePairs``, gloo on CPU), the pieces of different ranks at once. This module
starts one process per rank of each side (pinned, one torch thread each, the ranks spread over the
cores prefill ranks first, as a local cluster spreads its workers), lays a KV cache of the model's
shape on every prefill rank (its own layers and KV heads), and times, for prompts of
``TRANSFER_TOKENS`` tokens, from the moment every prefill rank starts sending (all at once, from their
caches, layer by layer as serving sends them) until every piece is sent and received. The result is a
``TransferProfile``'s fields: seconds against the bytes of the whole request (every piece).

The timings are CLOCK_MONOTONIC readings of different processes on one machine (one clock).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import re
import statistics
import time

from pdserve.common.sharding import KVLayoutSpec, KVPiece, rank_slice, transfer_pieces

TRANSFER_TOKENS = (64, 256, 1024, 2048)
BLOCK_SIZE = 16
_CTX = mp.get_context("spawn")
_PREFILL, _DECODE = "P", "D"  # the two workers' ids in the pairs (endpoints "P#0", "D#1", ...)
_WAIT_S = 60.0


def parse_layout(name: str) -> tuple[int, int]:
    """``"tp2pp1"`` -> (2, 1). Raises ValueError for anything else."""
    m = re.fullmatch(r"tp(\d+)pp(\d+)", name.strip())
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"a layout is tp<T>pp<P> with T, P >= 1 (e.g. tp2pp1), got {name!r}")
    return int(m[1]), int(m[2])


def parse_layout_pair(text: str) -> tuple[str, str]:
    """``"tp2pp1:tp1pp1"`` (prefill layout, decode layout), each checked. Raises ValueError."""
    parts = text.split(":")
    if len(parts) != 2:
        raise ValueError(f"a layout pair is PREFILL:DECODE, e.g. tp2pp1:tp1pp1, got {text!r}")
    for part in parts:
        parse_layout(part)
    return parts[0].strip(), parts[1].strip()


def _endpoint(worker: str, rank: int) -> str:
    return f"{worker}#{rank}"


def _pin(core: int) -> None:
    os.sched_setaffinity(0, {core})
    import torch

    torch.set_num_threads(1)


def _decode_rank(rank: int, core: int, ctrl, out) -> None:
    """One decode rank: hosts its pairs' store, receives what the headers announce, reports each arrival."""
    _pin(core)
    import msgspec

    from pdserve.common.protocol import KVTransferHeader
    from pdserve.kvtransfer.receiver import DecodePairs, ReceivedKV

    def on_received(r) -> None:
        if isinstance(r, ReceivedKV):
            pairs.release(r.kv)
            out.put(("received", rank, time.monotonic(), None))
        else:
            out.put(("received", rank, time.monotonic(), r.reason))

    pairs = DecodePairs(_endpoint(_DECODE, rank), "127.0.0.1", "cpu", _WAIT_S, on_received)
    out.put(("ready", rank, pairs.store_port, None))
    try:
        while True:
            cmd, arg = ctrl.get(timeout=600)
            if cmd == "generation":  # for the prefill endpoint arg
                out.put(("generation", rank, (arg, pairs.generation_for(arg)), None))
            elif cmd == "header":
                pairs.submit(msgspec.msgpack.decode(arg, type=KVTransferHeader))
            else:
                break
    finally:
        pairs.close()


def _prefill_rank(rank: int, core: int, model_shape: dict, pieces: list[KVPiece], my_slice, ctrl, out) -> None:
    """One prefill rank: a KV cache of its layers and heads; on "go", sends its pieces from it layer by layer."""
    _pin(core)
    import torch

    from pdserve.engine.execution.kv_cache import allocate_kv_cache
    from pdserve.kvtransfer.sender import OutgoingKV, PrefillPairs

    max_blocks = max(TRANSFER_TOKENS) // BLOCK_SIZE
    kv_cache = allocate_kv_cache(my_slice.num_layers, max_blocks + 1, BLOCK_SIZE, my_slice.num_heads,
                                 model_shape["head_dim"], torch.float32, "cpu")
    kv_cache.normal_()
    pairs = PrefillPairs(_endpoint(_PREFILL, rank), "cpu", _WAIT_S)
    try:
        cmd, peers = ctrl.get(timeout=120)  # ("pairs", {decode rank: (store port, generation)})
        for d, (port, generation) in peers.items():
            pairs.request_pair(_endpoint(_DECODE, d), "127.0.0.1", port, generation)
        deadline = time.monotonic() + _WAIT_S
        links = {}
        for d, (_, generation) in peers.items():
            while (pair := pairs.get(_endpoint(_DECODE, d), generation)) is None:
                why = pairs.failure(_endpoint(_DECODE, d), generation)
                if why or time.monotonic() > deadline:
                    raise RuntimeError(f"no transfer pair {_endpoint(_PREFILL, rank)}->{_endpoint(_DECODE, d)}: {why}")
                time.sleep(0.01)
            links[d] = pair
        out.put(("paired", rank, None, None))

        def view(piece: KVPiece, layer: int):  # the piece's heads of global layer `layer`
            s = piece.slice
            h0 = s.head_start - my_slice.head_start
            return kv_cache[layer - my_slice.layer_start][:, :, :, h0:h0 + s.num_heads]

        while True:
            cmd, arg = ctrl.get(timeout=600)
            if cmd != "go":
                break
            request_id, num_blocks, t0 = arg
            block_ids = list(range(1, num_blocks + 1))
            sends = []  # their metas go out first, as a worker's go out before its forward
            for piece in pieces:
                send = OutgoingKV(links[piece.decode_rank], request_id, piece.slice.num_layers, send_from_cache=True)
                send.start(view(piece, piece.slice.layer_start), block_ids)
                sends.append(send)
            time.sleep(max(0.0, t0 - time.monotonic() - 0.002))
            while time.monotonic() < t0:
                pass  # every rank starts at t0 (sleeping to the instant would wake late)
            started = time.monotonic()
            for layer in range(my_slice.layer_start, my_slice.layer_end):  # as the forward finishes each layer
                for piece, send in zip(pieces, sends):
                    if piece.slice.layer_start <= layer < piece.slice.layer_end:
                        send.send_layer(layer - piece.slice.layer_start, view(piece, layer), block_ids)
            for send in sends:
                send.wait(_WAIT_S)
            out.put(("sent", rank, (started, time.monotonic()), None))
    except BaseException as e:  # the coordinator names it
        out.put(("error", rank, None, f"prefill rank {rank}: {type(e).__name__}: {e}"))
    finally:
        pairs.close()


def _model_shape(model: str) -> dict:
    with open(os.path.join(model, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    return {"num_layers": cfg["num_hidden_layers"], "num_kv_heads": cfg.get("num_key_value_heads") or heads,
            "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads}


def measure_transfer(model: str, repeats: int, cores: list[int], prefill_layout: str = "tp1pp1",
                     decode_layout: str = "tp1pp1", on_point=None) -> dict:
    """KV transfer seconds for ``TRANSFER_TOKENS`` prompts of ``model``'s KV shape (float32), from a prefill
    worker of ``prefill_layout`` to a decode worker of ``decode_layout`` (``tpTppP``), every rank its own
    process on ``cores`` (prefill ranks first, round robin). The median of ``repeats`` timed sends (after
    one untimed) per length. Returns a ``TransferProfile``'s fields.

    Raises:
        ValueError: a layout the model cannot be cut into; RuntimeError: a rank failed (its reason named)
        or did not answer within a minute.
    """
    import msgspec

    from pdserve.common.protocol import KVTransferHeader

    shape = _model_shape(model)
    specs = {}
    for side, name in ((_PREFILL, prefill_layout), (_DECODE, decode_layout)):
        tp, pp = parse_layout(name)
        specs[side] = KVLayoutSpec(tp, pp, shape["num_layers"], shape["num_kv_heads"])
        rank_slice(specs[side], 0)  # raises ValueError for heads or layers that do not split
    pieces = transfer_pieces(specs[_PREFILL], specs[_DECODE])
    n_pre, n_dec = specs[_PREFILL].world_size, specs[_DECODE].world_size
    out = _CTX.Queue()
    decode_ctrl = [_CTX.Queue() for _ in range(n_dec)]
    prefill_ctrl = [_CTX.Queue() for _ in range(n_pre)]
    procs = [_CTX.Process(target=_decode_rank, args=(d, cores[(n_pre + d) % len(cores)], decode_ctrl[d], out),
                          daemon=True) for d in range(n_dec)]
    procs += [_CTX.Process(target=_prefill_rank, args=(p, cores[p % len(cores)], shape,
                                                       [x for x in pieces if x.prefill_rank == p],
                                                       rank_slice(specs[_PREFILL], p), prefill_ctrl[p], out),
                           daemon=True) for p in range(n_pre)]
    for proc in procs:
        proc.start()

    sizes, seconds = [], []
    try:
        ports = {rank: port for _, rank, port, _ in _expect(out, procs, {"ready": n_dec})}
        generations = {}
        for piece in pieces:
            decode_ctrl[piece.decode_rank].put(("generation", _endpoint(_PREFILL, piece.prefill_rank)))
            (_, d, (peer, generation), _), = _expect(out, procs, {"generation": 1})
            generations[(piece.prefill_rank, d)] = generation
        for p in range(n_pre):
            prefill_ctrl[p].put(("pairs", {x.decode_rank: (ports[x.decode_rank], generations[(p, x.decode_rank)])
                                           for x in pieces if x.prefill_rank == p}))
        _expect(out, procs, {"paired": n_pre})
        senders = sorted({x.prefill_rank for x in pieces})
        seq = 0
        for tokens in TRANSFER_TOKENS:
            num_blocks = tokens // BLOCK_SIZE
            samples = []
            for r in range(repeats + 1):
                seq += 1
                rid = f"t{seq}"
                for x in pieces:
                    s = x.slice
                    header = KVTransferHeader(
                        request_id=rid, prefill_worker_id=_endpoint(_PREFILL, x.prefill_rank),
                        pair_generation=generations[(x.prefill_rank, x.decode_rank)], num_layers=s.num_layers,
                        num_blocks=num_blocks, block_size=BLOCK_SIZE, num_kv_heads=s.num_heads,
                        head_dim=shape["head_dim"], dtype="float32", num_tokens=tokens, prefill_rank=x.prefill_rank,
                        decode_rank=x.decode_rank, first_layer=s.layer_start, first_kv_head=s.head_start)
                    decode_ctrl[x.decode_rank].put(("header", msgspec.msgpack.encode(header)))
                time.sleep(0.02)  # the headers reach the decode ranks first, as in serving
                t0 = time.monotonic() + 0.02  # every rank has its "go" by then
                for p in senders:
                    prefill_ctrl[p].put(("go", (rid, num_blocks, t0)))
                got = _expect(out, procs, {"sent": len(senders), "received": len(pieces)})
                start = min(m[2][0] for m in got if m[0] == "sent")  # t0, or later where a "go" came late
                end = max(m[2][1] if m[0] == "sent" else m[2] for m in got)
                if r:
                    samples.append(end - start)
            sizes.append(sum(2 * num_blocks * BLOCK_SIZE * x.slice.num_layers * x.slice.num_heads * shape["head_dim"]
                             * 4 for x in pieces))
            seconds.append(statistics.median(samples))
            if on_point:
                on_point()
    finally:
        for q in (*decode_ctrl, *prefill_ctrl):
            q.put(("stop", None))
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
    return {"prefill_layout": prefill_layout, "decode_layout": decode_layout, "backend": "gloo", "bytes": sizes,
            "seconds": seconds}


def _expect(out, procs, counts: dict[str, int]) -> list[tuple]:
    """The next messages on ``out`` until ``counts`` of each kind have come (in any order). Raises
    RuntimeError on an error report, a failed piece, or a minute of silence."""
    left, got = dict(counts), []
    while any(left.values()):
        try:
            msg = out.get(timeout=_WAIT_S)
        except Exception:
            dead = [p.exitcode for p in procs if not p.is_alive()]
            raise RuntimeError(f"the transfer's ranks stopped answering (exit codes of those gone: {dead})") from None
        if msg[0] == "error" or msg[3] is not None:
            raise RuntimeError(msg[3])
        if not left.get(msg[0]):
            raise RuntimeError(f"unexpected {msg[0]!r} from the transfer's ranks")
        left[msg[0]] -= 1
        got.append(msg)
    return got


def transfer_main(model, repeats, cores, prefill_layout, decode_layout, queue) -> None:
    """``_run_child``'s entry: the measure's figures (or its error) and a tick per point on ``queue``."""
    try:
        queue.put(("done", measure_transfer(model, repeats, cores, prefill_layout, decode_layout,
                                            on_point=lambda: queue.put(("point", None)))))
    except BaseException as e:
        queue.put(("error", f"{type(e).__name__}: {e}"))
