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

8-bit KV caches (fp8/int8) move their narrow bytes together with the producer's per-layer K/V scales. When a
load copies them in (start_step, before the forward pass that reads them or could calibrate on its own), each
layer either already has the same scales (fp8; int8 after adopting this producer's earlier): bytes as they
are; or is uncalibrated int8 (no prefill of its own yet): it adopts the producer's scales, bytes as they are;
or was calibrated differently (its own prefill, e.g. a fallback, or another producer first): the received
values are requantized into its scales (dequantize with theirs, quantize with its own, per K/V and head).
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Optional, Sequence

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.kv_transfer.base import KVConnectorWorker
from tokenmill.kv_transfer.fingerprint import kv_fingerprint
from tokenmill.kv_transfer.host_pool import HostBlockPool
from tokenmill.kv_transfer.p2p_params import advertised_host
from tokenmill.step.p2p_plan import Pull, TransferOutput, TransferPlan
from tokenmill.kv_transfer.p2p_transport import Blocks, BlockTransport, NotReady, TcpTransport, TransferError
from tokenmill.layers.attention.kv_quant import KVCacheQuant

logger = logging.getLogger("tokenmill")
_WAIT_S = 0.02  # an idle step waits this long for a pull or a "done" note rather than spin


class TransferWorker(KVConnectorWorker):
    def __init__(self, config: EngineConfig, transport: Optional[BlockTransport] = None) -> None:
        self.cfg = config.kv_transfer
        self.config = config
        self.transport = transport or TcpTransport()
        self.cond = threading.Condition()  # guards everything below; pulls and "done" notes notify it
        self.exposed: dict[str, set[int]] = {}
        self.staged: dict[str, Blocks] = {}
        self.in_flight: set[str] = set()
        self.cancelled: set[str] = set()
        self.pulled: list[tuple[str, bool]] = []
        self.pull_seconds: list[float] = []
        self.done_sending: list[str] = []
        self.bytes_sent = self.bytes_received = 0
        self.info: Optional[dict] = None
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull")
        self.io: Optional[HostBlockPool] = None
        self.quants: list[Optional[KVCacheQuant]] = []  # per KV tensor: an 8-bit cache's quantizer, else None
        self.fingerprint = ""

    def register_kv_caches(self, kv_caches: list[torch.Tensor],
                           kv_quants: Sequence[Optional[KVCacheQuant]] = ()) -> None:
        self.io = HostBlockPool(kv_caches, 0)  # batched device <-> row copies, no slots of its own
        self.quants = list(kv_quants) + [None] * (len(kv_caches) - len(kv_quants))
        self.fingerprint = kv_fingerprint(self.config, kv_caches, portable=True).hex()  # other machines too
        port = 0
        if self.cfg.is_producer:
            port = self.transport.serve(self, self.cfg.kv_host, self.cfg.kv_port)
            logger.info("KV transfer: serving prefilled blocks on %s:%d", self.cfg.kv_host, port)
        self.info = {"host": advertised_host(self.cfg.kv_host), "port": port, "kv_fingerprint": self.fingerprint}

    # -- producer: the transport's BlockSource -------------------------------------------------
    def read_blocks(self, request_id: str, block_ids: list[int], fingerprint: str) -> Blocks:
        if fingerprint != self.fingerprint:
            raise TransferError("KV format mismatch: the decode instance's model or KV layout (fingerprint "
                                f"{fingerprint}) differs from this prefill instance's ({self.fingerprint})")
        scales = self._own_scales()
        with self.cond:
            offered = self.exposed.get(request_id)
            if offered is None:
                raise NotReady()
            if not offered.issuperset(block_ids):
                raise TransferError(f"blocks {sorted(set(block_ids) - offered)} are not offered for {request_id!r}")
            rows = self.io.copy_out(block_ids)  # under the lock: unexpose cannot pass a read in progress
            self.bytes_sent += rows.nbytes
        return Blocks(rows, scales)

    def _own_scales(self) -> Optional[np.ndarray]:
        """This instance's K/V scales, flattened in layer order (None: the cache is not 8-bit). Final once any
        block is offered: a layer calibrates on the first forward pass that writes it, before the offer."""
        quants = [q for q in self.quants if q is not None]
        if not quants:
            return None
        if not all(q.calibrated for q in quants):
            raise TransferError("this prefill instance's int8 KV scales are not calibrated yet")
        return np.concatenate([q.scale.detach().cpu().numpy().ravel() for q in quants]).astype(np.float32)

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
        for blocks, first, block_ids in loads:
            rows = torch.from_numpy(blocks.rows[first:first + len(block_ids)])
            self.io.load_rows(self._into_own_scales(rows, blocks.scales), block_ids)

    def _into_own_scales(self, rows: torch.Tensor, scales: Optional[np.ndarray]) -> torch.Tensor:
        """Received rows made to mean what this instance's KV means: adopt the producer's scales where a layer
        is uncalibrated, requantize (in place: the rows are ours) where it is calibrated differently."""
        views = self.io.per_kv_tensor(rows)
        for view, quant, theirs in zip(views, self.quants, self._split_scales(scales)):
            if quant is None:
                continue
            if not quant.calibrated:
                quant.adopt(theirs)
            elif not torch.equal(quant.scale.cpu(), theirs):
                narrow = view.view(quant.dtype)
                narrow.copy_(quant.requantize(narrow, theirs))
        return rows

    def _split_scales(self, scales: Optional[np.ndarray]) -> list[Optional[torch.Tensor]]:
        """The flat scales per KV tensor ([2, KV heads] each, None where the tensor is not quantized); raises
        TransferError when they do not fit this instance's layers or are not positive and finite."""
        quants = self.quants
        if scales is None:
            if any(q is not None for q in quants):
                raise TransferError("no KV scales came with an 8-bit KV cache's blocks")
            return [None] * len(quants)
        sizes = [0 if q is None else q.scale.numel() for q in quants]
        if sum(sizes) != scales.size or not np.all(np.isfinite(scales) & (scales > 0)):
            raise TransferError(f"received {scales.size} KV scales that do not fit this instance's {sum(sizes)}")
        ends = np.cumsum(sizes)
        return [None if q is None else torch.from_numpy(scales[end - n:end]).view(q.scale.shape)
                for q, n, end in zip(quants, sizes, ends)]

    def after_step(self, plan: TransferPlan) -> None:
        if plan.expose:
            with self.cond:
                for rid, block_ids in plan.expose:  # this step's forward pass has written them
                    self.exposed[rid] = set(block_ids)

    def _pull(self, pull: Pull) -> None:
        rid, blocks, t0 = pull.request_id, None, time.monotonic()
        try:
            blocks = self.transport.pull(pull.host, pull.port, pull.remote_request_id, pull.remote_block_ids,
                                         self.fingerprint, time.monotonic() + self.cfg.pull_timeout_s,
                                         lambda: rid in self.cancelled)
            if pull.kv_fingerprint != self.fingerprint:  # the server checks too; this names the params' side
                raise TransferError("KV format mismatch with the prefill instance (kv_fingerprint differs)")
            if blocks.rows.size:
                self._split_scales(blocks.scales)  # checked here, so a misfit falls back to recomputing
        except TransferError as e:
            if str(e) != "cancelled":
                logger.warning("KV transfer for %s failed, recomputing its prompt: %s", rid, e)
            blocks = None
        except Exception:  # noqa: BLE001 - a background failure must reach the scheduler, as a fallback
            logger.exception("KV transfer for %s failed, recomputing its prompt", rid)
            blocks = None
        with self.cond:
            self.in_flight.discard(rid)
            if rid in self.cancelled:
                self.cancelled.discard(rid)
                return
            if blocks is not None and blocks.rows.size:  # (an empty pull only said done)
                self.staged[rid] = blocks
                self.bytes_received += blocks.rows.nbytes  # the KV blocks' bytes (scales: a few floats more)
                self.pull_seconds.append(time.monotonic() - t0)
            self.pulled.append((rid, blocks is not None))
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

