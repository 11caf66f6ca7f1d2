"""What the two halves of the transfer connector (disaggregated prefill/decode) tell each other, and the
connector's config. Plain data: it crosses processes inside the step messages (step.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class Pull:
    """Fetch a remote request's blocks into host staging rows, in the background (decode side)."""
    request_id: str            # the local request waiting for them
    host: str
    port: int
    remote_request_id: str
    remote_block_ids: list[int]
    kv_fingerprint: str        # hex; the remote worker's, as its params say (checked against ours first)


@dataclass
class TransferPlan:
    """One step's work for the transfer worker:

    - start_step (before the forward pass): `unexpose` (stop serving these requests' blocks: the pool may hand
      them out this step), `drops` (forget staged rows / cancel a pull), `pulls` (start), `loads`
      ((request id, first staged row, device block ids): copy its staged rows from that one on, in order,
      into those blocks; then forget them).
    - after_step (after the forward pass): `expose` ((request id, block ids) that this step's forward pass
      has just filled with the prompt's KV: serve them to pulls from now on).
    """
    pulls: list[Pull] = field(default_factory=list)
    loads: list[tuple[str, int, list[int]]] = field(default_factory=list)
    drops: list[str] = field(default_factory=list)
    expose: list[tuple[str, list[int]]] = field(default_factory=list)
    unexpose: list[str] = field(default_factory=list)
    keep_stepping: bool = False  # requests are held or pulls in flight: call the worker even if idle

    def __bool__(self) -> bool:
        return bool(self.pulls or self.loads or self.drops or self.expose or self.unexpose or self.keep_stepping)


@dataclass
class TransferOutput:
    pulled: list[tuple[str, bool]] = field(default_factory=list)   # (local request id, every block arrived intact)
    done_sending: list[str] = field(default_factory=list)          # exposed requests the puller is done with
    bytes_received: int = 0
    bytes_sent: int = 0
    # Reported once, on the worker's first finished(): where it serves blocks and what they mean
    info: Optional[dict] = None   # {"host", "port", "kv_fingerprint" (hex)}
    pull_seconds: list[float] = field(default_factory=list)  # how long each finished, intact pull took

    def __bool__(self) -> bool:
        return bool(self.pulled or self.done_sending or self.bytes_received or self.bytes_sent or self.info)


# Upper bounds (seconds) of the KV transfer time histogram; counts are cumulative per bucket, as Prometheus'.
PULL_SECONDS_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def pull_seconds_counters(seconds: list[float]) -> dict[str, int]:
    """The histogram's counter increments for these pull times: kv_pull_seconds_le_<bound> (cumulative, so a
    pull counts in every bucket at or above it), kv_pull_seconds_count and kv_pull_microseconds_sum."""
    out = {f"kv_pull_seconds_le_{b:g}": sum(1 for t in seconds if t <= b) for b in PULL_SECONDS_BUCKETS}
    out["kv_pull_seconds_count"] = len(seconds)
    out["kv_pull_microseconds_sum"] = int(sum(seconds) * 1e6)
    return out
