"""`tokenmill plan --trace load.jsonl`: the replay's flags, its table over time, the reserved-base comparison
and the PNG; `tokenmill plan --make-trace diurnal` writes a synthetic trace.

    tokenmill plan --make-trace diurnal --hours 24 --peak-rate 20 --out load.jsonl
    tokenmill plan --trace load.jsonl --replica-bench replica.json --slo ttft_p99=2s --plot replicas.png
    tokenmill plan --trace load.jsonl --replica-capacity 3.5 --replica-p99-ms 800 --reserved-replicas 2
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from typing import Any, Optional

from tokenmill.plan.autoscale import Autoscaler, Prices, Replica, Row, compare_reserved, replay, summary, with_reserved
from tokenmill.plan.trace import Trace, diurnal, load_trace, write_trace

SLO_METRICS = ("ttft", "e2e")   # what a replica's bench run measures per request and queueing delays in full


def add_trace_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("trace replay (--trace; docs/plan.md)")
    g.add_argument("--trace", default=None, metavar="FILE.jsonl",
                   help="replay this request-rate trace ({\"t\", \"rate\"} per bucket or {\"t\"} per request) "
                        "against an autoscaled pool of replicas: replicas, P99, SLA misses and cost over time")
    g.add_argument("--make-trace", default=None, choices=["diurnal"],
                   help="write a synthetic trace to --out instead (--hours, --peak-rate, --trough-rate)")
    g.add_argument("--out", default=None, help="with --make-trace: the JSONL file to write")
    g.add_argument("--hours", type=float, default=24.0, help="with --make-trace: length of the trace")
    g.add_argument("--peak-rate", type=float, default=None, help="with --make-trace: req/s at 16:00")
    g.add_argument("--trough-rate", type=float, default=None, help="with --make-trace: req/s at 04:00 "
                                                                   "(default: a tenth of --peak-rate)")
    g.add_argument("--seed", type=int, default=0, help="with --make-trace: seed of the 5%% noise per bucket")
    g.add_argument("--bucket-s", type=float, default=60.0,
                   help="seconds per bucket: of --make-trace, and for counting a per-request trace's arrivals")
    g.add_argument("--replica-bench", default=None, metavar="FILE.json",
                   help="one replica's capacity and P99, measured: a `tokenmill bench serve --request-rate inf "
                        "--max-concurrency C --save-result FILE.json` run against one `tokenmill serve`")
    g.add_argument("--replica-capacity", type=float, default=None, metavar="RPS",
                   help="one replica's capacity in req/s, given instead of --replica-bench")
    g.add_argument("--replica-p99-ms", type=float, default=0.0,
                   help="with --replica-capacity: P99 of the --slo metric at that load without queueing")
    g.add_argument("--replica-concurrency", type=int, default=1,
                   help="with --replica-capacity: requests in flight at that load (its request slots)")
    g.add_argument("--slo", default="ttft_p99=2s", help="the SLA: a P99 of ttft or e2e, e.g. e2e_p99=10s")
    g.add_argument("--min-replicas", type=int, default=1, help="autoscaler floor")
    g.add_argument("--max-replicas", type=int, default=16, help="autoscaler ceiling")
    g.add_argument("--target-utilization", default="0.7",
                   help="scale so each replica runs at this share of its capacity; a comma-separated list "
                        "(0.5,0.6,0.7) compares them")
    g.add_argument("--scale-down-delay", type=float, default=300.0,
                   help="cool-down: scale down only to the most replicas wanted over this many seconds")
    g.add_argument("--replica-start-s", type=float, default=120.0,
                   help="seconds from scale-up to a new replica serving (billed meanwhile)")
    g.add_argument("--reserved-replicas", type=int, default=None,
                   help="replicas on reserved pricing, always running (default: of the bases from 0 to the "
                        "peak, the cheapest of those with the fewest SLA-miss minutes)")
    g.add_argument("--reserved-price", type=float, default=0.6, help="per reserved replica-hour")
    g.add_argument("--on-demand-price", type=float, default=1.0, help="per on-demand replica-hour")
    g.add_argument("--report-every-s", type=float, default=3600.0, help="seconds per row of the table")
    g.add_argument("--plot", default=None, metavar="FILE.png", help="write replicas and P99 over time")


def parse_trace_slo(text: str) -> tuple[str, float]:
    """'ttft_p99=2s' -> ('ttft', 2.0): one P99 of a metric the replay models."""
    from tokenmill.bench.report import parse_slo, slo_key  # bench and bench.report, ~7 ms: `plan --help` skips them

    slo = parse_slo(text)
    if len(slo) != 1:
        raise ValueError(f"--slo with --trace takes one limit, e.g. ttft_p99=2s, got {text!r}")
    (key, limit), = slo.items()
    metric, pct = slo_key(key)
    if metric not in SLO_METRICS or pct not in (None, 99):
        raise ValueError(f"--slo with --trace is a P99 of {' or '.join(SLO_METRICS)} (e.g. ttft_p99=2s), got {key}")
    return metric, limit


def replica_from_bench(path: str, metric: str) -> Replica:
    """Capacity = the run's request throughput; latency = its P99 `metric` (the run holds `max_concurrency`
    requests in flight, so the server is full and nothing queues in front of it)."""
    with open(path) as f:
        try:
            run = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not JSON ({e.msg})") from None
    if not isinstance(run, dict) or run.get("tool") != "tokenmill bench serve":
        raise ValueError(f"{path}: not a `tokenmill bench serve --save-result` file")
    conf, s = run["config"], run["summary"]
    if conf.get("request_rate") != "inf" or not conf.get("max_concurrency"):
        raise ValueError(f"{path}: a rate-limited run measures the offered load, not a capacity; measure with "
                         "--request-rate inf --max-concurrency C")
    p99 = s[f"{metric}_ms"]["p99"]
    if not s["completed"] or p99 is None:
        raise ValueError(f"{path}: the run completed no request")
    return Replica(s["request_throughput"], p99 / 1e3, conf["max_concurrency"],
                   f"{path}: {s['completed']} requests of {conf['input_len']} in / {conf['output_len']} out tokens "
                   f"at concurrency {conf['max_concurrency']}: {s['request_throughput']:.2f} req/s, "
                   f"{metric} P99 {p99:.0f} ms")


def run_trace(args: argparse.Namespace) -> int:
    if args.make_trace:
        return make_trace(args)
    from tokenmill.bench.serve import parse_list  # asyncio, ssl, subprocess (~45 ms): only a trace replay needs it

    metric, slo_s = parse_trace_slo(args.slo)
    if (args.replica_bench is None) == (args.replica_capacity is None):
        raise ValueError("--trace needs one replica's capacity: --replica-bench FILE.json (measured by "
                         "`tokenmill bench serve`) or --replica-capacity RPS")
    replica = (replica_from_bench(args.replica_bench, metric) if args.replica_bench else
               Replica(args.replica_capacity, args.replica_p99_ms / 1e3, args.replica_concurrency,
                       "given (--replica-capacity)"))
    trace = load_trace(args.trace, args.bucket_s)
    scalers = [Autoscaler(args.min_replicas, args.max_replicas, target, args.scale_down_delay, args.replica_start_s)
               for target in parse_list(args.target_utilization, float)]
    if not scalers:
        raise ValueError("--target-utilization needs at least one value")
    prices = Prices(args.reserved_price, args.on_demand_price)
    options = [{"target_utilization": sc.target_utilization, **o} for sc in scalers
               for o in compare_reserved(trace.intervals, replica, sc, slo_s, prices)]
    best = choose(options, args.reserved_replicas)
    scaler = next(sc for sc in scalers if sc.target_utilization == best["target_utilization"])
    rows = replay(trace.intervals, replica, with_reserved(scaler, best["reserved_replicas"]), slo_s)
    result = {"trace": args.trace, "form": trace.form, "replica": dataclasses.asdict(replica),
              "slo": {metric: slo_s}, "autoscaler": dataclasses.asdict(scaler), "prices": dataclasses.asdict(prices),
              "totals": summary(rows, best["reserved_replicas"], prices),
              "options": options, "table": table_rows(rows, args.report_every_s)}
    if args.plot:
        plot_trace(rows, slo_s, metric, args.plot, f"{args.trace}: {best['reserved_replicas']} reserved, target "
                                                   f"{scaler.target_utilization:.0%}")
    if args.json:
        json.dump(result, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(format_trace(result, trace, metric, args.reserved_replicas is None))
    return 0


def make_trace(args: argparse.Namespace) -> int:
    if not args.out or args.peak_rate is None:
        raise ValueError("--make-trace needs --out FILE.jsonl and --peak-rate")
    rows = diurnal(args.hours, args.peak_rate, args.trough_rate, args.bucket_s, args.seed)
    write_trace(args.out, rows)
    print(f"wrote {args.out}: {len(rows)} buckets of {args.bucket_s:g} s, {args.hours:g} h, "
          f"{min(r['rate'] for r in rows):.3g} .. {max(r['rate'] for r in rows):.3g} req/s")
    return 0


def choose(options: list[dict[str, Any]], reserved: Optional[int]) -> dict[str, Any]:
    """The option to replay: the SLA first (fewest miss minutes), then the cost; with --reserved-replicas,
    among that base's options (one per target utilisation)."""
    if reserved is not None:
        if reserved < 0:
            raise ValueError(f"--reserved-replicas must be >= 0, got {reserved}")
        options = [o for o in options if o["reserved_replicas"] == reserved] or \
            [{**options[0], "reserved_replicas": reserved}]   # above every peak: its replay says what it costs
    return min(options, key=lambda o: (o["miss_seconds"], o["total_cost"]))


def table_rows(rows: list[Row], every_s: float) -> list[dict[str, Any]]:
    """The replay downsampled to rows of `every_s` seconds: mean/peak rate, replicas, worst P99, misses."""
    if every_s <= 0:
        raise ValueError(f"--report-every-s must be > 0, got {every_s}")
    groups: dict[int, list[Row]] = {}
    for r in rows:
        groups.setdefault(int((r.t - rows[0].t) // every_s), []).append(r)
    out = []
    for g in groups.values():
        span = sum(r.dt for r in g)
        out.append({"t": g[0].t, "mean_rate": sum(r.rate * r.dt for r in g) / span, "peak_rate": max(r.rate for r in g),
                    "ready_min": min(r.ready for r in g), "ready_max": max(r.ready for r in g),
                    "billed_max": max(r.billed for r in g), "utilization_max": max(r.utilization for r in g),
                    "p99_max_s": max(r.p99_s for r in g), "miss_s": sum(r.dt for r in g if r.miss),
                    "replica_hours": sum(r.billed * r.dt for r in g) / 3600})
    return out


def _clock(t: float) -> str:
    h, m = divmod(int(t // 60), 60)
    return f"{h:02d}:{m:02d}"


def _ms(s: float) -> str:
    return "inf" if math.isinf(s) else f"{s * 1e3:.0f}"


def format_trace(res: dict[str, Any], trace: Trace, metric: str, chose: bool) -> str:
    tot, rep, sc, pr = res["totals"], res["replica"], res["autoscaler"], res["prices"]
    slo_ms = res["slo"][metric] * 1e3
    lines = [f"{res['trace']}: {trace.duration_s / 3600:.1f} h, {tot['requests']:.0f} requests ({trace.form})",
             f"  replica    {rep['capacity']:.2f} req/s at {rep['concurrency']} in flight, {metric} P99 "
             f"{rep['latency_s'] * 1e3:.0f} ms unqueued; "
             f"{rep['about']}",
             f"  autoscaler {sc['min_replicas']}..{sc['max_replicas']} replicas at {sc['target_utilization']:.0%} "
             f"utilisation, start-up {sc['replica_start_s']:g} s, scale-down delay {sc['scale_down_delay']:g} s",
             f"  SLA        {metric} P99 <= {slo_ms:g} ms",
             "",
             f"{'time':>5} {'req/s mean':>10} {'peak':>6} {'ready':>7} {'up':>3} {'util':>5} "
             f"{'P99 ms':>7} {'miss min':>8} {'replica-h':>9}"]
    for r in res["table"]:
        ready = f"{r['ready_min']}-{r['ready_max']}" if r["ready_min"] != r["ready_max"] else str(r["ready_max"])
        lines.append(f"{_clock(r['t']):>5} {r['mean_rate']:>10.2f} {r['peak_rate']:>6.2f} {ready:>7} "
                     f"{r['billed_max']:>3} {min(r['utilization_max'], 9.99):>5.0%} {_ms(r['p99_max_s']):>7} "
                     f"{r['miss_s'] / 60:>8.0f} {r['replica_hours']:>9.2f}")
    lines += ["", f"{'target':>6} {'reserved':>8} {'reserved h':>10} {'on-demand h':>11} {'cost':>9} "
                  f"{'miss min':>8} {'requests in missed intervals':>29}"]
    cheapest = min(res["options"], key=lambda o: o["total_cost"])
    for o in res["options"]:
        chosen = (o["reserved_replicas"], o["target_utilization"]) == (tot["reserved_replicas"],
                                                                      sc["target_utilization"])
        mark = (" <- replayed above" if chosen else "") + (" <- cheapest" if o is cheapest and not chosen else "")
        lines.append(f"{o['target_utilization']:>6.0%} {o['reserved_replicas']:>8} "
                     f"{o['reserved_replica_hours']:>10.1f} {o['on_demand_replica_hours']:>11.1f} {o['total_cost']:>9.2f} {o['miss_seconds'] / 60:>8.0f} "
                     f"{o['miss_requests']:>29.0f}{mark}")
    why = "the cheapest of those with the fewest SLA-miss minutes" if chose else "as asked"
    lines += ["", f"totals ({tot['reserved_replicas']} reserved, {why}): peak {tot['peak_replicas']} replicas, "
                  f"{tot['replica_hours']:.1f} replica-h ({tot['reserved_replica_hours']:.1f} reserved at "
                  f"{pr['reserved']:g} + {tot['on_demand_replica_hours']:.1f} on-demand at {pr['on_demand']:g}) = "
                  f"{tot['total_cost']:.2f}; SLA missed in {tot['miss_seconds'] / 60:.0f} min "
                  f"({tot['miss_requests']:.0f} of {tot['requests']:.0f} requests arrived then)"]
    if trace.mean_input_len and trace.mean_output_len:
        lines.append(f"  note: the trace's requests average {trace.mean_input_len:.0f} in / "
                     f"{trace.mean_output_len:.0f} out tokens; the replica's capacity is for its own workload")
    return "\n".join(lines)


def plot_trace(rows: list[Row], slo_s: float, metric: str, path: str, title: str) -> Optional[str]:
    from tokenmill.bench.report import pyplot  # as in parse_trace_slo: `plan --help` skips bench

    plt = pyplot()
    if plt is None:
        return None
    hours = [r.t / 3600 for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(9, 5.5))
    top.step(hours, [r.billed for r in rows], where="post", label="replicas up (billed)", color="tab:blue")
    top.step(hours, [r.ready for r in rows], where="post", label="replicas serving", color="tab:green", ls="--")
    top.set_ylabel("replicas")
    top.set_ylim(bottom=0)
    rate_ax = top.twinx()
    rate_ax.plot(hours, [r.rate for r in rows], color="gray", lw=0.7, alpha=0.7)
    rate_ax.set_ylabel("req/s (gray)")
    rate_ax.set_ylim(bottom=0)
    top.legend(loc="upper left", fontsize=8)
    top.set_title(title, fontsize=9)
    cap = 10 * slo_s   # an overloaded interval's P99 is drawn at the top edge
    bottom.plot(hours, [min(r.p99_s, cap) * 1e3 for r in rows], color="tab:red", lw=0.8, label=f"{metric} P99")
    bottom.axhline(slo_s * 1e3, color="black", ls=":", label="SLA")
    bottom.set_yscale("log")
    bottom.set_ylabel("ms")
    bottom.set_xlabel("hours")
    bottom.legend(loc="upper left", fontsize=8)
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path
