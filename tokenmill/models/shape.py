"""A model's shape for the cost model (perf/): from a preset name, a local HF directory or config.json, a GGUF
file (with its tensors' real bytes when it is served in its own blocks), or the engine's loaded config. Model
resolution, so it lives with the models; the cost model below it imports nothing of this."""
from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any, Optional

from tokenmill.perf.gguf_bytes import GgufBytes, tally
from tokenmill.perf.memory import PRESET_ALIASES, GGUF, PRESETS, ModelShape, normalize_dtype


def gguf_bytes(path: str, config: dict) -> GgufBytes:
    """Tally the file's tensors as the engine loads them for the model `config` (models/gguf.read_config)."""
    from tokenmill.models.gguf import GgufWeights  # numpy (~60 ms): `plan --help` imports this module

    return tally(path, GgufWeights(os.path.abspath(path), config).entries)


def default_gguf() -> Optional[str]:
    """The built-in default model's GGUF file, where its package is installed."""
    from tokenmill.models.default_model import default_model_path  # importlib.metadata: `plan --help` skips it

    try:
        return default_model_path()
    except RuntimeError:
        return None


def gguf_weight_dtype(model: Optional[str], gguf_weights: str = "auto") -> Optional[str]:
    """"gguf" where the engine serves `model` (the default model too) in its GGUF file's own blocks, as
    `--gguf-weights` (auto: a quantized GGUF) decides, else None (a float or quantized-on-load model)."""
    path = default_gguf() if model in (None, "default") else model
    if not path or not path.endswith(".gguf") or not os.path.isfile(path):
        return None
    from tokenmill.models.gguf import weights_mode  # numpy, as in gguf_bytes

    return GGUF if weights_mode(path, gguf_weights) == "native" else None


def load_model_shape(model: Optional[str]) -> ModelShape:
    """A preset name (case-insensitive, an `org/` prefix is ignored), a local HF directory (config.json
    alone suffices), a config.json path, a .gguf file (its tensors' bytes in `gguf`), or None for the built-in
    default model (its Q4_1 GGUF; the SmolLM2-135M preset where the package is missing)."""
    if model is None or model == "default":
        model = default_gguf() or "SmolLM2-135M"
    if model.endswith(".gguf") and os.path.isfile(model):
        from tokenmill.models.gguf import read_config  # numpy, as in gguf_bytes

        config = read_config(model)
        shape = ModelShape.from_hf_config(config, name=os.path.basename(model).removesuffix(".gguf"))
        return replace(shape, gguf=gguf_bytes(model, config))
    if os.path.isdir(model) or (os.path.isfile(model) and model.endswith(".json")):
        path = os.path.join(model, "config.json") if os.path.isdir(model) else model
        if not os.path.isfile(path):
            raise ValueError(f"model directory {model} has no config.json")
        with open(path) as f:
            cfg = json.load(f)
        return ModelShape.from_hf_config(cfg, name=os.path.basename(os.path.normpath(model)))
    key = model.rsplit("/", 1)[-1].lower()
    key = PRESET_ALIASES.get(key, key)
    for name, cfg in PRESETS.items():
        if name.lower() == key.lower():
            return ModelShape.from_hf_config(cfg, name=name)
    if not os.path.exists(model):  # the same words as serve and generate, then what only plan also takes
        from tokenmill.models.resolution import model_not_found_message  # not imported for --help

        raise ValueError(f"{model_not_found_message(model)}; or name a preset: {', '.join(PRESETS)}")
    raise ValueError(f"model {model!r} is neither a local directory with config.json nor a preset; presets: "
                     f"{', '.join(PRESETS)}")


def engine_shape(hf_config: Any, float_dtype: str) -> tuple[ModelShape, str]:
    """(shape, weight dtype) of a model as the engine loaded it: a GGUF served in its own blocks (its config
    names the file: models/gguf.py) is weight dtype gguf with the file's tensor bytes; any other model's weights
    are in the engine's `float_dtype`."""
    fields = hf_config if isinstance(hf_config, dict) else vars(hf_config)
    gguf_file = fields.get("tokenmill_gguf_file")
    if gguf_file and os.path.isfile(gguf_file):
        return load_model_shape(gguf_file), GGUF
    return ModelShape.from_hf_config(hf_config), normalize_dtype(float_dtype)
