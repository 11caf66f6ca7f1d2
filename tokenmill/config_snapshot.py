"""A transformers model config as plain data, so the engine process can read it without importing transformers.

Unpickling a transformers config object imports its class's module, and for most families that pulls in
transformers' modelling machinery (torch.distributed.tensor, accelerate, kernels hub): about 2 s of CPU in
the engine process on every start, on the 2 cores the API process needs for its own imports. The engine only
reads a config's attributes, so `tokenmill serve` hands it a ConfigSnapshot: every public data attribute the
real object answers (instance fields, class defaults such as model_type, properties, attribute_map aliases),
nested configs as snapshots, the real to_dict()/to_json_string() results (the KV fingerprint hashes the
latter), and the pickled original for code that must hand the config to transformers itself (`original()`,
which imports transformers then). Torch dtypes are kept by name ("bfloat16", as config.json has them), so
a snapshot unpickles without torch too (the API process keeps one on disk: models/resolution_cache.py). This
module imports neither torch nor transformers.
"""
from __future__ import annotations

import contextlib
import copy
import io
import pickle
import sys
import warnings
from typing import Any

_SCALARS = (bool, int, float, str, bytes, type(None))


class ConfigSnapshot:
    """Attribute access to a transformers config's data, picklable without transformers."""

    def __init__(self, values: dict[str, Any], as_dict: dict[str, Any], as_json: str, source: str,
                 pickled: bytes) -> None:
        self.__dict__.update(values)
        self._as_dict, self._as_json, self._source, self._pickled = as_dict, as_json, source, pickled

    def original(self) -> Any:
        """The transformers config itself (imports transformers): for code that hands the config to
        transformers' own functions (rope initialisers other than the default)."""
        return pickle.loads(self._pickled)

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self._as_dict)

    def to_json_string(self, use_diff: bool = True) -> str:
        return self._as_json

    def __repr__(self) -> str:
        return f"ConfigSnapshot({self._source})"


def _is_hf_config(obj: Any) -> bool:
    mod = sys.modules.get("transformers.configuration_utils")
    return mod is not None and isinstance(obj, mod.PreTrainedConfig)


def _is_torch_dtype(value: Any) -> bool:
    return type(value).__module__ == "torch" and type(value).__name__ == "dtype"


def plain(value: Any) -> Any:
    """value as data that unpickles without transformers or torch (torch dtypes become their names, as
    config.json spells them), or NOT_PLAIN."""
    if isinstance(value, _SCALARS):
        return value
    if _is_torch_dtype(value):
        return str(value).removeprefix("torch.")
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [plain(v) for v in value]
        return NOT_PLAIN if any(v is NOT_PLAIN for v in items) else type(value)(items)
    if isinstance(value, dict):
        items = {plain(k): plain(v) for k, v in value.items()}
        return NOT_PLAIN if any(v is NOT_PLAIN for kv in items.items() for v in kv) else items
    return NOT_PLAIN


NOT_PLAIN = object()


@contextlib.contextmanager
def _quiet():
    """Deprecated aliases (use_return_dict...) warn or log when read; reading them all is not a use."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)


def snapshot(config: Any) -> ConfigSnapshot:
    values = {}
    with _quiet():
        for name in dir(config):
            if name.startswith("_"):
                continue
            try:
                value = getattr(config, name)
            except Exception:  # noqa: BLE001 - a property that does not apply to this config
                continue
            if _is_hf_config(value):
                values[name] = snapshot(value)
            elif not callable(value) and (value := plain(value)) is not NOT_PLAIN:
                values[name] = value
    return ConfigSnapshot(values, config.to_dict(), config.to_json_string(), type(config).__name__,
                          pickle.dumps(config))


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any):
        if _is_hf_config(obj):
            return ConfigSnapshot.__new__, (ConfigSnapshot,), snapshot(obj).__dict__
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """pickle.dumps, with every transformers config inside replaced by its ConfigSnapshot."""
    buf = io.BytesIO()
    _Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()
