"""The step contract (tokenmill/step/): messages survive msgpack unchanged, a run whose every step crosses
bytes gives the same tokens as one that passes objects, and a decode step's message does not grow with the
request's length (deltas, not whole lists)."""
from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams, step
from tokenmill.step.offload_plan import OffloadOutput, OffloadPlan
from tokenmill.step.p2p_plan import Pull, TransferOutput, TransferPlan
from tokenmill.worker.request_states import RequestStates


def _through_bytes(llm, sizes):
    """Route every step of llm's engine through step.encode/decode, recording each message's size."""
    executor = llm.engine.executor
    run = executor.execute_model

    def execute(so):
        data = step.encode(so)
        sizes.append((so, len(data)))
        out = run(step.decode_scheduler_output(data))
        return step.decode_runner_output(step.encode(out))

    executor.execute_model = execute


def test_messages_round_trip():
    sp = SamplingParams(temperature=0.5, seed=3, logit_bias={5: -1.0}, stop_token_ids=[7])
    so = step.SchedulerOutput(
        new_requests=[step.NewRequest("a", [1, 2, 3], sp, [2], [])],
        scheduled=[step.ScheduledRequest("a", [1, 2, 3], 0, [[4, 9], [5, 0]], [], True, token_bitmask=b"\xff" * 8)],
        finished_req_ids=["z"], num_batched_tokens=3,
        kv_connector_plan=step.ConnectorPlan(
            offload=OffloadPlan(disk_ops=[("write", b"h" * 16, 3)], saves=[(1, 2)], loads=[(0, 4)]),
            transfer=TransferPlan(pulls=[Pull("a", "127.0.0.1", 9000, "p-1", [3, 4], "ab" * 16)], loads=[("b", 1, [6])],
                                  drops=["c"], expose=[("d", [1, 2])], unexpose=["e"], keep_stepping=True)))
    assert step.decode_scheduler_output(step.encode(so)) == so
    out = step.ModelRunnerOutput(sampled={"a": [5]}, logprobs={"a": [([5, 1], [-0.1, -2.5], 1)]},
                                 kv_connector_output=step.ConnectorOutput(
                                     offload=OffloadOutput([(b"h" * 16, True)]),
                                     transfer=TransferOutput(pulled=[("a", True)], done_sending=["d"], bytes_sent=7,
                                                             info={"host": "h", "port": 1, "kv_fingerprint": "ab"})),
                                 expert_load=[[1, 2]])
    assert step.decode_runner_output(step.encode(out)) == out
    only_transfer = step.ModelRunnerOutput(
        kv_connector_output=step.ConnectorOutput(transfer=TransferOutput(done_sending=["x"])))
    assert step.decode_runner_output(step.encode(only_transfer)) == only_transfer


def test_worker_copy_follows_deltas():
    states = RequestStates()
    sp = SamplingParams()
    states.apply(step.SchedulerOutput(new_requests=[step.NewRequest("a", [1, 2], sp, [], [])],
                                      scheduled=[step.ScheduledRequest("a", [1, 2], 0, [[7]], [], True, new=True)]))
    states.apply(step.SchedulerOutput(scheduled=[step.ScheduledRequest("a", [5], 2, [[8]], [5], True)]))
    st = states["a"]
    assert st.block_ids == [[7, 8]] and st.output_token_ids == [5] and st.tokens_before(3) == [1, 2, 5]
    states.apply(step.SchedulerOutput(finished_req_ids=["a"]))
    assert "a" not in states


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 3}])
def test_run_through_bytes_matches_objects(tiny, spec):
    prompts = [[3 + i % 50 for i in range(n)] for n in (5, 37, 70)]
    sps = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
           SamplingParams(temperature=0.8, seed=11, max_tokens=24, ignore_eos=True, repetition_penalty=1.2),
           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, prompt_logprobs=1)]
    kw = dict(dtype="float32", seed=0, max_num_batched_tokens=32, num_gpu_blocks_override=9,
              speculative_config=spec)  # chunked prefill and preemption (9 blocks of 16 for 184 tokens)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs, o.prompt_logprobs) for o in outs]

    expected = run(LLM(tiny("llama"), **kw))
    llm = LLM(tiny("llama"), **kw)
    sizes = []
    _through_bytes(llm, sizes)
    assert run(llm) == expected
    assert llm.engine.stats().num_preemptions > 0
    # decode steps of one request: the message keeps its size while the request grows 60 tokens
    solo = LLM(tiny("llama"), dtype="float32", seed=0)
    sizes.clear()
    _through_bytes(solo, sizes)
    solo.generate([{"prompt_token_ids": prompts[2]}], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    decode = [n for so, n in sizes if so.scheduled and len(so.scheduled[0].token_ids) == 1
              and not so.scheduled[0].new_block_ids]
    assert len(decode) > 30 and max(decode) - min(decode) <= 8  # msgpack ints past 127 take 2 bytes more
