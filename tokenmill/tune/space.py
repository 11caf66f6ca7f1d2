"""The search space of `tokenmill tune`: configurations as plain dicts of `tokenmill serve` flags plus the
offered load, their stable hashes, and the command lines they become.

A configuration maps a serve flag's name (`max_num_seqs` for `--max-num-seqs`) to a value; None means the
flag's default and is left off the command line, True/False become `--flag` / `--no-flag`, a dict becomes
JSON (`--speculative-config`). Two keys are not server flags but the load the benchmark offers:
`max_concurrency` and `request_rate`. The baseline is the configuration with every server flag at its
default.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import random
import shlex
from typing import Any, Optional

LOAD_KEYS = ("max_concurrency", "request_rate")
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
MAX_GRID = 4096  # larger grids are sampled (seeded) down to this many configurations


def default_space(device: str = "cpu", num_devices: int = 1, native_bf16: bool = False) -> dict[str, list]:
    """Dims worth trying on any model: each technique on and off, a few batch limits. bf16 only where the
    hardware has it natively (emulated bf16 is slower than fp32), TP only with several accelerators."""
    space: dict[str, list] = {
        "quantization": [None, "int8"],
        "kv_cache_dtype": [None, "int8"],
        "speculative_config": [None, NGRAM],
        "max_num_seqs": [None, 16, 64],
        "max_num_batched_tokens": [None, 512],
        "enable_prefix_caching": [None, False],
        "data_parallel_size": [None, 2],
    }
    if device == "cuda" or native_bf16:
        space["dtype"] = [None, "bfloat16"]
    if device == "cuda" and num_devices >= 2:
        space["tensor_parallel_size"] = [None, 2]
    return space


def load_space(text: Optional[str]) -> dict[str, list]:
    """`--space`: a JSON object (or a file holding one) of flag name -> list of values (a lone value pins it)."""
    if not text:
        return {}
    if os.path.isfile(text):
        with open(text) as f:
            text = f.read()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--space is neither a JSON object nor a file holding one: {e.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError("--space must be a JSON object of flag name -> list of values")
    return {k.replace("-", "_").lstrip("_"): (v if isinstance(v, list) else [v]) for k, v in obj.items()}


def check_space(space: dict[str, list], serve_options: set[str]) -> None:
    """Every key must be a `tokenmill serve` flag or a load key; every dim needs a value."""
    for key, values in space.items():
        if key not in LOAD_KEYS and flag_of(key) not in serve_options:
            raise ValueError(f"--space: {key!r} is not a `tokenmill serve` flag (nor one of {', '.join(LOAD_KEYS)})")
        if not values:
            raise ValueError(f"--space: {key!r} has no values")


def grid(space: dict[str, list], seed: int = 0) -> list[dict[str, Any]]:
    """Every combination of the dims (seeded sample of MAX_GRID when larger), the baseline first."""
    keys = sorted(space)
    size = math.prod(len(space[k]) for k in keys)
    combos = itertools.product(*(space[k] for k in keys))
    configs = [dict(zip(keys, c)) for c in combos] if size <= MAX_GRID else \
        [{k: random.Random(seed + i).choice(space[k]) for k in keys} for i in range(MAX_GRID)]
    unique = {config_key(c): c for c in configs}
    return list(unique.values())


def canonical(config: dict[str, Any]) -> dict[str, Any]:
    """Without the keys at their defaults (None), so equal configurations compare and hash equal."""
    return {k: v for k, v in sorted(config.items()) if v is not None}


def config_key(config: dict[str, Any], extra: Any = None) -> str:
    text = json.dumps([canonical(config), extra], sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def server_part(config: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in canonical(config).items() if k not in LOAD_KEYS}


def flag_of(key: str) -> str:
    return "--" + key.replace("_", "-")


def serve_flags(config: dict[str, Any]) -> list[str]:
    """The `tokenmill serve` arguments of a configuration's server flags."""
    out: list[str] = []
    for key, value in server_part(config).items():
        if value is True:
            out.append(flag_of(key))
        elif value is False:
            out.append("--no-" + key.replace("_", "-"))
        else:
            out += [flag_of(key), json.dumps(value, separators=(",", ":")) if isinstance(value, dict) else str(value)]
    return out


def serve_command(model: Optional[str], fixed_args: list[str], config: dict[str, Any]) -> str:
    """The exact command line that serves `config`."""
    return shlex.join(["tokenmill", "serve", *([model] if model else []), *fixed_args, *serve_flags(config)])


def describe(config: dict[str, Any]) -> str:
    """Short label: what differs from the defaults, and the load."""
    parts = []
    for key, value in canonical(config).items():
        if key == "speculative_config" and isinstance(value, dict):
            parts.append(f"spec={value.get('method')}:{value.get('num_speculative_tokens', '')}")
        elif key == "max_concurrency":
            parts.append(f"conc={value}")
        elif key == "request_rate":
            parts.append(f"rate={value}")
        else:
            short = {"enable_prefix_caching": "prefix", "max_num_seqs": "seqs", "max_num_batched_tokens": "mnbt",
                     "kv_cache_dtype": "kv", "quantization": "quant", "data_parallel_size": "dp",
                     "tensor_parallel_size": "tp", "pipeline_parallel_size": "pp"}.get(key, key)
            parts.append(f"{short}={'on' if value is True else 'off' if value is False else value}")
    server = [p for p in parts if not p.startswith(("conc=", "rate="))]
    load = [p for p in parts if p.startswith(("conc=", "rate="))]
    return " ".join((server or ["default"]) + load)
