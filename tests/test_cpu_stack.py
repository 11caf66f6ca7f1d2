"""The one-call CPU decoder stack (models/cpu_stack.py) gives bit-identical results to the layer-by-layer
Python path: same token ids and the same logprobs to the last bit, for every Llama-family variant (q/k/v bias,
q/k norm, sliding window, GQA), in float32 and bfloat16, for plain decode and speculative verification."""
import random
import shutil

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.models.cpu_stack import CpuStack

_ORIGINAL_RUN = CpuStack.run
pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")


def _prompts(n=6, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 400) for _ in range(rng.choice([5, 30, 70]))] for _ in range(n)]


def _run(path, dtype, use_stack, monkeypatch, **kw):
    taken = []

    def counting(self, input_ids, meta):
        out = _ORIGINAL_RUN(self, input_ids, meta)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(CpuStack, "run", counting)
    llm = LLM(path, dtype=dtype, num_gpu_blocks_override=128, block_size=16, **kw)
    llm.engine.executor.collective_rpc(lambda w: setattr(w.model, "use_cpu_stack", use_stack))
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], sp, use_tqdm=False)
    assert llm.engine.scheduler.kv.is_whole()
    result = [(o.outputs[0].token_ids, [[(t, lp.logprob) for t, lp in s.items()] for s in o.outputs[0].logprobs])
              for o in outs]
    return result, taken


@pytest.mark.parametrize("arch,dtype", [("llama", "float32"), ("qwen2", "float32"), ("qwen3", "bfloat16"),
                                        ("mistral", "bfloat16"), ("qwen3", "float32")])
def test_stack_matches_the_python_layers(tiny, arch, dtype, monkeypatch):
    path = tiny(arch)
    ref, taken_ref = _run(path, dtype, False, monkeypatch)
    got, taken = _run(path, dtype, True, monkeypatch)
    assert not taken_ref and sum(taken) >= 20  # the decode steps ran in the stack, prefills did not
    assert not all(taken)
    assert got == ref


def test_stack_runs_speculative_verification(tiny, monkeypatch):
    path = tiny("llama")
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    ref, _ = _run(path, "float32", False, monkeypatch, speculative_config=spec)
    got, taken = _run(path, "float32", True, monkeypatch, speculative_config=spec)
    assert sum(taken) >= 5
    assert got == ref


def test_stack_leaves_steps_to_the_layers_where_torch_was_measured_faster(tiny, monkeypatch):
    """A matmul plan that gives batched rows to torch (layers/matmul_plan.py) caps the stack at decode-sized
    steps: 12 decoding sequences go layer by layer (their matmuls through torch), 1-8 still take the stack."""
    monkeypatch.setenv("TOKENMILL_MATMUL", "torch")
    path = tiny("llama")
    taken = []

    def counting(self, input_ids, meta):
        out = _ORIGINAL_RUN(self, input_ids, meta)
        taken.append((input_ids.shape[0], out is not None))
        return out

    monkeypatch.setattr(CpuStack, "run", counting)
    llm = LLM(path, dtype="float32", num_gpu_blocks_override=128, block_size=16)
    sp = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    twelve = [{"prompt_token_ids": p} for p in _prompts(12, seed=1)]
    llm.generate(twelve, sp, use_tqdm=False)
    llm.generate(twelve[:3], sp, use_tqdm=False)
    assert any(rows == 12 for rows, _ in taken) and all(not ok for rows, ok in taken if rows > 8)
    assert any(ok for rows, ok in taken if rows == 3)


@pytest.mark.parametrize("dtype,method", [("float32", "int8"), ("bfloat16", "int8"), ("float32", "w8a8")])
def test_stack_runs_int8_linear_layers(tiny, dtype, method, monkeypatch):
    """int8 weight-only and w8a8 layers run in the stack through the int8 kernel, bit-identical to their Python
    `apply` (the LM head quantized too in one case: it runs outside the stack either way)."""
    path = tiny("qwen2")  # q/k/v biases: the int8 kernel adds them as the Python layer does
    kw = dict(quantization=method, quantize_lm_head=dtype == "bfloat16")
    ref, taken_ref = _run(path, dtype, False, monkeypatch, **kw)
    got, taken = _run(path, dtype, True, monkeypatch, **kw)
    assert not taken_ref and sum(taken) >= 20
    assert got == ref
