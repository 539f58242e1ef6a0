"""Test-only fault injection, read once from ``$PDSERVE_FAULTS`` (a JSON object) at import.

Tests set the variable for the worker processes they start, so faults happen
inside real processes on the real code path; unset (always, in production)
every check is a dictionary lookup that finds nothing.

Keys:
    ``forward_fails_on_token``: int. ``EngineCore.execute`` raises ``InjectedFault``
        for a step that holds a request whose prompt contains this token id (a
        forward pass that fails for one batch, like an out-of-memory error).
"""

from __future__ import annotations

import json
import os

FAULTS: dict = json.loads(os.environ.get("PDSERVE_FAULTS") or "{}")


class InjectedFault(RuntimeError):
    """A fault a test asked for."""


def check_forward(prompts: list[list[int]]) -> None:
    """Raise ``InjectedFault`` if ``forward_fails_on_token`` is in any of this step's prompts."""
    token = FAULTS.get("forward_fails_on_token")
    if token is not None and any(token in prompt for prompt in prompts):
        raise InjectedFault(f"injected fault: forward pass over a prompt holding token {token}")
