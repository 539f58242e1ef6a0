"""KV transfer microbenchmark: pdserve's layer-wise transfer against raw torch.distributed, and
how much of a prefill the overlapped transfer adds.

Two processes on two pinned cores (prefill side on core 0, decode side on core 1), the
``bench`` preset's KV shape (12 layers, 4 KV heads of 64, float32, blocks of 16), prompts
of 512 and 2048 tokens:

* **transfer**: one request's KV through ``PrefillPairs``/``DecodePairs`` (metadata tensor,
  one gather + send per layer, the receiver's checksum), timed from the first
  ``send_layer`` until the decode side holds the whole checked KV;
* **raw**: the same layer tensors, already contiguous, with plain gloo send/recv (every
  send and receive posted at once, then waited for): the floor for moving these bytes;
* **exposed transfer**: the prefill forward of the same prompt on the bench model alone,
  then with every layer sent as soon as it is written (``on_layer_done``) and waited for;
  the extra time as a share of the forward alone.

    python benchmarks/bench_transfer.py [--tokens 512 2048] [--repeats 5]
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
    """Decode side: DecodePairs for the pdserve transfers, then a gloo rank for the raw ones."""
    os.sched_setaffinity(0, {1 % os.cpu_count()})
    torch.set_num_threads(1)
    from pdserve.common.protocol import KVTransferHeader
    from pdserve.kvtransfer.receiver import DecodePairs, ReceivedKV

    pairs = DecodePairs("D", HOST, "cpu", 60.0,
                        lambda r: out.put(("received", r.request_id, time.monotonic(),
                                           r.num_bytes if isinstance(r, ReceivedKV) else -1)))
    out.put(("ready", pairs.store_port))
    while True:
        cmd, arg = ctrl.get(timeout=600)
        if cmd == "generation":
            out.put(("generation", pairs.generation_for(arg)))
        elif cmd == "header":
            pairs.submit(msgspec.msgpack.decode(arg, type=KVTransferHeader))
        elif cmd == "raw":  # arg: (num_layers, [layer shape per size], repeats)
            num_layers, shapes, repeats = arg
            import torch.distributed as dist

            store = dist.TCPStore(HOST, raw_port, 2, False)
            group = dist.ProcessGroupGloo(store, 1, 2)
            for shape in shapes:
                bufs = [torch.empty(shape) for _ in range(num_layers)]
                for _ in range(repeats + 1):  # every receive posted at once, as pdserve's receiver does
                    for work in [group.recv([b], 0, 0) for b in bufs]:
                        work.wait()
                    out.put(("raw_done", time.monotonic()))
        else:
            break
    pairs.close()


def run(args) -> dict:
    from pdserve.common.protocol import KVTransferHeader
    from pdserve.common.utils import free_port
    from pdserve.engine.attention import AttentionMetadata
    from pdserve.engine.kv_cache import allocate_kv_cache
    from pdserve.engine.loader import load_model
    from pdserve.kvtransfer.sender import OutgoingKV, PrefillPairs
    import torch.distributed as dist

    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    num_layers, num_kv_heads, head_dim = _shape(args.model)
    max_blocks = max(args.tokens) // BLOCK_SIZE
    kv_cache = allocate_kv_cache(num_layers, max_blocks + 1, BLOCK_SIZE, num_kv_heads, head_dim, torch.float32, "cpu")
    kv_cache.normal_()
    model = load_model(args.model, dtype=torch.float32, device="cpu")
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
        seq = 0

        def start_request(num_blocks: int) -> OutgoingKV:
            nonlocal seq
            seq += 1
            rid = f"r{seq}"
            header = KVTransferHeader(request_id=rid, prefill_worker_id="P", pair_generation=generation,
                                      num_layers=num_layers, num_blocks=num_blocks, block_size=BLOCK_SIZE,
                                      num_kv_heads=num_kv_heads, head_dim=head_dim, dtype="float32",
                                      num_tokens=num_blocks * BLOCK_SIZE)
            ctrl.put(("header", msgspec.msgpack.encode(header)))
            return OutgoingKV(pair, rid, num_layers)

        for tokens in args.tokens:
            num_blocks = tokens // BLOCK_SIZE
            block_ids = list(range(1, num_blocks + 1))
            nbytes = num_layers * 2 * num_blocks * BLOCK_SIZE * num_kv_heads * head_dim * 4
            # pdserve transfer
            times = []
            for _ in range(args.repeats + 1):
                outgoing = start_request(num_blocks)
                time.sleep(0.05)  # the header reaches D first, as in serving
                t0 = time.monotonic()
                for layer in range(num_layers):
                    outgoing.send_layer(layer, kv_cache[layer], block_ids)
                outgoing.wait(60)
                kind, _, t_recv, got = out.get(timeout=60)
                assert got == nbytes, (got, nbytes)
                times.append(t_recv - t0)
            transfer = statistics.median(times[1:])
            # prefill forward alone, then with each layer sent as it is written
            ids = torch.randint(10, 1000, (tokens,))
            pos = torch.arange(tokens)
            md = AttentionMetadata.build([block_ids], [0], [tokens], BLOCK_SIZE, backend=args.attention)
            alone, overlapped = [], []
            for _ in range(args.repeats + 1):
                t0 = time.monotonic()
                with torch.inference_mode():
                    model(ids, pos, kv_cache, md)
                alone.append(time.monotonic() - t0)
                outgoing = start_request(num_blocks)
                time.sleep(0.05)
                t0 = time.monotonic()
                with torch.inference_mode():
                    model(ids, pos, kv_cache, md,
                          on_layer_done=lambda i: outgoing.send_layer(i, kv_cache[i], block_ids))
                outgoing.wait(60)
                _, _, t_recv, _ = out.get(timeout=60)
                overlapped.append(t_recv - t0)
            results[tokens] = {"bytes": nbytes, "transfer_s": transfer, "prefill_s": statistics.median(alone[1:]),
                               "prefill_with_transfer_s": statistics.median(overlapped[1:])}
        pairs.close()
        # raw gloo send/recv of the same layers
        shapes = [(2, tokens // BLOCK_SIZE, BLOCK_SIZE, num_kv_heads, head_dim) for tokens in args.tokens]
        ctrl.put(("raw", (num_layers, shapes, args.repeats)))
        store = dist.TCPStore(HOST, raw_port, 2, True)
        group = dist.ProcessGroupGloo(store, 0, 2)
        for tokens in args.tokens:
            num_blocks = tokens // BLOCK_SIZE
            layers = [kv_cache[i][:, 1:num_blocks + 1].contiguous() for i in range(num_layers)]
            times = []
            for _ in range(args.repeats + 1):
                t0 = time.monotonic()
                for work in [group.send([t], 1, 0) for t in layers]:
                    work.wait()
                _, t_done = out.get(timeout=60)
                times.append(t_done - t0)
            results[tokens]["raw_s"] = statistics.median(times[1:])
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
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--attention", default="paged", help="paged | reference")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from pdserve.models.tiny_model import ensure_default_model

    args.model = args.model or str(ensure_default_model("bench"))
    results = run(args)
    print(f"{'prompt':>7} {'KV MiB':>7} {'transfer':>9} {'raw gloo':>9} {'ratio':>6} {'prefill':>8} "
          f"{'+transfer':>10} {'exposed':>8}")
    for tokens, r in results.items():
        ratio = r["raw_s"] / r["transfer_s"] if "raw_s" in r else float("nan")
        exposed = (r["prefill_with_transfer_s"] - r["prefill_s"]) / r["prefill_s"]
        print(f"{tokens:7d} {r['bytes'] / 2**20:7.1f} {r['transfer_s'] * 1e3:7.1f}ms "
              f"{r.get('raw_s', float('nan')) * 1e3:7.1f}ms {ratio:6.2f} {r['prefill_s'] * 1e3:6.0f}ms "
              f"{r['prefill_with_transfer_s'] * 1e3:8.0f}ms {exposed:8.1%}")
        r.update(ratio_to_raw=ratio, exposed_share=exposed)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
