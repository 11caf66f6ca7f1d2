"""Replaying a request-rate trace against an autoscaled pool of replicas: replicas, P99 and cost over time.

One replica is measured (a `tokenmill bench serve` run that keeps `concurrency` requests in flight, or given):
the requests/s it completes when full, and the P99 latency its requests see at that load with nothing queued in
front of it. The pool of ready replicas is then an M/M/n queue of n = replicas x concurrency request slots,
each completing a request in concurrency / capacity s (Little's law), fed by a router that sends each request
to a free slot: the probability of waiting is Erlang's C formula, and the wait beyond it has the exponential
tail P(W > t) = P(wait) exp(-(n x slot rate - arrival rate) t). P99 = the replica's P99 + the P99 wait.
(disagg.py's M/G/1 queue is the right model for one instance's serial prompt chunks, not for a replica that
runs `concurrency` requests at once: as one server of 1 / capacity s it waits ~1 s at 16% load.) When the
arrivals exceed what the ready replicas complete, the excess carries over as a backlog (a fluid queue) that
later requests wait behind until it drains.

The autoscaler decides at the start of each interval from the rate it saw in the previous one: desired =
ceil(rate / (capacity x target utilisation)), between the floor and --max-replicas. It scales up at once (new
replicas serve after --replica-start-s), and down only to the most it desired over the last
--scale-down-delay (the cool-down). Every replica that is up, starting or serving, is billed.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from tokenmill.plan.trace import Interval


def erlang_c(servers: int, load: float) -> float:
    """The probability that an arrival waits in M/M/`servers` at `load` = arrival rate x service time (< servers);
    Erlang B by its stable recursion, then C from B."""
    b = 1.0
    for k in range(1, servers + 1):
        b = load * b / (k + load * b)
    rho = load / servers
    return b / (1 - rho * (1 - b))


def wait_p99(servers: int, slot_rate: float, rate: float) -> float:
    """P99 queueing wait of M/M/`servers` whose servers each complete `slot_rate` requests/s, at `rate` req/s."""
    waits = erlang_c(servers, rate / slot_rate)
    return math.log(waits / 0.01) / (servers * slot_rate - rate) if waits > 0.01 else 0.0


@dataclass(frozen=True)
class Replica:
    capacity: float          # requests/s one replica completes when full
    latency_s: float         # P99 of the SLA metric at that load, without queueing
    concurrency: int = 1     # requests in flight at that load (its request slots)
    about: str = ""          # where the figures come from

    def __post_init__(self) -> None:
        if not self.capacity > 0 or self.latency_s < 0 or self.concurrency < 1:
            raise ValueError(f"a replica needs a capacity > 0 req/s, a latency >= 0 and a concurrency >= 1, got "
                             f"{self.capacity:g} req/s, {self.latency_s:g} s, {self.concurrency}")

    def interval(self, rate: float, ready: int, backlog: float, dt: float) -> tuple[float, float, float]:
        """(P99 seconds, utilisation, backlog after) of `dt` seconds at `rate` over `ready` replicas."""
        served = self.capacity * ready
        if served == 0:
            return (math.inf if rate > 0 or backlog > 0 else self.latency_s), (math.inf if rate > 0 else 0.0), \
                backlog + rate * dt
        rho = rate / served
        after = max(0.0, backlog + (rate - served) * dt)
        if rho < 1:
            wait = wait_p99(ready * self.concurrency, self.capacity / self.concurrency, rate) + backlog / served
        else:  # the last arrival waits behind everything left over
            wait = max(backlog, after) / served
        return self.latency_s + wait, rho, after


@dataclass(frozen=True)
class Autoscaler:
    min_replicas: int = 1
    max_replicas: int = 16
    target_utilization: float = 0.7
    scale_down_delay: float = 300.0
    replica_start_s: float = 120.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got "
                             f"{self.min_replicas} and {self.max_replicas}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"--target-utilization must be in (0, 1], got {self.target_utilization}")
        if self.scale_down_delay < 0 or self.replica_start_s < 0:
            raise ValueError("--scale-down-delay and --replica-start-s must be >= 0")

    def desired(self, rate: float, capacity: float) -> int:
        want = math.ceil(rate / (capacity * self.target_utilization) - 1e-9)
        return min(self.max_replicas, max(self.min_replicas, want))


@dataclass(frozen=True)
class Row:
    t: float
    dt: float
    rate: float
    ready: int           # replicas serving
    billed: int          # replicas up (serving or starting)
    utilization: float
    p99_s: float
    miss: bool


def replay(intervals: list[Interval], replica: Replica, scaler: Autoscaler, slo_s: float) -> list[Row]:
    """The pool interval by interval (module docstring)."""
    up = [-math.inf] * scaler.desired(intervals[0].rate, replica.capacity)   # each replica's ready time
    wanted: list[tuple[float, int]] = []
    backlog, seen, rows = 0.0, intervals[0].rate, []
    for iv in intervals:
        want = scaler.desired(seen, replica.capacity)
        wanted = [(t, w) for t, w in wanted if t > iv.t - scaler.scale_down_delay] + [(iv.t, want)]
        keep = max(w for _, w in wanted)
        if want > len(up):
            up += [iv.t + scaler.replica_start_s] * (want - len(up))
        elif keep < len(up):
            up = up[:keep]       # the newest (still starting, if any) go first
        ready = sum(t <= iv.t for t in up)
        p99, rho, backlog = replica.interval(iv.rate, ready, backlog, iv.dt)
        rows.append(Row(iv.t, iv.dt, iv.rate, ready, len(up), rho, p99, p99 > slo_s))
        seen = iv.rate
    return rows


@dataclass(frozen=True)
class Prices:
    reserved: float          # per reserved replica-hour, paid for every hour whether used or not
    on_demand: float         # per on-demand replica-hour, paid while up

    def __post_init__(self) -> None:
        if self.reserved < 0 or self.on_demand < 0:
            raise ValueError("--reserved-price and --on-demand-price must be >= 0")


def cost(rows: list[Row], reserved: int, prices: Prices) -> dict[str, float]:
    """Reserved replicas are paid for the whole trace; replicas above them by the hour they are up."""
    reserved_h = reserved * sum(r.dt for r in rows) / 3600
    on_demand_h = sum(max(0, r.billed - reserved) * r.dt for r in rows) / 3600
    return {"reserved_replica_hours": reserved_h, "on_demand_replica_hours": on_demand_h,
            "reserved_cost": reserved_h * prices.reserved, "on_demand_cost": on_demand_h * prices.on_demand,
            "total_cost": reserved_h * prices.reserved + on_demand_h * prices.on_demand}


def summary(rows: list[Row], reserved: int, prices: Prices) -> dict[str, float]:
    missed = [r for r in rows if r.miss]
    return {"reserved_replicas": reserved, "peak_replicas": max(r.billed for r in rows),
            "replica_hours": sum(r.billed * r.dt for r in rows) / 3600,
            "requests": sum(r.rate * r.dt for r in rows),
            "miss_intervals": len(missed), "miss_seconds": sum(r.dt for r in missed),
            "miss_requests": sum(r.rate * r.dt for r in missed), **cost(rows, reserved, prices)}


def with_reserved(scaler: Autoscaler, reserved: int) -> Autoscaler:
    """Reserved replicas are paid for anyway, so they always run: they raise the autoscaler's floor."""
    if reserved > scaler.max_replicas:
        raise ValueError(f"--reserved-replicas {reserved} is above --max-replicas {scaler.max_replicas}")
    return dataclasses.replace(scaler, min_replicas=max(scaler.min_replicas, reserved))


def compare_reserved(intervals: list[Interval], replica: Replica, scaler: Autoscaler, slo_s: float,
                     prices: Prices) -> list[dict[str, float]]:
    """A summary for each reserved base from 0 to the peak the autoscaler reaches without one."""
    peak = max(r.billed for r in replay(intervals, replica, scaler, slo_s))
    return [summary(replay(intervals, replica, with_reserved(scaler, n), slo_s), n, prices)
            for n in range(peak + 1)]
