"""A request whose data makes the engine fail (a step raising, a grammar that does not compile) fails alone:
every other request finishes with exactly the tokens it gets without it, no block leaks, and the engine
keeps serving. The failure is injected by wrapping the executor: a step containing the poisoned request
raises before the forward pass, as a kernel error on that request's data would.

A failure the engine cannot isolate ends the engine process, which reports it (a `fatal` message) before it
exits; the API process then restarts it. That is checked on a real server, the failure injected into its
engine process by a sitecustomize module (FAULT_HOOK)."""
import os
import random
import textwrap
import time

import httpx
import pytest

from server_utils import ServerProc, require_default_model
from tokenmill import LLM, SamplingParams
from tokenmill.engine.async_llm import RestartBackoff
from tokenmill.messages import EngineCoreRequest, FinishReason
from tokenmill.sampling_params import StructuredOutputsParams

POISON = "poison"


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny("qwen2"), dtype="float32", num_gpu_blocks_override=128, block_size=16,
               max_num_batched_tokens=256, seed=0)


def _prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(20, 60))] for _ in range(n)]


def _run(engine, reqs: list[EngineCoreRequest]) -> dict[str, tuple[list[int], int, str]]:
    for r in reqs:
        engine.add_request(r)
    out: dict[str, list] = {r.request_id: [[], None, None] for r in reqs}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            out.setdefault(o.request_id, [[], None, None])[0] += o.new_token_ids
            if o.finish_reason is not None:
                out[o.request_id][1:] = [o.finish_reason, o.error]
    return {k: tuple(v) for k, v in out.items()}


@pytest.fixture
def poisoned(llm, monkeypatch):
    engine = llm.engine
    real = engine.executor.execute_model
    calls = []

    def execute_model(sched):
        calls.append([s.request_id for s in sched.scheduled])
        if any(s.request_id.startswith(POISON) for s in sched.scheduled):
            raise RuntimeError("injected kernel failure")
        return real(sched)

    monkeypatch.setattr(engine.executor, "execute_model", execute_model)
    return calls


def test_failing_request_fails_alone_and_others_are_exact(llm, poisoned):
    engine = llm.engine
    vocab = llm.config.model.hf_config.vocab_size
    prompts = _prompts(vocab, 6, seed=3)
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = _run(engine, [EngineCoreRequest(f"ref-{i}", p, sp) for i, p in enumerate(prompts)])
    poisoned.clear()
    # The poisoned request shares prompt 0's first 48 tokens: its failed step registered blocks it never
    # wrote, which must not be served to anyone from the prefix cache.
    bad = prompts[0][:48] + [5, 6, 7]
    got = _run(engine, [EngineCoreRequest(f"ok-{i}", p, sp) for i, p in enumerate(prompts[:3])]
               + [EngineCoreRequest(f"{POISON}-0", bad, sp)]
               + [EngineCoreRequest(f"ok-{i}", p, sp) for i, p in enumerate(prompts[3:], start=3)])
    tokens, reason, error = got[f"{POISON}-0"]
    assert reason == FinishReason.ERROR and "injected kernel failure" in error and tokens == []
    for i in range(len(prompts)):
        assert got[f"ok-{i}"][0] == expected[f"ref-{i}"][0], i
        assert got[f"ok-{i}"][1] == FinishReason.LENGTH
    assert any(len(c) > 1 and f"{POISON}-0" in c for c in poisoned)  # it did fail inside a batch
    assert [f"{POISON}-0"] in poisoned                                 # and was then run alone
    assert engine.scheduler.kv.is_whole() and not engine.scheduler.quarantine
    # The engine keeps serving, and the prefix cache still gives the right answer for prompt 0.
    again = _run(engine, [EngineCoreRequest("after", prompts[0], sp)])
    assert again["after"][0] == expected["ref-0"][0]


def test_engine_gives_up_after_many_failed_steps(llm, monkeypatch):
    """A step that fails for everyone (a broken engine, not a request) ends the engine after a bound, so
    the server can restart it."""
    from tokenmill.engine import core

    engine = llm.engine

    def broken(sched):
        raise RuntimeError("device lost")

    monkeypatch.setattr(engine.executor, "execute_model", broken)
    monkeypatch.setattr(core, "MAX_FAILED_STEPS", 3)
    sp = SamplingParams(temperature=0, max_tokens=4)
    for i in range(3):
        engine.add_request(EngineCoreRequest(f"b-{i}", [5, 6, 7, 8 + i], sp))
    with pytest.raises(RuntimeError, match="device lost"):
        for _ in range(10):
            engine.step()
    monkeypatch.undo()
    engine.abort_requests([f"b-{i}" for i in range(3)])
    engine.step()
    assert engine.scheduler.kv.is_whole() and not engine.has_unfinished_requests()
    engine.num_failed_steps = 0


def test_grammar_that_fails_to_compile_rejects_only_its_request(llm):
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    broken = sp.clone(structured_outputs=StructuredOutputsParams(grammar='root ::= "a" undefined_rule'))
    got = _run(engine, [EngineCoreRequest("free", [5, 6, 7, 8], sp), EngineCoreRequest("bad", [5, 6, 7, 9], broken)])
    assert got["bad"][1] == FinishReason.REJECTED and "grammar" in got["bad"][2]
    assert got["free"][1] == FinishReason.LENGTH and len(got["free"][0]) == 6
    assert engine.scheduler.kv.is_whole() and not engine.scheduler.compiling


def test_constrained_request_waits_for_its_grammar_without_holding_others(llm):
    engine = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    choice = sp.clone(structured_outputs=StructuredOutputsParams(choice=["yes", "no"]), ignore_eos=False,
                      max_tokens=8)
    engine.add_request(EngineCoreRequest("c", [5, 6, 7, 8], choice, [llm.tokenizer.eos_token_id]))
    engine.add_request(EngineCoreRequest("f", [5, 6, 7, 9], sp))
    assert [r.request_id for r in engine.scheduler.compiling] == ["c"]
    first = engine.step()  # the free request runs at once; the constrained one may still be compiling
    assert any(o.request_id == "f" for o in first)
    got = _run(engine, [])
    assert engine.scheduler.kv.is_whole()
    text = llm.tokenizer.decode([t for o in first if o.request_id == "c" for t in o.new_token_ids] + list(
        got.get("c", ([],))[0]), skip_special_tokens=True)
    assert text in ("yes", "no"), text


# Loaded by every Python process of the server (PYTHONPATH): in the engine process, a request with seed FAULT_SEED
# makes EngineCore.add_request raise a RuntimeError, which the engine loop does not isolate (only a ValueError is
# a rejected request): the engine reports it as fatal and exits 1.
FAULT_SEED = 4242
FAULT_HOOK = f"""
from tokenmill.engine import core_proc

_real_init = core_proc._EngineLoop.__init__


def _init(self, engine, *args, **kwargs):
    _real_init(self, engine, *args, **kwargs)
    real_add = engine.add_request

    def add_request(req):
        if req.sampling_params.seed == {FAULT_SEED}:
            raise RuntimeError("injected engine fault")
        return real_add(req)

    engine.add_request = add_request


core_proc._EngineLoop.__init__ = _init
"""


@pytest.fixture
def faulty_server(tmp_path, monkeypatch):
    require_default_model()
    (tmp_path / "sitecustomize.py").write_text(textwrap.dedent(FAULT_HOOK))
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    s = ServerProc(None, "--max-model-len", "256")
    yield s
    s.stop()


def test_engine_reported_failure_restarts_within_10s_every_time(faulty_server):
    """Each restart once raced the dead engine's exit watch: the new engine was marked dead at once ("exit code
    None"), again and again, /health 503 throughout and the API process spinning."""
    s = faulty_server
    for i in range(3):
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "seed": FAULT_SEED},
                       timeout=30)
        assert r.status_code in (500, 503) and "injected engine fault" in r.text, r.text
        t0 = time.monotonic()
        while httpx.get(s.url + "/health", timeout=5).status_code != 200:
            assert time.monotonic() - t0 < 10, f"round {i}: /health not 200 after 10 s"
            time.sleep(0.1)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4, (i, r.text)
    assert httpx.get(s.url + "/health", params={"detail": 1}, timeout=5).json()["engine_restarts"] == 3
    assert "exit code None" not in s.logs() and "restart 3 failed" not in s.logs()


def test_restart_backoff_grows_in_a_crash_loop_and_resets_after_a_healthy_period():
    b = RestartBackoff()  # up to 30 s; healthy after 10 s of being ready
    delays = []
    now = 0.0
    for _ in range(7):  # each engine dies 3 s after it became ready
        delays.append(b.next_delay(now))
        now += delays[-1] + 2.0
        b.on_ready(now)
        now += 3.0
    assert delays == [0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0]
    assert b.next_delay(now + 1.0) == 30.0        # a failed start (never ready) keeps the pause
    b.on_ready(now + 40.0)
    assert b.next_delay(now + 51.0) == 0.0        # served 11 s: the next failure restarts at once
    assert b.next_delay(now + 52.0) == 1.0
