"""Core lending: a decode worker computes on a prefill worker's cores while that worker has nothing to do.

Disaggregation gives prefill and decode cores of their own so that neither stalls the other (DistServe,
Splitwise). Under light prompt load the prefill worker's cores then sit idle most of the time while the
decode worker, memory-bound, runs every step on its own cores alone: one core of a 2-core machine. With
lending, a prefill worker publishes in a one-byte shared file whether it is idle (nothing scheduled or
waiting; ``LenderFlag``), and the decode worker it lends to reads it before each step and runs the step
with its own threads plus one per borrowed core while the lender is idle, its own alone otherwise
(``CoreBorrower``). The prefill worker is never slowed but for what a decode step already under way takes
of its cores when a prompt arrives (at most one step). Semi-PD and DynaServe share one accelerator's
compute between the two phases at run time in the same spirit; here the unit shared is a core, and the
prefill worker always has priority.

The extra threads must run on the borrowed cores and the worker's own threads on its own: the launcher
binds OpenMP's threads in order with ``GOMP_CPU_AFFINITY`` (own cores first, then the borrowed ones:
``gomp_cpu_affinity``), which both torch's OpenMP runtime and the native kernels' read at start-up; the
native kernels and torch's operators take ``torch.get_num_threads()`` threads at each call.

On the bench preset at batch 8, one Xeon core: a decode step 49-53 ms on one thread, 28.6-29.5 ms on two
(the second on the idle prefill core); with that core busy, two threads took 69.6 ms (a step waits for its
slowest thread), which is why the borrower gives the core back whenever the lender has work.
"""

from __future__ import annotations

import logging
import mmap
import os

logger = logging.getLogger(__name__)

IDLE, BUSY = b"\x01", b"\x00"  # a new file reads BUSY (zero-filled): no borrowing before the lender says so


class LenderFlag:
    """One byte in a file both workers map: ``IDLE`` while the lender has nothing to compute.

    ``path`` is created if missing (by whichever side opens it first). Raises OSError if it cannot be
    opened or mapped."""

    def __init__(self, path: str):
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < 1:
                os.ftruncate(fd, 1)
            self._map = mmap.mmap(fd, 1)
        finally:
            os.close(fd)
        self._idle: bool | None = None

    def set_idle(self, idle: bool) -> None:
        """The lender's state (written only when it changes)."""
        if idle != self._idle:
            self._map[0:1] = IDLE if idle else BUSY
            self._idle = idle

    def idle(self) -> bool:
        return self._map[0:1] == IDLE

    def close(self) -> None:
        """Leaving: the cores are not idle-and-lent any more (a worker placed there next may compute)."""
        try:
            self.set_idle(False)
            self._map.close()
        except (ValueError, OSError):
            pass


class CoreBorrower:
    """The decode side: before each step, ``own + borrowed`` torch threads while the lender is idle, else
    ``own``. Raises ValueError for fewer than one thread of either, OSError if the flag cannot be mapped."""

    def __init__(self, flag_path: str, own_threads: int, borrowed_threads: int):
        if own_threads < 1 or borrowed_threads < 1:
            raise ValueError(f"a borrower needs >= 1 own and borrowed threads, got {own_threads} and "
                             f"{borrowed_threads}")
        self.flag = LenderFlag(flag_path)
        self.own, self.borrowed = own_threads, borrowed_threads

    def before_step(self) -> int:
        """Size torch's thread pool for the step about to run; returns its threads."""
        import torch

        threads = self.own + self.borrowed if self.flag.idle() else self.own
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        return threads

    def close(self) -> None:
        self.flag.close()


def gomp_cpu_affinity(own_cores: list[int], borrowed_cores: list[int]) -> str:
    """``GOMP_CPU_AFFINITY`` binding OpenMP thread k to the k-th of the own cores then the borrowed ones."""
    return " ".join(str(c) for c in [*own_cores, *borrowed_cores])
