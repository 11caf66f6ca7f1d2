"""The fleet: replicas the router launched itself (`tokenmill router --launch ...`), kept alive and sized.

Every interval the fleet
- heals: a replica whose process is gone, or whose health probe failed `failure_threshold` times in a row
  (a grace period: one slow probe is not a death), is taken out of the pool and killed; the count falls below
  the wanted one, so
- sizes: it starts replicas (in parallel) up to the autoscaler's count (or the fixed size), each added to
  the pool once its /health answers 200, or retires one (a scale-down): drained first, i.e. it gets no new
  requests, those in flight finish, and only then is it stopped.
A rolling upgrade replaces the replicas one at a time: start the new one, wait until healthy, add it, drain
and stop an old one. Requests are never dropped by the fleet: a retired replica has none left, and a dead
one's requests are retried elsewhere by router/forward.py (or end with an error event if they had started
streaming).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Optional

import httpx

from tokenmill.fleet.autoscale import Autoscaler, Signals
from tokenmill.fleet.launchers import Launcher, ReplicaHandle
from tokenmill.router.forward import Router
from tokenmill.router.pool import Replica

logger = logging.getLogger("tokenmill")


@dataclass
class Member:
    handle: ReplicaHandle
    argv: list[str]
    replica: Optional[Replica] = None   # its pool entry, once healthy
    state: str = "starting"             # starting -> serving -> draining -> stopping -> (gone)

    def describe(self) -> dict:
        r = self.replica
        return {"url": self.handle.url, "pid": self.handle.pid, "state": self.state,
                "healthy": bool(r and r.healthy), "in_flight": r.in_flight if r else 0,
                "load": r.load if r else 0.0, "kv_usage": r.kv_usage if r else 0.0, "argv": self.argv}


class Fleet:
    def __init__(self, router: Router, launcher: Launcher, argv: list[str], group: str = "default",
                 size: int = 1, autoscaler: Optional[Autoscaler] = None, failure_threshold: int = 3,
                 start_timeout: float = 600.0, drain_timeout: float = 300.0, interval: float = 1.0) -> None:
        """size: the replica count without an autoscaler (with one, it decides between its min and max)."""
        if failure_threshold < 1:
            raise ValueError(f"--health-check-failures must be at least 1, got {failure_threshold}")
        self.router, self.launcher, self.argv, self.group = router, launcher, argv, group
        self.size, self.autoscaler = size, autoscaler
        self.failure_threshold, self.start_timeout = failure_threshold, start_timeout
        self.drain_timeout, self.interval = drain_timeout, interval
        self.members: list[Member] = []
        self.retired: list[dict] = []       # each drained replica's last report: in flight, KV usage (leak check)
        self.resizing = asyncio.Lock()      # held by an upgrade: no scaling meanwhile
        self.retry_start_at = 0.0           # after a failed start, the next waits (backoff)
        self.start_failures = 0
        self.launching = 0                  # launcher.start calls under way (not members yet)
        self.tasks: set[asyncio.Task] = set()

    # -- state ----------------------------------------------------------------------------------------
    def in_state(self, *states: str) -> list[Member]:
        return [m for m in self.members if m.state in states]

    def describe(self) -> dict:
        return {"group": self.group, "argv": self.argv, "launcher": self.launcher.name,
                "replicas": [m.describe() for m in self.members], "retired": self.retired}

    def _event(self, event: Optional[str]) -> None:
        if event is not None:
            self.router.metrics.fleet_events.labels(event).inc()
        for state in ("starting", "serving", "draining"):
            self.router.metrics.fleet_replicas.labels(state).set(len(self.in_state(state)))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- the loop -------------------------------------------------------------------------------------
    async def run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - the fleet must outlive one bad tick
                logger.exception("fleet %s: tick failed", self.group)
            await asyncio.sleep(self.interval)

    async def tick(self) -> None:
        await self.heal()
        if self.resizing.locked():
            return
        active = len(self.in_state("starting", "serving")) + self.launching
        wanted = self.wanted()
        if wanted > active and time.monotonic() >= self.retry_start_at:
            logger.info("fleet %s: %d -> %d replicas", self.group, active, wanted)
            for _ in range(wanted - active):
                self._spawn(self.start_one(self.argv, "scaled_up" if active else "started"))
        elif wanted < active and not self.in_state("starting") and not self.launching:
            victim = min(self.in_state("serving"), key=lambda m: m.replica.load)
            logger.info("fleet %s: %d -> %d replicas (retiring %s)", self.group, active, wanted, victim.handle.url)
            self._spawn(self.retire(victim, "scaled_down"))

    def wanted(self) -> int:
        if self.autoscaler is None:
            return self.size
        serving = [m.replica for m in self.in_state("serving")]
        signals = Signals(len(serving), sum(r.load for r in serving),
                          sum(r.kv_usage for r in serving) / max(1, len(serving)),
                          self.router.metrics.recent_first_byte[self.group].percentile(0.9))
        return self.autoscaler.decide(signals, time.monotonic())

    async def heal(self) -> None:
        for m in self.in_state("serving", "draining"):
            alive = await asyncio.to_thread(m.handle.alive)
            if alive and m.replica.failures < self.failure_threshold:
                continue
            why = "its process exited" if not alive else f"{m.replica.failures} health checks failed in a row"
            logger.warning("fleet %s: replica %s is gone (%s); replacing it", self.group, m.handle.url, why)
            m.state = "failed"
            self.router.remove_replica(m.replica)
            self.members.remove(m)
            self._event("replaced")
            self._spawn(asyncio.to_thread(m.handle.kill))

    # -- one replica ----------------------------------------------------------------------------------
    async def start_one(self, argv: list[str], event: str = "started") -> Optional[Member]:
        """Launch a replica, wait until healthy, add it to the pool; None if it failed to start."""
        self.launching += 1
        member = None
        try:
            try:
                member = Member(await asyncio.to_thread(self.launcher.start, argv), argv)
            finally:
                self.launching -= 1
            self.members.append(member)
            self._event(None)
            await self._wait_healthy(member.handle)
        except Exception as e:  # noqa: BLE001 - a launcher's or a replica's failure: back off, try again later
            logger.error("fleet %s: a replica failed to start: %s", self.group, e)
            if member is not None:
                self.members.remove(member)
                await asyncio.to_thread(member.handle.kill)
            self.start_failures += 1
            self.retry_start_at = time.monotonic() + min(60.0, 2.0 ** self.start_failures)
            self._event("start_failed")
            return None
        self.start_failures = 0
        member.replica = self.router.add_replica(member.handle.url, self.group, healthy=True)
        member.state = "serving"
        logger.info("fleet %s: replica %s is serving", self.group, member.handle.url)
        self._event(event)
        return member

    async def _wait_healthy(self, handle: ReplicaHandle) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            if not await asyncio.to_thread(handle.alive):
                raise RuntimeError(f"{handle.url}: its process exited while starting (see its log above)")
            try:
                if (await self.router.client.get(handle.url + "/health", timeout=2.0)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{handle.url} not healthy after {self.start_timeout:.0f}s")
            await asyncio.sleep(0.5)

    async def retire(self, member: Member, event: str = "drained") -> None:
        """Drain (no new requests; wait for those in flight), then stop the replica."""
        member.state = "draining"
        replica = member.replica
        replica.draining = True
        self._event(None)
        deadline = time.monotonic() + self.drain_timeout
        while replica.in_flight > 0 and time.monotonic() < deadline and member in self.members:
            await asyncio.sleep(0.1)
        if member not in self.members:
            return  # it died while draining: heal() took it out
        await self.router.pool.probe(replica)  # its own view once idle: anything still held there leaked
        self.retired.append({"url": replica.url, "in_flight": replica.in_flight, "running": replica.running,
                             "waiting": replica.waiting, "kv_usage": replica.kv_usage})
        self.router.remove_replica(replica)
        member.state = "stopping"
        await asyncio.to_thread(member.handle.stop, 30.0)
        self.members.remove(member)
        logger.info("fleet %s: replica %s drained and stopped", self.group, replica.url)
        self._event(event)

    # -- upgrades and shutdown ------------------------------------------------------------------------
    async def upgrade(self, argv: list[str]) -> dict:
        """Replace every replica, one at a time, by one running `argv`: new one healthy first, then the old
        one drained and stopped. New replicas started from now on (healing, scaling) run `argv` too."""
        async with self.resizing:
            old = self.in_state("serving")
            replaced = []
            for m in old:
                if m not in self.members:
                    continue  # died meanwhile: healing replaces it with `argv`
                new = await self.start_one(argv, "started")
                if new is None:
                    raise RuntimeError(f"the upgrade stopped: a replica running {argv} failed to start; "
                                       f"{len(replaced)} of {len(old)} were replaced")
                self.argv = argv
                await self.retire(m)
                replaced.append({"old": m.handle.url, "new": new.handle.url})
            self.argv = argv
            return {"group": self.group, "replaced": replaced}

    async def close(self) -> None:
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*(asyncio.to_thread(m.handle.stop, 30.0) for m in self.members),
                             return_exceptions=True)
        self.members.clear()
        self.launcher.close()
