"""LoRA adapters, the contract side: which adapter a request runs (`LoRARequest`, vLLM's name and fields) and a
PEFT adapter folder's config, read and checked without torch so the API process can refuse a bad adapter
before the engine sees it. The weights are the worker's (layers/lora.py).

An adapter is a PEFT folder as PEFT saves it: `adapter_config.json` (r, lora_alpha, target_modules,
use_rslora) and `adapter_model.safetensors`. What tokenmill does not run is refused with a one-line reason:
a rank over --max-lora-rank, target modules other than the attention and MLP projections, modules_to_save,
DoRA, per-module rank or alpha patterns, LoRA biases.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Optional

import msgspec

# Hugging Face projection names an adapter may target (Llama-family layers; q/k/v and gate/up are merged
# matmuls here, each part with its own A and B)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"


class LoRARequest(msgspec.Struct, array_like=True, frozen=True):
    """The adapter a request runs. lora_int_id (> 0) names this load of the adapter: the worker caches its weights
    by it and the prefix cache keys blocks by it, so an adapter loaded again under the same name gets a new id."""
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be at least 1 (0 is the base model), got {self.lora_int_id}")


@dataclass(frozen=True)
class AdapterConfig:
    rank: int
    scaling: float                 # alpha / r, or alpha / sqrt(r) with rslora
    target_modules: tuple[str, ...]


def read_adapter_config(path: str, max_lora_rank: Optional[int] = None) -> AdapterConfig:
    """The adapter folder's checked config; ValueError with a reason a user can act on. Reads nothing but
    `<path>/adapter_config.json`: path must be a directory holding it (the server never opens other files)."""
    if not isinstance(path, str) or not os.path.isdir(path):
        raise ValueError(f"LoRA adapter path {path!r} is not a directory")
    config_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter path {path!r} has no {CONFIG_FILE} (a PEFT adapter folder has one)")
    try:
        with open(config_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read {config_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    _check_supported(cfg, config_path)
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{config_path}: r must be a positive integer and lora_alpha a number")
    if max_lora_rank is not None and rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {path!r} has rank {rank}, more than --max-lora-rank {max_lora_rank}; "
                         "raise --max-lora-rank")
    if not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise ValueError(f"LoRA adapter path {path!r} has no {WEIGHTS_FILE}")
    scaling = alpha / (math.sqrt(rank) if cfg.get("use_rslora") else rank)
    return AdapterConfig(rank, float(scaling), _targets(cfg.get("target_modules"), config_path))


def _check_supported(cfg: dict, where: str) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {cfg.get('peft_type')!r} is not supported, only LORA")
    refused = [("use_dora", "DoRA adapters"), ("modules_to_save", "modules_to_save (fully trained extra modules)"),
               ("rank_pattern", "per-module ranks (rank_pattern)"),
               ("alpha_pattern", "per-module alphas (alpha_pattern)"),
               ("fan_in_fan_out", "fan_in_fan_out weights")]
    for key, what in refused:
        if cfg.get(key):
            raise ValueError(f"{where}: {what} are not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{where}: LoRA biases (bias={cfg['bias']!r}) are not supported")


def _targets(value, where: str) -> tuple[str, ...]:
    if value == "all-linear":
        return TARGET_MODULES
    if isinstance(value, str):
        raise ValueError(f"{where}: target_modules as a regular expression ({value!r}) is not supported; "
                         f"list module names ({', '.join(TARGET_MODULES)})")
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: target_modules must be a non-empty list of module names")
    unknown = sorted(set(value) - set(TARGET_MODULES))
    if unknown:
        raise ValueError(f"{where}: target modules {unknown} are not supported; LoRA runs on "
                         f"{', '.join(TARGET_MODULES)}")
    return tuple(value)
