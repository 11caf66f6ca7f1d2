"""config_snapshot.py: the engine process gets the model's transformers config as plain data; it must
read back without transformers and answer every data attribute as the real config does."""
from __future__ import annotations

import pickle
import subprocess
import sys

import pytest

from models import tiny_model
from tokenmill import config_snapshot


def _config(arch: str):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_model(arch))


def _data_attributes(config) -> dict:
    out = {}
    for name in dir(config):
        if name.startswith("_"):
            continue
        try:
            value = getattr(config, name)
        except Exception:  # noqa: BLE001
            continue
        if not callable(value) and (value := config_snapshot.plain(value)) is not config_snapshot.NOT_PLAIN:
            out[name] = value  # torch dtypes by name
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen3_moe"])
def test_snapshot_answers_like_the_config(arch):
    real = _config(arch)
    snap = pickle.loads(config_snapshot.dumps({"nested": [real]}))["nested"][0]
    assert isinstance(snap, config_snapshot.ConfigSnapshot)
    expected = _data_attributes(real)
    assert {"model_type", "hidden_size", "num_key_value_heads", "vocab_size"} <= set(expected)
    for name, value in expected.items():
        assert getattr(snap, name) == value, name
    assert snap.to_json_string() == real.to_json_string() and snap.to_dict() == real.to_dict()


def test_snapshot_unpickles_without_transformers_or_torch():
    data = config_snapshot.dumps((_config("llama"), "other args"))
    code = ("import pickle, sys; cfg, rest = pickle.loads(sys.stdin.buffer.read()); "
            "print('transformers' in sys.modules, 'torch' in sys.modules, cfg.model_type, cfg.hidden_size, "
            "cfg.dtype, rest)")
    out = subprocess.run([sys.executable, "-c", code], input=data, capture_output=True, check=True).stdout
    assert out.decode().split() == ["False", "False", "llama", "64", "float32", "other", "args"]


def test_original_is_the_real_config_for_transformers_functions():
    from tokenmill.layers.rotary import compute_inv_freq

    real = _config("llama")  # llama3 rope scaling: transformers' own initialiser
    snap = pickle.loads(config_snapshot.dumps(real))
    assert snap.original().to_dict() == real.to_dict()
    head_dim = real.hidden_size // real.num_attention_heads
    (a, sa), (b, sb) = compute_inv_freq(snap, head_dim), compute_inv_freq(real, head_dim)
    assert sa == sb and a.equal(b)
