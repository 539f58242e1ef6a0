"""The disk tier's files (``--kv-offload-disk PATH:SIZE``): one file a slot, safe across restarts.

The index is ``pdserve.engine.scheduling.kv_offload.OffloadTier`` (medium ``disk``); this module holds
the bytes. A slot's file ``<PATH>/<fingerprint>/<slot>.kv`` is one KV block as the host tier holds it
(every layer, K and V), after a header:

    magic b"PDKV\\x01" | fingerprint: 8 bytes | key: 2-byte length + bytes | tokens: 4-byte count +
    int64 each | payload: 8-byte length | SHA-256 of the payload, first 16 bytes

Workers sharing ``PATH`` (``pdserve up`` gives every worker the same flags) each take a directory of
their own, ``<PATH>/<fingerprint>/<n>``: the first ``n`` whose lock file no live process holds
(``flock``, released by the kernel however the holder dies). A restarted worker so finds the directory
its predecessor left, while the others keep theirs.

``fingerprint`` names everything that makes two blocks of equal tokens hold different KV: the model
(its path and config, dtype, KV dtype, quantization: the prefix cache's salt; its weight files' names,
sizes and modification times), the block size and the KV layout (layers, KV heads, head size, K/V or
latent rows, rank). LoRA adapters are keyed by name and path, not by their weights, so a worker with
``--enable-lora`` keeps no disk tier. It is the directory's name, and
each header repeats it. So another model, or this one under another layout, never reads these files
(SGLang served KV written by other weights sharing a model name; here the name is not the key).

A file is written to ``<slot>.kv.tmp`` and renamed over ``<slot>.kv``, so a worker killed mid-write
(SIGKILL included) leaves the old file or the new one, never half of one; a stray ``.tmp`` is removed
at start. At start (warm restart) ``DiskKVStore.scan`` reads every file, checks its header and its
payload's checksum, and hands back the blocks to index; a truncated or corrupt file is deleted and its
block recomputed when next needed, never served (LMCache's disk index, lost at every restart, is what
users asked to keep). A file that fails its check when read during serving raises
``CorruptKVFile``: the step fails and its requests get an error rather than wrong KV.

Writes run off the step loop (SGLang HiCache's write-back, LMCache's async store): ``write`` takes the
block's bytes (a memory copy, in the step) and a writer thread hashes and writes the file while the
next steps compute (hashlib and file IO let go of the GIL). Until its file is in place a block is read
back from those bytes; writes run in the order queued, so a slot written twice ends with the second.
A worker killed with writes pending loses only those blocks: its next life indexes what is on disk.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import pathlib
import queue
import struct
import threading
import time

import torch

from pdserve.common import faults

logger = logging.getLogger(__name__)

MAGIC = b"PDKV\x01"


class CorruptKVFile(RuntimeError):
    """A disk tier file that does not hold what its index says (truncated, corrupt, or another block's)."""


def weight_files_id(model_dir: str) -> str:
    """The model's weight files as they are on disk: each one's name, size and modification time (cheap
    to read at every start; a checkpoint replaced in place changes it)."""
    files = sorted(p for pattern in ("*.safetensors", "*.bin", "*.pt") for p in pathlib.Path(model_dir).glob(pattern))
    return ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)


def disk_fingerprint(salt: int, weights: str, block_size: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                     rank: int) -> bytes:
    """8 bytes naming what a block's KV depends on besides its tokens (module docstring): the prefix
    cache's ``salt``, the weight files (``weight_files_id``), the block's size, shape and dtype, the rank."""
    text = f"{salt}|{weights}|{block_size}|{tuple(block_shape)}|{dtype}|{rank}".encode()
    return hashlib.sha256(text).digest()[:8]


class DiskKVStore:
    """The disk tier's files under ``root/<fingerprint hex>``, each one block of ``block_shape``.

    Args:
        root: the directory (created if missing); this store takes the first free ``root/<fp>/<n>``.
        fingerprint: ``disk_fingerprint`` of this worker.
        block_shape: one block's KV, e.g. [num_layers, kv_slots, block_size, num_kv_heads, head_dim].
        dtype: the KV cache's storage dtype.
        capacity: slots; files of slots past it are removed at start.
    """

    _MAX_SHARERS = 256

    def __init__(self, root: str, fingerprint: bytes, block_shape: tuple[int, ...], dtype: torch.dtype,
                 capacity: int):
        self._lock = None
        for n in range(self._MAX_SHARERS):
            self.dir = pathlib.Path(root) / fingerprint.hex() / str(n)
            self.dir.mkdir(parents=True, exist_ok=True)
            lock = open(self.dir / "lock", "a")
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                lock.close()
                continue
            self._lock = lock
            break
        else:
            raise RuntimeError(f"{root}: {self._MAX_SHARERS} live workers already use this disk tier path")
        self.fingerprint = fingerprint
        self.block_shape = tuple(block_shape)
        self.dtype = dtype
        self.capacity = capacity
        self.payload_bytes = torch.empty(self.block_shape, dtype=dtype).numel() * dtype.itemsize
        self.num_corrupt = 0  # files found bad (at start or when read)
        self.write_seconds = 0.0  # the writer thread's wall time, hashing and writing files
        self.num_written = 0  # files it wrote
        self._pending: dict[int, tuple] = {}  # slot -> (key, tokens, payload) queued, its file not yet in place
        self._pending_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def flush(self) -> None:
        """Wait until every write queued so far is on disk."""
        self._queue.join()

    def close(self) -> None:
        """Finish the queued writes, stop the writer and let another process take this directory (a
        process that dies lets go of it too)."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def discard(self, slot: int) -> None:
        """Remove slot ``slot``'s file (a block the index will not hold)."""
        self.path(slot).unlink(missing_ok=True)

    def path(self, slot: int) -> pathlib.Path:
        return self.dir / f"{slot}.kv"

    def write(self, slot: int, key: bytes, tokens: tuple[int, ...], block: torch.Tensor) -> None:
        """Store one block (``block_shape``, any strides) as slot ``slot``'s file: its bytes are taken
        now, the file is written atomically by the writer thread."""
        entry = (key, tuple(tokens), block.contiguous().view(torch.uint8).numpy().tobytes())
        with self._pending_lock:
            self._pending[slot] = entry
        self._queue.put((slot, entry))

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            slot, entry = item
            start = time.perf_counter()
            try:
                self._write_file(slot, *entry)
            except Exception as e:  # noqa: BLE001 (the writer must not die) the index still names the block:
                # reading it fails its check, it is never served
                logger.warning("disk KV tier: could not write %s: %s", self.path(slot), e)
            with self._pending_lock:
                if self._pending.get(slot) is entry:
                    del self._pending[slot]
            self.write_seconds += time.perf_counter() - start
            self.num_written += 1
            self._queue.task_done()
        self._queue.task_done()

    def _write_file(self, slot: int, key: bytes, tokens: tuple[int, ...], payload: bytes) -> None:
        header = (MAGIC + self.fingerprint + struct.pack("<H", len(key)) + key + struct.pack("<I", len(tokens))
                  + struct.pack(f"<{len(tokens)}q", *tokens) + struct.pack("<Q", len(payload))
                  + hashlib.sha256(payload).digest()[:16])
        tmp = self.path(slot).with_suffix(".kv.tmp")
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(payload)
        os.replace(tmp, self.path(slot))

    def _read(self, path: pathlib.Path) -> tuple[bytes, tuple[int, ...], bytes]:
        """(key, tokens, payload) of a file whose header and checksum hold; raises CorruptKVFile."""
        try:
            data = path.read_bytes()
            if not data.startswith(MAGIC) or data[5:13] != self.fingerprint:
                raise CorruptKVFile(f"{path}: not a KV block file of this model and layout")
            pos = 13
            (key_len,) = struct.unpack_from("<H", data, pos)
            key = data[pos + 2:pos + 2 + key_len]
            pos += 2 + key_len
            (num_tokens,) = struct.unpack_from("<I", data, pos)
            tokens = struct.unpack_from(f"<{num_tokens}q", data, pos + 4)
            pos += 4 + 8 * num_tokens
            (size,) = struct.unpack_from("<Q", data, pos)
            digest = data[pos + 8:pos + 24]
            payload = data[pos + 24:]
        except (OSError, struct.error) as e:
            raise CorruptKVFile(f"{path}: {e}") from e
        if size != self.payload_bytes or len(payload) != size or hashlib.sha256(payload).digest()[:16] != digest:
            raise CorruptKVFile(f"{path}: truncated or corrupt (checksum)")
        return key, tokens, payload

    def read(self, slot: int, key: bytes, out: torch.Tensor) -> None:
        """Copy slot ``slot``'s block into ``out`` (``block_shape``), checking it is block ``key``.

        Raises:
            CorruptKVFile: the file is missing, truncated, corrupt or holds another block."""
        with self._pending_lock:
            entry = self._pending.get(slot)
        if entry is not None:  # its file is still being written: the bytes it was given
            got, _, payload = entry
        else:
            faults.disk_read_delay()
            got, _, payload = self._read(self.path(slot))
        if got != key:
            raise CorruptKVFile(f"{self.path(slot)} holds another block")
        out.copy_(torch.frombuffer(bytearray(payload), dtype=self.dtype).view(self.block_shape))

    def scan(self) -> list[tuple[int, bytes, tuple[int, ...]]]:
        """Every good file's (slot, key, tokens), for the index at start; bad and stray files are removed."""
        found, keys = [], set()
        for path in sorted(self.dir.iterdir()):
            name = path.name
            if name == "lock":
                continue
            if name.endswith(".kv.tmp") or not name.endswith(".kv") or not name[:-3].isdigit():
                path.unlink(missing_ok=True)
                continue
            slot = int(name[:-3])
            try:
                key, tokens, _ = self._read(path)
            except CorruptKVFile as e:
                self.num_corrupt += 1
                logger.warning("disk KV tier: skipping %s; its block will be recomputed", e)
                path.unlink(missing_ok=True)
                continue
            if slot >= self.capacity or key in keys:
                path.unlink(missing_ok=True)
                continue
            keys.add(key)
            found.append((slot, key, tokens))
        return found
