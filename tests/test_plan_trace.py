"""`tokenmill plan --trace`: trace parsing (both forms, bad input), the autoscaled replay (replicas follow the
load, SLA misses when the ceiling is too low), the queueing and cost arithmetic by hand, the CLI and its PNG."""
from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from tokenmill.bench.report import summarize
from tokenmill.bench.serve import ServeConfig
from tokenmill.cli import main
from tokenmill.plan.autoscale import (Autoscaler, Prices, Replica, compare_reserved, erlang_c, replay, summary,
                                      wait_p99, with_reserved)
from tokenmill.plan.trace import Interval, diurnal, load_trace, write_trace


def _jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_bucket_form(tmp_path):
    p = _jsonl(tmp_path / "b.jsonl", [{"t": 0, "rate": 2}, "", {"t": 60, "rate": 3.5}, {"t": 180, "rate": 0}])
    tr = load_trace(p)
    assert tr.form == "buckets"
    # the last bucket lasts as long as the one before it
    assert tr.intervals == [Interval(0, 60, 2), Interval(60, 120, 3.5), Interval(180, 120, 0)]
    assert tr.requests == 2 * 60 + 3.5 * 120
    lone = load_trace(_jsonl(tmp_path / "one.jsonl", [{"t": 10, "rate": 1}]), bucket_s=30)
    assert lone.intervals == [Interval(10, 30, 1)]


def test_request_form_is_bucketed(tmp_path):
    arrivals = [0.5, 59.9, 1.0, 61, 130, 131, 179.9]
    p = _jsonl(tmp_path / "r.jsonl", [{"t": t, "input_len": 100, "output_len": 10 + i} for i, t in enumerate(arrivals)])
    tr = load_trace(p, bucket_s=60)
    assert tr.form == "requests"
    assert [iv.rate * 60 for iv in tr.intervals] == pytest.approx([3, 1, 3])
    assert [iv.t for iv in tr.intervals] == [0, 60, 120] and tr.requests == pytest.approx(7)
    assert tr.mean_input_len == 100 and tr.mean_output_len == 13


@pytest.mark.parametrize("lines,message", [
    (['{"t": 0, "rate": 1', ], "b.jsonl:1: not JSON"),
    ([{"rate": 1}], "each line needs \"t\""),
    ([{"t": 0, "rate": 1}, {"t": 60}], "1 of 2 lines have \"rate\""),
    ([{"t": 60, "rate": 1}, {"t": 60, "rate": 2}], "b.jsonl:2: bucket times must increase"),
    ([{"t": 0, "rate": -1}], "'rate' must be a number >= 0"),
    ([{"t": 0, "rate": "fast"}], "'rate' must be a number >= 0"),
    ([{"t": 0, "output_len": 0}], "'output_len' must be a number >= 1"),
    ([], "the trace is empty")])
def test_bad_trace_is_a_one_line_cli_error(tmp_path, capsys, lines, message):
    p = _jsonl(tmp_path / "b.jsonl", lines)
    assert main(["plan", "--trace", p, "--replica-capacity", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("args,message", [
    (["--trace", "/no/such.jsonl", "--replica-capacity", "1"], "No such file"),
    (["--trace", "T"], "--trace needs one replica's capacity"),
    (["--trace", "T", "--replica-capacity", "0"], "capacity > 0"),
    (["--trace", "T", "--replica-capacity", "1", "--slo", "tpot_p99=1s"], "a P99 of ttft or e2e"),
    (["--trace", "T", "--replica-capacity", "1", "--slo", "ttft_p90=1s"], "a P99 of ttft or e2e"),
    (["--trace", "T", "--replica-capacity", "1", "--min-replicas", "5", "--max-replicas", "2"], "--min-replicas"),
    (["--trace", "T", "--replica-capacity", "1", "--reserved-replicas", "20"], "above --max-replicas 16"),
    (["--make-trace", "diurnal", "--peak-rate", "1"], "--make-trace needs --out")])
def test_bad_flags_are_one_line_cli_errors(tmp_path, capsys, args, message):
    trace = _jsonl(tmp_path / "t.jsonl", [{"t": 0, "rate": 1}])
    assert main(["plan", *[trace if a == "T" else a for a in args]]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


def test_erlang_c_and_p99_wait_by_hand():
    assert erlang_c(1, 0.5) == pytest.approx(0.5)              # M/M/1: P(wait) = rho
    assert erlang_c(2, 1.0) == pytest.approx(1 / 3)            # (a^2/2! x 2/(2-a)) / (1 + a + that) = 1 / 3
    # M/M/1 at mu = 1, lambda = 0.5: P(W > t) = 0.5 exp(-0.5 t) = 0.01 at t = ln(50) / 0.5
    assert wait_p99(1, 1.0, 0.5) == pytest.approx(math.log(50) / 0.5)
    assert wait_p99(8, 1.0, 0.5) == 0.0                        # 8 free slots at 0.5 busy: nobody waits


DAY = [Interval(r["t"], 60, r["rate"]) for r in diurnal(24, peak_rate=10, seed=1)]
REPLICA = Replica(capacity=1.0, latency_s=0.5, concurrency=4)
SCALER = Autoscaler(min_replicas=1, max_replicas=32, target_utilization=0.5, scale_down_delay=300,
                    replica_start_s=0)


def test_replicas_follow_the_day_and_meet_the_sla_when_the_ceiling_allows():
    rows = replay(DAY, REPLICA, SCALER, slo_s=2.0)
    trough = max(r.ready for r in rows if 3 <= r.t / 3600 < 5)
    peak = min(r.ready for r in rows if 15 <= r.t / 3600 < 17)
    assert peak >= 3 * trough and peak <= 24                   # 10 req/s / (1 req/s x 0.5) = 20 at the top
    assert not any(r.miss for r in rows) and max(r.utilization for r in rows) < 1


def test_too_low_a_ceiling_misses_the_sla_at_peak_only():
    rows = replay(DAY, REPLICA, dataclasses.replace(SCALER, max_replicas=8), slo_s=2.0)
    missed = [r.t / 3600 for r in rows if r.miss]
    assert missed and all(9 <= h < 24 for h in missed)          # 8 replicas serve 8 req/s: the afternoon, and
    assert any(15 <= h < 17 for h in missed)                    # the backlog it leaves drains into the evening
    assert not any(r.miss for r in rows if 2 <= r.t / 3600 < 6)


def test_start_up_delay_misses_the_ramp_that_a_reserved_base_covers():
    step = [Interval(i * 60, 60, 1.0 if i < 10 else 6.0) for i in range(30)]
    slow = dataclasses.replace(SCALER, replica_start_s=300)
    rows = replay(step, REPLICA, slow, slo_s=5.0)
    assert not any(r.miss for r in rows[:10])
    assert [r.ready for r in rows][9:12] == [2, 2, 2] and rows[16].ready == 12  # ready 5 min after the jump
    assert rows[10].miss and rows[10].utilization == 3.0 and rows[10].billed == 2
    assert rows[11].billed == 12                                 # billed while starting
    assert rows[16].utilization == 0.5 and rows[16].miss         # the backlog of the ramp still drains
    assert not rows[-1].miss
    covered = replay(step, REPLICA, with_reserved(slow, 12), slo_s=5.0)
    assert not any(r.miss for r in covered)


def test_cost_by_hand():
    # 4 half-hours at 1, 1, 4, 4 req/s; a replica serves 1 req/s; the autoscaler sees the previous half-hour's rate
    ivs = [Interval(i * 1800, 1800, r) for i, r in enumerate([1, 1, 4, 4])]
    scaler = Autoscaler(1, 8, 1.0, 0, 0)
    rows = replay(ivs, Replica(1.0, 0.1), with_reserved(scaler, 1), slo_s=1.0)
    assert [r.billed for r in rows] == [1, 1, 1, 4]
    s = summary(rows, 1, Prices(reserved=0.5, on_demand=2.0))
    assert s["reserved_replica_hours"] == 2.0 and s["reserved_cost"] == 1.0     # 1 replica x 2 h x 0.5
    assert s["on_demand_replica_hours"] == 1.5 and s["on_demand_cost"] == 3.0   # 3 replicas x 0.5 h x 2
    assert s["total_cost"] == 4.0 and s["replica_hours"] == 3.5
    # half-hour 3 is overloaded (4 req/s on 1), half-hour 4 drains none of its 5400-request backlog
    assert [r.miss for r in rows] == [False, False, True, True]
    assert rows[3].p99_s == pytest.approx(0.1 + 5400 / 4)
    assert s["miss_requests"] == 4 * 1800 * 2 and s["miss_seconds"] == 3600
    options = compare_reserved(ivs, Replica(1.0, 0.1), scaler, 1.0, Prices(0.5, 2.0))
    assert [o["reserved_replicas"] for o in options] == [0, 1, 2, 3, 4]
    assert options[0]["total_cost"] == 3.5 * 2.0 and options[4]["total_cost"] == 4 * 2 * 0.5


def _bench_result(path, throughput_rps=2.0, ttft=0.4, concurrency=4):
    """A `tokenmill bench serve --save-result` file: its summary from the bench's own summarize()."""
    n, duration = 40, 40 / throughput_rps
    records = [{"success": True, "prompt_tokens": 128, "output_tokens": 16, "ttft": ttft * (0.5 + i / n),
                "tpot": 0.05, "itl": [0.05] * 15, "e2e": 1.2, "start": i / throughput_rps, "error_kind": None}
               for i in range(n)]
    conf = {**dataclasses.asdict(ServeConfig(input_len=128, output_len=16, max_concurrency=concurrency)),
            "request_rate": "inf"}
    path.write_text(json.dumps({"tool": "tokenmill bench serve", "config": conf,
                                "summary": summarize(records, duration)}))
    return str(path)


def test_cli_replay_with_a_bench_result_table_and_png(tmp_path, capsys):
    trace = str(tmp_path / "load.jsonl")
    assert main(["plan", "--make-trace", "diurnal", "--hours", "24", "--peak-rate", "8", "--bucket-s", "300",
                 "--out", trace]) == 0
    assert "288 buckets of 300 s" in capsys.readouterr().out
    bench, png = _bench_result(tmp_path / "replica.json"), tmp_path / "replicas.png"
    assert main(["plan", "--trace", trace, "--replica-bench", bench, "--slo", "ttft_p99=1s", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "2.00 req/s at 4 in flight, ttft P99 586 ms" in out   # the bench's own P99 of 0.2 .. 0.59 s
    hourly = [line for line in out.splitlines() if re.match(r"\d\d:\d\d ", line)]
    assert len(hourly) == 24 and hourly[0].startswith("00:00") and hourly[-1].startswith("23:00")
    options = [line.split() for line in out.splitlines() if re.match(r"\s*\d+% ", line)]
    assert [int(o[1]) for o in options] == list(range(len(options))) and {o[0] for o in options} == {"70%"}
    fewest = min(float(o[5]) for o in options)
    chosen = [o for o in options if "replayed" in o]
    assert len(chosen) == 1 and float(chosen[0][5]) == fewest
    assert float(chosen[0][4]) == min(float(o[4]) for o in options if float(o[5]) == fewest)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    assert main(["plan", "--trace", trace, "--replica-bench", bench, "--slo", "ttft_p99=1s", "--json",
                 "--reserved-replicas", "2", "--target-utilization", "0.5,0.7"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["totals"]["reserved_replicas"] == 2 and res["replica"]["concurrency"] == 4 and len(res["table"]) == 24
    at_2 = {o["target_utilization"]: o for o in res["options"] if o["reserved_replicas"] == 2}
    best = min(at_2.values(), key=lambda o: (o["miss_seconds"], o["total_cost"]))
    assert set(at_2) == {0.5, 0.7} and res["autoscaler"]["target_utilization"] == best["target_utilization"]
    assert res["totals"]["total_cost"] == pytest.approx(best["total_cost"])


def test_a_rate_limited_bench_run_is_no_capacity(tmp_path, capsys):
    bench = tmp_path / "b.json"
    obj = json.loads(open(_bench_result(bench)).read())
    obj["config"]["request_rate"] = 2.0
    bench.write_text(json.dumps(obj))
    trace = _jsonl(tmp_path / "t.jsonl", [{"t": 0, "rate": 1}])
    assert main(["plan", "--trace", trace, "--replica-bench", str(bench)]) == 2
    assert "a rate-limited run measures the offered load" in capsys.readouterr().err


def test_diurnal_shape(tmp_path):
    rows = diurnal(24, peak_rate=10, bucket_s=600, noise=0)
    assert len(rows) == 144 and min(rows, key=lambda r: r["rate"])["t"] == 4 * 3600
    assert max(rows, key=lambda r: r["rate"])["t"] == 16 * 3600 and rows[16 * 6]["rate"] == 10
    write_trace(str(tmp_path / "d.jsonl"), rows)
    assert load_trace(str(tmp_path / "d.jsonl")).intervals[24] == Interval(4 * 3600, 600, 1.0)
