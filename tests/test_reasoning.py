"""Reasoning output (--reasoning-parser): the parsers on real-looking outputs (whole, a character at a time, at
random splits), the engine's grammar waiting for the reasoning's end, and a real server through the OpenAI SDK
(chat whole and streamed, JSON output after the reasoning, the Responses API's reasoning item)."""
from __future__ import annotations

import json
import random

import pytest

from server_utils import shared_server
from tokenmill.sampling_params import StructuredOutputsParams
from tokenmill.serve.reasoning import PARSERS, ReasoningStream, get_parser

QWEN3, R1 = PARSERS["qwen3"], PARSERS["deepseek_r1"]
QWEN3_PROMPT = "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINK = QWEN3_PROMPT + "<think>\n\n</think>\n\n"  # the template with enable_thinking false
R1_PROMPT = "<｜begin▁of▁sentence｜><｜User｜>What is 2+2?<｜Assistant｜><think>\n"

CASES = [  # (parser, prompt, output, (reasoning, answer))
    (QWEN3, QWEN3_PROMPT, "<think>\nThe user asks 2+2. That is 4.\n</think>\n\nThe answer is **4**.",
     ("\nThe user asks 2+2. That is 4.\n", "\n\nThe answer is **4**.")),
    (QWEN3, QWEN3_PROMPT, "The answer is 4.", (None, "The answer is 4.")),  # a model that does not think
    (QWEN3, QWEN3_PROMPT, "<think>\nLet me count: 1, 2, 3", ("\nLet me count: 1, 2, 3", None)),  # cut off
    (QWEN3, QWEN3_PROMPT, "<think>\n\n</think>\n\n4", ("\n\n", "\n\n4")),
    (QWEN3, QWEN3_PROMPT, "<thin", (None, "<thin")),
    (QWEN3, QWEN3_PROMPT, "Use a < b and </think", (None, "Use a < b and </think")),
    (QWEN3, QWEN3_NO_THINK, '{"answer": 4}', (None, '{"answer": 4}')),
    (QWEN3, QWEN3_NO_THINK, "<think>x</think>y", (None, "<think>x</think>y")),  # closed: all answer
    (R1, R1_PROMPT, "Okay, 2+2 = 4. </think>\n\nThe answer is 4.", ("Okay, 2+2 = 4. ", "\n\nThe answer is 4.")),
    (R1, "<｜Assistant｜>", "<think>\nOkay.\n</think>4", ("\nOkay.\n", "4")),  # an older template: the model opens it
    (R1, R1_PROMPT, "Still thinking about </thi", ("Still thinking about </thi", None)),
    (R1, R1_PROMPT, "", (None, None)),
    (R1, "no tags", "plain", ("plain", None)),  # deepseek_r1 reads an untagged output as reasoning
    (QWEN3, "assistant\n<think>\n", "opened by the template</think>answer", ("opened by the template", "answer")),
]


@pytest.mark.parametrize("parser,prompt,output,expected", CASES)
def test_parser_whole_and_at_every_split(parser, prompt, output, expected):
    assert parser.split(output, prompt) == expected
    for trial in range(60):
        rng = random.Random(trial)
        stream, got, i = ReasoningStream(parser, prompt), ["", ""], 0
        while i < len(output):
            j = i + (1 if trial == 0 else rng.randint(1, 7))  # trial 0: a character at a time
            for k, part in enumerate(stream.feed(output[i:j])):
                got[k] += part
            i = j
        for k, part in enumerate(stream.finish()):
            got[k] += part
        assert (got[0] or None, got[1] or None) == expected, (trial, got)


def test_parser_names():
    assert get_parser(None) is None and get_parser("qwen3") is QWEN3
    with pytest.raises(ValueError, match="deepseek_r1, qwen3|qwen3, deepseek_r1"):
        get_parser("gpt")
    assert QWEN3.state_after(QWEN3_NO_THINK) == "answer" and R1.state_after(R1_PROMPT) == "reasoning"
    assert QWEN3.state_after(QWEN3_PROMPT) == "open"


def test_grammar_waits_for_the_end_of_the_reasoning():
    """The engine's matcher sees only the tokens after the closing tag, found across steps."""
    pytest.importorskip("xgrammar")
    from models import tiny_model
    from tokenmill.structured.manager import StructuredOutputManager
    from transformers import AutoTokenizer

    path = tiny_model("llama")
    tok = AutoTokenizer.from_pretrained(path)
    end = [11, 12, 13]  # any ids: the tag's tokens
    so = StructuredOutputsParams(choice=["yes", "no"], reasoning_end=end)
    m = StructuredOutputManager(path, len(tok))
    m.submit(so)
    while not m.ready(so):
        m.wait(1.0)
    free = StructuredOutputsParams(choice=["yes", "no"])
    first = m.bitmask("plain", free)
    assert first is not None
    assert m.bitmask("r", so) is None
    m.accept("r", [5, 11, 12], so)      # the tag's start: still reasoning
    assert m.bitmask("r", so) is None
    m.accept("r", [13], so)             # ... its end, in the next step
    assert m.bitmask("r", so).equal(first)  # the grammar from its start
    yes = tok("yes", add_special_tokens=False).input_ids
    m.accept("r", yes[:1], so)
    assert not m.bitmask("r", so).equal(first)
    m.free("r")
    assert m.bitmask("r", so) is None   # a new request of the same id starts in its reasoning again


# -- a real server ---------------------------------------------------------------------------------------
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "<|im_start|>assistant\n")
OPEN = CHATML + "<think>\n"                   # deepseek_r1's kind of template: the reasoning is open
CLOSED = CHATML + "<think>\n\n</think>\n\n"   # qwen3 with enable_thinking false: it is closed
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["four", "five"]}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request.config, None, "--max-model-len", "512", "--reasoning-parser", "deepseek_r1")


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


def _chat(client, template, **kw):
    return client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "What is 2+2?"}], temperature=0,
        extra_body={"chat_template": template}, **{"max_tokens": 24, **kw})


def test_sdk_chat_whole_and_streamed(client):
    whole = _chat(client, OPEN).choices[0].message
    assert whole.content is None and whole.reasoning_content and whole.reasoning == whole.reasoning_content
    chunks = list(_chat(client, OPEN, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == whole.reasoning_content
    assert not any(d.content for d in deltas)


def test_structured_output_applies_after_the_reasoning(client):
    free = _chat(client, OPEN).choices[0].message
    rf = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}
    open_json = _chat(client, OPEN, response_format=rf).choices[0].message
    assert open_json.reasoning_content == free.reasoning_content  # the grammar waits: the reasoning is free
    closed = _chat(client, CLOSED, response_format=rf, max_tokens=40).choices[0].message
    assert closed.reasoning_content is None and json.loads(closed.content)["answer"] in ("four", "five")


def test_responses_reasoning_item(client, server):
    import httpx

    body = {"model": "SmolLM2-135M-Instruct", "input": "What is 2+2?", "max_output_tokens": 16,
            "temperature": 0}
    # The Responses API renders with the server's template (the model's own: no reasoning opened), so the
    # output comes from the chat path's parser as the chat endpoint does: compare the two.
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "What is 2+2?"}],
        "max_tokens": 16, "temperature": 0}).json()["choices"][0]["message"]
    r = client.responses.create(**body)
    kinds = [item.type for item in r.output]
    assert kinds[0] == "reasoning" and r.output[0].content[0].text == chat["reasoning_content"]
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == chat["reasoning_content"]
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert done[0]["item"]["type"] == "reasoning" and events[-1]["type"] == "response.completed"
