"""/v1/responses (OpenAI's Responses API) through the official `openai` SDK, against one real `tokenmill serve`
on the default model (and a `tokenmill router` in front of it); CORS on both. The translation's tool-call
mapping is tested without a server."""
from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
from openai.types.responses import Response as SDKResponse

from server_utils import API_KEY, CliProc, metrics, require_default_model, shared_server
from tokenmill.http.errors import APIError
from tokenmill.serve.protocol import ResponsesRequest
from tokenmill.serve.responses import ResponseContext, StreamTranslator, from_chat_body, to_chat_request

MODEL = "SmolLM2-135M-Instruct"
ORIGIN = "http://app.example"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def server(request):
    require_default_model()
    return shared_server(request.config, None, "--max-model-len", "512", "--allowed-origins", f'["{ORIGIN}"]',
                         api_key=API_KEY)


@pytest.fixture(scope="module")
def router(server):
    proc = CliProc(["router", "--replica", server.url, "--allowed-origins", ORIGIN], api_key=API_KEY)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as c:
        yield c


def _chat(client, messages, **kw) -> str:
    out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=24, **kw)
    return out.choices[0].message.content


def _events(stream) -> list:
    return [e for e in stream]


def _assert_400(r, param=None):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", err
    if param is not None:
        assert err["param"] == param, err


# -- the server, through the SDK -------------------------------------------------------------------------
def test_create_equals_chat_completion(client, http):
    r = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24)
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == _chat(client, [{"role": "user", "content": QUESTION}])
    assert "Paris" in r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    chat = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": QUESTION}],
                                                   "temperature": 0, "max_tokens": 24}).json()
    assert r.usage.input_tokens == chat["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == chat["usage"]["completion_tokens"] > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    raw = http.post("/v1/responses", json={"model": MODEL, "input": QUESTION, "max_output_tokens": 4})
    SDKResponse.model_validate(raw.json())  # every field the SDK's type requires is there


def test_instructions_and_message_items_equal_chat(client):
    r = client.responses.create(model=MODEL, instructions="You are a pirate. Answer like one.", input=QUESTION,
                                temperature=0, max_output_tokens=24)
    assert r.output_text == _chat(client, [{"role": "system", "content": "You are a pirate. Answer like one."},
                                           {"role": "user", "content": QUESTION}])
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi!"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello! How can I help?"}]},
             {"role": "developer", "content": "Be brief."},
             {"role": "user", "content": "Name a colour."}]
    r = client.responses.create(model=MODEL, input=items, temperature=0, max_output_tokens=24)
    assert r.output_text == _chat(client, [{"role": "user", "content": "Hi!"},
                                           {"role": "assistant", "content": "Hello! How can I help?"},
                                           {"role": "developer", "content": "Be brief."},
                                           {"role": "user", "content": "Name a colour."}])


def test_stream_events_in_order(client):
    whole = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24).output_text
    events = _events(client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24,
                                             stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == whole == events[-4].text == events[-2].item.content[0].text
    final = events[-1].response
    assert final.status == "completed" and final.output_text == text and final.id == events[0].response.id
    assert final.usage.output_tokens >= len(deltas) > 0  # a delta may hold several tokens, never none
    with client.responses.stream(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=24) as stream:
        for _ in stream:
            pass
        assert stream.get_final_response().output_text == whole


def test_raw_stream_names_each_event(http):
    with http.stream("POST", "/v1/responses", json={"input": "Hi", "max_output_tokens": 3, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in data] and len(data) == len(lines) // 2  # no [DONE]: as OpenAI's


def test_max_output_tokens_is_incomplete(client):
    r = client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 3 and r.output[0].status == "incomplete"
    events = _events(client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=3,
                                             stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == r.output_text


def test_stateful_requests_are_refused(client, http):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", store=True)
    assert e.value.body["param"] == "store" and "keeps no responses" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert e.value.body["param"] == "previous_response_id"
    r = http.get("/v1/responses/resp_123")
    assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found"
    assert client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=2).status == "incomplete"


@pytest.mark.parametrize("body,param", [
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": ["hi"]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),  # text model
    ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "1"}]}, "input[0].call_id"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0].name"),
    ({"input": "hi", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "temperature": -1}, "temperature"),
    ({"input": "hi", "max_output_tokens": 100000}, "max_output_tokens"),
    ({"input": "hi", "model": "gpt-4o"}, "model"),
])
def test_bad_input_is_400_and_serving_goes_on(http, body, param):
    r = http.post("/v1/responses", json=body)
    if param == "model":
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    else:
        _assert_400(r, param)
    assert http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).json()["status"] == "incomplete"


# Issue 29: a text.format that was not an object was a 500 (AttributeError: 'str' object has no attribute
# 'get'), streamed or not; a bad name, schema, strict or verbosity was let through or blamed on another field.
BAD_TEXT = {
    "format string": {"format": "json"},
    "format number": {"format": 5},
    "format list": {"format": []},
    "format bool": {"format": True},
    "format without type": {"format": {}},
    "format type number": {"format": {"type": 5}},
    "json_schema without schema": {"format": {"type": "json_schema", "name": "x"}},
    "json_schema schema string": {"format": {"type": "json_schema", "name": "x", "schema": "object"}},
    "json_schema name number": {"format": {"type": "json_schema", "name": 5, "schema": {"type": "object"}}},
    "json_schema strict string": {"format": {"type": "json_schema", "name": "x", "schema": {}, "strict": "maybe"}},
    "verbosity": {"verbosity": "loud"},
    "text string": "json",
    "text list": [],
}


@pytest.mark.parametrize("stream", [False, True], ids=["unary", "stream"])
@pytest.mark.parametrize("text", list(BAD_TEXT.values()), ids=list(BAD_TEXT))
def test_bad_text_format_is_400_and_serving_goes_on(http, text, stream):
    r = http.post("/v1/responses", json={"input": "hi", "max_output_tokens": 2, "stream": stream, "text": text})
    _assert_400(r)
    assert r.json()["error"]["param"].startswith("text"), r.json()
    assert http.post("/v1/responses", json={"input": "Hi", "max_output_tokens": 2}).json()["status"] == "incomplete"


def test_text_formats_are_served_and_echoed(http):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for fmt in ({"type": "text"}, {"type": "json_object"},
                {"type": "json_schema", "name": "obj", "schema": schema, "strict": True}):
        r = http.post("/v1/responses", json={"input": "Give me a JSON object.", "max_output_tokens": 4,
                                             "text": {"format": fmt}})
        assert r.status_code == 200, r.text
        assert r.json()["text"]["format"] == fmt


def test_async_client(server):
    async def run():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        whole, stream = await asyncio.gather(
            client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16),
            client.responses.create(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16, stream=True))
        deltas = [e.delta async for e in stream if e.type == "response.output_text.delta"]
        await client.close()
        return whole.output_text, "".join(deltas)

    whole, streamed = asyncio.run(run())
    assert whole == streamed and whole


def test_tool_choice_none_answers_in_text(client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    r = client.responses.create(model=MODEL, input=QUESTION, tools=tools, tool_choice="none", temperature=0,
                                max_output_tokens=8)
    assert r.output[0].type == "message" and r.output_text and r.tools[0].name == "get_weather"


def test_function_call_streamed_and_round_trip(client):
    """A forced function call comes back as a function_call item (grammar-constrained, so its arguments parse
    even on the tiny default model), streamed as function_call_arguments events, and its output item sent back
    as input gets a text answer."""
    tools = [{"type": "function", "name": "get_weather", "description": "Weather of a city",
              "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=tools, temperature=0, max_output_tokens=64,
              tool_choice={"type": "function", "name": "get_weather"})
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert isinstance(args.get("city"), str)
    events = _events(client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert done and done[0].arguments == deltas == calls[0].arguments
    assert events[-1].type == "response.completed"
    follow = client.responses.create(model=MODEL, tools=tools, tool_choice="none", temperature=0,
                                     max_output_tokens=16, input=[
        {"role": "user", "content": "What is the weather in Paris?"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete") and follow.output_text


# -- router and CORS ---------------------------------------------------------------------------------------
def test_responses_through_the_router(router, client):
    via = openai.OpenAI(base_url=router.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    kw = dict(model=MODEL, input=QUESTION, temperature=0, max_output_tokens=16,
              instructions="You are a helpful assistant who answers questions about geography in one sentence.")
    direct = client.responses.create(**kw).output_text
    assert via.responses.create(**kw).output_text == direct
    events = _events(via.responses.create(**kw, stream=True))
    assert events[-1].type == "response.completed" and events[-1].response.output_text == direct
    seen = metrics(router)  # routed by the policy, with prefix chunks from the input, and its usage learned
    assert sum(v for k, v in seen.items() if k.startswith("tokenmill:router_requests_total")) >= 2
    assert sum(v for k, v in seen.items() if k.startswith("tokenmill:router_prefix_chunks_queried_total")) > 0
    assert sum(v for k, v in seen.items() if k.startswith("tokenmill:router_prompt_tokens_total")) > 0


@pytest.mark.parametrize("front", ["server", "router"])
def test_cors_preflight(request, front):
    url = request.getfixturevalue(front).url
    ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
    ok = httpx.options(url + "/v1/responses", headers={"Origin": ORIGIN, **ask})
    assert ok.status_code == 200  # answered before the API-key check, never forwarded
    assert ok.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in ok.headers["access-control-allow-methods"]
    assert "authorization" in ok.headers["access-control-allow-headers"].lower()
    other = httpx.options(url + "/v1/responses", headers={"Origin": "http://evil.example", **ask})
    assert "access-control-allow-origin" not in other.headers
    r = httpx.get(url + "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == ORIGIN


def test_cors_flags_parse_and_refuse_malformed():
    from tokenmill.cli import main
    from tokenmill.http.cors import parse_list

    assert parse_list('["http://a", "http://b"]', "--x") == parse_list(" http://a, http://b ", "--x") == ["http://a",
                                                                                                        "http://b"]
    with pytest.raises(ValueError, match="--allowed-origins"):
        parse_list('["http://a"', "--allowed-origins")
    assert main(["router", "--replica", "http://127.0.0.1:9", "--allowed-origins", "[1]"]) == 2


# -- the translation, without a server ------------------------------------------------------------------
TOOLS = [{"type": "function", "name": "get_weather", "parameters": {"type": "object"}}]


def test_request_translation_of_tools_and_tool_items():
    req = ResponsesRequest(input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
        {"type": "function_call", "call_id": "call_2", "name": "get_weather", "arguments": '{"city":"Lyon"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "rain"}]},
    ], instructions="Use tools.", tools=TOOLS, tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=5, top_k=3)
    chat = to_chat_request(req)
    msgs = [m.model_dump(exclude_none=True) for m in chat.messages]
    assert msgs[0] == {"role": "system", "content": "Use tools."}
    assert [c["id"] for c in msgs[2]["tool_calls"]] == ["call_1", "call_2"] and msgs[2]["role"] == "assistant"
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert msgs[3] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    assert msgs[4]["content"] == [{"type": "text", "text": "rain"}]
    assert chat.tools == [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.max_completion_tokens == 5 and chat.top_k == 3


def test_chat_tool_calls_become_function_call_items():
    ctx = ResponseContext(ResponsesRequest(input="x", tools=TOOLS), "m")
    body = {"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": None,
            "tool_calls": [{"id": "call_9", "type": "function",
                            "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}]}}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}}
    r = from_chat_body(ctx, body)
    assert r["status"] == "completed" and len(r["output"]) == 1
    item = r["output"][0]
    assert item["type"] == "function_call" and item["call_id"] == "call_9" and item["id"].startswith("fc_")
    assert (item["name"], item["arguments"]) == ("get_weather", '{"city":"Paris"}')
    parsed = SDKResponse.model_validate(r)
    assert parsed.output[0].name == "get_weather" and parsed.usage.total_tokens == 12


def _chunk(delta=None, finish=None, usage=None):
    choices = [] if delta is None and finish is None else [{"index": 0, "delta": delta or {}, "finish_reason": finish}]
    return {"choices": choices, **({"usage": usage} if usage else {})}


def test_streamed_tool_call_deltas_become_argument_events():
    t = StreamTranslator(ResponseContext(ResponsesRequest(input="x", tools=TOOLS), "m"))
    events = t.start()
    for chunk in [_chunk({"role": "assistant", "content": ""}), _chunk({"content": "Let me check."}),
                  _chunk({"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                          "function": {"name": "get_weather", "arguments": ""}}]}),
                  _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city":'}}]}),
                  _chunk({"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}),
                  _chunk(finish="tool_calls"),
                  _chunk(usage={"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12})]:
        events += t.feed(chunk)
    events += t.finish()
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = events[-3]
    assert done["arguments"] == '{"city":"Paris"}' and done["output_index"] == 1
    final = events[-1]["response"]
    assert [o["type"] for o in final["output"]] == ["message", "function_call"]
    assert final["output"][1]["call_id"] == "call_1" and final["usage"]["output_tokens"] == 9
    from openai.types.responses import ResponseStreamEvent
    from pydantic import TypeAdapter

    adapter = TypeAdapter(ResponseStreamEvent)
    for e in events:  # each one is a valid event of the SDK's union
        adapter.validate_python(e)


def test_a_failure_mid_stream_ends_with_response_failed():
    t = StreamTranslator(ResponseContext(ResponsesRequest(input="x"), "m"))
    t.start()
    t.feed(_chunk({"content": "Hel"}))
    (event,) = t.fail(APIError(500, "the engine died", code="request_failed"))
    assert event["type"] == "response.failed" and event["response"]["status"] == "failed"
    assert event["response"]["error"] == {"code": "request_failed", "message": "the engine died"}
