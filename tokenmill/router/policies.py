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
    replica: Any            # what the caller routes to (the pool's Replica)
    load: float             # requests running + waiting there
    cached_fraction: float  # estimated share of the request's prefix chunks cached there (0..1)
    cached_chunks: int = 0  # prefix chunks the router believes the replica holds (how full its cache is)


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
    """score = cached_fraction - load_weight * load / (load of the busiest candidate).

    A replica holding the whole prefix wins unless it is the busiest one and the cached share does not
    outweigh load_weight; with nothing cached anywhere this is least-load. Ties (typically a new prefix
    on idle replicas) go to the lower load, then to the replica whose cache holds the least, so new
    prefixes spread over the replicas' caches instead of evicting each other on one."""
    name = "prefix_aware"

    def __init__(self, load_weight: float = 0.5) -> None:
        super().__init__()
        self.load_weight = load_weight

    def score(self, c: Candidate, busiest: float) -> float:
        return c.cached_fraction - (self.load_weight * c.load / busiest if busiest > 0 else 0.0)

    def choose(self, candidates: Sequence[Candidate]) -> Candidate:
        busiest = max(c.load for c in candidates)
        scores = [self.score(c, busiest) for c in candidates]
        best = max(scores)
        tied = [c for c, s in zip(candidates, scores) if s >= best - 1e-9]
        return min(self._rotate(tied), key=lambda c: (c.load, c.cached_chunks))


POLICIES = {p.name: p for p in (PrefixAware, LeastLoad, RoundRobin)}


def make_policy(name: str, load_weight: float = 0.5) -> Policy:
    if name == PrefixAware.name:
        return PrefixAware(load_weight)
    return POLICIES[name]()
