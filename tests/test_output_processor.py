"""Front-side output processing without a model: deltas, prompt logprobs over several chunks, stop strings."""
import pytest

from models import build_tokenizer
from tokenmill.engine.output_processor import OutputProcessor, RequestState
from tokenmill.messages import EngineCoreOutput, FinishReason
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
    plp = outs[0][1].prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    assert [next(iter(d)) for d in plp[1:]] == prompt[1:]
    ((state, out),), _ = proc.process([EngineCoreOutput("r", [8], finish_reason=int(FinishReason.LENGTH))])
    assert out.prompt_logprobs is None and out.outputs[0].token_ids == [8]
    assert out.finished and out.outputs[0].finish_reason == "length"
    assert state.request_id == "r" and "r" not in proc.requests  # the pair is the last place it is seen


TEXT = "The quick brown fox jumps over the lazy dog. Hello, world!"


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """The tiny test models' real byte-level BPE tokenizer (its words are single tokens: ' lazy', ' dog')."""
    return build_tokenizer(str(tmp_path_factory.mktemp("tokenizer")))


def _feed(tok, params, delta):
    """TEXT's tokens one engine step at a time (the last step finishes by length), as the engine would send
    them; stops feeding when the processor asks to abort. Returns the per-step outputs and the abort step."""
    ids = tok(TEXT).input_ids
    proc = OutputProcessor(tok)
    proc.add_request(RequestState("r", "", [], params, tok, delta=delta), ["r"])
    steps, aborted_at = [], None
    for i, t in enumerate(ids):
        finish = int(FinishReason.LENGTH) if i == len(ids) - 1 else None
        outs, to_abort = proc.process([EngineCoreOutput("r", [t], finish_reason=finish)])
        steps.append([ro for _, ro in outs])
        if to_abort:
            assert to_abort == ["r"]
            aborted_at = i
            break
    return ids, steps, aborted_at


def _final(steps):
    return [o for outs in steps for o in outs][-1].outputs[0]


def _pieces(tok):
    return [tok.decode([t]) for t in tok(TEXT).input_ids]


@pytest.mark.parametrize("delta", [False, True])
def test_stop_string_across_a_token_boundary(tok, delta):
    stop = "y do"  # the end of ' lazy' and the start of ' dog'
    assert not any(stop in piece for piece in _pieces(tok)) and stop in TEXT
    ids, steps, aborted_at = _feed(tok, SamplingParams(max_tokens=64, stop=[stop]), delta)
    assert aborted_at == _pieces(tok).index(" dog")  # the step whose token completes the stop string
    text = "".join(o.outputs[0].text for outs in steps for o in outs) if delta else _final(steps).text
    assert text == TEXT[:TEXT.index(stop)]
    out = _final(steps)
    assert out.finish_reason == "stop" and out.stop_reason == stop
    if not delta:
        assert out.token_ids == ids[:aborted_at + 1]


def test_include_stop_str_in_output(tok):
    _, steps, _ = _feed(tok, SamplingParams(max_tokens=64, stop=["y do"], include_stop_str_in_output=True), False)
    assert _final(steps).text == TEXT[:TEXT.index("y do") + len("y do")]


def test_first_completed_of_several_stop_strings_wins(tok):
    _, steps, aborted_at = _feed(tok, SamplingParams(max_tokens=64, stop=["Hello", "dog", "k bro"]), False)
    out = _final(steps)
    assert aborted_at == _pieces(tok).index(" brown")
    assert out.stop_reason == "k bro" and out.text == "The quic"


def test_delta_mode_holds_back_a_possible_partial_stop_string(tok):
    stop = "lazy dog"
    _, steps, _ = _feed(tok, SamplingParams(max_tokens=64, stop=[stop]), True)
    sent = ""
    for outs in steps[:-1]:  # ' lazy' arrives a step before ' dog': none of it may go out meanwhile
        sent += "".join(o.outputs[0].text for o in outs)
        assert len(sent) <= TEXT.index(stop), sent
    sent += "".join(o.outputs[0].text for o in steps[-1])
    assert sent == TEXT[:TEXT.index(stop)]


def test_delta_mode_releases_held_back_text_when_no_stop_string_matches(tok):
    stop = "lazy cat"  # "the lazy " looks like its start, but it never completes
    pieces = _pieces(tok)
    _, steps, aborted_at = _feed(tok, SamplingParams(max_tokens=64, stop=[stop]), True)
    assert aborted_at is None
    sent, decoded = "", ""
    for piece, outs in zip(pieces[:-1], steps[:-1]):
        decoded += piece
        sent += "".join(o.outputs[0].text for o in outs)
        assert sent == decoded[:max(len(decoded) - (len(stop) - 1), 0)]  # the last 7 characters wait
    last = steps[-1][0].outputs[0]
    assert sent + last.text == TEXT and last.finish_reason == "length"
