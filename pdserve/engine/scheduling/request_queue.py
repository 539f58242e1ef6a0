"""The scheduler's waiting queue, under a scheduling policy (vLLM's ``--scheduling-policy``).

* ``fcfs``: first come, first served. New requests join the tail; a preempted
  request goes back to the head, so it is the next one admitted.
* ``priority``: ordered by ``(priority, arrival_time)``: a lower ``priority``
  value runs sooner, and among equal priorities the earlier arrival. A
  preempted request keeps its arrival time, so it returns to its place in that
  order rather than to the head.

Both keep the deque-like interface the scheduler uses (``add``, ``prepend``,
``peek``, ``pop``, ``remove``, ``len``, iteration in admission order).
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterator

from pdserve.engine.scheduling.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(request: Request) -> tuple[int, float]:
    """The order of the priority policy: lower ``priority`` first, then earlier arrival."""
    return request.sampling_params.priority, request.arrival_time


class FCFSQueue:
    """Arrival order; preempted requests return to the head."""

    def __init__(self):
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        """A preempted request: admitted next."""
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Sorted by ``priority_key``; insertion is a binary search (O(n) list insert, n = waiting)."""

    def __init__(self):
        self._keys: list[tuple[int, float, int]] = []
        self._requests: list[Request] = []
        self._seq = 0  # ties of equal key keep insertion order

    def add(self, request: Request) -> None:
        key = (*priority_key(request), self._seq)
        self._seq += 1
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._requests.insert(i, request)

    prepend = add  # a preempted request goes back to its place in priority order

    def peek(self) -> Request:
        return self._requests[0]

    def pop(self) -> Request:
        del self._keys[0]
        return self._requests.pop(0)

    def remove(self, request: Request) -> None:
        i = self._requests.index(request)
        del self._keys[i]
        del self._requests[i]

    def __len__(self) -> int:
        return len(self._requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._requests)


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    """The waiting queue of ``policy`` (``fcfs`` or ``priority``).

    Raises:
        ValueError: an unknown policy.
    """
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
