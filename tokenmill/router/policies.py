"""Routing policies: given the healthy replicas a request may go to, pick one.

A policy sees each replica as a Candidate (its load and how much of the request's prefix it is estimated
to hold) and keeps no other state than a rotation counter for fair tie-breaks, so it is testable without
servers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence


@dataclass
class Candidate:
    replica: Any             # what the caller routes to (the pool's Replica)
    load: float              # requests running + waiting there
    cached_fraction: float   # estimated share of the request's prefix chunks cached there (0..1)
    cache_fullness: float = 0.0  # estimated share of its prefix cache in use (0..1; 0 while unknown)


class Policy:
    name = ""

    def __init__(self) -> None:
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        raise NotImplementedError

    def _rotate(self, candidates: Sequence[Candidate]) -> list[Candidate]:
        """The candidates starting at a position that advances each call (so ties spread evenly)."""
        start = self._turn % len(candidates)
        self._turn += 1
        return list(candidates[start:]) + list(candidates[:start])


class RoundRobin(Policy):
    name = "round_robin"

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        return self._rotate(candidates)[0]


class LeastLoad(Policy):
    name = "least_load"

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        return min(self._rotate(candidates), key=lambda c: c.load)


class PrefixAware(Policy):
    """score = cached_fraction
               - load_weight * (load - least load) / (least load + 1)
               - room_weight * (1 - cached_fraction) * cache_fullness

    The cached share is prefill the replica skips. The load term grows with the excess over the least
    loaded replica relative to that replica's load, so one request more or less among idle replicas weighs
    little, while a hot prefix still spills over once its replica's queue runs far ahead of the others.
    The room term is the cost of the part that is not cached: it has to evict someone else's prefix where
    the cache is full, so new prefixes spread over the replicas' caches instead of displacing each other on
    one. Ties go to the lower load, then the emptier cache."""
    name = "prefix_aware"

    def __init__(self, load_weight: float = 0.2, room_weight: float = 1.0) -> None:
        super().__init__()
        self.load_weight = load_weight
        self.room_weight = room_weight

    def score(self, c: Candidate, least_load: float) -> float:
        return (c.cached_fraction - self.load_weight * (c.load - least_load) / (least_load + 1)
                - self.room_weight * (1.0 - c.cached_fraction) * c.cache_fullness)

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        least = min(c.load for c in candidates)
        scores = [self.score(c, least) for c in candidates]
        best = max(scores)
        tied = [c for c, s in zip(candidates, scores) if s >= best - 1e-9]
        return min(self._rotate(tied), key=lambda c: (c.load, c.cache_fullness))


POLICIES = {p.name: p for p in (PrefixAware, LeastLoad, RoundRobin)}


def make_policy(name: str, load_weight: float = 0.2) -> Policy:
    if name == PrefixAware.name:
        return PrefixAware(load_weight)
    return POLICIES[name]()
