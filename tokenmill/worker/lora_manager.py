"""The worker's LoRA adapters (--enable-lora): up to --max-cpu-loras loaded in host memory (least recently used
dropped, keyed by lora_int_id: loaded from the path once per id), and up to --max-loras of them in the model's
slots (layers/lora.py). The scheduler never runs more than max_loras distinct adapters in one step, so the
step's adapters always find slots: ones no request of the step uses give theirs up, least recently used first.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Optional, Sequence

import numpy as np
import torch

from tokenmill.config import LoRAConfig
from tokenmill.layers.lora import AdapterWeights, LoRABatch, attach, load_adapter
from tokenmill.lora import LoRARequest, read_adapter_config

logger = logging.getLogger("tokenmill")


class LoRAManager:
    def __init__(self, model: torch.nn.Module, config: LoRAConfig, dtype: torch.dtype, device) -> None:
        self.model, self.config, self.dtype, self.device = model, config, dtype, device
        self.batch = LoRABatch()
        self.layers = attach(model, self.batch, config.max_loras, config.max_lora_rank, dtype, device)
        self.host: OrderedDict[int, AdapterWeights] = OrderedDict()  # lora_int_id -> weights, LRU first
        self.slots: list[Optional[int]] = [None] * config.max_loras   # slot -> lora_int_id it holds
        self.last_used = [0] * config.max_loras
        self.num_steps = 0
        self._told_stack = device != "cpu" or dtype == torch.float32  # the CPU stack's fallback, logged once

    def prepare(self, loras: Sequence[Optional[LoRARequest]], qlens: np.ndarray) -> bool:
        """Put the step's adapters (one per request, None for the base model; qlens: each request's tokens) in
        slots and set the step's token -> slot mask. Returns whether any token runs an adapter."""
        self.num_steps += 1
        if not any(loras):
            self.batch.mask = self.batch.slots = None
            return False
        needed = {lr.lora_int_id: lr for lr in loras if lr is not None}
        if len(needed) > len(self.slots):
            raise RuntimeError(f"a step runs {len(needed)} adapters but there are {len(self.slots)} slots "
                               "(--max-loras): the scheduler should have held some back")
        slot_of = {}
        for lid, lr in needed.items():
            slot_of[lid] = self._slot(lr, needed)
            self.last_used[slot_of[lid]] = self.num_steps
        slots = np.array([slot_of[lr.lora_int_id] if lr is not None else -1 for lr in loras], dtype=np.int64)
        rows = np.repeat(slots, qlens)
        n = int(slots.max()) + 1
        mask = np.zeros((len(rows), n), dtype=np.float32)
        hit = np.nonzero(rows >= 0)[0]
        mask[hit, rows[hit]] = 1.0
        self.batch.mask = torch.from_numpy(mask).to(self.device, self.dtype)
        self.batch.slots = torch.from_numpy(rows.astype(np.int32)).to(self.device)
        if not self._told_stack:
            self._told_stack = True
            logger.info("LoRA on a %s model: steps with adapter rows run layer by layer (the one-call CPU decoder "
                        "stack applies float32 adapters only)", self.dtype)
        return True

    def _slot(self, lr: LoRARequest, needed: dict) -> int:
        """lr's slot, filling one (a free one, the lowest first, else the least recently used that no adapter
        of this step holds) when it has none."""
        if lr.lora_int_id in self.slots:
            return self.slots.index(lr.lora_int_id)
        free = [s for s, lid in enumerate(self.slots) if lid is None]
        if free:
            slot = free[0]
        else:
            slot = min((s for s, lid in enumerate(self.slots) if lid not in needed), key=self.last_used.__getitem__)
        weights = self._weights(lr)
        for path, layer in self.layers.items():
            layer.set_slot(slot, weights.get(path, {}))
        self.slots[slot] = lr.lora_int_id
        return slot

    def _weights(self, lr: LoRARequest) -> AdapterWeights:
        weights = self.host.get(lr.lora_int_id)
        if weights is not None:
            self.host.move_to_end(lr.lora_int_id)
            return weights
        config = read_adapter_config(lr.lora_path, self.config.max_lora_rank)
        weights = load_adapter(lr.lora_path, config, self.model, self.layers, self.dtype)
        self.host[lr.lora_int_id] = weights
        while len(self.host) > self.config.max_cpu_loras:
            self.host.popitem(last=False)
        logger.info("LoRA adapter %s (id %d) loaded from %s: rank %d, %d layers", lr.lora_name, lr.lora_int_id,
                    lr.lora_path, config.rank, len(weights))
        return weights
