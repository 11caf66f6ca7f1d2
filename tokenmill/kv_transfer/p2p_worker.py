"""Worker half of the transfer connector (disaggregated prefill/decode).

Producer: serves pulls of offered blocks from the device KV tensors, on the transport's background threads.
A request's blocks are offered from `after_step` of the step that wrote its prompt's KV (never before they are
written) until a plan's `unexpose` (issued when the scheduler gives them back to the pool, so they are never
read after they may be overwritten: unexpose runs in start_step, before that step's forward pass). Reads and
unexposes take one lock, so no read is in progress once unexpose returns.

Consumer: pulls run on a background thread into host rows the worker owns ("staged"); `finished()` reports
each pull as intact or failed; a plan's `loads` copies staged rows into the device blocks the scheduler
allocated for them, before the forward pass. A pull whose request is dropped meanwhile is cancelled and
its rows discarded.
"""
from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.kv_transfer.base import KVConnectorWorker
from tokenmill.kv_transfer.fingerprint import kv_fingerprint
from tokenmill.kv_transfer.host_pool import HostBlockPool
from tokenmill.kv_transfer.p2p_plan import Pull, TransferOutput, TransferPlan
from tokenmill.kv_transfer.p2p_transport import BlockTransport, NotReady, TcpTransport, TransferError

logger = logging.getLogger("tokenmill")
_WAIT_S = 0.02  # an idle step waits this long for a pull or a "done" note rather than spin


class TransferWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, transport: Optional[BlockTransport] = None) -> None:
        self.cfg = config.kv_transfer
        self.config = config
        self.transport = transport or TcpTransport()
        self.cond = threading.Condition()  # guards everything below; pulls and "done" notes notify it
        self.exposed: dict[str, set[int]] = {}
        self.staged: dict[str, np.ndarray] = {}
        self.in_flight: set[str] = set()
        self.cancelled: set[str] = set()
        self.pulled: list[tuple[str, bool]] = []
        self.pull_seconds: list[float] = []
        self.done_sending: list[str] = []
        self.bytes_sent = self.bytes_received = 0
        self.info: Optional[dict] = None
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")
        self.io: Optional[HostBlockPool] = None
        self.fingerprint = ""

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        self.io = HostBlockPool(kv_caches, 0)  # batched device <-> row copies, no slots of its own
        self.fingerprint = kv_fingerprint(self.config, kv_caches, portable=True).hex()  # other machines too
        port = 0
        if self.cfg.is_producer:
            port = self.transport.serve(self, self.cfg.kv_host, self.cfg.kv_port)
            logger.info("KV transfer: serving prefilled blocks on %s:%d", self.cfg.kv_host, port)
        self.info = {"host": advertised_host(self.cfg.kv_host), "port": port, "kv_fingerprint": self.fingerprint}

    # -- producer: the transport's BlockSource -------------------------------------------------
    def read_blocks(self, request_id: str, block_ids: list[int], fingerprint: str) -> np.ndarray:
        if fingerprint != self.fingerprint:
            raise TransferError("KV format mismatch: the decode instance's model or KV layout (fingerprint "
                                f"{fingerprint}) differs from this prefill instance's ({self.fingerprint})")
        with self.cond:
            offered = self.exposed.get(request_id)
            if offered is None:
                raise NotReady()
            if not offered.issuperset(block_ids):
                raise TransferError(f"blocks {sorted(set(block_ids) - offered)} are not offered for {request_id!r}")
            rows = self.io.copy_out(block_ids)  # under the lock: unexpose cannot pass a read in progress
            self.bytes_sent += rows.nbytes
        return rows

    def done(self, request_id: str) -> None:
        with self.cond:
            self.done_sending.append(request_id)
            self.cond.notify_all()

    # -- the step --------------------------------------------------------------------------------
    def start_step(self, plan: TransferPlan) -> None:
        with self.cond:
            for rid in plan.unexpose:
                self.exposed.pop(rid, None)
            for rid in plan.drops:
                if self.staged.pop(rid, None) is None and rid in self.in_flight:
                    self.cancelled.add(rid)
            for pull in plan.pulls:
                self.in_flight.add(pull.request_id)
                self.cancelled.discard(pull.request_id)
            loads = [(self.staged.pop(rid), first, ids) for rid, first, ids in plan.loads]
        for pull in plan.pulls:
            self.pool.submit(self._pull, pull)
        for rows, first, block_ids in loads:
            self.io.load_rows(torch.from_numpy(rows[first:first + len(block_ids)]), block_ids)

    def after_step(self, plan: TransferPlan) -> None:
        if plan.expose:
            with self.cond:
                for rid, block_ids in plan.expose:  # this step's forward pass has written them
                    self.exposed[rid] = set(block_ids)

    def _pull(self, pull: Pull) -> None:
        rid, rows, t0 = pull.request_id, None, time.monotonic()
        try:
            rows = self.transport.pull(pull.host, pull.port, pull.remote_request_id, pull.remote_block_ids,
                                       self.fingerprint, time.monotonic() + self.cfg.pull_timeout_s,
                                       lambda: rid in self.cancelled)
            if pull.kv_fingerprint != self.fingerprint:  # the server checks too; this names the params' side
                raise TransferError("KV format mismatch with the prefill instance (kv_fingerprint differs)")
        except TransferError as e:
            if str(e) != "cancelled":
                logger.warning("KV transfer for %s failed, recomputing its prompt: %s", rid, e)
            rows = None
        except Exception:  # noqa: BLE001 - a background failure must reach the scheduler, as a fallback
            logger.exception("KV transfer for %s failed, recomputing its prompt", rid)
            rows = None
        with self.cond:
            self.in_flight.discard(rid)
            if rid in self.cancelled:
                self.cancelled.discard(rid)
                return
            if rows is not None and rows.size:  # (an empty pull only said done)
                self.staged[rid] = rows
                self.bytes_received += rows.nbytes
                self.pull_seconds.append(time.monotonic() - t0)
            self.pulled.append((rid, rows is not None))
            self.cond.notify_all()

    def finished(self, wait: bool = False) -> Optional[TransferOutput]:
        with self.cond:
            if wait and not (self.pulled or self.done_sending):
                self.cond.wait(_WAIT_S)
            out = TransferOutput(self.pulled, self.done_sending, self.bytes_received, self.bytes_sent, self.info,
                                 self.pull_seconds)
            self.pulled, self.done_sending, self.info, self.pull_seconds = [], [], None, []
            self.bytes_received = self.bytes_sent = 0
        return out if out else None

    def close(self) -> None:
        self.transport.close()
        with self.cond:
            self.cancelled.update(self.in_flight)
        self.pool.shutdown(wait=False, cancel_futures=True)


def advertised_host(bind_host: str) -> str:
    """The address a decode instance should pull from: the bind address, or for a wildcard bind (0.0.0.0, ::)
    this machine's address on its default route (no packet is sent: a UDP socket only picks the route)."""
    if bind_host not in ("0.0.0.0", "::", ""):
        return bind_host
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: never routed anywhere, only chosen a route for
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())
