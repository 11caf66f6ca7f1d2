"""The scheduler's waiting queue under a scheduling policy (--scheduling-policy, vLLM's names).

- fcfs: arrival order; a request that comes back (preempted, rolled back, its KV loaded) goes to the head,
  since it already waited its turn.
- priority: by rank = (priority, arrival time): a lower `priority` value first, ties by arrival; a request that
  comes back takes its rank's place, so a later request of better rank still goes first. The scheduler also
  preempts a running request of worse rank to start a waiting one (engine/scheduler.py).

Both keep a `front` the scheduler can put one request at regardless of rank: the quarantine's suspect, which
must run next and alone.
"""
from __future__ import annotations

import bisect
from collections import deque
from typing import Iterator

from tokenmill.messages import Request


def rank(req: Request) -> tuple[int, float]:
    """Lower runs first under the priority policy."""
    return req.priority, req.arrival_time


class WaitingQueue:
    def __init__(self, policy: str = "fcfs") -> None:
        self.by_priority = policy == "priority"
        self._front: deque[Request] = deque()  # ahead of everything, in this order
        self._rest: list[Request] = []         # fcfs: arrival order; priority: sorted by rank

    def add(self, req: Request) -> None:
        """A request joining for the first time (or, under the priority policy, coming back)."""
        if self.by_priority:
            bisect.insort_right(self._rest, req, key=rank)  # right: equal ranks keep arrival order
        else:
            self._rest.append(req)

    def requeue(self, req: Request) -> None:
        """A request coming back: preempted, rolled back after a failed step, or its KV loaded."""
        if self.by_priority:
            self.add(req)
        else:
            self._front.appendleft(req)

    def put_back(self, reqs: list[Request]) -> None:
        """Requests just popped from the head this step, in order, back where they were."""
        if self.by_priority:
            for req in reqs:
                self.add(req)
        else:
            self._front.extendleft(reversed(reqs))

    def to_front(self, req: Request) -> None:
        """Put a waiting request at the head whatever its rank (the quarantine's suspect)."""
        self.remove(req)
        self._front.appendleft(req)

    def peek(self) -> Request:
        return self._front[0] if self._front else self._rest[0]

    def pop(self) -> Request:
        return self._front.popleft() if self._front else self._rest.pop(0)

    def remove(self, req: Request) -> None:
        if req in self._front:
            self._front.remove(req)
        else:
            self._rest.remove(req)

    def __contains__(self, req: Request) -> bool:
        return req in self._front or req in self._rest

    def __len__(self) -> int:
        return len(self._front) + len(self._rest)

    def __iter__(self) -> Iterator[Request]:
        yield from self._front
        yield from self._rest
