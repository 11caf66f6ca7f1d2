"""The router's view on the dashboard (`tokenmill router`, /dashboard): its replicas with their health,
load and KV usage (from the pool's probes), and what the router did — requests routed to each, estimated
prefix hits, cached tokens, failovers — read from its own Prometheus registry, so the page and /metrics
never disagree. The page turns the cumulative counts into routing decisions per second."""
from __future__ import annotations

import time
from collections import defaultdict

from fastapi import FastAPI

from tokenmill.serve.dashboard import mount

_PER_REPLICA = {
    "tokenmill:router_requests_total": "requests",
    "tokenmill:router_retries_total": "retries",
    "tokenmill:router_stream_failures_total": "stream_failures",
    "tokenmill:router_prompt_tokens_total": "prompt_tokens",
    "tokenmill:router_cached_tokens_total": "cached_tokens",
    "tokenmill:router_estimated_prefix_hit_rate": "estimated_hit_rate",
}


def router_snapshot(router) -> dict:
    counts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    unrouted = 0.0
    for family in router.metrics.registry.collect():
        for s in family.samples:
            if s.name in _PER_REPLICA and "replica" in s.labels:
                counts[s.labels["replica"]][_PER_REPLICA[s.name]] += s.value
            elif s.name == "tokenmill:router_unrouted_requests_total":
                unrouted += s.value
    replicas = []
    for r in router.pool.replicas:
        c = counts[r.url]
        replicas.append({"url": r.url, "healthy": r.healthy, "load": r.load, "in_flight": r.in_flight,
                         "running": r.running, "waiting": r.waiting, "kv_usage": r.kv_usage,
                         "last_error": r.last_error, **{k: int(c[k]) for k in ("requests", "retries",
                                                                              "stream_failures", "prompt_tokens",
                                                                              "cached_tokens")},
                         "estimated_hit_rate": c["estimated_hit_rate"]})
    return {"t": time.time(), "policy": router.policy.name, "replicas": replicas, "unrouted": int(unrouted)}


def mount_router_dashboard(app: FastAPI, router) -> None:
    mount(app, "router", lambda: router_snapshot(router),
          lambda: {"replicas": len(router.pool.replicas), "policy": router.policy.name}, interval=0.5)
