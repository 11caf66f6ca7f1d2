"""models/resolution_cache.py: a warm start resolves the model (config, dtype, tokenizer class) from the last
start's record, without torch or transformers' config machinery, and ends up with what a cold start gets."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from models import tiny_model
from tokenmill.config import EngineConfig
from tokenmill.models.resolution import resolve_engine_config
from tokenmill.config_snapshot import ConfigSnapshot
from tokenmill.engine.frontend import load_tokenizer

TEXT = "Hello <|im_start|> world, the quick brown fox\n\tjumps ünïcode 12345 <|im_end|>"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]


def _resolve(model: str, **kw):
    config = resolve_engine_config(EngineConfig.from_kwargs(model=model, device="cpu", **kw))
    return config, load_tokenizer(config)


def _tokenizer_view(tok) -> dict:
    ids = tok(TEXT).input_ids
    return {"class": type(tok), "ids": ids, "decoded": tok.decode(ids),
            "skip": tok.decode(ids, skip_special_tokens=True), "eos": tok.eos_token_id, "bos": tok.bos_token_id, "special": tok.all_special_ids, "len": len(tok),
            "chat": tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)}


@pytest.mark.parametrize("arch", ["llama", "qwen3", "mixtral"])
def test_warm_resolution_equals_cold(arch, tmp_path, monkeypatch):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    cold, cold_tok = _resolve(tiny_model(arch), dtype="auto")
    assert cold.model.resolution_key is not None and cold.model.tokenizer_class is None
    assert len(os.listdir(tmp_path / "resolved")) == 1  # written once the tokenizer loaded
    warm, warm_tok = _resolve(tiny_model(arch), dtype="auto")
    assert warm.model.resolution_key is None and warm.model.tokenizer_class is not None
    assert isinstance(warm.model.hf_config, ConfigSnapshot)
    assert warm.model.hf_config.to_dict() == cold.model.hf_config.to_dict()
    for name in ("dtype_name", "max_model_len", "quantization", "pooler", "task", "served_model_name", "tokenizer"):
        assert getattr(warm.model, name) == getattr(cold.model, name), name
    assert warm.model.torch_dtype == cold.model.torch_dtype
    assert _tokenizer_view(warm_tok) == _tokenizer_view(cold_tok)


def test_record_follows_its_inputs(tmp_path, monkeypatch):
    """Another dtype, or a changed config.json, is a miss, not a stale hit."""
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    model = tmp_path / "model"
    subprocess.run(["cp", "-r", tiny_model("llama"), str(model)], check=True)
    first, _ = _resolve(str(model), dtype="float32")
    assert _resolve(str(model), dtype="float32")[0].model.resolution_key is None  # hit
    assert _resolve(str(model), dtype="bfloat16")[0].model.dtype_name == "bfloat16"  # its own record
    cfg = model / "config.json"
    cfg.write_text(cfg.read_text().replace('"max_position_embeddings": 1024', '"max_position_embeddings": 512'))
    changed, _ = _resolve(str(model), dtype="float32")
    assert changed.model.resolution_key is not None and changed.model.max_model_len == 512
    assert first.model.max_model_len == 1024


def test_a_broken_record_is_a_miss(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    _resolve(tiny_model("llama"))
    (record,) = (tmp_path / "resolved").iterdir()
    record.write_bytes(b"not a pickle")
    config, tok = _resolve(tiny_model("llama"))
    assert config.model.resolution_key is not None and tok is not None and "unreadable" in caplog.text
    assert _resolve(tiny_model("llama"))[0].model.resolution_key is None  # rewritten


def test_warm_resolution_imports_no_torch(tmp_path):
    """What the API process of `tokenmill serve` does to start (resolve, then load the tokenizer), in a fresh
    interpreter: with a record, torch never loads (the engine process has it)."""
    env = dict(os.environ, TOKENMILL_CACHE_DIR=str(tmp_path))
    code = ("import sys; from tokenmill.config import EngineConfig; from tokenmill.engine.frontend import "
            "load_tokenizer; from tokenmill.models.resolution import resolve_engine_config; "
            "import tokenmill.serve.api_server; "
            f"c = resolve_engine_config(EngineConfig.from_kwargs(model={tiny_model('qwen2')!r})); t = load_tokenizer(c); "
            "print(c.model.resolution_key is None, 'torch' in sys.modules, c.model.dtype_name, "
            "t('hi').input_ids != [])")
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                           check=True).stdout.split() for _ in range(2)]
    assert runs[0][:1] == ["False"]  # cold: transformers' AutoConfig, which imports torch
    assert runs[1] == ["True", "False", "float32", "True"]
