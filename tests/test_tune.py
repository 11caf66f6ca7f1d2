"""`tokenmill tune` and `tokenmill bench matrix`: SLO parsing and verdicts, the search space, pruning with the
plan's arithmetic, successive halving, and real runs on a tiny random model (real `tokenmill serve`
subprocesses driven by the bench load generator): failed starts, resumability, the winning command, the
matrix's JSON and PNG."""
from __future__ import annotations

import json
import os
import shlex

import httpx
import pytest

from server_utils import CliProc
from tokenmill.bench.report import meets_slo, parse_slo, slo_violations, summarize
from tokenmill.cli import main
from tokenmill.perf.hardware import Hardware
from tokenmill.models.shape import load_model_shape
from tokenmill.tune import prune, search, space

TINY_ARGS = ["--input-len", "16", "--output-len", "4", "--num-prompts", "4", "--warmup", "1", "--no-progress"]
SERVE_ARGS = "--serve-args=--dtype float32 --kv-cache-memory-bytes 64MiB"


# -- SLOs ---------------------------------------------------------------------------------------------
def _rec(ttft, tpot, itl, e2e, ok=True):
    return {"success": ok, "ttft": ttft, "tpot": tpot, "itl": itl, "e2e": e2e, "start": 0.0, "prompt_tokens": 4,
            "output_tokens": len(itl) + 1, "error_kind": None if ok else "http"}


def test_percentile_slo_keys_and_verdicts():
    slo = parse_slo("ttft_p90=2s,tpot_p99=100ms,itl=300ms,e2e_p50=5s")
    assert slo == {"ttft_p90": 2.0, "tpot_p99": 0.1, "itl": 0.3, "e2e_p50": 5.0}
    for bad in ("ttft_p95=1s", "latency_p90=1s", "ttft_p=1s", "ttft_p90"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    # per request: itl bare = its largest gap; ttft_p90 = its own ttft within the limit
    assert meets_slo(_rec(1.0, 0.05, [0.05, 0.2], 3.0), slo)
    assert not meets_slo(_rec(1.0, 0.05, [0.05, 0.4], 3.0), slo)
    assert not meets_slo(_rec(2.5, 0.05, [0.05], 3.0), slo)
    recs = [_rec(0.1 * (i + 1), 0.05, [0.05] * 3, 1.0) for i in range(10)]  # ttft 0.1 .. 1.0 s
    s = summarize(recs, 10.0, parse_slo("ttft_p90=0.5s"))
    assert s["goodput"] == pytest.approx(0.5) and s["slo_violations"] == ["ttft_p90 910ms > 500ms"]
    assert slo_violations(s, parse_slo("ttft_p50=600ms,e2e=1s")) == []
    assert slo_violations(s, parse_slo("ttft=900ms")) == ["ttft 1000ms > 900ms"]  # bare: every request (max)


# -- space ---------------------------------------------------------------------------------------------
def test_space_grid_hash_and_command():
    dims = {"quantization": [None, "int8"], "speculative_config": [None, space.NGRAM],
            "enable_prefix_caching": [None, False], "max_concurrency": [4]}
    configs = space.grid(dims)
    assert len(configs) == 8 and len({space.config_key(c) for c in configs}) == 8
    c = {"quantization": "int8", "speculative_config": space.NGRAM, "enable_prefix_caching": False,
         "max_concurrency": 4}
    assert space.config_key(c) == space.config_key({**c, "kv_cache_dtype": None})  # None = default
    cmd = space.serve_command("m", ["--dtype", "float32"], c)
    assert shlex.split(cmd) == ["tokenmill", "serve", "m", "--dtype", "float32", "--no-enable-prefix-caching",
                                "--quantization", "int8", "--speculative-config",
                                '{"method":"ngram","num_speculative_tokens":4}']
    assert space.describe(c) == "prefix=off quant=int8 spec=ngram:4 conc=4"
    from tokenmill.tune.run import serve_option_strings

    with pytest.raises(ValueError, match="not a `tokenmill serve` flag"):
        space.check_space({"max_num_seq": [1]}, serve_option_strings())
    assert space.load_space('{"max-num-seqs": 8}') == {"max_num_seqs": [8]}


# -- pruning -------------------------------------------------------------------------------------------
def _machine(memory=64 * 2**30):
    return prune.Machine(Hardware("test-cpu", memory, 20e9, {"fp32": 200e9}, measured=True), "fp32", shared=True)


def test_prune_with_plan_memory_and_roofline():
    shape = load_model_shape("SmolLM2-135M")
    work = prune.Workload(input_len=256, output_len=64, num_prompts=32)
    configs = [{"max_concurrency": 8}, {"quantization": "int8", "max_concurrency": 8},
               {"kv_cache_memory_bytes": "1MiB", "max_concurrency": 8},
               {"data_parallel_size": 8, "max_concurrency": 8}]
    kept, pruned = prune.prune_and_rank(configs, shape, _machine(memory=24 * 2**30), work, {}, "throughput", {})
    reasons = {space.describe(c): r for c, r in pruned}
    assert "holds no sequence" in reasons["kv_cache_memory_bytes=1MiB conc=8"]
    assert "GiB usable" in reasons["dp=8 conc=8"]  # 8 x (weights + 4 GiB KV) > 24 GiB
    # bandwidth-bound decode: int8 weights move a quarter of fp32's bytes, so the plan ranks int8 first
    assert [space.describe(c) for c, _ in kept] == ["quant=int8 conc=8", "default conc=8"]
    assert kept[0][1]["output_tok_s"] > kept[1][1]["output_tok_s"]
    # an SLA no configuration can meet even in theory (TPOT under the time to read the weights once)
    kept, pruned = prune.prune_and_rank(configs[:2], shape, _machine(), work, parse_slo("tpot_p90=1us"),
                                        "goodput", {})
    assert not kept and all("roofline" in r for _, r in pruned)
    # speculation lowers the per-token floor: 4 drafted tokens per step make a 5x lower TPOT bound
    pred = prune.predict({"speculative_config": space.NGRAM}, shape, _machine(), work, {})
    base = prune.predict({}, shape, _machine(), work, {})
    assert pred["tpot_min_s"] == pytest.approx(base["tpot_min_s"] / 5)


# -- successive halving --------------------------------------------------------------------------------
def test_successive_halving_promotes_the_best_and_respects_max_trials():
    speed = {f"c{i}": float(i) for i in range(9)}
    calls = []

    def run(config, n, rung):
        calls.append((config["name"], n, rung))
        s = {"completed": n, "output_throughput": speed[config["name"]] * (1 + rung)}
        return {"config": config, "label": config["name"], "rung": rung, "status": "ok", "summary": s,
                "violations": ["ttft_p90"] if config["name"] == "c8" else []}

    cands = [{"name": f"c{i}"} for i in range(9)]
    sizes = search.rung_sizes(27, rungs=3, eta=3, smallest=2)
    assert sizes == [3, 9, 27]
    recs = search.successive_halving(cands, run, sizes, 3, search.Budget(max_trials=13), "throughput")
    assert [c for c in calls if c[2] == 0] == [(f"c{i}", 3, 0) for i in range(9)]
    # c8 is fastest but misses the SLA: it ranks below every configuration that meets it
    assert [c[0] for c in calls if c[2] == 1] == ["c7", "c6", "c5"] and calls[-1] == ("c7", 27, 2)
    assert search.pick_winner(recs, "throughput")["label"] == "c7"
    calls.clear()
    search.successive_halving(cands, run, sizes, 3, search.Budget(max_trials=6), "throughput")
    assert len(calls) <= 6 and calls[0] == ("c0", 3, 0)


def test_interleaved_abba_ratio_spread():
    order = []

    def meas(name, value):
        def f(i):
            order.append(name)
            return {"status": "ok", "summary": {"output_throughput": value * (1 + i), "completed": 1}}
        return f

    out = search.interleaved(meas("a", 10.0), meas("b", 15.0), 3, "throughput")
    assert order == ["a", "b", "b", "a", "a", "b"]
    assert out["ratio"] == {"median": 1.5, "min": 1.5, "max": 1.5, "n": 3}


# -- real runs on the tiny model -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_tune(tmp_path_factory):
    from models import tiny_model

    model = tiny_model("llama")
    out = str(tmp_path_factory.mktemp("tune"))
    argv = ["tune", model, "--no-default-space", "--space", '{"block_size": [null, 3], "max_concurrency": [1, 2]}',
            "--max-concurrency", "1", "--rungs", "1", "--repeats", "0", "--slo", "ttft_p90=60s,tpot_p90=10s",
            "--out", out, SERVE_ARGS, *TINY_ARGS]
    assert main(argv) == 0
    with open(os.path.join(out, "tune.json")) as f:
        first = json.load(f)
    return model, out, argv, first


def test_tune_trials_verdicts_and_failed_start(tiny_tune, capsys):
    model, out, _, res = tiny_tune
    trials = {t["label"]: t for t in res["trials"]}
    assert set(trials) == {"default conc=1", "default conc=2", "block_size=3 conc=1", "block_size=3 conc=2"}
    # one server for both loads of the default flags, one failed start for block_size=3 (not retried)
    assert res["server_starts"] == 2 and res["measured"] == 4
    for label in ("default conc=1", "default conc=2"):
        t = trials[label]
        assert t["status"] == "ok" and t["violations"] == [] and search.verdict(t) == "meets SLA"
        assert t["summary"]["completed"] == 4 and t["summary"]["ttft_ms"]["p90"] > 0 and "goodput" in t["summary"]
        assert os.path.exists(os.path.join(out, "trials", t["key"] + ".json"))
    for label in ("block_size=3 conc=1", "block_size=3 conc=2"):
        assert trials[label]["status"] == "failed_start" and "block_size" in trials[label]["reason"]
    # the same measured summary judged against an SLA no HTTP round trip can meet
    assert slo_violations(trials["default conc=1"]["summary"], parse_slo("ttft_p50=100us"))
    assert os.path.exists(res["pareto_png"])
    assert res["winner"]["label"].startswith("default")


def test_tune_rerun_skips_measured_trials(tiny_tune, capsys):
    _, out, argv, first = tiny_tune
    capsys.readouterr()
    assert main(argv) == 0
    with open(os.path.join(out, "tune.json")) as f:
        again = json.load(f)
    assert again["server_starts"] == 0 and again["measured"] == 0 and again["resumed"] == 4
    assert again["winner"] == first["winner"]
    printed = capsys.readouterr().out
    assert "meets SLA" in printed and "failed_start" in printed and first["winner"]["command"] in printed


def test_winning_command_starts_a_healthy_server(tiny_tune):
    cmd = shlex.split(tiny_tune[3]["winner"]["command"])
    assert cmd[:2] == ["tokenmill", "serve"]
    server = CliProc(cmd[1:])
    try:
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    finally:
        server.stop()


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if entry.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    kids.append(int(entry))
        except (OSError, ValueError, IndexError):
            pass
    return kids


def test_sigterm_stops_the_trial_server(tmp_path):
    """A tune killed mid-trial (SIGTERM) stops its trial server, which runs in its own session."""
    import subprocess
    import sys
    import time

    from models import tiny_model

    argv = [sys.executable, "-m", "tokenmill.cli", "tune", tiny_model("llama"), "--no-default-space",
            "--max-concurrency", "1", "--rungs", "1", "--repeats", "0", "--out", str(tmp_path), SERVE_ARGS,
            *TINY_ARGS[:4], "--num-prompts", "100000", "--warmup", "0", "--no-progress"]
    tune = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while not (kids := _children(tune.pid)) and time.monotonic() < deadline and tune.poll() is None:
            time.sleep(0.2)
        assert kids, "the tune never started a trial server"
        time.sleep(1.0)
        tune.send_signal(15)
        assert tune.wait(timeout=90) != 0
        deadline = time.monotonic() + 30
        while any(os.path.exists(f"/proc/{k}") for k in kids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(os.path.exists(f"/proc/{k}") for k in kids)
    finally:
        tune.kill()


def test_bench_matrix_json_product_and_png(tmp_path, capsys):
    from models import tiny_model

    out = str(tmp_path / "matrix")
    argv = ["bench", "matrix", tiny_model("llama"), "--techniques", "prefix,batch", "--batch", "2", "--repeats", "1",
            "--out", out, SERVE_ARGS, *[a for a in TINY_ARGS if a != "--no-progress"]]
    assert main(argv) == 0
    with open(os.path.join(out, "matrix.json")) as f:
        res = json.load(f)
    rows = {r["label"]: r for r in res["rows"]}
    assert list(rows) == ["baseline", "prefix", "batch", "prefix+batch"]
    assert rows["baseline"]["speedup"] == 1.0 and res["server_starts"] == 2  # batch is load-only: shares a server
    both = rows["prefix+batch"]
    assert both["product"] == pytest.approx(rows["prefix"]["speedup"] * rows["batch"]["speedup"])
    assert both["interaction"] == pytest.approx(both["speedup"] / both["product"])
    assert all(r["status"] == "ok" and r["value"] > 0 for r in rows.values())
    assert os.path.getsize(os.path.join(out, "matrix.png")) > 0
    assert "prefix+batch" in capsys.readouterr().out


def test_remeasure_serves_both_side_by_side_and_caches(tmp_path):
    import argparse

    from models import tiny_model
    from tokenmill.bench.serve import ServeConfig
    from tokenmill.tune.run import remeasure
    from tokenmill.tune.trial import TrialRunner

    workload = ServeConfig(input_len=16, output_len=4, warmup=1, progress=False)
    runner = TrialRunner(tiny_model("llama"), ["--dtype", "float32", "--kv-cache-memory-bytes", "64MiB"], workload,
                         str(tmp_path))
    args = argparse.Namespace(repeats=2, objective="throughput", out=str(tmp_path))
    base, winner = {"max_concurrency": 2}, {"max_num_seqs": 1, "max_concurrency": 2}
    rm = remeasure(runner, base, winner, args, num_prompts=3)
    assert runner.server_starts == 2 and len(rm["rounds"]) == 2
    assert all(r["a"]["completed"] == 3 and r["b"]["completed"] == 3 for r in rm["rounds"])
    assert rm["ratio"]["n"] == 2 and rm["ratio"]["min"] <= rm["ratio"]["median"] <= rm["ratio"]["max"]
    assert rm["ratio"]["min"] == pytest.approx(min(r["b_value"] / r["a_value"] for r in rm["rounds"]))
    assert remeasure(runner, base, winner, args, num_prompts=3) == json.loads(json.dumps(rm))  # read back
    assert runner.server_starts == 2
