"""Parallel settings that cannot work are refused before any process starts, with a message that says what
would work (issue 17, item 6). The dying-rank and missing-Ray cases are in test_executor.py."""
from __future__ import annotations

import subprocess
import sys

import pytest

from tokenmill.config import EngineConfig
from tokenmill.models.resolution import resolve_engine_config


def _finalize(model, **kw):
    return resolve_engine_config(EngineConfig.from_kwargs(model=model, **kw), install_default=model is None)


def test_default_model_refuses_tp2_naming_the_sizes_that_work():
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 2 does not divide the model's 9 attention heads "
                                         r"\(3 KV heads\); sizes that work: 1, 3, 9"):
        _finalize(None, tensor_parallel_size=2)


def test_cli_refusal_is_one_line():
    proc = subprocess.run([sys.executable, "-m", "tokenmill.cli", "generate", "--tensor-parallel-size", "2",
                           "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "sizes that work: 1, 3, 9" in last and "Traceback" not in proc.stderr


@pytest.mark.parametrize("kw, message", [
    (dict(tensor_parallel_size=4, pipeline_parallel_size=2), r"world size 8 .* is larger than this machine can run"),
    (dict(pipeline_parallel_size=3), r"--pipeline-parallel-size 3 is more than the model's 2 layers"),
    (dict(pipeline_parallel_size=2, pp_layer_partition="2,1"), r"must list 2 positive layer counts that sum to"),
    (dict(tensor_parallel_size=0), r"must be at least 1"),
    (dict(tensor_parallel_size=2, kv_offloading_size=1), r"--kv-offloading-size .* does not support tensor"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     r"speculative decoding \(ngram\) with pipeline parallel is not supported"),
    (dict(tensor_parallel_size=2, distributed_executor_backend="uniproc"), r"needs the mp or ray executor"),
])
def test_refusals(tiny, monkeypatch, kw, message):
    monkeypatch.setattr("tokenmill.config.usable_cpus", lambda: 2)  # the same answer on a bigger CI machine
    with pytest.raises(ValueError, match=message):
        _finalize(tiny("llama"), dtype="float32", **kw)


def test_expert_parallel_sizes(tiny):
    with pytest.raises(ValueError, match=r"the model's 4 experts do not divide; sizes that work: 1, 2, 4"):
        _finalize(tiny("mixtral"), tensor_parallel_size=3, enable_expert_parallel=True)
