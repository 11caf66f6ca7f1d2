"""Structured output (response_format json_object / json_schema, guided_choice / guided_regex) through the
real server, constrained and free requests sharing batches; and the sampler's bitmask against xgrammar's."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
import torch

from models import tiny_model
from server_utils import API_KEY, shared_server

xgr = pytest.importorskip("xgrammar")

MODEL = "tiny-llama"

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"},
                                      "ok": {"type": "boolean"}},
     "required": ["name", "age", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
     "required": ["color", "tags"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 1, "maxItems": 4},
]


@pytest.fixture(scope="module")
def server(request):
    # The same server as test_server.py (same arguments): started once per session.
    return shared_server(request.config, tiny_model("llama"), "--served-model-name", MODEL, api_key=API_KEY)


def _rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def test_json_schema_valid_under_concurrency_with_free_requests(server):
    constrained = [{"model": MODEL, "prompt": f"Give me JSON {i}:", "max_tokens": 96,
                    "response_format": _rf(SCHEMAS[i % len(SCHEMAS)]),
                    **({"temperature": 0} if i % 4 == 0 else {"temperature": 1.0, "seed": i})}
                   for i in range(16)]
    free = [{"model": MODEL, "prompt": f"The quick brown fox {i}", "max_tokens": 24, "temperature": 0,
             "ignore_eos": True} for i in range(16)]
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=120) as c:
        free_alone = [c.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in free]

    async def post(ac, path, body):
        r = await ac.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()

    async def all_at_once():
        async with httpx.AsyncClient(base_url=server.url, headers=server.headers, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as ac:
            chat = [{"model": MODEL, "messages": [{"role": "user", "content": f"JSON please {i}"}],
                     "max_tokens": 96, "temperature": 1.0, "seed": 100 + i, "response_format": _rf(SCHEMAS[i % 3])}
                    for i in range(4)]
            return await asyncio.gather(*(post(ac, "/v1/completions", b) for b in constrained + free),
                                        *(post(ac, "/v1/chat/completions", b) for b in chat))

    results = asyncio.run(all_at_once())
    done = 0
    outs = [(constrained[i]["response_format"], r["choices"][0]["text"], r["choices"][0]["finish_reason"])
            for i, r in enumerate(results[:16])]
    outs += [(None, r["choices"][0]["message"]["content"], r["choices"][0]["finish_reason"]) for r in results[32:]]
    for i, (rf, text, reason) in enumerate(outs):
        schema = rf["json_schema"]["schema"] if rf else SCHEMAS[(i - 16) % 3]
        if reason == "stop":
            jsonschema.validate(json.loads(text), schema)
            done += 1
        else:
            assert reason == "length"
    assert done >= 15, outs  # nearly all finish well within max_tokens
    # Free requests that shared those batches are unaffected by their neighbours' grammars.
    assert [r["choices"][0]["text"] for r in results[16:32]] == free_alone


def test_json_object_choice_regex(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        for seed in range(3):
            r = c.post("/v1/chat/completions", json={
                "model": MODEL, "messages": [{"role": "user", "content": "Reply in JSON"}], "max_tokens": 64,
                "temperature": 1.0, "seed": seed, "response_format": {"type": "json_object"}}).json()
            choice = r["choices"][0]
            # The grammar lets the object close well within 64 tokens (the tiny model closes it at once).
            assert choice["finish_reason"] == "stop", choice
            assert isinstance(json.loads(choice["message"]["content"]), dict)
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Pick:", "max_tokens": 16, "seed": seed,
                                                "guided_choice": ["yes", "no", "maybe not"]}).json()
            assert r["choices"][0]["text"] in ("yes", "no", "maybe not")
            assert r["choices"][0]["finish_reason"] == "stop"
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": "Date:", "max_tokens": 16, "seed": seed,
                                                "guided_regex": r"20[0-9]{2}-(0[1-9]|1[0-2])"}).json()
            assert re.fullmatch(r"20[0-9]{2}-(0[1-9]|1[0-2])", r["choices"][0]["text"])


def test_structured_stream_equals_nonstream(server):
    body = {"model": MODEL, "prompt": "JSON:", "max_tokens": 96, "temperature": 0, "response_format": _rf(SCHEMAS[0])}
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        full = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
        text = ""
        with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
    assert text == full


def test_invalid_grammar_is_400(server):
    with httpx.Client(base_url=server.url, headers=server.headers, timeout=60) as c:
        base = {"model": MODEL, "prompt": "x", "max_tokens": 4}
        for extra, param in [({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
                              "response_format"),
                             ({"response_format": _rf({"type": "no-such-type"})}, "response_format"),
                             ({"guided_regex": "(unclosed"}, "guided_regex"),
                             ({"guided_choice": []}, "guided_choice"),
                             ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice")]:
            r = c.post("/v1/completions", json={**base, **extra})
            assert r.status_code == 400, (extra, r.text)
            assert r.json()["error"]["param"] == param
        assert c.post("/v1/completions", json=base).status_code == 200


def test_sampler_bitmask_matches_xgrammar():
    from tokenmill.layers.sampler import apply_token_bitmask

    g = torch.Generator().manual_seed(0)
    for vocab in (31, 400, 1000):
        logits = torch.randn(5, vocab, generator=g)
        mask = xgr.allocate_token_bitmask(5, vocab)
        mask.copy_(torch.randint(-2**31, 2**31 - 1, mask.shape, generator=g, dtype=torch.int64).to(torch.int32))
        mask[2] = -1  # a free row
        expected = logits.clone()
        xgr.apply_token_bitmask_inplace(expected, mask)
        assert torch.equal(apply_token_bitmask(logits, mask), expected)
