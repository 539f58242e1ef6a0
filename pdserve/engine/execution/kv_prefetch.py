"""Reading a prefix hit's tier blocks into the KV cache off the step loop (prefetch).

A hit that reaches the disk tier costs a file read and a checksum per block: hundreds of
microseconds to milliseconds each, far more than a host-memory copy. Read in the step, they stall
every request of the batch. Instead the scheduler leaves such a request waiting, the block manager
gives its tier blocks fresh KV cache blocks (``BlockManager.start_prefetch``), and this reader thread
copies them in (disk reads, and the host-tier blocks of the same hit) while the steps go on computing
the other requests; when it is done the blocks enter the prefix cache and the request is admitted
with them as ordinary hits (SGLang HiCache's prefetch; vLLM's offloading connector also loads
asynchronously).

What makes this safe: the destination blocks belong to the prefetch alone (allocated, not cached, so
no step's request reads or writes them), the source slots are held (no offload or spill takes them
until the prefetch ends), and the copies are handed here only after the step's own tier copies ran
(the allocation that gave the blocks may have queued a copy out of one of them). One rank only: a
tensor-parallel worker's ranks would have to agree on when each read ended, so they load in the step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from pdserve.common.protocol import TierOp, TierOpKind
from pdserve.engine.execution.kv_disk import CorruptKVFile, DiskKVStore

logger = logging.getLogger(__name__)


class TierPrefetcher:
    """One thread that runs prefetches' copies in order and reports each prefetch when it is done.

    Args:
        kv_cache: the KV cache [layers, kv_slots, num_blocks, block_size, kv_heads, head_dim].
        offload_cache: the host tier's blocks (the KV cache's layout), or None.
        disk: the disk tier's files.
    """

    def __init__(self, kv_cache: torch.Tensor, offload_cache: torch.Tensor | None, disk: DiskKVStore):
        self.kv_cache = kv_cache
        self.offload_cache = offload_cache
        self.disk = disk
        self._todo: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self.in_flight = 0  # prefetches started and not yet collected by ``finished``
        self._thread = threading.Thread(target=self._run, name="kv-prefetch", daemon=True)
        self._thread.start()

    def start(self, prefetch_id: int, ops: list[TierOp]) -> None:
        """Queue one prefetch's copies (ONLOAD: host slot -> block, LOAD: disk slot -> block)."""
        self.in_flight += 1
        self._todo.put((prefetch_id, ops))

    def finished(self, timeout_s: float = 0.0) -> list[tuple[int, list[bool], dict[TierOpKind, list]]]:
        """The prefetches done since the last call: (id, per block whether it was read, kind -> [blocks,
        seconds]). Waits up to ``timeout_s`` for the first when none is done yet."""
        out = []
        try:
            out.append(self._done.get(timeout=timeout_s) if timeout_s > 0 else self._done.get_nowait())
            while True:
                out.append(self._done.get_nowait())
        except queue.Empty:
            pass
        self.in_flight -= len(out)
        return out

    def close(self) -> None:
        """Finish what is queued and stop the thread."""
        if self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()

    @torch.inference_mode()
    def _run(self) -> None:
        while (item := self._todo.get()) is not None:
            prefetch_id, ops = item
            ok: list[bool] = []
            timings: dict[TierOpKind, list] = {}
            for op in ops:
                start = time.perf_counter()
                try:
                    if op.kind == TierOpKind.LOAD:
                        self.disk.read(op.src, op.key, self.kv_cache[:, :, op.dst])
                    else:
                        self.kv_cache[:, :, op.dst].copy_(self.offload_cache[:, :, op.src])
                except CorruptKVFile as e:  # recomputed, never served
                    logger.warning("disk KV tier: %s; the block will be recomputed", e)
                    self.disk.num_corrupt += 1
                    ok += [False] * (len(ops) - len(ok))
                    break
                entry = timings.setdefault(op.kind, [0, 0.0])
                entry[0] += 1
                entry[1] += time.perf_counter() - start
                ok.append(True)
            self._done.put((prefetch_id, ok, timings))
