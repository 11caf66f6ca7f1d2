"""Tensor and pipeline parallel through the whole engine (mp executor: real worker processes joined by gloo)
give the single-process engine's greedy tokens, and logprobs within 1e-4, for a batch of prompts of varied
lengths with chunked prefill and preemption."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.perf import parallel as perf_parallel
from tokenmill.perf.memory import ModelShape

pytestmark = pytest.mark.distributed

PROMPTS = [[3 + (7 * i + n) % 60 for i in range(n)] for n in (4, 23, 41, 66)]
# 16-token steps chunk the prefills; 12 blocks of 16 tokens for ~250 tokens of requests forces preemption.
ENGINE = dict(dtype="float32", seed=0, max_num_batched_tokens=16, num_gpu_blocks_override=12)


def _run(model: str, **kw):
    llm = LLM(model, **ENGINE, **kw)
    try:
        sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)
        _check_plan_agrees(llm)
        return [o.outputs[0] for o in outs], llm.engine.stats().num_preemptions
    finally:
        llm.engine.shutdown()


def _rank_memory(worker) -> tuple[int, int]:
    """(parameter bytes, KV bytes per token) of one rank."""
    params = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    return params, worker.bytes_per_block() // worker.config.cache.block_size


def _check_plan_agrees(llm) -> None:
    """tokenmill plan's per-device weights and KV bytes per token are what each rank allocated."""
    cfg = llm.engine.config
    if cfg.model.online_quantization is not None:
        return
    split = perf_parallel.Split(tp=cfg.parallel.tensor_parallel_size, pp=cfg.parallel.pipeline_parallel_size)
    stages = perf_parallel.device_memory(ModelShape.from_hf_config(cfg.model.hf_config), split, "fp32", "fp32",
                                         2**30, 0.9, 64, 16, 1)["stages"]
    for rank, (params, kv) in enumerate(llm.engine.executor.collective_rpc(_rank_memory)):
        stage = stages[rank // split.tp]
        assert (params, kv) == (stage["weight_bytes"], stage["kv_bytes_per_token"]), f"rank {rank}"


def _assert_same(got, expected) -> None:
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        for lp_g, lp_e in zip(g.logprobs, e.logprobs):
            assert lp_g.keys() == lp_e.keys()
            for t in lp_e:
                assert abs(lp_g[t].logprob - lp_e[t].logprob) < 1e-4


@pytest.fixture(scope="module")
def reference(tiny):
    return {q: _run(tiny("llama"), quantization=q)[0] for q in (None, "int8")}


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_split_model_matches_one_process(tiny, reference, tp, pp):
    got, preemptions = _run(tiny("llama"), tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert preemptions > 0
    _assert_same(got, reference[None])


def test_int8_tensor_parallel_matches_int8_one_process(tiny, reference):
    got, _ = _run(tiny("llama"), tensor_parallel_size=2, quantization="int8")
    _assert_same(got, reference["int8"])


def test_pipeline_keeps_a_step_in_flight_per_stage(tiny):
    """PP=2: the running requests are spread over two steps in flight, so both stages have work."""
    llm = LLM(tiny("llama"), dtype="float32", pipeline_parallel_size=2)
    engine, in_flight, sizes = llm.engine, [], []
    submit = engine.executor.execute_model

    def recording(sched, non_block=False):
        in_flight.append(len(engine.batch_queue) + 1)
        sizes.append(len(sched.scheduled))
        return submit(sched, non_block)

    engine.executor.execute_model = recording
    try:
        sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS * 2], sp)
    finally:
        engine.shutdown()
    assert all(len(o.outputs[0].token_ids) == 12 for o in outs)
    assert max(in_flight) == 2 and 4 in sizes  # 8 decoding requests: two steps of 4
