"""The replicas behind the router: health and load, kept fresh by a background loop.

Every interval each replica's /health is probed and, when it answers, its /metrics scraped for load
(`tokenmill:num_requests_running` + `num_requests_waiting`) and KV capacity. A replica that fails a probe
is taken out of rotation and put back as soon as a probe succeeds again; `failures` counts the misses in a row
(the fleet replaces a replica it launched after a few, fleet/fleet.py). The forwarding path reports failures too:
a refused connection takes a replica out at once; other transport errors ask for an immediate probe.
Replicas join and leave at run time (add, remove); a draining one is probed but gets no new requests.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import httpx

logger = logging.getLogger("tokenmill")


@dataclass
class Replica:
    url: str
    group: str = "default"                    # replica group (--group), weighted per request
    healthy: bool = False
    draining: bool = False                    # taken out of rotation on purpose; its in-flight requests finish
    failures: int = 0                         # failed probes in a row
    in_flight: int = 0                        # requests this router has open there
    running: float = 0.0                      # from its /metrics
    waiting: float = 0.0
    kv_capacity_tokens: Optional[int] = None  # KV blocks x block size, once the replica reports them
    kv_usage: float = 0.0                     # share of its KV cache in use (0..1)
    last_error: str = ""

    @property
    def free_kv_tokens(self) -> float:
        """KV tokens free there (0 while its capacity is unknown)."""
        return (self.kv_capacity_tokens or 0) * (1.0 - self.kv_usage)

    @property
    def load(self) -> float:
        # The scrape lags by up to an interval but also counts other clients' requests; our own in-flight
        # count is exact for our traffic. The larger of the two does not count ours twice.
        return max(float(self.in_flight), self.running + self.waiting)


@dataclass
class ReplicaLoad:
    running: float = 0.0
    waiting: float = 0.0
    kv_capacity_tokens: Optional[int] = None
    kv_usage: float = 0.0


def parse_replica_metrics(text: str) -> ReplicaLoad:
    """Load and KV capacity from a `tokenmill serve` /metrics scrape (summed over models)."""
    from prometheus_client.parser import text_string_to_metric_families

    out, blocks, block_size, prefix_caching = ReplicaLoad(), 0.0, 16, True
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tokenmill:num_requests_running":
                out.running += s.value
            elif s.name == "tokenmill:num_requests_waiting":
                out.waiting += s.value
            elif s.name == "tokenmill:kv_cache_usage_perc":
                out.kv_usage = max(out.kv_usage, s.value)
            elif s.name == "tokenmill:kv_cache_total_blocks":
                blocks += s.value
            elif s.name == "tokenmill:cache_config_info":  # set as soon as the replica is up
                block_size = int(s.labels.get("block_size", block_size))
                blocks = max(blocks, float(s.labels.get("num_gpu_blocks", 0)))
                prefix_caching = s.labels.get("enable_prefix_caching", "True") == "True"
    if blocks > 0:
        out.kv_capacity_tokens = int(blocks) * block_size if prefix_caching else 0
    return out


class ReplicaPool:
    def __init__(self, urls: Iterable[str], client: httpx.AsyncClient, interval: float = 1.0,
                 timeout: float = 5.0, on_update: Optional[Callable[[Replica, bool], None]] = None,
                 groups: Optional[dict[str, str]] = None) -> None:
        """on_update(replica, was_healthy) runs after every probe and every failure report; groups: url -> its
        group (default: "default")."""
        groups = groups or {}
        self.replicas = [Replica(url.rstrip("/"), groups.get(url, "default")) for url in urls]
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self.on_update = on_update or (lambda replica, was_healthy: None)
        self._probing: dict[str, asyncio.Task] = {}

    def healthy(self, exclude: Iterable[Replica] = ()) -> list[Replica]:
        skip = {r.url for r in exclude}
        return [r for r in self.replicas if r.healthy and not r.draining and r.url not in skip]

    def get(self, url: str) -> Optional[Replica]:
        return next((r for r in self.replicas if r.url == url.rstrip("/")), None)

    def add(self, url: str, group: str = "default", healthy: bool = False) -> Replica:
        """A replica joins (healthy: it was just checked, so it takes requests before the next probe)."""
        replica = Replica(url.rstrip("/"), group, healthy=healthy)
        self.replicas = [*self.replicas, replica]  # a new list: loops over the old one are not disturbed
        self.on_update(replica, False)
        return replica

    def remove(self, replica: Replica) -> None:
        self.replicas = [r for r in self.replicas if r is not replica]
        replica.healthy, replica.last_error = False, "removed from the pool"

    async def probe(self, replica: Replica) -> None:
        was = replica.healthy
        try:
            r = await self.client.get(replica.url + "/health", timeout=self.timeout)
            if r.status_code != 200:
                raise RuntimeError(f"/health answered {r.status_code}")
            m = await self.client.get(replica.url + "/metrics", timeout=self.timeout)
            if m.status_code == 200:
                load = parse_replica_metrics(m.text)
                replica.running, replica.waiting = load.running, load.waiting
                replica.kv_capacity_tokens, replica.kv_usage = load.kv_capacity_tokens, load.kv_usage
            replica.healthy, replica.last_error, replica.failures = True, "", 0
        except (httpx.HTTPError, RuntimeError, ValueError) as e:
            replica.failures += 1
            self._set_down(replica, f"{type(e).__name__}: {e}")
        if replica.healthy and not was:
            logger.info("replica %s is up", replica.url)
        self.on_update(replica, was)

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(r) for r in self.replicas))

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval)

    def report_failure(self, replica: Replica, error: Exception) -> None:
        """A forwarded request failed in transport. A refused connection means nothing listens there any
        more; anything else (a reset, a stale keep-alive connection) is checked with a probe first."""
        if isinstance(error, httpx.ConnectError):
            was = replica.healthy
            self._set_down(replica, f"{type(error).__name__}: {error}")
            self.on_update(replica, was)
        elif replica.url not in self._probing:
            task = asyncio.ensure_future(self.probe(replica))
            self._probing[replica.url] = task
            task.add_done_callback(lambda _: self._probing.pop(replica.url, None))

    def _set_down(self, replica: Replica, reason: str) -> None:
        if replica.healthy:
            logger.warning("replica %s is down: %s", replica.url, reason)
        replica.healthy, replica.last_error = False, reason
        replica.running = replica.waiting = 0.0
