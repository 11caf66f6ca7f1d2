"""Front-side output processing without a model: deltas, prompt logprobs over several chunks, stop strings."""
from tokenmill.engine.output_processor import OutputProcessor, RequestState
from tokenmill.engine.request import EngineCoreOutput, FinishReason
from tokenmill.sampling_params import SamplingParams


def _entry(token):
    return ([token], [-1.0], 1)


def test_delta_mode_sends_all_prompt_logprobs_once_after_chunked_prefill():
    prompt = list(range(10, 20))
    proc = OutputProcessor(tokenizer=None)
    sp = SamplingParams(max_tokens=2, prompt_logprobs=0, detokenize=False)
    proc.add_request(RequestState("r", None, prompt, sp, None, delta=True), ["r"])
    # Chunk 1 covers positions 0..4 (scores prompt tokens 1..5): no token sampled yet.
    outs, _ = proc.process([EngineCoreOutput("r", [], new_prompt_logprobs=[_entry(t) for t in prompt[1:6]])])
    assert outs == []
    # Chunk 2 finishes the prompt and samples the first token.
    outs, _ = proc.process([EngineCoreOutput("r", [7], new_prompt_logprobs=[_entry(t) for t in prompt[6:]])])
    assert len(outs) == 1
    plp = outs[0].prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    assert [next(iter(d)) for d in plp[1:]] == prompt[1:]
    outs, _ = proc.process([EngineCoreOutput("r", [8], finish_reason=int(FinishReason.LENGTH))])
    assert outs[0].prompt_logprobs is None and outs[0].outputs[0].token_ids == [8]
    assert outs[0].finished and outs[0].outputs[0].finish_reason == "length"
