"""The autoscaler's policy: how many replicas the fleet should run, from load signals and --target.

Targets (`--target NAME=VALUE`, repeatable): `ttft_p90=2s` (time to first byte of the group's generation
requests over the last 30 s, at the router), `queue=4` (running + waiting requests per replica) and `kv_usage=0.8` (mean
share of the replicas' KV caches in use). Pressure is the largest observed / target ratio. The fleet scales
up *before* a target breaks: once pressure passes `headroom` (0.8), straight to the count that brings it back
under (proportionally, as Kubernetes' HPA does), at least one more. It scales down one replica at a time, and
only after pressure stayed under `low` (0.5) for `cooldown` seconds since the last high reading or scale-down,
so a lull between bursts does not shed capacity. Pure logic with an explicit clock: testable without servers.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional

TARGETS = ("ttft_p90", "queue", "kv_usage")


@dataclass
class Target:
    ttft_p90: Optional[float] = None   # seconds
    queue: Optional[float] = None      # running + waiting requests per replica
    kv_usage: Optional[float] = None   # 0..1


def parse_targets(values: list[str]) -> Target:
    """['ttft_p90=2s', 'queue=4'] -> Target (queue=4 when none is given)."""
    found: dict[str, float] = {}
    for value in values:
        m = re.fullmatch(r"\s*(\w+)\s*=\s*([0-9.]+)\s*(ms|s)?\s*", value)
        if not m or m[1] not in TARGETS:
            raise ValueError(f"--target {value!r}: expected NAME=VALUE with NAME one of {', '.join(TARGETS)} "
                             "(e.g. ttft_p90=2s, queue=4, kv_usage=0.8)")
        try:
            number = float(m[2]) / (1000.0 if m[3] == "ms" else 1.0)
        except ValueError:
            raise ValueError(f"--target {value!r}: {m[2]!r} is not a number") from None
        if number <= 0 or (m[1] == "kv_usage" and number > 1):
            raise ValueError(f"--target {value!r}: must be positive{' and at most 1' if m[1] == 'kv_usage' else ''}")
        found[m[1]] = number
    return Target(**found) if found else Target(queue=4.0)


@dataclass
class Signals:
    replicas: int                    # serving replicas
    load: float                      # running + waiting requests over them
    kv_usage: float                  # mean share of their KV caches in use
    ttft_p90: Optional[float]        # None: no recent generation request


class Autoscaler:
    def __init__(self, target: Target, min_replicas: int, max_replicas: int, cooldown: float = 60.0,
                 headroom: float = 0.8, low: float = 0.5) -> None:
        if not 1 <= min_replicas <= max_replicas:
            raise ValueError(f"need 1 <= --min-replicas <= --max-replicas, got {min_replicas} and {max_replicas}")
        if cooldown < 0:
            raise ValueError(f"--scale-down-delay must be >= 0, got {cooldown}")
        self.target = target
        self.min, self.max = min_replicas, max_replicas
        self.cooldown, self.headroom, self.low = cooldown, headroom, low
        self.calm_since: Optional[float] = None  # when pressure last dropped under `low` (or we last scaled down)

    def pressure(self, s: Signals) -> float:
        """Largest observed / target ratio (1.0 = at target)."""
        t, ratios = self.target, []
        if t.queue is not None:
            ratios.append(s.load / max(1, s.replicas) / t.queue)
        if t.kv_usage is not None:
            ratios.append(s.kv_usage / t.kv_usage)
        if t.ttft_p90 is not None and s.ttft_p90 is not None:
            ratios.append(s.ttft_p90 / t.ttft_p90)
        return max(ratios, default=0.0)

    def decide(self, s: Signals, now: float) -> int:
        """How many replicas to run, given `s` about the `s.replicas` serving now."""
        if s.replicas == 0:
            return self.min
        p = self.pressure(s)
        if p > self.headroom:
            self.calm_since = None
            wanted = max(s.replicas + 1, math.ceil(s.replicas * p / self.headroom))
            return min(self.max, wanted)
        if p >= self.low:
            self.calm_since = None
            return max(self.min, s.replicas)
        if self.calm_since is None:
            self.calm_since = now
        if now - self.calm_since >= self.cooldown and s.replicas > self.min:
            self.calm_since = now  # the next step down waits a full cool-down again
            return s.replicas - 1
        return max(self.min, s.replicas)
