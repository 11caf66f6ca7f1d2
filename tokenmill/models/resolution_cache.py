"""What a warm start reuses from the last start on the same model: its config (as a ConfigSnapshot), the
dtype --dtype resolved to, and the tokenizer class transformers' AutoTokenizer chose.

Reading a config through transformers imports transformers' config machinery and torch (about 4 s of CPU
on a small machine), and so does AutoTokenizer, which reads the config to pick a class. With this record the
API process of `tokenmill serve` needs neither: the snapshot is plain data, the dtype a name, and the
tokenizer class is imported and loaded directly, the same class with the same files as AutoTokenizer would
give. The engine process imports torch anyway, in parallel (engine/prestart.py).

The key covers everything the record was derived from: the files' paths, sizes and mtimes (config.json,
generation_config.json, the tokenizer's files), transformers' and tokenmill's versions, the requested dtype,
the device, and for --dtype auto on a CPU this CPU and TOKENMILL_MATMUL. A miss falls back to transformers
and writes the record once the tokenizer is loaded (engine/frontend.load_tokenizer; a start with
skip_tokenizer_init writes none).
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any, Optional

import tokenmill
from tokenmill.config_snapshot import ConfigSnapshot, snapshot
from tokenmill.host import cache_root, cpu_key

logger = logging.getLogger("tokenmill")

FORMAT = 3  # bump when a record's meaning changes (2: --dtype auto is bfloat16 for a GGUF served natively;
            # 3: a GGUF's tokenizer is its tokenizer.json as converted, not AutoTokenizer's model class)
_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
          "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
          "chat_template.json", "modules.json", "sentence_bert_config.json")


@dataclass
class Resolution:
    hf_config: Any                  # config_snapshot.ConfigSnapshot
    dtype: str                      # torch attribute name ("bfloat16")
    tokenizer_class: str            # "module:name" of the class AutoTokenizer chose (a GGUF's: models/gguf.py)


def _stamp(folder: str) -> list:
    out = []
    for name in _FILES:
        try:
            st = os.stat(os.path.join(folder, name))
        except OSError:
            continue
        out.append((name, st.st_size, st.st_mtime_ns))
    return out


def key(model_dir: str, tokenizer: str, requested_dtype: Any, device: str) -> str:
    try:
        transformers_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        transformers_version = ""
    parts = [FORMAT, tokenmill.__version__, transformers_version, os.path.abspath(model_dir), _stamp(model_dir),
             os.path.abspath(tokenizer), _stamp(tokenizer) if os.path.isdir(tokenizer) else None,
             str(requested_dtype), device, cpu_key() if device == "cpu" else None,
             os.environ.get("TOKENMILL_MATMUL")]
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:24]


def _path(k: str) -> str:
    return os.path.join(cache_root(), "resolved", f"{k}.pkl")


def load(k: str) -> Optional[Resolution]:
    """The record under key k, or None (never written, unreadable, or from another format)."""
    try:
        with open(_path(k), "rb") as f:
            res = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken record is a miss, and gets rewritten
        logger.warning("ignoring the unreadable resolution record %s: %s", _path(k), e)
        return None
    return res if isinstance(res, Resolution) else None


def save(k: str, hf_config: Any, dtype: str, tokenizer: Any) -> None:
    """Write the record (atomically; a failure only costs the next start its shortcut)."""
    snap = hf_config if isinstance(hf_config, ConfigSnapshot) else snapshot(hf_config)
    cls = type(tokenizer)
    res = Resolution(snap, dtype, f"{cls.__module__}:{cls.__qualname__}")
    path = _path(k)
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(res, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not write the resolution record %s: %s", path, e)


def load_tokenizer_class(spec: str, path: str) -> Any:
    """Load a tokenizer with the class a record names (what AutoTokenizer.from_pretrained resolved to)."""
    module, name = spec.split(":")
    return getattr(importlib.import_module(module), name).from_pretrained(path)
