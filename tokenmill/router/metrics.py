"""The router's own /metrics (Prometheus text), named `tokenmill:router_<metric>`."""
from __future__ import annotations

import time
from collections import defaultdict, deque
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest


# Why a request went to a decode instance without KV transfer params: the prefill instance answered without
# them (no connector there), every prefill instance failed, or a batch of prompts (not split into requests).
FALLBACK_REASONS = ("no_kv_transfer_params", "prefill_failed", "batch")
# What the fleet (fleet/fleet.py) did to its replicas.
FLEET_EVENTS = ("started", "start_failed", "replaced", "drained", "scaled_up", "scaled_down")
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)


class LatencyWindow:
    """Recent latencies (the last `seconds`), for a percentile the autoscaler compares to its target."""

    def __init__(self, seconds: float = 30.0) -> None:
        self.seconds = seconds
        self.samples: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: Optional[float] = None) -> None:
        self.samples.append((time.monotonic() if now is None else now, value))

    def percentile(self, q: float, now: Optional[float] = None) -> Optional[float]:
        """The q-quantile (0..1) of the window's samples, None when it has none."""
        cutoff = (time.monotonic() if now is None else now) - self.seconds
        while self.samples and self.samples[0][0] < cutoff:
            self.samples.popleft()
        values = sorted(v for _, v in self.samples)
        return values[min(len(values) - 1, int(q * len(values)))] if values else None


class RouterMetrics:
    def __init__(self, replica_urls: list[str], policy: str) -> None:
        self.registry = r = CollectorRegistry()
        self.policy = policy
        self.requests = Counter("tokenmill:router_requests", "Requests routed, by replica and policy.",
                                ["replica", "policy"], registry=r)
        self.retries = Counter("tokenmill:router_retries",
                               "Requests retried on another replica after this one failed before answering.",
                               ["replica"], registry=r)
        self.stream_failures = Counter("tokenmill:router_stream_failures",
                                       "Streams cut by a replica failure after they had started (not retryable).",
                                       ["replica"], registry=r)
        self.unrouted = Counter("tokenmill:router_unrouted_requests",
                                "Requests answered with an error because no replica could take them.", registry=r)
        self.healthy = Gauge("tokenmill:router_replica_healthy", "1 while the replica answers its health checks.",
                             ["replica"], registry=r)
        self.load = Gauge("tokenmill:router_replica_load",
                          "Requests running + waiting on the replica (its /metrics or our in-flight count).",
                          ["replica"], registry=r)
        self.in_flight = Gauge("tokenmill:router_replica_in_flight", "Requests this router has open there.",
                               ["replica"], registry=r)
        self.est_queried = Counter("tokenmill:router_prefix_chunks_queried",
                                   "Prompt prefix chunks of routed requests.", ["replica"], registry=r)
        self.est_hits = Counter("tokenmill:router_prefix_chunks_estimated_cached",
                                "Prompt prefix chunks the router estimated cached on the replica it chose.",
                                ["replica"], registry=r)
        self.est_hit_rate = Gauge("tokenmill:router_estimated_prefix_hit_rate",
                                  "Estimated cached / queried prefix chunks of requests routed there (cumulative).",
                                  ["replica"], registry=r)
        self.prompt_tokens = Counter("tokenmill:router_prompt_tokens",
                                     "Prompt tokens reported in non-streaming replies' usage.", ["replica"], registry=r)
        self.cached_tokens = Counter("tokenmill:router_cached_tokens",
                                     "Cached prompt tokens (usage.prompt_tokens_details.cached_tokens) in those "
                                     "replies.", ["replica"], registry=r)
        # Per replica group (--group): a canary is judged by its own latency percentiles and errors.
        self.duration = Histogram("tokenmill:router_request_duration_seconds",
                                  "Arrival to the end of the response (a stream's last byte), by replica group.",
                                  ["group"], buckets=_LATENCY_BUCKETS, registry=r)
        self.first_byte = Histogram("tokenmill:router_time_to_first_byte_seconds",
                                    "Arrival to the response's first byte (a stream's first event), by group.",
                                    ["group"], buckets=_LATENCY_BUCKETS, registry=r)
        self.group_errors = Counter("tokenmill:router_group_errors",
                                    "Responses with a 5xx status or a stream cut by a replica failure, by group.",
                                    ["group"], registry=r)
        self.fleet_replicas = Gauge("tokenmill:router_fleet_replicas",
                                    "Replicas the fleet runs, by state (starting, serving, draining).",
                                    ["state"], registry=r)
        self.fleet_events = Counter("tokenmill:router_fleet_events",
                                    "What the fleet did: started, start_failed, replaced (unhealthy or dead), "
                                    "drained (stopped after its requests finished), scaled_up, scaled_down.",
                                    ["event"], registry=r)
        for event in FLEET_EVENTS:
            self.fleet_events.labels(event)
        # per group, generation requests': each fleet's autoscaler reads its own group's TTFT
        self.recent_first_byte: defaultdict[str, LatencyWindow] = defaultdict(LatencyWindow)
        self._queried: dict[str, int] = {}
        self._hits: dict[str, int] = {}
        for url in replica_urls:  # export every series from the start, zeros included
            self.add_replica(url)

    def add_replica(self, url: str) -> None:
        self._queried.setdefault(url, 0)
        self._hits.setdefault(url, 0)
        self.requests.labels(url, self.policy)
        for m in (self.retries, self.stream_failures, self.est_queried, self.est_hits, self.prompt_tokens,
                  self.cached_tokens):
            m.labels(url)
        for g in (self.healthy, self.load, self.in_flight, self.est_hit_rate):
            g.labels(url).set(0)

    def forget_replica(self, url: str) -> None:
        """A replica left: its gauges go (a stale 'healthy' would mislead); its counters stay, they are history."""
        for g in (self.healthy, self.load, self.in_flight, self.est_hit_rate):
            try:
                g.remove(url)
            except KeyError:
                pass

    def on_response(self, group: str, first_byte: float, duration: float, error: bool,
                    generation: bool) -> None:
        self.first_byte.labels(group).observe(first_byte)
        self.duration.labels(group).observe(duration)
        if error:
            self.group_errors.labels(group).inc()
        if generation:
            self.recent_first_byte[group].add(first_byte)

    def add_disagg(self, prefill_urls: list[str], decode_urls: list[str]) -> None:
        """Per-role series of the disaggregated router (tokenmill router --prefill ... --decode ...)."""
        r = self.registry
        self.role_requests = Counter("tokenmill:router_disagg_requests",
                                     "Requests sent to each prefill / decode instance (retries included).",
                                     ["role", "replica"], registry=r)
        self.role_retries = Counter("tokenmill:router_disagg_retries",
                                    "Requests retried on another instance of the role after one failed.",
                                    ["role"], registry=r)
        self.fallbacks = Counter("tokenmill:router_disagg_fallbacks",
                                 "Requests sent to a decode instance without KV transfer params (it recomputes "
                                 "the prompt), by reason.", ["reason"], registry=r)
        self.prefill_seconds = Histogram("tokenmill:router_prefill_phase_seconds",
                                         "Time from a request's arrival to the end of its prefill phase.",
                                         buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                         registry=r)
        for role, urls in (("prefill", prefill_urls), ("decode", decode_urls)):
            self.role_retries.labels(role)
            for url in urls:
                self.role_requests.labels(role, url)
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason)

    def on_routed(self, replica: str, queried_chunks: int, cached_chunks: int) -> None:
        self.requests.labels(replica, self.policy).inc()
        self.est_queried.labels(replica).inc(queried_chunks)
        self.est_hits.labels(replica).inc(cached_chunks)
        self._queried[replica] += queried_chunks
        self._hits[replica] += cached_chunks
        if self._queried[replica]:
            self.est_hit_rate.labels(replica).set(self._hits[replica] / self._queried[replica])

    def on_usage(self, replica: str, prompt_tokens: int, cached_tokens: int) -> None:
        self.prompt_tokens.labels(replica).inc(prompt_tokens)
        self.cached_tokens.labels(replica).inc(cached_tokens)

    def on_replica(self, replica: str, healthy: bool, load: float, in_flight: int) -> None:
        self.healthy.labels(replica).set(1 if healthy else 0)
        self.load.labels(replica).set(load)
        self.in_flight.labels(replica).set(in_flight)

    def render(self) -> bytes:
        return generate_latest(self.registry)
