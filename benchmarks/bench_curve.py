"""What CurveZMQ costs a ``Mailbox``: latency and throughput with and without a cluster secret.

Two processes on loopback, each with a ``Mailbox`` (the worker's ZMQ endpoint:
PULL socket, PUSH sockets, IO threads, queues), as two workers or a worker and
the router talk. For each mode (plain TCP, CURVE under a cluster secret) and each
message (real protocol messages: a one-token ``RequestOutputs`` as a decode worker
streams, a ``GenerateRequest`` with a 1,024-token prompt as the router sends):

* **round trip**: A puts a message for B, B's loop gets it and puts it back, A
  gets it; one at a time, ``--num-round-trips`` of them (median and p99).
* **throughput**: A puts ``--num-messages`` messages for B as fast as its
  sender thread takes them; B counts them and answers the last one (messages/s
  and payload MB/s, from A's first put to the answer).
* **first message**: a fresh ``PushSocket`` connecting and delivering one
  message (TCP connect plus, with CURVE, the handshake and the ZAP check).

    taskset -c 1 python benchmarks/bench_curve.py            # the figures in docs/benchmarks.md
    python benchmarks/bench_curve.py --num-messages 5000      # quick
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

from pdserve.common.curve import cluster_keys
from pdserve.common.protocol import (AbortRequest, GenerateRequest, RequestDelta, RequestOutputs,
                                     SamplingParams)
from pdserve.common.transport import Mailbox, PushSocket, encode

HOST = "127.0.0.1"
SECRET = "bench-cluster-secret"


def messages() -> dict[str, object]:
    return {
        "RequestOutputs, 1 token": RequestOutputs(worker_id="decode-0", deltas=[RequestDelta(
            request_id="0123456789abcdef0123456789abcdef", new_token_ids=[1234])]),
        "GenerateRequest, 1024-token prompt": GenerateRequest(
            request_id="0123456789abcdef0123456789abcdef", prompt_token_ids=list(range(1000, 2024)),
            sampling_params=SamplingParams(max_tokens=128)),
    }


def _peer(secret: str | None, addr_out, stop) -> None:
    """Process B: echo every message back to its sender, except during a throughput run (count, answer the
    last). A's address comes as the first message's ``request_id`` (an ``AbortRequest``)."""
    box = Mailbox(HOST, keys=cluster_keys(secret))
    addr_out.put(box.address)
    back = box.get(timeout=30).request_id
    box.put(back, AbortRequest(request_id="ready"))
    counting = 0
    while not stop.is_set():
        msg = box.get(timeout=0.1)
        if msg is None:
            continue
        if isinstance(msg, AbortRequest) and msg.request_id.startswith("count:"):
            counting = int(msg.request_id.split(":")[1])  # the next ``counting`` messages are counted, not echoed
            continue
        if counting:
            counting -= 1
            if counting == 0:
                box.put(back, AbortRequest(request_id="counted"))
            continue
        box.put(back, msg)
    box.close()


def run_mode(secret: str | None, num_round_trips: int, num_messages: int, num_connects: int) -> dict:
    ctx = mp.get_context("spawn")
    addr_q, stop = ctx.Queue(), ctx.Event()
    peer = ctx.Process(target=_peer, args=(secret, addr_q, stop), daemon=True)
    peer.start()
    keys = cluster_keys(secret)
    box = Mailbox(HOST, keys=keys)
    results: dict = {}
    try:
        peer_addr = addr_q.get(timeout=60)
        box.put(peer_addr, AbortRequest(request_id=box.address))
        assert box.get(timeout=30).request_id == "ready"
        for name, msg in messages().items():
            size = len(encode(msg)[1]) + 1
            for _ in range(50):  # warm
                box.put(peer_addr, msg)
                box.get(timeout=10)
            rtts = []
            for _ in range(num_round_trips):
                t0 = time.perf_counter()
                box.put(peer_addr, msg)
                box.get(timeout=10)
                rtts.append(time.perf_counter() - t0)
            rtts.sort()
            box.put(peer_addr, AbortRequest(request_id=f"count:{num_messages}"))
            t0 = time.perf_counter()
            for _ in range(num_messages):
                box.put(peer_addr, msg)
            answer = box.get(timeout=300)
            elapsed = time.perf_counter() - t0
            assert isinstance(answer, AbortRequest) and answer.request_id == "counted", answer
            results[name] = {"bytes": size, "rtt_median_us": statistics.median(rtts) * 1e6,
                             "rtt_p99_us": rtts[int(0.99 * (len(rtts) - 1))] * 1e6,
                             "msgs_per_s": num_messages / elapsed, "mb_per_s": num_messages * size / elapsed / 1e6}
        connects = []
        for _ in range(num_connects):  # a fresh connection: TCP, and with CURVE the handshake and ZAP
            t0 = time.perf_counter()
            sock = PushSocket(peer_addr, keys=keys)
            sock.send(AbortRequest(request_id="ping"))
            box.get(timeout=10)
            connects.append(time.perf_counter() - t0)
            sock.close()
        results["first message on a new connection"] = {"median_us": statistics.median(connects) * 1e6}
    finally:
        stop.set()
        peer.join(timeout=10)
        if peer.is_alive():
            peer.kill()
        box.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-round-trips", type=int, default=2000)
    parser.add_argument("--num-messages", type=int, default=50_000)
    parser.add_argument("--num-connects", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each mode, alternating; each figure is the median over them")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {"plain": [], "curve": []}
    for _ in range(args.repeats):  # alternate, so a noisy neighbour's burst does not land on one mode only
        for mode, secret in (("plain", None), ("curve", SECRET)):
            runs[mode].append(run_mode(secret, args.num_round_trips, args.num_messages, args.num_connects))
    out = {mode: {name: {key: statistics.median(run[name][key] for run in mode_runs) for key in mode_runs[0][name]}
                  for name in mode_runs[0]} for mode, mode_runs in runs.items()}
    print(f"{'message':38} {'mode':6} {'bytes':>6} {'RTT med us':>10} {'RTT p99 us':>10} {'msg/s':>9} {'MB/s':>7}")
    for name in messages():
        for mode in out:
            r = out[mode][name]
            print(f"{name:38} {mode:6} {r['bytes']:6.0f} {r['rtt_median_us']:10.0f} {r['rtt_p99_us']:10.0f} "
                  f"{r['msgs_per_s']:9.0f} {r['mb_per_s']:7.1f}")
    print(f"(medians of {args.repeats} alternating runs)")
    for mode in out:
        print(f"first message on a new connection, {mode}: "
              f"{out[mode]['first message on a new connection']['median_us']:.0f} us (median)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
