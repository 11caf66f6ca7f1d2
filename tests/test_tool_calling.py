"""Tool calling on /v1/chat/completions: the tool-call parsers on real strings (whole and streamed a character
at a time), the 'required'/named constraints, and a real `tokenmill serve` (default model, the shipped
hermes_tools template, --enable-auto-tool-choice --tool-call-parser hermes) through the openai SDK."""
from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from models import tiny_model
from server_utils import API_KEY, require_default_model, shared_server
from tokenmill.http.errors import APIError
from tokenmill.serve.protocol import RequestLimits
from tokenmill.serve.tool_parsers import ContentDelta, ToolCallArguments, ToolCallStart, get_tool_parser
from tokenmill.serve.tools import (FunctionTool, parse_tools, plan_tools, required_calls_schema,
                                   template_messages)

NAMES = {"get_weather", "add"}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 999},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 999}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}


def _stream(parser_name, text, chunks, **kw):
    """Feed text in the given chunk sizes; (content, [(name, arguments)], events)."""
    p = get_tool_parser(parser_name)(NAMES, **kw)
    events, at = [], 0
    for size in chunks:
        events += p.feed(text[at:at + size])
        at += size
    events += p.feed(text[at:]) + p.finish()
    content = "".join(e.text for e in events if isinstance(e, ContentDelta))
    calls = {}
    for e in events:
        if isinstance(e, ToolCallStart):
            assert e.index == len(calls) and e.id.startswith("call_")
            calls[e.index] = [e.name, ""]
        elif isinstance(e, ToolCallArguments):
            calls[e.index][1] += e.text
    return content, [tuple(c) for c in calls.values()], events


def _whole(parser_name, text):
    content, calls = get_tool_parser(parser_name)(NAMES, eager=False).extract(text)
    return content, [(c.name, c.arguments) for c in calls]


WELL_FORMED = [
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": '
               '"celsius"}}\n</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>',
     "Let me check.", [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("add", '{"a": 1, "b": 2}')]),
    ("hermes", '<tool_call>{"arguments": {"unit": "celsius", "city": "x}\\"<tool_call>"}, "name": "get_weather"}'
               '</tool_call>', None, [("get_weather", '{"unit": "celsius", "city": "x}\\"<tool_call>"}')]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "unit": "celsius"}}; '
                    '{"name": "add", "parameters": {"a": 5, "b": 6}}',
     None, [("get_weather", '{"city": "Rome", "unit": "celsius"}'), ("add", '{"a": 5, "b": 6}')]),
    ("llama3_json", '  {"name": "add", "parameters": {"a": 1, "b": 1}}', None, [("add", '{"a": 1, "b": 1}')]),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "add", "arguments": {"a": 7, "b": 8}}, {"name": "get_weather", '
                '"arguments": {"city": "Oslo", "unit": "fahrenheit"}}]',
     "Sure.", [("add", '{"a": 7, "b": 8}'), ("get_weather", '{"city": "Oslo", "unit": "fahrenheit"}')]),
]
MARKUP = ("<tool_call", "tool_call>", "<|python_tag|>", "[TOOL_CALLS]", '"name"')


@pytest.mark.parametrize("parser,text,content,calls", WELL_FORMED)
def test_parsers_extract_whole_and_streamed(parser, text, content, calls):
    assert _whole(parser, text) == (content, calls)
    for arguments in calls:
        jsonschema.validate(json.loads(arguments[1]), SCHEMAS[arguments[0]])
    # One character at a time: the same calls, arguments in many fragments, no markup in the content.
    streamed, streamed_calls, events = _stream(parser, text, [1] * len(text))
    assert streamed_calls == calls and streamed == (content or "")
    assert not any(m in streamed for m in MARKUP)
    for i, (_, arguments) in enumerate(calls):
        fragments = [e for e in events if isinstance(e, ToolCallArguments) and e.index == i]
        if '{"arguments"' not in text:  # name first: arguments stream as they arrive (else once it is known)
            assert len(fragments) >= len(arguments) // 2, fragments
        start = next(k for k, e in enumerate(events) if isinstance(e, ToolCallStart) and e.index == i)
        assert events.index(fragments[0]) > start  # id and name first
    rng = random.Random(0)
    for _ in range(20):  # and split anywhere else
        chunks = [rng.randint(1, 9) for _ in range(len(text))]
        assert _stream(parser, text, chunks)[:2] == (content or "", calls)


PLAIN = ["The weather is fine. I <3 tools; {braces} and [brackets] are text.", "", "  spaced  "]
MALFORMED = [
    ("hermes", 'Hi <tool_call>{"name": get_weather, "arguments": {"city": "Paris"}}</tool_call>'),  # broken JSON
    ("hermes", '<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'),  # unknown function
    ("hermes", '<tool_call>{name: add}</tool_call>'),
    ("hermes", 'Almost <tool_ca'),                                                     # a cut-off tag
    ("llama3_json", '{"city": "Paris"} is JSON, not a call'),
    ("llama3_json", '{"name": "nope", "parameters": {}}'),
    ("mistral", '[TOOL_CALLS] not an array'),
    ("mistral", '[TOOL_CALLS][{"name": "launch_rockets", "arguments": {}}]'),
]


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_plain_text_passes_through(parser):
    for text in PLAIN:
        assert _whole(parser, text) == (text, [])
        assert _stream(parser, text, [1] * len(text))[:2] == (text, [])


@pytest.mark.parametrize("parser,text", MALFORMED)
def test_malformed_output_is_plain_content(parser, text):
    assert _whole(parser, text) == (text, [])
    content, calls, _ = _stream(parser, text, [1] * len(text))
    assert calls == [] and content.split() == text.split()


@pytest.mark.parametrize("text,sent", [('<tool_call>{"name": "add", "arguments": {"a": 1', '{"a": 1'),
                                       ('<tool_call>{"name": "add", "arguments": {"a": }}</tool_call> ok', '{"a": }')])
def test_call_broken_after_its_name_whole_is_content_streamed_is_cut(text, sent):
    assert _whole("hermes", text) == (text, [])
    # Streamed, the call went out once its name was read and cannot be taken back: it ends with the arguments
    # sent, the rest of its markup is dropped, and text after the markup is content again.
    content, calls, _ = _stream("hermes", text, [1] * len(text))
    assert calls == [("add", sent)] and content == text.partition("</tool_call>")[2].strip()


def test_required_schema_pairs_names_with_their_parameters():
    defs = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
            "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    tools = [FunctionTool("add", None, ADD), FunctionTool("where", None, defs), FunctionTool("ping")]
    schema = required_calls_schema(tools, parallel=True)
    jsonschema.validate([{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "ping", "parameters": {}},
                         {"name": "where", "parameters": {"loc": {"city": "Oslo"}}}], schema)
    for bad in ([], [{"name": "add", "parameters": {"loc": {"city": "Oslo"}}}],
                [{"name": "where", "parameters": {"loc": {}}}], [{"name": "nope", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):  # parallel_tool_calls false: one call
        jsonschema.validate([{"name": "ping", "parameters": {}}] * 2, required_calls_schema(tools, parallel=False))
    plan = plan_tools(tools, "required", None, auto_parser=None)  # compiles (xgrammar) with the moved $refs
    assert plan.constraint is not None and plan.extract('[{"name": "ping", "parameters": {}}]')[1][0].name == "ping"


def test_plans_and_their_400s():
    tools = parse_tools(TOOLS)
    named = plan_tools(tools, {"type": "function", "function": {"name": "add"}}, None, auto_parser=None)
    assert json.loads(named.constraint.json) == ADD
    content, calls = named.extract('{"a": 1, "b": 2}')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("add", '{"a": 1, "b": 2}')]
    assert named.extract('{"a": 1, "b"') == ('{"a": 1, "b"', [])  # cut off by max_tokens
    stream = named.stream()
    deltas = [d for ch in '{"a": 1, "b": 2}' for d in stream.feed(ch)] + stream.finish()
    assert deltas[0]["tool_calls"][0]["function"] == {"name": "add", "arguments": ""}
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:]) == '{"a": 1, "b": 2}'
    assert plan_tools(tools, "none", None, auto_parser="hermes").constraint is None
    assert plan_tools(tools, None, None, auto_parser="hermes").mode == "auto"
    bad = [(TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice"), (TOOLS, "always", "tool_choice"),
           ([], "required", "tool_choice"), (TOOLS, None, "tools"), (TOOLS, "auto", "tool_choice")]
    for raw, choice, param in bad:
        with pytest.raises(APIError) as e:
            plan_tools(parse_tools(raw), choice, None, auto_parser=None)
        assert e.value.status == 400 and e.value.param == param, e.value.message
    for raw, param in [([{"type": "function", "function": {"name": "a b"}}], "tools[0].function.name"),
                       ([{"type": "function", "function": {"name": "f", "parameters": []}}],
                        "tools[0].function.parameters"),
                       ([{"type": "retrieval"}], "tools[0]"), (TOOLS + TOOLS[:1], "tools")]:
        with pytest.raises(APIError) as e:
            parse_tools(raw)
        assert e.value.param == param



def _fn(name: str, **extra) -> dict:
    return {"type": "function", "function": {"name": name, **extra}}


def test_tools_are_bounded_and_checked_in_linear_time():
    limits = RequestLimits()
    with pytest.raises(APIError) as e:  # a duplicate at the allowed maximum is named
        parse_tools([_fn(f"f{i}") for i in range(limits.max_tools - 1)] + [_fn("f7")], limits)
    assert e.value.param == "tools" and "'f7'" in e.value.message
    for tools, flag in (([_fn(f"f{i}") for i in range(limits.max_tools + 1)], "--max-tools"),
                        ([_fn(f"f{i}", description="x" * 8192) for i in range(100)], "--max-tools-schema-bytes")):
        with pytest.raises(APIError) as e:
            parse_tools(tools, limits)
        assert e.value.status == 400 and e.value.param == "tools" and flag in e.value.message, e.value.message
    deep: dict = {"type": "object"}
    for _ in range(limits.max_json_schema_depth):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(APIError) as e:  # a tool's parameters are a JSON schema: its depth bound holds
        parse_tools([_fn("f", parameters=deep)], limits)
    assert e.value.param == "tools[0].function.parameters" and "--max-json-schema-depth" in e.value.message
    # The duplicate-name check was quadratic (20k tools: 4.6 s on the event loop); with the bounds lifted,
    # 20k distinct tools and a duplicate at the end are checked in linear time.
    many = [_fn(f"f{i}") for i in range(20000)]
    wide = RequestLimits(max_tools=10**6, max_tools_schema_bytes=1 << 30)
    t0 = time.perf_counter()
    assert len(parse_tools(many, wide)) == 20000
    with pytest.raises(APIError) as e:
        parse_tools(many + [_fn("f19999")], wide)
    assert "'f19999'" in e.value.message and time.perf_counter() - t0 < 1.0

def test_template_messages_turn_arguments_into_objects():
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
    assert template_messages(msgs)[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    for bad in ([{**msgs[0], "tool_calls": [{"function": {"name": "add", "arguments": "{oops"}}]}],
                [{"role": "tool", "content": "3"}]):
        with pytest.raises(APIError):
            template_messages(bad)


# -- through a real server ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(request):
    require_default_model()
    return shared_server(request.config, None, "--chat-template", "hermes_tools", "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes", "--max-model-len", "1024")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


ASK = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


def _reassemble(stream):
    """(content, [(id, name, arguments)], finish_reason) of a streamed chat completion."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                if tc.id is not None:  # a call's first delta: id, type, name, empty arguments
                    assert tc.index not in calls and tc.type == "function" and tc.function.arguments == ""
                    calls[tc.index] = [tc.id, tc.function.name, ""]
                else:
                    assert tc.function.name is None
                    calls[tc.index][2] += tc.function.arguments
            finish = choice.finish_reason or finish
    return content, [tuple(c) for _, c in sorted(calls.items())], finish


@pytest.mark.parametrize("choice,parallel", [("required", False), ("required", True),
                                             ({"type": "function", "function": {"name": "add"}}, True)],
                         ids=["required-one", "required-parallel", "named"])
def test_forced_tool_calls_are_valid_whole_and_streamed(client, model, choice, parallel):
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel,
              max_tokens=64 if choice == "required" and parallel else 120, temperature=0)
    r = client.chat.completions.create(**kw)
    msg, finish = r.choices[0].message, r.choices[0].finish_reason
    assert msg.tool_calls and msg.content is None
    for tc in msg.tool_calls:
        assert tc.type == "function" and tc.id.startswith("call_")
        jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
    if parallel:  # the tiny model may go on calling until max_tokens: every complete call is still valid
        assert finish in ("tool_calls", "length")
    else:  # one call, always complete
        assert finish == "tool_calls" and len(msg.tool_calls) == 1
    if isinstance(choice, dict):
        assert [tc.function.name for tc in msg.tool_calls] == ["add"]
    content, calls, streamed_finish = _reassemble(client.chat.completions.create(**kw, stream=True))
    assert content == "" and streamed_finish == finish
    whole = [(tc.function.name, tc.function.arguments) for tc in msg.tool_calls]
    assert [c[1:] for c in calls][:len(whole)] == whole  # streamed, a cut-off last call shows as far as it got
    assert len({c[0] for c in calls}) == len(calls)  # distinct ids


def test_tool_result_round_trip(client, model):
    r = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=120, temperature=0)
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [r.choices[0].message,  # the SDK object as it came back, as clients send it
                     {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"result": "22 C, sunny"})}]
    answer = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice="none",
                                            max_tokens=16, temperature=0)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_auto_answers_without_leaking_markup(client, model):
    kw = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=40, temperature=0)
    r = client.chat.completions.create(**kw)
    content, calls, finish = _reassemble(client.chat.completions.create(**kw, stream=True))
    msg = r.choices[0].message
    assert (content or None, [c[1:] for c in calls]) == (
        msg.content, [(tc.function.name, tc.function.arguments) for tc in msg.tool_calls or []])
    if msg.tool_calls:
        assert "<tool_call>" not in (msg.content or "")
    assert finish == r.choices[0].finish_reason


def test_auto_extracts_hermes_calls_the_model_writes(client, model):
    """The model steered (guided_regex) to write two hermes calls and some text: auto mode reads them out."""
    regex = (r'Checking\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)", '
             r'"unit": "celsius"\}\}\n</tool_call>\n<tool_call>\n\{"name": "add", "arguments": \{"a": [1-9], '
             r'"b": [1-9]\}\}\n</tool_call>')
    kw = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=100, temperature=0, extra_body={"guided_regex": regex})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == "Checking."
    assert [tc.function.name for tc in msg.tool_calls] == ["get_weather", "add"]
    for tc in msg.tool_calls:
        jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
    content, calls, finish = _reassemble(client.chat.completions.create(**kw, stream=True))
    assert (content, finish) == ("Checking.", "tool_calls")
    assert [c[1:] for c in calls] == [(tc.function.name, tc.function.arguments) for tc in msg.tool_calls]


class City(BaseModel):
    name: str = Field(max_length=12)
    country: Literal["France", "Germany", "Italy"]
    population_millions: int = Field(ge=0, le=99)


def test_sdk_parse_with_a_pydantic_response_format(client, model):
    r = client.chat.completions.parse(model=model, messages=[{"role": "user", "content": "Describe Paris as JSON."}],
                                      response_format=City, max_tokens=80, temperature=0)
    assert isinstance(r.choices[0].message.parsed, City)


def _error(r: httpx.Response, param: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, err
    return err["message"]


def test_bad_tool_requests_are_400_and_the_server_keeps_serving(server, model):
    base = {"model": model, "messages": ASK, "max_tokens": 4}
    cases = [({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
              "tools[0].function.parameters"),
             ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
             ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools[0].function"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format"),
             ({"messages": ASK + [{"role": "assistant", "tool_calls": [
                 {"id": "c", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
              "messages[1].tool_calls[0].function.arguments"),
             ({"messages": ASK + [{"role": "tool", "content": "3"}]}, "messages[1].tool_call_id")]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for body, param in cases:
            _error(http.post("/v1/chat/completions", json={**base, **body}), param)
        r = http.post("/v1/chat/completions", json=base)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]


def test_auto_needs_the_server_flags(request):
    tiny = shared_server(request.config, tiny_model("llama"), "--served-model-name", "tiny-llama", api_key=API_KEY)
    with httpx.Client(base_url=tiny.url, headers=tiny.headers, timeout=60) as http:
        body = {"model": "tiny-llama", "messages": ASK, "tools": TOOLS, "max_tokens": 2}
        for choice, param in (("auto", "tool_choice"), (None, "tools")):
            msg = _error(http.post("/v1/chat/completions", json={**body, "tool_choice": choice}), param)
            assert "--enable-auto-tool-choice" in msg and "--tool-call-parser" in msg
        ok = http.post("/v1/chat/completions", json={**body, "tool_choice": "none"})
        assert ok.status_code == 200


def test_auto_flag_without_a_parser_is_refused_at_start():
    r = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--enable-auto-tool-choice"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "tokenmill: error: --enable-auto-tool-choice needs --tool-call-parser" in r.stderr
