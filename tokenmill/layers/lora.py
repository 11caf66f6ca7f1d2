"""LoRA adapters on the linear layers, several in one batch.

Each targeted linear layer (the merged q|k|v and gate|up, o, down) gets a `LoRALayer`: the adapters' A and B
matrices stacked in slots, A `[max_loras, P, R, in]` and per part p B_p `[max_loras, R, out_p]` (P: the
layer's merged parts, R: --max-lora-rank; a smaller rank, or a part an adapter does not target, is zero
padding; the adapter's scaling is folded into B; `present[slot][p]` says which parts a slot's adapter has, so a
layer none of the step's adapters targets costs nothing). It runs as a forward hook, after the layer's own
quant_method (and a row-parallel layer's all-reduce), so it works over any quantization: h = (x A^T) * mask,
then y_p += h_p B_p^T for each part, where mask `[T, n]` keeps for each token only the columns of its adapter's
slot among the step's first n slots (a base-model token keeps none). That is one shrink matmul and one expand
per part for the whole batch, whatever mix of adapters it holds: no loop over requests or slots. The price is
computing every used slot for every token (n x R extra columns per part), small next to the layer itself while
max_loras x R stays well under its width; a step with no adapter row costs nothing.

Tensor parallel: a rank holds the slices of A and B its layer's sharding says. A column-parallel layer (q|k|v,
gate|up) has the whole input: A whole, B's rows of the rank's outputs, no communication. A row-parallel layer (o,
down) has the rank's input columns: A's matching columns, B whole, and the shrunk [T, n * P * R] is all-reduced
before the expand (rank-sized, far smaller than the layer's own all-reduce).

`LoRABatch` is the step's mask, shared by every LoRA layer of a model; the worker's LoRA manager
(worker/lora_manager.py) fills the slots and sets the mask before each forward pass.
"""
from __future__ import annotations

from typing import Optional

import torch
from safetensors.torch import load_file

from tokenmill.distributed import tp_all_reduce
from tokenmill.layers.linear import LinearBase
from tokenmill.lora import WEIGHTS_FILE, AdapterConfig

# our merged layer -> the Hugging Face projections of its parts, in order
LAYER_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
               "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}

# per LoRA layer path: {part index: (A [r, in], B [out_part, r] scaled)}
AdapterWeights = dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]]


class LoRABatch:
    """The step's adapter rows: mask [T, n] (token t runs slot j: 1 at [t, j]; a base-model row is all zero)
    and slots [T] int32 (the slot, -1 for the base model; what the CPU decoder stack reads), both None when no
    token of the step runs an adapter."""

    def __init__(self) -> None:
        self.mask: Optional[torch.Tensor] = None
        self.slots: Optional[torch.Tensor] = None


class LoRALayer:
    """The adapter slots of one linear layer, applied by __call__ as the layer's forward hook."""

    def __init__(self, layer: LinearBase, batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype,
                 device) -> None:
        self.batch = batch
        self.sharding = layer.sharding  # tensor parallel: the rank's part of A's columns or B's rows (load_adapter)
        self.part_sizes = list(layer.shard_sizes)
        self.in_features, self.out_features = layer.in_features, layer.out_features
        self.rank = max_rank
        self.a = torch.zeros(max_loras, len(self.part_sizes), max_rank, layer.in_features, dtype=dtype, device=device)
        self.b = [torch.zeros(max_loras, max_rank, size, dtype=dtype, device=device) for size in self.part_sizes]
        self.present = torch.zeros(max_loras, len(self.part_sizes), dtype=torch.uint8)  # host: the C stack reads it

    def set_slot(self, slot: int, weights: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Put one adapter's parts in `slot` (parts it does not have stay zero)."""
        self.a[slot].zero_()
        for part, b in enumerate(self.b):
            b[slot].zero_()
            self.present[slot, part] = part in weights
            if part in weights:
                r = weights[part][0].shape[0]
                self.a[slot, part, :r].copy_(weights[part][0])
                b[slot, :r].copy_(weights[part][1].T)

    def __call__(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> Optional[torch.Tensor]:
        mask = self.batch.mask
        if mask is None or not self.present[:mask.shape[1]].any():
            return None  # the layer's output as it is
        x = args[0]
        T, n = mask.shape
        P, R = len(self.b), self.rank
        shrunk = x @ self.a[:n].view(n * P * R, self.in_features).T                # [T, n * P * R]
        if self.sharding.in_sharded:  # a row-parallel layer's x is this rank's columns: sum the ranks' parts
            shrunk = tp_all_reduce(shrunk)
        shrunk = shrunk.view(T, n, P, R) * mask[:, :, None, None]                  # only the token's slot
        if P == 1:
            return torch.addmm(output, shrunk.view(T, n * R), self.b[0][:n].view(n * R, -1))
        offset = 0
        for part, b in enumerate(self.b):  # each merged part (q, k, v) from its own B
            size = b.shape[2]
            output[:, offset:offset + size] += shrunk[:, :, part].reshape(T, n * R) @ b[:n].view(n * R, size)
            offset += size
        return output


def attach(model: torch.nn.Module, batch: LoRABatch, max_loras: int, max_rank: int, dtype: torch.dtype,
           device) -> dict[str, LoRALayer]:
    """A LoRALayer hooked on every targetable linear layer of the model, by module path (this stage's
    `layers.<i>...` names, as the model's checkpoint_target gives them)."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, LinearBase) and name.rsplit(".", 1)[-1] in LAYER_PARTS and name.startswith("layers."):
            layers[name] = LoRALayer(module, batch, max_loras, max_rank, dtype, device)
            module.register_forward_hook(layers[name])
    return layers


def load_adapter(path: str, config: AdapterConfig, model: torch.nn.Module, layers: dict[str, LoRALayer],
                 dtype: torch.dtype) -> AdapterWeights:
    """A PEFT adapter's tensors (adapter_model.safetensors) by LoRA layer and part, B scaled. Tensors of another
    pipeline stage's layers are skipped; any other tensor is an error naming it."""
    tensors = load_file(f"{path}/{WEIGHTS_FILE}")
    found: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        name = key.removeprefix("base_model.model.")
        module, kind = _split_key(name, key)
        target = model.checkpoint_target(module + ".weight")
        if target is None:
            continue
        layer_path = target[0].removesuffix(".weight")
        if layer_path not in layers:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} targets a module LoRA does not run on")
        found.setdefault((layer_path, target[1]), {})[kind] = tensor
    weights: AdapterWeights = {}
    for (layer_path, part), ab in found.items():
        layer = layers[layer_path]
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None:
            raise ValueError(f"LoRA adapter {path!r}: {layer_path} part {part} lacks its lora_A or lora_B")
        r = a.shape[0]
        s = layer.sharding
        if (tuple(a.shape) != (r, s.full_in) or tuple(b.shape) != (s.full_sizes[part], r) or r > layer.rank):
            raise ValueError(f"LoRA adapter {path!r}: {layer_path} part {part} has A {tuple(a.shape)} and B "
                             f"{tuple(b.shape)}, which do not fit the layer (rank at most {layer.rank})")
        a = a.narrow(1, *s.in_range)      # this rank's input columns (all of them unless row-parallel)
        b = b.narrow(0, *s.out_ranges[part])  # its rows of the part (all of them unless column-parallel)
        weights.setdefault(layer_path, {})[part] = (a.to(dtype), (b.double() * config.scaling).to(dtype))
    return weights


def _split_key(name: str, key: str) -> tuple[str, str]:
    for kind in ("lora_A", "lora_B"):
        marker = f".{kind}."
        if marker in name and name.endswith(".weight"):
            return name.split(marker)[0], kind
    raise ValueError(f"LoRA adapter tensor {key!r} is neither a lora_A nor a lora_B weight")
