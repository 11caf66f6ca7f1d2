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

    def __bool__(self) -> bool:
        return bool(self.pulled or self.done_sending or self.bytes_received or self.bytes_sent or self.info)
