"""A disaggregated request's first token leaves the decode worker as soon as its KV is verified.

The decode worker's step loop handles its inbox between steps. A request whose last KV piece and
``RemotePrefillDone`` arrive while a step is in flight used to wait for that step's end (a decode
step, or a whole local prefill) before its first token went back: at 1 req/s that wait was most of
the ``kv_transfer`` hop (p50 10 ms, mean 26 ms, issue 23). ``FirstTokenWatch`` sees the same
messages on the mailbox's threads as they arrive (``Mailbox.tap``): each piece's header, the rank
reports that a piece was received (bytes, checksum) and the prefill worker's done message (first
token, per-piece sums). When every piece's header says what the step loop's check wants (worked out
when the request was sent to the prefill worker: its blocks do not change while it waits) and every
piece's sums match, it sends the first token to the request's router at once. (A single-rank
decode worker also hands each header to its lane from the tap, so a piece is received while a step
runs; a multi-rank one hands headers to its ranks between steps.) The step loop still installs the
KV and admits the request at its next step, as before, and leaves the first token out of that
delta (``claim``). Splitwise and DistServe likewise stream the token the prompt phase sampled while
the KV is on its way.

Only the step loop ever sends tokens after the first, and the first token sent early is always the
one it appends (the done message's), so the stream is the same either way. A request is watched
only when its first delta can carry nothing but that token: one choice, no logprobs, no prompt
logprobs, more than one token to generate. A request the step loop fails or aborts is forgotten
(``forget``) before it could be sent; once sent, the step loop no longer expires its deadline
(``withdraw``): everything it waits for is already in its inbox.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

import msgspec

from pdserve.common.protocol import (KVTransferHeader, RankReport, RankReportKind, RemotePrefillDone, RequestDelta,
                                     RequestOutputs, RequestTiming, SamplingParams)


def header_fields(header: KVTransferHeader) -> tuple:
    """What a decode worker checks in a piece's header against the request it names: layers, KV heads,
    blocks, blocks per layer, block size, head dim, dtype, KV slots, the prompt's tokens and its first
    block sent (``DecodeWorker._wanted_header``). Each layer's blocks are its logical blocks [the prompt's
    last block + 1 - its count, the prompt's last block], so the tokens, the counts and the first block
    name every layer's blocks: a piece that would fill other blocks than a layer's window wants is
    refused before any byte is installed."""
    return (header.first_layer, header.num_layers, header.first_kv_head, header.num_kv_heads, header.num_blocks,
            header.layer_num_blocks, header.block_size, header.head_dim, header.dtype, header.kv_slots,
            header.num_tokens, header.first_block)


def watchable(params: SamplingParams) -> bool:
    """Whether a request's first delta can go early: one choice, no logprobs of any kind, and more
    than one token to generate (a first token that also ends the request goes with its finish)."""
    return params.n == 1 and params.logprobs is None and params.prompt_logprobs is None and params.max_tokens > 1


@dataclasses.dataclass
class _Watched:
    router_addr: str
    headers: dict[tuple[int, int], tuple]  # (prefill rank, decode rank) of every piece -> its header_fields
    num_prompt_tokens: int
    num_cached_tokens: int
    timing: RequestTiming | None
    headers_ok: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    received: dict[tuple[int, int], tuple[int, int]] = dataclasses.field(default_factory=dict)  # -> (bytes, sum)
    done: RemotePrefillDone | None = None
    sent: bool = False
    spoiled: bool = False  # a header failed its check, a piece failed or its sums differ: the step loop decides


class FirstTokenWatch:
    """The decode worker's early first tokens (module docstring).

    ``send(addr, msg)`` queues a message for a router (``Mailbox.put``: thread-safe, in order per
    peer). ``observe`` runs on the mailbox's threads; every other method on the step loop's.
    """

    def __init__(self, worker_id: str, send: Callable[[str, RequestOutputs], None]):
        self.worker_id = worker_id
        self._send = send
        self._lock = threading.Lock()
        self._watched: dict[str, _Watched] = {}

    def expect(self, request_id: str, router_addr: str, headers: dict[tuple[int, int], tuple], num_prompt_tokens: int,
               num_cached_tokens: int, timing: RequestTiming | None) -> None:
        """Watch ``request_id``, whose RemotePrefillRequest is about to be sent (so no piece of it has
        arrived yet). ``headers``: for each piece (prefill rank, decode rank), the ``header_fields`` its
        header must have (the step loop's own check); ``timing``: its stamps so far (a copy is sent
        with the token)."""
        entry = _Watched(router_addr, dict(headers), num_prompt_tokens, num_cached_tokens,
                         msgspec.structs.replace(timing) if timing is not None else None)
        with self._lock:
            self._watched[request_id] = entry

    def observe(self, msg) -> None:
        """A message on its way to the inbox (mailbox threads): a piece's header, the piece received, or
        the done message."""
        if isinstance(msg, KVTransferHeader):
            request_id, piece = msg.request_id, (msg.prefill_rank, msg.decode_rank)
        elif isinstance(msg, RankReport):
            if msg.kind != RankReportKind.RECEIVED or msg.request_id is None:
                return
            request_id, piece = msg.request_id, (int(msg.peer.rpartition("#")[2]), msg.rank)
        elif isinstance(msg, RemotePrefillDone):
            request_id = msg.request_id
        else:
            return
        with self._lock:
            entry = self._watched.get(request_id)
            if entry is None or entry.sent or entry.spoiled:
                return
            if isinstance(msg, KVTransferHeader):
                if entry.headers.get(piece) == header_fields(msg):
                    entry.headers_ok.add(piece)
                else:  # the step loop's own check fails it over
                    entry.spoiled = True
            elif isinstance(msg, RemotePrefillDone):
                entry.done = msg
                entry.spoiled = msg.error is not None or msg.first_token_id is None
            elif msg.error is not None:
                entry.spoiled = True
            else:
                entry.received[piece] = (msg.num_bytes, msg.checksum)
            if entry.spoiled or not self._complete(entry):
                return
            entry.sent = True
        self._send_first_token(request_id, entry)

    @staticmethod
    def _complete(entry: _Watched) -> bool:
        """Every piece's header checked and piece received, the done message in, and the sums agree
        (else the entry is spoiled and the step loop fails the transfer as before)."""
        if entry.done is None or entry.headers_ok != set(entry.headers) or set(entry.received) != set(entry.headers):
            return False
        sent = {(s.prefill_rank, s.decode_rank): (s.num_bytes, s.checksum) for s in entry.done.pieces}
        if any(sent.get(piece) != got for piece, got in entry.received.items()):  # (the step loop says why)
            entry.spoiled = True
            return False
        return True

    def _send_first_token(self, request_id: str, entry: _Watched) -> None:
        timing = entry.timing
        if timing is not None:
            timing.kv_installed = time.time()  # every piece and the done message checked
            if (sent := entry.done.timing) is not None:
                timing.prefill_received = sent.prefill_received
                timing.prefill_started, timing.prefill_done = sent.prefill_started, sent.prefill_done
        delta = RequestDelta(request_id=request_id, new_token_ids=[entry.done.first_token_id],
                             num_prompt_tokens=entry.num_prompt_tokens, num_cached_tokens=entry.num_cached_tokens,
                             timing=timing)
        self._send(entry.router_addr, RequestOutputs(worker_id=self.worker_id, deltas=[delta]))

    def claim(self, request_id: str) -> bool:
        """The step loop admitted the request: stop watching it; True if its first token was sent early
        (the step loop then leaves that token, and the stamps, out of its delta)."""
        with self._lock:
            entry = self._watched.pop(request_id, None)
        return entry is not None and entry.sent

    def withdraw(self, request_id: str) -> bool:
        """Stop watching ``request_id`` unless its first token is out. True: the step loop may still fail
        it over (recompute or error); False: the token went, and the rest of its KV is in the inbox."""
        with self._lock:
            entry = self._watched.get(request_id)
            if entry is not None and entry.sent:
                return False
            self._watched.pop(request_id, None)
            return True

    def forget(self, request_id: str) -> None:
        """Stop watching a request the step loop failed over, aborted or prefilled itself."""
        with self._lock:
            self._watched.pop(request_id, None)
