"""`tokenmill bench matrix`: how serving techniques interact on one model and workload.

The baseline (prefix caching off, --max-concurrency of the workload) and every combination of the chosen
techniques are measured on real `tokenmill serve` processes with the `bench serve` load generator, in one
interleaved run: each round visits every server configuration (in an order rotated each round), so drift
of a shared machine falls on all of them alike. Each combination's speedup over the baseline (median of the
per-round ratios) is printed beside the product of its techniques' single speedups: equal means they are
independent, above means they compound, below means they cancel.
"""
from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import os
import shlex
import statistics
import time
from typing import Any, Optional

from tokenmill.bench.datasets import load_tokenizer
from tokenmill.bench.report import parse_slo, pyplot
from tokenmill.bench.serve import ServeConfig, add_workload_args, workload_kwargs
from tokenmill.tune.space import NGRAM, describe, serve_flags

logger = logging.getLogger("tokenmill")

TECHNIQUES: dict[str, dict[str, Any]] = {  # name -> configuration keys (serve flags, or the load)
    "int8": {"quantization": "int8"},
    "fp8": {"quantization": "fp8"},
    "kv-int8": {"kv_cache_dtype": "int8"},
    "ngram": {"speculative_config": NGRAM},
    "prefix": {"enable_prefix_caching": True},
    "batch": {"max_concurrency": 32},
    "dp2": {"data_parallel_size": 2},
    "tp2": {"tensor_parallel_size": 2},
    "disagg": {"disaggregate": "1P1D"},
}
METRICS = {"throughput": ("output_throughput", None), "per_user_tps": ("per_user_tok_s", "median"),
           "goodput": ("goodput", None), "request_throughput": ("request_throughput", None)}


def parse_techniques(names: str, custom: list[str], batch: int) -> dict[str, dict[str, Any]]:
    """--techniques a,b plus --technique NAME=JSON (configuration keys, as in `tune --space`)."""
    out = {}
    for spec in custom or []:
        name, eq, text = spec.partition("=")
        try:
            cfg = json.loads(text) if eq else None
        except json.JSONDecodeError as e:
            raise ValueError(f"--technique {spec!r}: not JSON ({e.msg})") from None
        if not isinstance(cfg, dict) or not name.strip():
            raise ValueError(f"--technique {spec!r}: use NAME='{{\"flag_name\": value}}'")
        out[name.strip()] = {k.replace("-", "_"): v for k, v in cfg.items()}
    for name in (n.strip() for n in names.split(",") if n.strip()):
        if name in out:
            continue
        if name not in TECHNIQUES:
            raise ValueError(f"unknown technique {name!r}; built in: {', '.join(TECHNIQUES)} "
                             "(or define one with --technique NAME=JSON)")
        out[name] = dict(TECHNIQUES[name], **({"max_concurrency": batch} if name == "batch" else {}))
    if not out:
        raise ValueError("no techniques: pass --techniques and/or --technique")
    clash = [(a, b) for a, b in itertools.combinations(out, 2) if set(out[a]) & set(out[b])]
    if clash:
        raise ValueError(f"techniques {clash[0][0]} and {clash[0][1]} set the same flag; they cannot combine")
    return out


def combinations(techniques: dict[str, dict], baseline: dict[str, Any]) -> list[tuple[tuple[str, ...], dict]]:
    """(names, configuration) for the baseline and every non-empty subset, server flags grouped together so
    load-only variants share a server."""
    names = list(techniques)
    out = []
    for k in range(len(names) + 1):
        for combo in itertools.combinations(names, k):
            cfg = dict(baseline)
            for n in combo:
                cfg.update(techniques[n])
            out.append((combo, cfg))
    return sorted(out, key=lambda nc: (serve_flags(nc[1]), len(nc[0])))


def metric_value(summary: Optional[dict], metric: str) -> Optional[float]:
    if not summary or not summary.get("completed"):
        return None
    key, sub = METRICS[metric]
    v = summary.get(key)
    return v.get(sub) if isinstance(v, dict) else v


def run_rounds(runner, combos: list[tuple[tuple, dict]], repeats: int, num_prompts: int) -> list[dict[str, dict]]:
    """Per round: label -> measurement record. Server groups rotate their order each round."""
    from tokenmill.tune.trial import measure  # ~1.5 ms: `bench --help` imports this module

    groups = [list(g) for _, g in itertools.groupby(combos, key=lambda nc: tuple(serve_flags(nc[1])))]
    rounds = []
    for r in range(repeats):
        got: dict[str, dict] = {}
        for group in groups[r % len(groups):] + groups[:r % len(groups)]:
            for names, cfg in group:
                server = runner.server(cfg)
                if server.error is not None:
                    got[label(names)] = {"status": "failed_start", "reason": server.error}
                    continue
                got[label(names)] = {"status": "ok", **measure(server, runner.workload, cfg, num_prompts,
                                                               runner.tokenizer)}
                logger.info("round %d/%d: %s measured", r + 1, repeats, label(names))
            runner.close()  # a fresh server per group and round: no state carried between rounds
        rounds.append(got)
    return rounds


def label(names: tuple[str, ...]) -> str:
    return "+".join(names) if names else "baseline"


def speedup_rows(combos, rounds: list[dict[str, dict]], metric: str) -> list[dict[str, Any]]:
    """Each combination's median value and speedup (with min/max over rounds), the product of its techniques'
    single speedups, and measured / product."""
    rows, single = [], {}
    for names, cfg in sorted(combos, key=lambda nc: len(nc[0])):
        vals, ratios = [], []
        for got in rounds:
            v, b = metric_value(got[label(names)].get("summary"), metric), \
                metric_value(got["baseline"].get("summary"), metric)
            if v is not None:
                vals.append(v)
            if v is not None and b:
                ratios.append(v / b)
        row = {"combination": list(names), "label": label(names), "config": describe(cfg), "value": None,
               "speedup": None, "speedup_min": None, "speedup_max": None, "product": None, "interaction": None,
               "status": next((g[label(names)]["status"] + ": " + str(g[label(names)].get("reason"))
                               for g in rounds if g[label(names)]["status"] != "ok"), "ok")}
        if vals:
            row["value"] = statistics.median(vals)
        if ratios:
            row.update(speedup=statistics.median(ratios), speedup_min=min(ratios), speedup_max=max(ratios))
        if len(names) == 1:
            single[names[0]] = row["speedup"]
        elif len(names) > 1 and all(single.get(n) for n in names):
            row["product"] = math.prod(single[n] for n in names)
            if row["speedup"] is not None:
                row["interaction"] = row["speedup"] / row["product"]
        rows.append(row)
    return rows


def format_matrix(rows: list[dict[str, Any]], metric: str) -> str:
    def f(x, spec=".2f"):
        return "-" if x is None else format(x, spec)

    head = f"{'combination':<30}{metric:>14}{'speedup':>9}{'(min-max)':>14}{'product':>9}{'meas/prod':>10}  status"
    lines = [head, "-" * len(head)]
    for r in rows:
        rng = "-" if r["speedup_min"] is None else f"{r['speedup_min']:.2f}-{r['speedup_max']:.2f}"
        lines.append(f"{r['label'][:29]:<30}{f(r['value'], '.3g'):>14}{f(r['speedup']):>9}{rng:>14}"
                     f"{f(r['product']):>9}{f(r['interaction']):>10}  {r['status'][:80]}")
    lines.append("(speedup: median over rounds of value / the same round's baseline; product: of the techniques' "
                 "single speedups; meas/prod > 1: they compound, < 1: they cancel)")
    return "\n".join(lines)


def plot_matrix(rows: list[dict[str, Any]], techniques: list[str], path: str, title: str) -> Optional[str]:
    """matrix.png: left, technique x technique (diagonal: the single speedup; off it: the pair's measured
    speedup, coloured by measured / product); right, every combination's speedup beside its product."""
    plt = pyplot()
    if plt is None:
        return None
    import numpy as np

    by = {tuple(r["combination"]): r for r in rows}
    k = len(techniques)
    color, text = np.full((k, k), np.nan), [["" for _ in range(k)] for _ in range(k)]
    for i, a in enumerate(techniques):
        for j, b in enumerate(techniques):
            r = by.get((a,) if i == j else tuple(t for t in techniques if t in (a, b)))
            if r is None or r["speedup"] is None:
                continue
            ratio = r["speedup"] if i == j else r["interaction"]
            color[i, j] = np.log2(ratio) if ratio else np.nan
            pred = "" if i == j or r["product"] is None else f"\n(product x{r['product']:.2f})"
            text[i][j] = f"x{r['speedup']:.2f}" + pred
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(6 + 2 * k, 1.5 + 1.2 * k), gridspec_kw={"width_ratios": [1, 1.3]})
    lim = max(1.0, float(np.nanmax(np.abs(color))) if not np.all(np.isnan(color)) else 1.0)
    im = ax.imshow(color, cmap="RdYlGn", vmin=-lim, vmax=lim)
    for i in range(k):
        for j in range(k):
            ax.text(j, i, text[i][j], ha="center", va="center", fontsize=8)
    ax.set_xticks(range(k), techniques)
    ax.set_yticks(range(k), techniques)
    ax.set_title("speedup over baseline\n(colour: log2 of single speedup / of measured÷product)", fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.7)
    multi = [r for r in rows if r["combination"] and r["speedup"] is not None]
    ys = range(len(multi))
    bx.barh([y + 0.2 for y in ys], [r["speedup"] for r in multi], height=0.4, label="measured")
    bx.barh([y - 0.2 for y in ys], [r["product"] or 0 for r in multi], height=0.4, label="product of singles")
    bx.set_yticks(list(ys), [r["label"] for r in multi], fontsize=8)
    bx.axvline(1.0, color="gray", lw=0.8)
    bx.set_xlabel("speedup over baseline")
    bx.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def add_matrix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF dir or .gguf (default: built-in default model)")
    p.add_argument("--techniques", default="int8,ngram,prefix,batch",
                   help=f"comma-separated, from {', '.join(TECHNIQUES)}")
    p.add_argument("--technique", action="append", default=[], metavar="NAME=JSON",
                   help='define a technique by its configuration keys, e.g. dp2=\'{"data_parallel_size": 2}\'')
    p.add_argument("--batch", type=int, default=32, help="the batch technique's concurrency")
    p.add_argument("--metric", default="throughput", choices=list(METRICS), help="what a speedup is a ratio of")
    p.add_argument("--endpoint", default="completions", choices=["completions", "chat"],
                   help="/v1/completions or /v1/chat/completions")
    add_workload_args(p)
    p.add_argument("--max-concurrency", type=int, default=1, help="the baseline's concurrency")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per measurement")
    p.add_argument("--warmup", type=int, default=2, help="requests sent first to each server and not counted")
    p.add_argument("--slo", default=None, help="for --metric goodput, e.g. ttft_p90=2s,tpot_p90=100ms")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds over all combinations")
    p.add_argument("--serve-args", default=None, help="flags every server gets, e.g. "
                                                      "--serve-args='--kv-cache-memory-bytes 1GiB'")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a server may take to be healthy")
    p.add_argument("--out", default="matrix-out", metavar="DIR", help="matrix.json, matrix.png, logs/")


def matrix_main(args: argparse.Namespace) -> tuple[int, list[str]]:
    """Run the matrix; (exit code, the lines the CLI prints), as tune_main."""
    from tokenmill.tune.trial import TrialRunner  # as in run_rounds

    if args.repeats < 1 or args.num_prompts < 1:
        raise ValueError("--repeats and --num-prompts must be at least 1")
    if args.metric == "goodput" and not args.slo:
        raise ValueError("--metric goodput needs --slo")
    techniques = parse_techniques(args.techniques, args.technique, args.batch)
    baseline = {"enable_prefix_caching": False, "max_concurrency": args.max_concurrency}
    combos = combinations(techniques, baseline)
    wk = {**workload_kwargs(args), "tokenizer": args.tokenizer or args.model or "default"}
    workload = ServeConfig(endpoint=args.endpoint, warmup=args.warmup, slo=parse_slo(args.slo), progress=False, **wk)
    runner = TrialRunner(args.model, shlex.split(args.serve_args or ""), workload, args.out,
                         load_tokenizer(workload.tokenizer), args.startup_timeout)
    t0 = time.monotonic()
    try:
        rounds = run_rounds(runner, combos, args.repeats, args.num_prompts)
    finally:
        runner.close()
    rows = speedup_rows(combos, rounds, args.metric)
    title = (f"tokenmill bench matrix: {args.model or 'default model'}, {args.dataset} {args.input_len} in / "
             f"{args.output_len} out, baseline concurrency {args.max_concurrency}, {args.metric}, "
             f"{args.repeats} round(s)")
    png = plot_matrix(rows, list(techniques), os.path.join(args.out, "matrix.png"), title)
    out = {"tool": "tokenmill bench matrix", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": args.model,
           "metric": args.metric, "techniques": techniques, "baseline": baseline, "repeats": args.repeats,
           "num_prompts": args.num_prompts, "rows": rows, "server_starts": runner.server_starts,
           "wall_s": time.monotonic() - t0, "png": png,
           "rounds": [{k: {kk: vv for kk, vv in v.items() if kk != "requests"} for k, v in g.items()} for g in rounds]}
    with open(os.path.join(args.out, "matrix.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    lines = [title, format_matrix(rows, args.metric),
             f"wrote {os.path.join(args.out, 'matrix.json')}" + (f" and {png}" if png else "")]
    return (0 if any(r["speedup"] is not None for r in rows if r["combination"]) else 1), lines
