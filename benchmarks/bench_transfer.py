"""KV transfer microbenchmark: pdserve's layer-wise transfer against raw torch.distributed, and
how much of a prefill the overlapped transfer adds.

Two processes on two pinned cores (prefill side on core 0, decode side on core 1), the
``bench`` preset's KV shape (12 layers, 4 KV heads of 64, float32, blocks of 16), prompts
of 512 and 2048 tokens:

* **transfer**: one request's KV through ``PrefillPairs``/``DecodePairs`` (its two processes share this
  host, so the pair moves its messages through shared memory, ``kvtransfer/shm.py``, unless
  ``PDSERVE_KV_TRANSPORT=gloo``; metadata tensor,
  each layer checksummed and sent in runs of at most 512 KiB (``wire.layer_runs``): a run of
  adjacent blocks straight from the cache, as the prefill worker sends it, others gathered into
  staging first (``--block-order scattered``: every run gathered); the receiver's checksum), timed from the first
  ``send_layer`` until both sides hold their bytes and checksum (the decode side the whole
  received KV, the prefill side its completed sends): what the decode worker compares;
* **raw**: the same layer tensors, already contiguous, with plain gloo send/recv (every
  send and receive posted at once, then waited for): the floor for moving these bytes.
  The two alternate, one run each, so the shared machine's changing load hits both alike;
  the ratio is raw / transfer of the medians, with the spread of the per-pair ratios;
* **raw, pdserve's messages**: plain gloo again, each layer cut into the messages pdserve sends
  (``wire.layer_messages``: K and V lie apart in the paged cache, so a layer is two messages at
  least): what the cache layout costs before any of pdserve's own work (third in each turn);
* **own work**: the sending core's share that raw gloo does not have, alone (no wire): the
  gather of every layer's blocks into a staging buffer with their checksum, in one native pass
  (or, without the kernel, ``index_select`` then the torch checksum);
* **exposed transfer**: the prefill forward of the same prompt on the bench model alone,
  then with every layer sent as soon as it is written (``on_layer_done``) and waited for;
  the extra time as a share of the forward alone (the difference of two noisy forwards),
  and the **tail**: from the forward's end until both sides hold bytes and checksum.

    python benchmarks/bench_transfer.py [--tokens 512 2048] [--repeats 5] [--transfer-repeats 20] [--skip-prefill]
        [--block-order adjacent|scattered]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time

import msgspec
import torch

CTX = mp.get_context("spawn")
HOST = "127.0.0.1"
BLOCK_SIZE = 16


def _shape(model_dir: str) -> tuple[int, int, int]:
    with open(os.path.join(model_dir, "config.json")) as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    return cfg["num_hidden_layers"], cfg.get("num_key_value_heads") or heads, cfg["hidden_size"] // heads


def decode_main(ctrl, out, raw_port: int) -> None:
    """Decode side: DecodePairs for the pdserve transfers and a plain gloo rank for the raw ones."""
    os.sched_setaffinity(0, {1 % os.cpu_count()})
    torch.set_num_threads(1)
    import torch.distributed as dist

    from pdserve.common.protocol import KVTransferHeader
    from pdserve.kvtransfer.receiver import DecodePairs, ReceivedKV
    from pdserve.kvtransfer.wire import layer_messages

    def on_received(r) -> None:
        out.put(("received", r.request_id, time.monotonic(), r.num_bytes if isinstance(r, ReceivedKV) else -1))
        if isinstance(r, ReceivedKV):
            pairs.release(r.kv)  # as the decode worker's install does once it copied the KV out

    pairs = DecodePairs("D", HOST, "cpu", 60.0, on_received)
    out.put(("ready", pairs.store_port))
    group, raw_bufs = None, {}
    while True:
        cmd, arg = ctrl.get(timeout=600)
        if cmd == "generation":
            out.put(("generation", pairs.generation_for(arg)))
        elif cmd == "header":
            pairs.submit(msgspec.msgpack.decode(arg, type=KVTransferHeader))
        elif cmd == "raw_connect":
            group = dist.ProcessGroupGloo(dist.TCPStore(HOST, raw_port, 2, False), 1, 2)
        elif cmd == "raw":  # arg: (num_layers, layer shape, split): one transfer, every receive posted at once
            num_layers, shape, split = arg
            bufs = raw_bufs.setdefault(tuple(shape), [torch.empty(shape) for _ in range(num_layers)])
            messages = [m for b in bufs for m in layer_messages(b)] if split else bufs
            for work in [group.recv([m], 0, 0) for m in messages]:
                work.wait()
            out.put(("raw_done", time.monotonic()))
        else:
            break
    pairs.close()


def own_work(kv_cache: torch.Tensor, block_ids: list[int], repeats: int) -> dict:
    """What pdserve adds to raw gloo on the sending core, measured alone (no wire), as the sender does
    it: each layer's blocks gathered into a staging buffer and checksummed in one native pass
    (``BlockGather``), run by run (``wire.layer_runs``, with nothing sent between runs; a run of
    adjacent blocks only checksummed where it lies, as ``send_from_cache`` does), or where
    that kernel is not built, ``index_select`` then the torch checksum. Median seconds for every
    layer: ``gather_s`` (the one pass, or the gather) and ``checksum_s`` (0 for the one pass)."""
    from pdserve.kvtransfer.checksum import BlockGather, KVChecksum
    from pdserve.kvtransfer.sender import direct_runs
    from pdserve.kvtransfer.wire import layer_runs

    index = torch.tensor(block_ids)
    staging = torch.empty((kv_cache.shape[0], 2, len(block_ids), *kv_cache.shape[3:]), dtype=kv_cache.dtype)
    runs = layer_runs(2, len(block_ids), staging[0, 0, 0].nbytes, "cpu")
    direct = direct_runs(kv_cache[0], block_ids, runs)
    gather, checksum = [], []
    for _ in range(repeats + 1):
        sums = KVChecksum()
        t0 = time.monotonic()
        plan = BlockGather.plan(kv_cache[0], index, staging[0])
        for layer in range(kv_cache.shape[0]) if plan is not None else ():
            plan.in_runs(kv_cache[layer], staging[layer], runs, lambda i: None, direct)
        t1 = time.monotonic()
        if plan is None:
            for layer in range(kv_cache.shape[0]):
                torch.index_select(kv_cache[layer], 1, index, out=staging[layer])
            t1 = time.monotonic()
            for layer in range(kv_cache.shape[0]):
                sums.update(staging[layer])
            sums.value
        gather.append(t1 - t0)
        checksum.append(time.monotonic() - t1)
    return {"gather_s": statistics.median(gather[1:]), "checksum_s": statistics.median(checksum[1:])}


def run(args) -> dict:
    from pdserve.common.protocol import KVTransferHeader
    from pdserve.common.utils import free_port
    from pdserve.engine.layers.attention import AttentionMetadata
    from pdserve.engine.execution.kv_cache import allocate_kv_cache
    from pdserve.engine.models.loader import load_model
    from pdserve.kvtransfer.sender import OutgoingKV, PrefillPairs
    from pdserve.kvtransfer.wire import layer_messages
    import torch.distributed as dist

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    num_layers, num_kv_heads, head_dim = _shape(args.model)
    max_blocks = max(args.tokens) // BLOCK_SIZE
    kv_cache = allocate_kv_cache(num_layers, max_blocks + 1, BLOCK_SIZE, num_kv_heads, head_dim, torch.float32, "cpu")
    kv_cache.normal_()
    model = None if args.skip_prefill else load_model(args.model, dtype=torch.float32, device="cpu")
    raw_port = free_port()
    ctrl, out = CTX.Queue(), CTX.Queue()
    d = CTX.Process(target=decode_main, args=(ctrl, out, raw_port), daemon=True)
    d.start()
    results: dict = {}
    try:
        _, store_port = out.get(timeout=60)
        ctrl.put(("generation", "P"))
        _, generation = out.get(timeout=10)
        pairs = PrefillPairs("P", "cpu", 60.0)
        pairs.request_pair("D", HOST, store_port, generation)
        while (pair := pairs.get("D", generation)) is None:
            if pairs.failure("D", generation):
                raise RuntimeError(pairs.failure("D", generation))
            time.sleep(0.01)
        results["transport"] = pair.transport
        ctrl.put(("raw_connect", None))
        group = dist.ProcessGroupGloo(dist.TCPStore(HOST, raw_port, 2, True), 0, 2)
        seq = 0

        def start_request(num_blocks: int, block_ids: list[int]) -> OutgoingKV:
            """The header to D, then the request's OutgoingKV with its meta on the wire, as the prefill
            rank's agent does before the forward."""
            nonlocal seq
            seq += 1
            rid = f"r{seq}"
            header = KVTransferHeader(request_id=rid, prefill_worker_id="P", pair_generation=generation,
                                      num_layers=num_layers, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype="float32",
                                      num_tokens=num_blocks * BLOCK_SIZE)
            ctrl.put(("header", msgspec.msgpack.encode(header)))
            outgoing = OutgoingKV(pair, rid, num_layers, send_from_cache=True)
            outgoing.start(kv_cache[0], block_ids)
            return outgoing

        def pdserve_once(num_blocks: int, block_ids: list[int], nbytes: int) -> float:
            """From the first send_layer until both sides hold their (bytes, checksum): the decode
            worker compares the two before it installs the KV."""
            outgoing = start_request(num_blocks, block_ids)
            time.sleep(0.05)  # the header reaches D first, as in serving
            t0 = time.monotonic()
            for layer in range(num_layers):
                outgoing.send_layer(layer, kv_cache[layer], block_ids)
            outgoing.wait(60)
            t_sent = time.monotonic()
            _, _, t_recv, got = out.get(timeout=60)
            assert got == nbytes, (got, nbytes)
            return max(t_sent, t_recv) - t0

        def raw_once(layers: list[torch.Tensor], split: bool) -> float:
            """Plain gloo: each layer whole (``split`` False: one message, K and V together), or cut into
            the very messages pdserve sends (``wire.layer_messages``: K and V apart, runs of at most 512 KiB)."""
            ctrl.put(("raw", (num_layers, list(layers[0].shape), split)))
            time.sleep(0.05)  # D posts its receives first (it would not matter to gloo)
            messages = [m for t in layers for m in layer_messages(t)] if split else layers
            t0 = time.monotonic()
            for work in [group.send([m], 1, 0) for m in messages]:
                work.wait()
            _, t_done = out.get(timeout=60)
            return t_done - t0

        for tokens in args.tokens:
            num_blocks = tokens // BLOCK_SIZE
            block_ids = list(range(1, num_blocks + 1))
            if args.block_order == "scattered":  # no two neighbours adjacent: every run is gathered
                block_ids = block_ids[0::2] + block_ids[1::2]
            nbytes = num_layers * 2 * num_blocks * BLOCK_SIZE * num_kv_heads * head_dim * 4
            layers = [kv_cache[i][:, 1:num_blocks + 1].contiguous() for i in range(num_layers)]
            # pdserve and raw gloo alternate, so a change in the shared machine's load hits both alike
            times, raw, raw_split = [], [], []
            for _ in range(args.transfer_repeats + 1):
                times.append(pdserve_once(num_blocks, block_ids, nbytes))
                raw.append(raw_once(layers, False))
                raw_split.append(raw_once(layers, True))
            results[tokens] = {"bytes": nbytes, "transfer_s": statistics.median(times[1:]),
                               "raw_s": statistics.median(raw[1:]), "raw_split_s": statistics.median(raw_split[1:]),
                               "messages": sum(len(layer_messages(t)) for t in layers), "layers": num_layers,
                               "ratios": sorted(r / t for r, t in zip(raw[1:], times[1:])),
                               **own_work(kv_cache, block_ids, args.transfer_repeats)}
            if args.skip_prefill:
                continue
            # prefill forward alone, then with each layer sent as it is written
            ids = torch.randint(10, 1000, (tokens,))
            pos = torch.arange(tokens)
            md = AttentionMetadata.build([block_ids], [0], [tokens], BLOCK_SIZE, backend=args.attention)
            alone, overlapped, tail = [], [], []
            for _ in range(args.repeats + 1):
                t0 = time.monotonic()
                with torch.inference_mode():
                    model(ids, pos, kv_cache, md)
                alone.append(time.monotonic() - t0)
                outgoing = start_request(num_blocks, block_ids)
                time.sleep(0.05)
                t0 = time.monotonic()
                with torch.inference_mode():
                    model(ids, pos, kv_cache, md,
                          on_layer_done=lambda i: outgoing.send_layer(i, kv_cache[i], block_ids))
                t_forward = time.monotonic()
                outgoing.wait(60)
                t_sent = time.monotonic()
                _, _, t_recv, _ = out.get(timeout=60)
                overlapped.append(max(t_sent, t_recv) - t0)
                tail.append(max(t_sent, t_recv) - t_forward)
            results[tokens].update(prefill_s=statistics.median(alone[1:]),
                                   prefill_with_transfer_s=statistics.median(overlapped[1:]),
                                   tail_s=statistics.median(tail[1:]))
        pairs.close()
    finally:
        ctrl.put(("stop", None))
        d.join(10)
        if d.is_alive():
            d.kill()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bench preset)")
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--repeats", type=int, default=5, help="prefill forwards (alone and overlapped) per prompt")
    ap.add_argument("--transfer-repeats", type=int, default=20, help="transfers (pdserve and raw) per prompt")
    ap.add_argument("--attention", default="paged", help="paged | reference")
    ap.add_argument("--skip-prefill", action="store_true", help="transfer and raw gloo only (no model forward)")
    ap.add_argument("--block-order", choices=["adjacent", "scattered"], default="adjacent",
                    help="the request's blocks: 1..N (runs sent from the cache) or odd ids then even ones (gathered)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from pdserve.default_model.tiny_model import ensure_default_model

    args.model = args.model or str(ensure_default_model("bench"))
    results = run(args)
    transport = results.pop("transport")
    print(f"pdserve's pair moved its messages through {transport} (PDSERVE_KV_TRANSPORT=gloo keeps it on gloo)")
    print(f"{'prompt':>7} {'KV MiB':>7} {'transfer':>9} {'raw gloo':>9} {'ratio':>6} {'raw split':>10} "
          f"{'prefill':>8} {'+transfer':>10} {'exposed':>8} {'tail':>7}")
    for tokens, r in results.items():
        ratio = r["raw_s"] / r["transfer_s"]
        prefill, both = r.get("prefill_s", float("nan")), r.get("prefill_with_transfer_s", float("nan"))
        exposed = (both - prefill) / prefill
        print(f"{tokens:7d} {r['bytes'] / 2**20:7.1f} {r['transfer_s'] * 1e3:7.1f}ms "
              f"{r['raw_s'] * 1e3:7.1f}ms {ratio:6.2f} {r['raw_split_s'] * 1e3:8.1f}ms {prefill * 1e3:6.0f}ms "
              f"{both * 1e3:8.0f}ms {exposed:8.1%} {r.get('tail_s', float('nan')) * 1e3:5.1f}ms")
        r.update(ratio_to_raw=ratio, exposed_share=exposed)
    for tokens, r in results.items():  # per-repeat ratios (raw / pdserve of adjacent runs): the spread
        q = r["ratios"]
        print(f"ratio to raw gloo at {tokens} tokens: {r['ratio_to_raw']:.2f} (medians); per pair of runs "
              f"min {q[0]:.2f}, median {statistics.median(q):.2f}, max {q[-1]:.2f}; own work on the "
              f"sending core: gather (for runs sent from the cache: checksum alone) {r['gather_s'] * 1e3:.1f} ms, "
              f"torch checksum {r['checksum_s'] * 1e3:.1f} ms")
        print(f"  raw gloo in pdserve's {r['messages']} messages against {r['layers']} whole layers: "
              f"{r['raw_s'] / r['raw_split_s']:.2f}x; the transfer against raw gloo in its messages: "
              f"{r['raw_split_s'] / r['transfer_s']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
