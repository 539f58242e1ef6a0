"""torch's thread count for a block of a test (the native kernels take theirs from it)."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def torch_threads(n: int):
    """Run the block with ``torch.set_num_threads(n)``, then put the count back."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
