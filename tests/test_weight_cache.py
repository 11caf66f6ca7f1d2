"""The weight cache (tokenmill/models/weight_cache.py): a second load maps the first one's cached weights
zero-copy, with the same tensors, ties and packed panels as a load from the checkpoint."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from models import tiny_model


def _load(path: str, dtype=torch.bfloat16):
    from transformers import AutoConfig

    from tokenmill.layers.attention import get_attention_backend
    from tokenmill.models.loader import load_model

    return load_model(path, AutoConfig.from_pretrained(path), dtype, "cpu", get_attention_backend("cpu"),
                      max_positions=256)


def _tensors(model) -> dict[str, torch.Tensor]:
    out = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    out.update({f"{n}.panels": m.packed_weight.data for n, m in model.named_modules()
                if getattr(m, "packed_weight", None) is not None})
    return out


@pytest.fixture
def cache_env(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE_MIN_MB", "0")  # tiny test models are cached too
    return tmp_path / "cache" / "weights"


def test_second_load_maps_the_cache_with_identical_weights(cache_env, tmp_path):
    path = shutil.copytree(tiny_model("llama"), tmp_path / "model")
    first = _load(str(path))
    files = os.listdir(cache_env)
    assert len(files) == 1 and first.checkpoint_bytes_read > 0
    second = _load(str(path))
    assert second.checkpoint_bytes_read == 0 and os.listdir(cache_env) == files  # read nothing, wrote nothing
    a, b = _tensors(first), _tensors(second)
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
    cached = os.path.join(cache_env, files[0])
    mapped = second.embed_tokens.weight.untyped_storage()
    assert mapped.nbytes() == os.path.getsize(cached)  # a view into the whole file's mapping: no copy
    if first.tie_word_embeddings:
        assert second.lm_head.weight is second.embed_tokens.weight
    # copy-on-write: writing a mapped weight changes neither the file nor the next load
    with torch.no_grad():
        second.embed_tokens.weight.add_(1.0)
    assert torch.equal(_load(str(path)).embed_tokens.weight, first.embed_tokens.weight)


def test_a_changed_checkpoint_or_dtype_gets_its_own_entry(cache_env, tmp_path):
    path = shutil.copytree(tiny_model("llama"), tmp_path / "model")
    _load(str(path))
    _load(str(path), torch.float32)
    assert len(os.listdir(cache_env)) == 2
    weights = os.path.join(path, "model.safetensors")
    os.utime(weights, ns=(0, os.stat(weights).st_mtime_ns + 10**9))  # a rewritten checkpoint: a new key
    assert _load(str(path)).checkpoint_bytes_read > 0
    assert len(os.listdir(cache_env)) == 3


def test_an_unusable_cache_file_falls_back_to_the_checkpoint(cache_env, tmp_path):
    path = shutil.copytree(tiny_model("llama"), tmp_path / "model")
    expected = _tensors(_load(str(path)))
    (entry,) = os.listdir(cache_env)
    with open(os.path.join(cache_env, entry), "wb") as f:
        f.write(b"not a safetensors file")
    model = _load(str(path))
    assert model.checkpoint_bytes_read > 0
    assert all(torch.equal(t, expected[n]) for n, t in _tensors(model).items())


def test_small_checkpoints_and_off_are_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    _load(tiny_model("llama"))  # default minimum 64 MB: a tiny model is not worth a file
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE_MIN_MB", "off")
    _load(tiny_model("llama"))
    assert not os.path.exists(tmp_path / "cache" / "weights")
    monkeypatch.setenv("TOKENMILL_WEIGHT_CACHE_MIN_MB", "lots")
    with pytest.raises(ValueError, match="TOKENMILL_WEIGHT_CACHE_MIN_MB"):
        _load(tiny_model("llama"))
