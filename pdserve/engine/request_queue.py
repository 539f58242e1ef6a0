"""The scheduler's waiting queue, under a scheduling policy (vLLM's ``--scheduling-policy``).

* ``fcfs``: first come, first served. New requests join the tail; a preempted
  request goes back to the head, so it is the next one admitted.
* ``priority``: ordered by ``(priority, arrival_time)``: a lower ``priority``
  value runs sooner, and among equal priorities the earlier arrival. A
  preempted request keeps its arrival time, so it returns to its place in that
  order rather than to the head.
* ``srpt``: shortest remaining processing time, for prefill workers, whose
  jobs' sizes are known on arrival: the waiting queue is ordered by the tokens
  a request still has to compute (its prompt, or prompt and outputs after a
  preemption), then arrival, and the scheduler gives a step's budget to the
  requests with the fewest tokens left, running or waiting, so a short prompt
  that arrives while a long one is being prefilled in chunks goes first. This
  minimises the mean time in queue of an M/G/1 server (Schrage, 1968); the
  prefill instances of DistServe and Splitwise are such servers. A request
  that has waited ``SRPT_MAX_WAIT_S`` since it arrived counts as shortest, in
  arrival order, so a long prompt is delayed a bounded time, never starved.

All keep the deque-like interface the scheduler uses (``add``, ``prepend``,
``peek``, ``pop``, ``remove``, ``len``, iteration in admission order).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Iterator

from pdserve.engine.request import Request

SCHEDULING_POLICIES = ("fcfs", "priority", "srpt")
SRPT_MAX_WAIT_S = 3.0  # srpt: a request waiting this long (seconds) since arrival goes before shorter ones


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


class ShortestFirstQueue(PriorityQueue):
    """Sorted by the tokens left to compute, then arrival (``srpt``); requests waiting ``max_wait_s``
    or longer come first, in arrival order. ``clock``: seconds, comparable with ``Request.arrival_time``."""

    def __init__(self, max_wait_s: float = SRPT_MAX_WAIT_S, clock=time.monotonic):
        super().__init__()
        self.max_wait_s = max_wait_s
        self._clock = clock

    def add(self, request: Request) -> None:
        key = (request.num_tokens - request.num_computed_tokens, request.arrival_time, self._seq)
        self._seq += 1
        i = bisect.bisect_right(self._keys, key)
        self._keys.insert(i, key)
        self._requests.insert(i, request)

    prepend = add  # a preempted request: ordered by what it must recompute

    def _order(self) -> list[Request]:
        deadline = self._clock() - self.max_wait_s
        overdue = sorted((r for r in self._requests if r.arrival_time <= deadline), key=lambda r: r.arrival_time)
        if not overdue:
            return self._requests
        return overdue + [r for r in self._requests if r.arrival_time > deadline]

    def peek(self) -> Request:
        return self._order()[0]

    def pop(self) -> Request:
        request = self.peek()
        self.remove(request)
        return request

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._order()))


def srpt_key(request: Request, now: float, max_wait_s: float = SRPT_MAX_WAIT_S) -> tuple[int, float]:
    """The ``srpt`` order of a running or waiting request at time ``now``: tokens left to compute (0 once it
    has waited ``max_wait_s`` since arrival), then arrival."""
    overdue = now - request.arrival_time >= max_wait_s
    return (0 if overdue else request.num_tokens - request.num_computed_tokens), request.arrival_time


def make_waiting_queue(policy: str) -> FCFSQueue | PriorityQueue:
    """The waiting queue of ``policy`` (``fcfs``, ``priority`` or ``srpt``).

    Raises:
        ValueError: an unknown policy.
    """
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    if policy == "srpt":
        return ShortestFirstQueue()
    raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
