"""--batch-invariant: identical token ids and bit-identical logprobs whether prompts run one at a time, all
together, or in random groups with random chunk sizes, with prefix caching on and off, in fp32 and bf16."""
import random
import shutil

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import batch_invariant

pytestmark = pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")

NUM_PROMPTS = 32


@pytest.fixture(autouse=True)
def _reset_mode():
    yield
    batch_invariant.enable(False)  # the mode is process-wide; leave other tests in the default mode


def _prompts(vocab, seed=0):
    rng = random.Random(seed)
    base = [rng.randrange(3, vocab) for _ in range(40)]
    out = []
    for i in range(NUM_PROMPTS):
        n = rng.choice([1, 3, 17, 40, 65, 120])
        body = [rng.randrange(3, vocab) for _ in range(n)]
        out.append(base[:rng.choice([0, 16, 32])] + body if i % 3 else body)  # some share a cached prefix
    return out


def _run(path, dtype, prompts, groups, mnbt, caching, max_tokens=4):
    llm = LLM(path, dtype=dtype, batch_invariant=True, max_num_batched_tokens=mnbt, num_gpu_blocks_override=256,
              enable_prefix_caching=caching, block_size=16)
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    results = {}
    for group in groups:
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in group], sp, use_tqdm=False)
        for i, o in zip(group, outs):
            c = o.outputs[0]
            results[i] = (c.token_ids, [[(t, lp.logprob) for t, lp in step.items()] for step in c.logprobs])
    assert llm.engine.scheduler.kv.is_whole()
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outputs_do_not_depend_on_the_batch(tiny, dtype):
    path = tiny("qwen3")
    prompts = _prompts(400)
    one_by_one = _run(path, dtype, prompts, [[i] for i in range(NUM_PROMPTS)], 512, True)
    rng = random.Random(1)
    runs = [_run(path, dtype, prompts, [list(range(NUM_PROMPTS))], 512, True),       # all together
            _run(path, dtype, prompts, [list(range(NUM_PROMPTS))], 23, False)]       # small odd chunks, no cache
    for trial in range(1):                                                           # random groups and chunks
        order = list(range(NUM_PROMPTS))
        rng.shuffle(order)
        cuts = sorted(rng.sample(range(1, NUM_PROMPTS), 4))
        groups = [order[a:b] for a, b in zip([0] + cuts, cuts + [NUM_PROMPTS])]
        runs.append(_run(path, dtype, prompts, groups, rng.choice([7, 31, 64]), True))
    for r in runs:
        for i in range(NUM_PROMPTS):
            assert r[i][0] == one_by_one[i][0], f"prompt {i}: tokens differ"
            assert r[i][1] == one_by_one[i][1], f"prompt {i}: logprobs are not bit-identical"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_default_model_outputs_do_not_depend_on_the_batch(dtype):
    prompts = _prompts(49152, seed=3)[:8]
    path = None  # the built-in default model (SmolLM2-135M-Instruct)
    alone = _run(path, dtype, prompts, [[i] for i in range(8)], 512, True, max_tokens=3)
    together = _run(path, dtype, prompts, [list(range(8))], 37, False, max_tokens=3)
    assert together == alone


def test_mode_is_refused_off_cpu(tiny):
    with pytest.raises(ValueError, match="batch-invariant"):
        LLM(tiny("llama"), dtype="float32", batch_invariant=True, device="cuda")


def test_server_concurrent_streams_equal_sequential_bf16(request, tiny):
    """The real server with --batch-invariant --dtype bfloat16: 32 concurrent streamed greedy requests give
    exactly what each gives alone (text and logprobs)."""
    import asyncio
    import json

    import httpx
    from server_utils import shared_server

    server = shared_server(request.config, tiny("llama"), "--batch-invariant", "--dtype", "bfloat16",
                           "--max-num-batched-tokens", "48")
    assert httpx.get(server.url + "/version").json()["batch_invariant"] is True
    model = httpx.get(server.url + "/v1/models").json()["data"][0]["id"]
    prompts = _prompts(400, seed=7)

    async def one(client, p):
        body = {"model": model, "prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                "logprobs": 2, "stream": True}
        text, lps = "", []
        async with client.stream("POST", server.url + "/v1/completions", json=body, timeout=300) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    if choice.get("logprobs"):
                        lps += choice["logprobs"]["token_logprobs"]
        return text, lps

    async def run(concurrent):
        async with httpx.AsyncClient() as client:
            if concurrent:
                return await asyncio.gather(*(one(client, p) for p in prompts))
            return [await one(client, p) for p in prompts]

    sequential = asyncio.run(run(False))
    together = asyncio.run(run(True))
    assert all(len(lps) == 8 for _, lps in sequential)
    assert together == sequential
