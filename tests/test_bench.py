"""`tokenmill bench`: statistics on known samples, workloads, the load generator against a fake endpoint with
injected delays and failures, end to end against a real `tokenmill serve`, sweep and offline."""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import threading
import time

import numpy as np
import pytest
from fastapi import Request  # at module level: FastAPI resolves the handlers' string annotations here

from models import tiny_model
from server_utils import API_KEY, free_port, shared_server
from tokenmill.bench.datasets import build_dataset, load_tokenizer, sharegpt_dataset
from tokenmill.bench.report import distribution, format_table, max_in_flight, parse_slo, percentile, summarize
from tokenmill.bench.serve import ServeConfig, arrival_times, parse_priority_classes, run_benchmark
from tokenmill.cli import main

HAVE_MPL = True
try:
    import matplotlib  # noqa: F401
except ImportError:
    HAVE_MPL = False


# -- statistics ---------------------------------------------------------------------------------------
def test_percentiles_on_known_samples():
    xs = list(range(1, 101))
    assert percentile(xs, 50) == 50.5
    assert percentile(xs, 90) == pytest.approx(90.1)
    assert percentile(xs, 99) == pytest.approx(99.01)
    assert percentile([10, 20, 30, 40], 50) == 25
    assert percentile([40, 10, 30, 20], 90) == pytest.approx(37)   # order does not matter
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    rng = random.Random(0)
    sample = [rng.expovariate(1.0) for _ in range(1001)]
    for p in (0, 10, 50, 90, 99, 100):
        assert percentile(sample, p) == pytest.approx(np.percentile(sample, p))
    d = distribution([0.1, 0.2, 0.3, 0.4], scale=1e3)
    assert d["mean"] == pytest.approx(250) and d["median"] == pytest.approx(250) and d["max"] == pytest.approx(400)
    assert d["p90"] == pytest.approx(370) and d["p99"] == pytest.approx(397) and d["count"] == 4
    assert distribution([])["median"] is None


def _rec(i, start, ttft, e2e, n_out, n_in=10, ok=True, kind=None):
    tpot = (e2e - ttft) / (n_out - 1) if ok and n_out > 1 else None
    itl = [tpot] * (n_out - 1) if tpot else []
    return {"index": i, "start": start, "ttft": ttft if ok else None, "itl": itl, "e2e": e2e, "tpot": tpot,
            "prompt_tokens": n_in if ok else None, "output_tokens": n_out if ok else None, "success": ok,
            "error_kind": kind, "error": None, "usage_missing": False}


def test_summary_by_hand():
    recs = [_rec(0, 0.0, 0.2, 1.2, 11),     # tpot 0.1
            _rec(1, 0.5, 0.8, 1.3, 6),      # tpot 0.1
            _rec(2, 1.0, 0.1, 0.5, 5),      # tpot 0.1
            _rec(3, 1.5, 0, 0.1, 0, ok=False, kind="http_503"),
            _rec(4, 1.6, 0, 0.1, 0, ok=False, kind="timeout")]
    s = summarize(recs, duration=2.0, slo=parse_slo("ttft=500ms,tpot=150ms"))
    assert (s["completed"], s["failed"]) == (3, 2)
    assert s["errors"] == {"http_503": 1, "timeout": 1}
    assert s["total_output_tokens"] == 22 and s["total_input_tokens"] == 30
    assert s["request_throughput"] == 1.5 and s["output_throughput"] == 11 and s["total_token_throughput"] == 26
    assert s["tpot_ms"]["median"] == pytest.approx(100) and s["per_user_tok_s"]["median"] == pytest.approx(10)
    assert s["ttft_ms"]["median"] == pytest.approx(200) and s["e2e_ms"]["max"] == pytest.approx(1300)
    assert s["itl_ms"]["count"] == 10 + 5 + 4
    assert s["max_concurrency"] == 3  # 0.5..1.8 and 1.0..1.5 overlap request 0 (0..1.2) around t=1.0
    assert s["goodput"] == 1.0 and s["slo_attainment"] == pytest.approx(2 / 5)  # request 1 misses ttft


def test_parse_slo():
    assert parse_slo("ttft=500ms,tpot=50ms") == {"ttft": 0.5, "tpot": 0.05}
    assert parse_slo("e2e=2s, ttft=250") == {"e2e": 2.0, "ttft": 0.25}
    assert parse_slo(None) == {}
    for bad in ("latency=1s", "ttft", "ttft=fast"):
        with pytest.raises(ValueError):
            parse_slo(bad)


# -- workloads ----------------------------------------------------------------------------------------
def test_random_dataset_deterministic_and_lengths():
    a = build_dataset("random", 20, input_len=100, output_len=50, range_ratio=0.5, seed=3)
    b = build_dataset("random", 20, input_len=100, output_len=50, range_ratio=0.5, seed=3)
    c = build_dataset("random", 20, input_len=100, output_len=50, range_ratio=0.5, seed=4)
    assert [r.prompt for r in a] == [r.prompt for r in b] and a[0].prompt != c[0].prompt
    assert all(50 <= r.prompt_len <= 150 and 25 <= r.output_len <= 75 for r in a)
    assert all(len(r.prompt.split()) == r.prompt_len for r in a)
    assert len({r.prompt.split()[:8].__str__() for r in a}) == 20  # no shared prefixes between requests


def test_random_dataset_exact_lengths_with_tokenizer():
    tok = load_tokenizer(tiny_model("llama"))
    reqs = build_dataset("random", 10, input_len=40, output_len=8, range_ratio=0.25, seed=1, tokenizer=tok)
    for r in reqs:
        assert len(tok.encode(r.prompt, add_special_tokens=False)) == r.prompt_len
        assert 30 <= r.prompt_len <= 50


def test_shared_prefix_dataset():
    reqs = build_dataset("shared-prefix", 12, prefix_len=64, num_prefixes=3, input_len=10, output_len=5, seed=0)
    systems = [r.system for r in reqs]
    assert len(set(systems)) == 3 and systems[0] == systems[3] == systems[6]
    assert all(r.prompt.startswith(r.system) for r in reqs)
    assert len({r.prompt for r in reqs}) == 12
    m = reqs[0].messages()
    assert m[0] == {"role": "system", "content": reqs[0].system} and m[1]["role"] == "user"


def test_sharegpt_and_jsonl(tmp_path):
    convs = [{"id": i, "conversations": [{"from": "human", "value": f"question number {i} " + "word " * 5},
                                         {"from": "gpt", "value": "answer " * (6 + i)}]} for i in range(5)]
    convs.append({"id": "short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]})
    convs.append({"id": "one-turn", "conversations": [{"from": "human", "value": "a b c d e f"}]})
    p = tmp_path / "sg.json"
    p.write_text(json.dumps(convs))
    reqs = sharegpt_dataset(str(p), 5, seed=0)
    assert sorted(r.output_len for r in reqs) == [6, 7, 8, 9, 10]  # word counts without a tokenizer
    pl = tmp_path / "sg.jsonl"
    pl.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": c["conversations"][0]["value"]},
                                                      {"role": "assistant", "content": "x y z w v"}]})
                            for c in convs[:3]))
    reqs = build_dataset(f"sharegpt:{pl}", 6, seed=1)
    assert len(reqs) == 6 and all(r.output_len == 5 for r in reqs)
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"prompt": "hello there", "output_len": 3}\n{"prompt": "bye", "max_tokens": 7}\n{"prompt": "x"}\n')
    reqs = build_dataset(f"jsonl:{jl}", 4, output_len=9)
    assert [(r.prompt, r.output_len) for r in reqs] == [("hello there", 3), ("bye", 7), ("x", 9), ("hello there", 3)]
    with pytest.raises(ValueError, match="unknown dataset"):
        build_dataset("sharegpt", 1)
    with pytest.raises(ValueError, match="does not exist"):
        build_dataset(f"jsonl:{tmp_path}/missing.jsonl", 1)


def test_poisson_arrivals():
    ts = [t for t, _ in zip(arrival_times(4.0, random.Random(0)), range(4001))]
    gaps = np.diff(ts)
    assert gaps.mean() == pytest.approx(0.25, rel=0.05) and gaps.std() == pytest.approx(0.25, rel=0.08)
    assert ts[:5] == [t for t, _ in zip(arrival_times(4.0, random.Random(0)), range(5))]
    assert [t for t, _ in zip(arrival_times(math.inf, random.Random(0)), range(3))] == [0, 0, 0]


# -- a fake OpenAI endpoint with injected delays ----------------------------------------------------------
def _fake_app():
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

    app = FastAPI()
    app.state.received = 0

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        app.state.received += 1
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL500" in prompt:
            return JSONResponse({"error": {"message": "injected failure", "type": "server_error"}}, status_code=500)
        ttft, itl = body.get("fake_ttft", 0.0), body.get("fake_itl", 0.0)
        ttft += body.get("priority", 0) * body.get("fake_ttft_per_priority", 0.0)
        per_chunk = body.get("fake_tokens_per_chunk", 1)
        n = body["max_tokens"]

        def sse(obj) -> str:
            return "data: " + json.dumps(obj) + "\n\n"

        async def stream():
            await asyncio.sleep(ttft)
            if chat:
                yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            sent = 0
            while sent < n:
                if sent:
                    await asyncio.sleep(itl)
                k = min(per_chunk, n - sent)
                text = "".join(f" t{sent + j}" for j in range(k))
                choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                yield sse({"choices": [choice]})
                sent += k
                if "DROP" in prompt and sent >= 2:
                    return  # connection closes mid-stream, no [DONE]
            yield sse({"choices": [], "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                                                "total_tokens": len(prompt.split()) + n}})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    @app.get("/metrics")
    async def metrics():
        # a speculating server: per request served, 3 drafts of k = 3 tokens, accepted 3, 2 and 1 by position
        n = app.state.received
        text = (f"tokenmill:spec_decode_num_drafts_total{{model_name=\"m\"}} {3.0 * n}\n"
                f"tokenmill:spec_decode_num_draft_tokens_total{{model_name=\"m\"}} {9.0 * n}\n"
                f"tokenmill:spec_decode_num_accepted_tokens_total{{model_name=\"m\"}} {6.0 * n}\n"
                + "".join(f"tokenmill:spec_decode_num_accepted_tokens_per_pos_total{{model_name=\"m\",position="
                          f"\"{i}\"}} {float(a * n)}\n" for i, a in enumerate((3, 2, 1))))
        return PlainTextResponse(text)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle(request, chat=True)

    return app


class _ThreadServer:
    def __init__(self, app) -> None:
        import uvicorn

        self.app = app
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    loop="asyncio"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def fake():
    s = _ThreadServer(_fake_app())
    yield s
    s.stop()


def _assert_injected(measured_ms: float, injected_ms: float, jitter: float = 0.0) -> None:
    """The server sleeps at least the injected delay, so that is a lower bound (less `jitter`, for gaps between
    chunk arrivals that one late chunk shortens); a busy machine only adds, so the excess bound is generous."""
    assert injected_ms * (1 - jitter) <= measured_ms <= injected_ms * 1.5 + 20, (measured_ms, injected_ms)


def test_measured_latencies_match_injected_delays(fake, tmp_path):
    """TTFT 300 ms and ITL 50 ms injected by the server: the client measures them (and not less)."""
    out = tmp_path / "r.json"
    rc = main(["bench", "serve", "--base-url", fake.url + "/v1", "--num-prompts", "6", "--max-concurrency", "3",
               "--input-len", "8", "--output-len", "6", "--no-progress", "--save-result", str(out),
               "--extra-body", json.dumps({"fake_ttft": 0.3, "fake_itl": 0.05})])
    assert rc == 0
    r = json.loads(out.read_text())
    s = r["summary"]
    assert r["config"]["model"] == "fake-model"  # found through /v1/models
    assert s["completed"] == 6 and s["failed"] == 0
    _assert_injected(s["ttft_ms"]["median"], 300)
    _assert_injected(s["itl_ms"]["median"], 50, jitter=0.1)
    _assert_injected(s["tpot_ms"]["median"], 50, jitter=0.1)
    _assert_injected(s["e2e_ms"]["median"], 300 + 5 * 50)
    # per request, the lower bounds the server's sleeps guarantee (one gap between chunk arrivals is not one: a
    # chunk that arrives late, on a loaded machine, shortens the gap after it)
    assert min(x["ttft"] for x in r["requests"]) >= 0.3 and min(x["e2e"] for x in r["requests"]) >= 0.3 + 5 * 0.05
    assert s["max_concurrency"] == 3


def test_token_counts_come_from_usage_not_chunks(fake):
    cfg = ServeConfig(base_url=fake.url, num_prompts=4, output_len=8, input_len=5, progress=False,
                      extra_body={"fake_tokens_per_chunk": 2, "fake_itl": 0.02})
    r = run_benchmark(cfg)
    s = r["summary"]
    assert s["total_output_tokens"] == 32 and s["total_input_tokens"] == 20
    for rec in r["requests"]:
        assert rec["output_tokens"] == 8 and len(rec["itl"]) == 3  # 4 chunks of 2 tokens
        assert rec["tpot"] == pytest.approx((rec["e2e"] - rec["ttft"]) / 7)


def test_spec_decode_acceptance_reported_from_server_metrics(fake):
    """Counters scraped before and after the run (warm-up excluded): acceptance, mean length, per position."""
    cfg = ServeConfig(base_url=fake.url, num_prompts=4, output_len=4, input_len=5, progress=False, warmup=2)
    s = run_benchmark(cfg)["summary"]
    sd = s["spec_decode"]
    assert (sd["num_drafts"], sd["num_draft_tokens"], sd["num_accepted_tokens"]) == (12, 36, 24)
    assert sd["acceptance_rate"] == pytest.approx(24 / 36) and sd["mean_acceptance_length"] == pytest.approx(3.0)
    assert sd["acceptance_per_position"] == pytest.approx([1.0, 2 / 3, 1 / 3])
    assert "spec decode" in format_table(s) and "66.7%" in format_table(s)


def test_errors_by_kind_and_chat(fake, tmp_path):
    jl = tmp_path / "p.jsonl"
    jl.write_text("\n".join(json.dumps({"prompt": p, "output_len": 4}) for p in ("fine", "FAIL500 please", "DROP it",
                                                                                 "fine again")))
    cfg = ServeConfig(base_url=fake.url, endpoint="chat", dataset=f"jsonl:{jl}", num_prompts=8, progress=False,
                      slo=parse_slo("ttft=5s"))
    r = run_benchmark(cfg)
    s = r["summary"]
    assert s["completed"] == 4 and s["failed"] == 4
    assert s["errors"] == {"http_500": 2, "incomplete_stream": 2}
    assert "injected failure" in next(x["error"] for x in r["requests"] if x["error_kind"] == "http_500")
    assert s["total_output_tokens"] == 16 and s["slo_attainment"] == 0.5
    # nothing listening: connection errors, and the run still reports
    dead = ServeConfig(base_url=f"http://127.0.0.1:{free_port()}", model="m", num_prompts=2, progress=False)
    s = run_benchmark(dead)["summary"]
    assert s["errors"] == {"connect": 2} and s["completed"] == 0


def test_priority_classes_sent_and_reported_apart(fake):
    """--priority-classes: each request carries its class's priority, and the report splits the latencies by
    class (the fake server answers priority p after p x 50 ms)."""
    classes = parse_priority_classes("high=0:1,low=3:3")
    assert classes == [("high", 0, 1.0), ("low", 3, 3.0)]
    cfg = ServeConfig(base_url=fake.url, num_prompts=24, input_len=4, output_len=2, progress=False,
                      priority_classes=classes, extra_body={"fake_ttft_per_priority": 0.05})
    r = run_benchmark(cfg)
    s = r["summary"]
    assert list(s["classes"]) == ["high", "low"]
    high, low = s["classes"]["high"], s["classes"]["low"]
    assert high["completed"] + low["completed"] == 24 and high["completed"] >= 1 and low["completed"] >= 8
    assert high["priority"] == 0 and low["priority"] == 3
    assert low["ttft_ms"]["min"] >= 150 and high["ttft_ms"]["median"] < low["ttft_ms"]["median"]
    assert all(x["priority"] == (0 if x["class"] == "high" else 3) for x in r["requests"])
    assert "class low (priority 3)" in format_table(s)
    for bad in ("high=0", "a=1:0", "a=1:1,a=2:1", "x y=1:1"):
        with pytest.raises(Exception, match="priority class"):
            parse_priority_classes(bad)


def test_rate_duration_and_warmup(fake):
    before = fake.app.state.received
    cfg = ServeConfig(base_url=fake.url, num_prompts=50, request_rate=40.0, duration=0.5, warmup=3, input_len=4,
                      output_len=2, progress=False, max_concurrency=8)
    r = run_benchmark(cfg)
    n = len(r["requests"])
    assert fake.app.state.received - before == n + 3  # warm-up sent but not counted
    assert 8 <= n <= 40 and all(x["start"] < 0.5 for x in r["requests"])
    assert r["summary"]["completed"] == n
    with pytest.raises(ValueError, match="--duration needs"):
        run_benchmark(ServeConfig(base_url=fake.url, duration=1.0))


def test_sweep_writes_table_json_and_pareto(fake, tmp_path, capsys):
    out, plots = tmp_path / "sweep.json", tmp_path / "plots"
    rc = main(["bench", "sweep", "--base-url", fake.url, "--max-concurrency", "1,4", "--num-prompts", "4",
               "--input-len", "4", "--output-len", "4", "--no-progress", "--save-result", str(out),
               "--plot", str(plots), "--extra-body", '{"fake_ttft": 0.02, "fake_itl": 0.01}'])
    assert rc == 0
    table = capsys.readouterr().out
    assert "user tok/s" in table and "TTFT p50" in table
    r = json.loads(out.read_text())
    assert [p["max_concurrency"] for p in r["points"]] == [1, 4]
    assert all(p["summary"]["completed"] == 4 for p in r["points"])
    assert r["points"][1]["summary"]["output_throughput"] > r["points"][0]["summary"]["output_throughput"]
    if HAVE_MPL:
        assert (plots / "pareto.png").stat().st_size > 1000


# -- end to end against a real server ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(request):
    # the same server test_server.py uses (shared within a session)
    return shared_server(request.config, tiny_model("llama"), "--served-model-name", "tiny-llama", api_key=API_KEY)


def test_bench_serve_against_tokenmill_serve(server, tmp_path, capsys):
    out, plots = tmp_path / "result.json", tmp_path / "plots"
    rc = main(["bench", "serve", "--base-url", server.url, "--api-key", API_KEY, "--num-prompts", "8",
               "--max-concurrency", "4", "--input-len", "24", "--output-len", "8", "--range-ratio", "0.5",
               "--tokenizer", tiny_model("llama"), "--warmup", "2", "--slo", "ttft=30s,tpot=10s", "--no-progress",
               "--save-result", str(out), "--plot", str(plots)])
    assert rc == 0
    table = capsys.readouterr().out
    for word in ("TTFT (ms)", "TPOT (ms)", "ITL (ms)", "E2E (ms)", "goodput", "8 ok, 0 failed"):
        assert word in table
    r = json.loads(out.read_text())
    s, recs = r["summary"], r["requests"]
    assert r["config"]["model"] == "tiny-llama" and "api_key" not in r["config"]
    assert len(recs) == 8 and s["completed"] == 8 and s["failed"] == 0 and s["errors"] == {}
    for x in recs:
        assert x["success"] and x["output_tokens"] == x["expected_output_len"]  # ignore_eos: exact lengths
        assert x["prompt_tokens"] == x["expected_prompt_len"]                   # exact with --tokenizer
        assert 0 < x["ttft"] <= x["e2e"] and len(x["itl"]) <= x["output_tokens"] - 1
    assert s["total_output_tokens"] == sum(x["output_tokens"] for x in recs)
    assert s["total_input_tokens"] == sum(x["prompt_tokens"] for x in recs)
    assert s["output_throughput"] == pytest.approx(s["total_output_tokens"] / s["duration_s"])
    assert s["request_throughput"] == pytest.approx(8 / s["duration_s"])
    assert s["ttft_ms"]["count"] == s["e2e_ms"]["count"] == 8 and s["slo_attainment"] == 1.0
    assert s["ttft_ms"]["median"] <= s["ttft_ms"]["p90"] <= s["ttft_ms"]["p99"] <= s["ttft_ms"]["max"]
    assert s["max_concurrency"] == max_in_flight(recs) and 2 <= s["max_concurrency"] <= 4  # the limit held
    if HAVE_MPL:
        for name in ("latency_cdf.png", "timeline.png"):
            assert (plots / name).stat().st_size > 1000


def test_bench_serve_chat_shared_prefix(server):
    cfg = ServeConfig(base_url=server.url, api_key=API_KEY, endpoint="chat", dataset="shared-prefix",
                      prefix_len=32, num_prefixes=2, input_len=8, output_len=4, num_prompts=4, progress=False)
    s = run_benchmark(cfg)["summary"]
    assert s["completed"] == 4 and s["total_output_tokens"] == 16


def test_bench_offline_cli(tiny, monkeypatch, capsys):
    import tokenmill.perf.hardware as hw

    monkeypatch.setattr(hw, "copy_bandwidth", lambda: 1e10)  # skip the GiB-sized measurements
    monkeypatch.setattr(hw, "read_bandwidth", lambda: 1e10)
    assert main(["bench", "offline", tiny("llama"), "--num-requests", "3", "--dtype", "float32", "--input-range",
                 "8,32", "--output-range", "4,8", "--single-stream-len", "8"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("tokenmill ") and "out tok/s (3 reqs, float32)" in out[-1]
    result = json.loads("\n".join(out[:-1]))
    assert result["tokenmill"]["output_tokens"] > 0 and "transformers" not in result


def test_benchmarks_script_reuses_the_package():
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    spec = importlib.util.spec_from_file_location("offline_throughput", os.path.join(root, "benchmarks",
                                                                                      "offline_throughput.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    from tokenmill.bench import offline

    assert mod.run_offline is offline.run_offline
