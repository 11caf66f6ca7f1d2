"""`tokenmill tune MODEL`: find the `tokenmill serve` configuration that serves a workload best under an SLA,
by measuring the real engine.

    tokenmill tune --dataset shared-prefix --endpoint chat --slo ttft_p90=2s,tpot_p90=100ms --budget 20m
    tokenmill tune path/to/model --objective throughput --max-trials 20 --space '{"max_num_seqs": [32, 128]}'

space.py (configurations, hashes, command lines), prune.py (plan's memory and roofline: prune, rank),
trial.py (a real server + the bench load generator, one JSON per trial), search.py (successive halving,
interleaved re-measure), report.py (table, Pareto PNG), run.py (the driver).
"""
from __future__ import annotations

import argparse

from tokenmill.bench.serve import add_workload_args


def add_tune_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face directory or .gguf file (default: built-in SmolLM2-135M-Instruct)")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="/v1/completions or /v1/chat/completions")
    add_workload_args(p)
    g = p.add_argument_group("load (each list is a dimension of the search space)")
    g.add_argument("--max-concurrency", default="8", help="comma-separated concurrencies to offer ('none': no limit)")
    g.add_argument("--request-rate", default="inf", help="comma-separated Poisson rates in req/s (inf: closed loop)")
    g.add_argument("--num-prompts", type=int, default=32, help="requests per trial at the last rung")
    g.add_argument("--warmup", type=int, default=2, help="requests sent first to each server and not counted")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g = p.add_argument_group("goal")
    g.add_argument("--slo", default=None, help="the SLA, e.g. ttft_p90=2s,tpot_p90=100ms (ttft, tpot, itl, e2e; "
                                               "_p50/_p90/_p99, or bare for every request)")
    g.add_argument("--objective", default="goodput", choices=["goodput", "throughput", "per_user_tps", "cost"],
                   help="what to maximise among configurations that meet the SLA (cost: minimise $ per million "
                        "output tokens at --price-per-hour per device)")
    g.add_argument("--price-per-hour", type=float, default=1.0, help="$ per device-hour, for --objective cost")
    g = p.add_argument_group("search")
    g.add_argument("--budget", default=None, help="wall time, e.g. 30m, 90s, 1h (a quarter is kept for the re-measure)")
    g.add_argument("--max-trials", type=int, default=None,
                   help="measured trials of the search, all rungs (default 12 when no --budget is given)")
    g.add_argument("--space", default=None, metavar="JSON|FILE",
                   help='dims to search, flag name -> values, e.g. \'{"max_num_seqs": [16, 64], "quantization": '
                        '[null, "int8"]}\'; they replace the default space\'s dims of the same name (null: the '
                        "flag's default)")
    g.add_argument("--no-default-space", action="store_true", help="search only the dims --space names")
    g.add_argument("--serve-args", default=None,
                   help="flags every server gets, e.g. '--kv-cache-memory-bytes 1GiB --max-model-len 2048'")
    g.add_argument("--rungs", type=int, default=2, help="successive-halving rungs (1: every candidate once, in full)")
    g.add_argument("--eta", type=int, default=3, help="each rung keeps the best 1/eta, on eta times the prompts")
    g.add_argument("--repeats", type=int, default=3,
                   help="interleaved re-measures of the winner and the baseline (0: none)")
    g.add_argument("--hardware", default=None,
                   help="figures for the pruning (a `tokenmill plan --list` name; default: measured here)")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to be healthy")
    g.add_argument("--out", default="tune-out", metavar="DIR",
                   help="results: trials/<hash>.json, logs/, pareto.png, tune.json; rerunning skips measured trials")
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
