"""The connectors an engine runs at once (KV tiers and disaggregated transfer), behind the one connector the
scheduler and the worker talk to. Each call goes to both parts; plans and outputs travel as one typed pair
(step.py's ConnectorPlan / ConnectorOutput, None where neither part has anything).

Lookups: a request's hit comes from one part only (the transfer part first, for a request whose KV is on a
prefill instance; else the tiers). The part that answered owns the request's hit until release.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from tokenmill.messages import EngineCoreRequest, Request
from tokenmill.kv_transfer.base import ExternalHit, KVConnectorScheduler, KVConnectorWorker
from tokenmill.step import ConnectorOutput, ConnectorPlan


class CompositeScheduler(KVConnectorScheduler):
    def __init__(self, offload: Optional[KVConnectorScheduler], transfer: Optional[KVConnectorScheduler]) -> None:
        self.offload, self.transfer = offload, transfer
        self.parts = [c for c in (transfer, offload) if c is not None]  # lookup order
        self.owner: dict[str, KVConnectorScheduler] = {}

    def lookup(self, req: Request, num_device_tokens: int) -> ExternalHit:
        self.owner.pop(req.request_id, None)
        hit = ExternalHit(0, True)
        for part in self.parts:
            hit = part.lookup(req, num_device_tokens)
            if hit.num_tokens or not hit.ready:
                self.owner[req.request_id] = part
                for other in self.parts:
                    if other is not part:
                        other.release(req)  # it may hold what it found; only one part supplies the hit
                break
        return hit

    def check_request(self, req: EngineCoreRequest) -> None:
        for part in self.parts:
            part.check_request(req)

    def on_allocated(self, req: Request, block_ids: list[int]) -> None:
        for part in self.parts:
            part.on_allocated(req, block_ids if self.owner.get(req.request_id) is part else [])

    def release(self, req: Request) -> None:
        self.owner.pop(req.request_id, None)
        for part in self.parts:
            part.release(req)

    def is_ready(self, req: Request) -> bool:
        part = self.owner.get(req.request_id)
        return part is None or part.is_ready(req)

    def first_token(self, req: Request) -> Optional[int]:
        part = self.owner.get(req.request_id)
        return None if part is None else part.first_token(req)

    def on_evict(self, block_id: int, block_hash: bytes) -> None:
        for part in self.parts:
            part.on_evict(block_id, block_hash)

    def on_prompt_scheduled(self, req: Request, block_ids: list[int]) -> None:
        for part in self.parts:
            part.on_prompt_scheduled(req, block_ids)

    def request_finished(self, req: Request, block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        hold, params = False, None
        for part in self.parts:
            h, p = part.request_finished(req, block_ids)
            hold, params = hold or h, params or p
        return hold, params

    def take_freeable(self) -> list[str]:
        return [rid for part in self.parts for rid in part.take_freeable()]

    def build_plan(self) -> Optional[ConnectorPlan]:
        plan = ConnectorPlan(offload=self.offload.build_plan() if self.offload else None,
                             transfer=self.transfer.build_plan() if self.transfer else None)
        return plan if (plan.offload is not None or plan.transfer is not None) else None

    def update(self, output: Optional[ConnectorOutput]) -> None:
        for name in ("offload", "transfer"):
            part = getattr(self, name)
            if part is not None:
                part.update(getattr(output, name) if output is not None else None)

    def counters(self) -> dict[str, int]:
        return {k: v for part in self.parts for k, v in part.counters().items()}


class CompositeWorker(KVConnectorWorker):
    def __init__(self, offload: Optional[KVConnectorWorker], transfer: Optional[KVConnectorWorker]) -> None:
        self.offload, self.transfer = offload, transfer
        self.parts = [c for c in (offload, transfer) if c is not None]

    def register_kv_caches(self, kv_caches: list[torch.Tensor], kv_quants: Sequence = ()) -> None:
        for part in self.parts:
            part.register_kv_caches(kv_caches, kv_quants)

    def start_step(self, plan: ConnectorPlan) -> None:
        # Tiers first: their saves copy out blocks the pool hands out again this step, before any load.
        if plan.offload is not None:
            self.offload.start_step(plan.offload)
        if plan.transfer is not None:
            self.transfer.start_step(plan.transfer)

    def after_step(self, plan: ConnectorPlan) -> None:
        if plan.transfer is not None:
            self.transfer.after_step(plan.transfer)
        if plan.offload is not None:
            self.offload.after_step(plan.offload)

    def finished(self, wait: bool = False) -> Optional[ConnectorOutput]:
        # Only one part may block briefly (the transfer part when present: pulls and "done" notes arrive there).
        out = ConnectorOutput(
            offload=self.offload.finished(wait and self.transfer is None) if self.offload else None,
            transfer=self.transfer.finished(wait) if self.transfer else None)
        return out if (out.offload is not None or out.transfer is not None) else None

    def close(self) -> None:
        for part in self.parts:
            part.close()
