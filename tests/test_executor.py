"""Executors with real processes: the mp executor (one process per rank, ZMQ channels, gloo) and the Ray
executor (actors on a local Ray instance) give the in-process engine's tokens; collective_rpc reaches every
rank; a rank that fails to start or dies is reported by rank, and a server whose rank dies exits non-zero
within 10 s; ranks never outlive their engine; a missing Ray names the install command."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import httpx
import pytest

from server_utils import ROOT, ServerProc, process_alive
from tokenmill import LLM, SamplingParams
from tokenmill.executor.base import WorkerDiedError
from tokenmill.step import ModelRunnerOutput, SchedulerOutput

pytestmark = pytest.mark.distributed

PROMPTS = [[3 + (7 * i + n) % 60 for i in range(n)] for n in (4, 23, 41, 66)]
# 16-token steps chunk the prefills; 12 blocks of 16 tokens for ~250 tokens of requests forces preemption.
ENGINE = dict(dtype="float32", seed=0, max_num_batched_tokens=16, num_gpu_blocks_override=12)
SP = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


def _generate(llm) -> list:
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SP, use_tqdm=False)]


def _assert_same(got, expected) -> None:
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
        for lp_g, lp_e in zip(g.logprobs, e.logprobs):
            assert lp_g.keys() == lp_e.keys()
            assert all(abs(lp_g[t].logprob - lp_e[t].logprob) < 1e-4 for t in lp_e)


@pytest.fixture(scope="module")
def reference(tiny):
    llm = LLM(tiny("llama"), **ENGINE)
    try:
        return _generate(llm)
    finally:
        llm.engine.shutdown()


def rank_info(worker, boom_on=None) -> tuple:
    """collective_rpc target (module level, so it pickles by reference into the rank processes)."""
    import torch

    from tokenmill import distributed

    if worker.rank == boom_on:
        raise ValueError(f"boom on rank {worker.rank}")
    return worker.rank, distributed.tp_rank(), torch.get_num_threads(), os.getpid()


def test_mp_one_rank_matches_in_process(tiny, reference):
    llm = LLM(tiny("llama"), distributed_executor_backend="mp", **ENGINE)
    try:
        _assert_same(_generate(llm), reference)
        ex = llm.engine.executor
        assert [r[:2] for r in ex.collective_rpc(rank_info)] == [(0, 0)]
        assert ex.collective_rpc(rank_info)[0][3] != os.getpid()  # it ran in the rank's own process
        assert ex.kernels()["attention"]
        # Steps in flight (pipeline parallel keeps several): futures, resolved in submission order
        futures = [ex.execute_model(SchedulerOutput(finished_req_ids=[f"gone-{i}"]), non_block=True) for i in range(3)]
        assert all(isinstance(f.result(timeout=30), ModelRunnerOutput) for f in futures)
        # A rank that dies while the engine is idle: the engine loop's health check raises within a poll
        os.kill(ex.ranks.procs[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        with pytest.raises(WorkerDiedError, match=r"worker rank 0 \(pid \d+\) was killed by SIGKILL"):
            while time.monotonic() < deadline:
                llm.engine.check_health()
                time.sleep(0.05)
    finally:
        llm.engine.shutdown()


def test_mp_tp2_rpc_errors_and_a_hung_rank(tiny, reference, monkeypatch):
    monkeypatch.setenv("TOKENMILL_COLLECTIVE_TIMEOUT_S", "8")  # the ranks inherit it
    llm = LLM(tiny("llama"), tensor_parallel_size=2, **ENGINE)
    ex = llm.engine.executor
    try:
        assert type(ex).__name__ == "MultiprocExecutor"  # the default for world size > 1
        _assert_same(_generate(llm), reference)
        info = ex.collective_rpc(rank_info)
        assert [r[:3] for r in info] == [(0, 0, 1), (1, 1, 1)]  # 2 cores split between the ranks
        with pytest.raises(RuntimeError, match="worker rank 1: ValueError: boom on rank 1"):
            ex.collective_rpc(rank_info, kwargs={"boom_on": 1})
        assert [r[0] for r in ex.collective_rpc(rank_info)] == [0, 1]  # the channel stays in order after it

        # Rank 1 hangs (alive, not answering): rank 0's all-reduce times out, and rank 0 leaves the broken world.
        os.kill(info[1][3], signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 0 \(pid \d+\) exited after a collective failed"):
            while time.monotonic() - t0 < 30:  # the first step fails (rolled back), the next finds rank 0 gone
                _generate(llm)
        assert time.monotonic() - t0 < 8 + 5
        deadline = time.monotonic() + 5  # the hung rank is killed with it
        while process_alive(info[1][3]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not process_alive(info[1][3])
    finally:
        llm.engine.shutdown()


def test_a_rank_that_fails_to_start_is_named(tiny, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(tiny("llama")):
        if not name.endswith(".safetensors"):
            os.symlink(os.path.join(tiny("llama"), name), bad / name)
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 0 failed to start: "):
        LLM(str(bad), distributed_executor_backend="mp", dtype="float32")
    assert time.monotonic() - t0 < 60


def test_ranks_do_not_outlive_their_engine(tiny):
    """An engine shut down normally takes its ranks along; so does one SIGKILLed (no cleanup runs in it):
    its ranks notice and exit on their own."""
    script = textwrap.dedent(f"""
        import time
        from tokenmill import LLM
        def engine():
            return LLM({tiny("llama")!r}, distributed_executor_backend="mp", dtype="float32", num_gpu_blocks_override=8)
        llm = engine()
        print(*[p.pid for p in llm.engine.executor.ranks.procs], flush=True)
        llm.engine.shutdown()
        print("shut down", flush=True)
        llm = engine()
        print(*[p.pid for p in llm.engine.executor.ranks.procs], flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        first = [int(p) for p in proc.stdout.readline().split()]
        assert proc.stdout.readline() == "shut down\n"
        assert first and not any(process_alive(p) for p in first)
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(process_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 5
    while any(process_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(process_alive(p) for p in pids)


def _rank_pids(engine_pid: int) -> list[int]:
    with open(f"/proc/{engine_pid}/task/{engine_pid}/children") as f:
        children = [int(p) for p in f.read().split()]
    ranks = []
    for pid in children:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"worker_entry" in f.read():
                ranks.append(pid)
    return sorted(ranks)


def test_server_exits_when_a_rank_dies_mid_stream(tiny):
    s = ServerProc(tiny("llama"), "--tensor-parallel-size", "2")
    try:
        ranks = _rank_pids(s.engine_pid())
        assert len(ranks) == 2
        body = {"model": tiny("llama"), "prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            next(lines)  # the stream is running: steps are in flight
            os.kill(ranks[1], signal.SIGKILL)
            t0 = time.monotonic()
            rest = "\n".join(lines)
        assert "error" in rest
        code = s.proc.wait(10 - (time.monotonic() - t0))
        assert code != 0
        assert "worker rank 1" in s.logs() and "killed by SIGKILL" in s.logs()
        assert "server stopped: the engine failed: WorkerDiedError" in s.logs()
        assert not any(process_alive(p) for p in ranks)
    finally:
        s.stop(signal.SIGKILL)


def test_ray_executor_matches_in_process(tiny, reference):
    ray = pytest.importorskip("ray")
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers do not have tests/ on their path
    llm = LLM(tiny("llama"), tensor_parallel_size=2, distributed_executor_backend="ray", **ENGINE)
    try:
        _assert_same(_generate(llm), reference)
        ex = llm.engine.executor
        assert [r[:2] for r in ex.collective_rpc(rank_info)] == [(0, 0), (1, 1)]
        assert ex.collective_rpc(lambda w: w.rank) == [0, 1]  # Ray pickles a lambda by value
        with pytest.raises(RuntimeError, match="worker rank 0 failed during rpc: ValueError: boom on rank 0"):
            ex.collective_rpc(rank_info, kwargs={"boom_on": 0})
        os.kill(ex.collective_rpc(rank_info)[1][3], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match=r"worker rank 1 \(Ray actor\) died"):
            _generate(llm)
        assert time.monotonic() - t0 < 10
    finally:
        llm.engine.shutdown()


def test_missing_ray_names_the_install_command(tiny):
    script = textwrap.dedent(f"""
        import sys
        sys.modules["ray"] = None  # `import ray` raises ImportError, as when it is not installed
        from tokenmill.executor.ray import import_ray
        try:
            import_ray()
        except RuntimeError as e:
            print(e)
        from tokenmill import LLM
        LLM({tiny("llama")!r}, tensor_parallel_size=2, distributed_executor_backend="ray")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode != 0
    hint = "--distributed-executor-backend ray needs Ray: pip install 'tokenmill[ray]'"
    assert r.stdout.strip() == hint
    assert r.stderr.strip().splitlines()[-1] == f"ValueError: {hint}"
