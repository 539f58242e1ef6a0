"""Test-only fault injection, read once from ``$PDSERVE_FAULTS`` (a JSON object) at import.

Tests set the variable for the worker processes they start, so faults happen
inside real processes on the real code path; unset (always, in production)
every check is a dictionary lookup that finds nothing.

Keys:
    ``forward_fails_on_token``: int. ``EngineCore.execute`` raises ``InjectedFault``
        for a step that holds a request whose prompt contains this token id (a
        forward pass that fails for one batch, like an out-of-memory error).
    ``kv_send``: ``{"token": id, "mode": ..., "delay_s": s}``. The prefill worker's
        sender (``OutgoingKV.send_layer``) misbehaves for requests whose prompt
        contains ``token``: ``never`` sends nothing, ``delay`` sleeps ``delay_s``
        before the first layer, ``corrupt`` sends the layers with one value changed
        (the checksum it reports is of the true layers), ``truncate`` sends the
        first half of each layer. The decode worker must detect each (deadline,
        checksum) and recompute the prompt itself. (gloo accepts a message
        shorter than the receive buffer, so a cut is caught by the checksum over
        the whole buffer; a cut that only drops unused slots of the last block
        changes nothing that is read, and passes.)
    ``disk_read_delay_s``: float. The disk KV tier (``DiskKVStore.read``) sleeps this long before
        each block it reads back: a slow disk, whose hits the worker must learn to recompute.
"""

from __future__ import annotations

import json
import os

FAULTS: dict = json.loads(os.environ.get("PDSERVE_FAULTS") or "{}")


class InjectedFault(RuntimeError):
    """A fault a test asked for."""


def check_forward(scheduled: list) -> None:
    """Raise ``InjectedFault`` if ``forward_fails_on_token`` is in the prompt of any of this step's
    ``(request, num_new_tokens)``. Without the fault configured this is one dictionary lookup."""
    token = FAULTS.get("forward_fails_on_token") if FAULTS else None
    if token is not None and any(token in request.prompt_token_ids for request, _ in scheduled):
        raise InjectedFault(f"injected fault: forward pass over a prompt holding token {token}")


_kv_send_faults: dict[str, dict] = {}  # request_id -> the kv_send fault it gets (prefill worker process)


def mark_kv_send(request_id: str, prompt_token_ids: list[int]) -> None:
    """Prefill worker: note that ``request_id``'s KV send misbehaves if its prompt holds the fault's token."""
    spec = FAULTS.get("kv_send")
    if spec is not None and spec["token"] in prompt_token_ids:
        _kv_send_faults[request_id] = spec


def kv_send_fault(request_id: str) -> dict | None:
    """The ``kv_send`` fault for ``request_id``'s KV, if a test asked for one."""
    return _kv_send_faults.get(request_id) if _kv_send_faults else None


def disk_read_delay() -> None:
    """Sleep ``disk_read_delay_s`` if configured (one dictionary lookup otherwise)."""
    delay = FAULTS.get("disk_read_delay_s") if FAULTS else None
    if delay:
        import time

        time.sleep(delay)
