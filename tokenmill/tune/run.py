"""`tokenmill tune`: the driver. Space -> prune and rank (plan) -> successive halving over real servers ->
interleaved re-measure of the winner against the baseline -> table, Pareto PNG, command line, tune.json."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import shlex
import signal
import time
from typing import Any, Optional

from tokenmill.bench.datasets import load_tokenizer
from tokenmill.bench.report import parse_slo
from tokenmill.bench.serve import ServeConfig, parse_list, parse_rate, workload_kwargs
from tokenmill.fleet.serve_command import serve_flags
from tokenmill.host import cpu_has_avx512_bf16
from tokenmill.models.resolution import resolve_model_path
from tokenmill.perf.hardware import for_device
from tokenmill.plan import get_hardware, load_model_shape
from tokenmill.tune import prune, report, search, space
from tokenmill.tune.trial import ServerProcess, TrialRunner, measure

logger = logging.getLogger("tokenmill")


def parse_budget(text: Optional[str]) -> Optional[float]:
    """'30m' -> 1800.0; '90s', '1.5h'; a plain number is minutes."""
    if not text:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|m|min|h)?\s*", text)
    if not m:
        raise ValueError(f"cannot parse --budget {text!r}; use e.g. 30m, 90s or 1h")
    return float(m.group(1)) * {"s": 1, "m": 60, "min": 60, "h": 3600, None: 60}[m.group(2)]


def serve_option_strings() -> set[str]:
    return serve_flags()


def build_space(args: argparse.Namespace, device: str) -> dict[str, list]:
    import torch

    dims = {} if args.no_default_space else space.default_space(
        device, torch.cuda.device_count() if device == "cuda" else 1, cpu_has_avx512_bf16())
    dims.update(space.load_space(args.space))
    concs = parse_list(args.max_concurrency, lambda x: None if x.lower() in ("none", "inf") else int(x))
    rates = [None if math.isinf(r) else r for r in parse_list(args.request_rate, parse_rate)]
    dims.setdefault("max_concurrency", concs or [None])
    dims.setdefault("request_rate", rates or [None])
    space.check_space(dims, serve_option_strings())
    return dims


def machine_and_shape(args: argparse.Namespace, device: str):
    """(ModelShape, Machine) for pruning, or (None, None) with a warning when the model's shape is unknown."""
    try:
        shape = load_model_shape(None if args.model is None else resolve_model_path(args.model))
    except (ValueError, OSError) as e:
        logger.warning("no model shape for pruning (%s): every configuration will be measured, unranked", e)
        return None, None
    native = device == "cuda" or cpu_has_avx512_bf16()
    model_dtype = "bf16" if native else "fp32"
    hw = get_hardware(args.hardware, (model_dtype,)) if args.hardware else for_device(device, model_dtype)
    if hw is None:
        logger.warning("no figures for device %s: nothing pruned, candidates unranked", device)
        return None, None
    return shape, prune.Machine(hw, model_dtype, shared=hw.name == "local-cpu")


def fixed_flags(fixed_args: list[str]) -> dict[str, Any]:
    """--serve-args as a config dict, for the memory arithmetic (--kv-cache-memory-bytes, -dp...)."""
    out, i = {}, 0
    while i < len(fixed_args):
        a = fixed_args[i]
        if a.startswith("--"):
            key, eq, val = a[2:].partition("=")
            if not eq and i + 1 < len(fixed_args) and not fixed_args[i + 1].startswith("--"):
                val, i = fixed_args[i + 1], i + 1
            out[key.replace("-", "_")] = val if (eq or val) else True
        i += 1
    return out


def ranked_candidates(args, dims, work, slo, fixed, device) -> tuple[list[dict], dict[str, dict], list[dict]]:
    """(candidates best-predicted first with the baseline first of all, predictions by config key, pruned)."""
    configs = space.grid(dims, args.seed)
    baseline = {k: (v[0] if k in space.LOAD_KEYS else None) for k, v in dims.items()}
    shape, machine = machine_and_shape(args, device)
    kept, pruned = prune.prune_and_rank(configs, shape, machine, work, slo, args.objective, fixed)
    preds = {space.config_key(c): p for c, p in kept}
    bkey = space.config_key(baseline)
    order = group_by_server([baseline] + [c for c, _ in kept if space.config_key(c) != bkey])
    pruned_recs = [{"config": c, "label": space.describe(c), "status": "pruned", "reason": r} for c, r in pruned
                   if space.config_key(c) != bkey]
    logger.info("search space: %d configurations, %d pruned by the plan; %d candidates with the baseline",
                len(configs), len(pruned_recs), len(order))
    return order, preds, pruned_recs


def group_by_server(configs: list[dict]) -> list[dict]:
    """Ranked order, except that configurations differing only in the load follow the first of them, so one
    server start serves them all."""
    groups: dict[tuple, list[dict]] = {}
    for c in configs:
        groups.setdefault(tuple(space.serve_flags(c)), []).append(c)
    return [c for g in groups.values() for c in g]


def remeasure(runner: TrialRunner, baseline: dict, winner: dict, args, num_prompts: int) -> dict[str, Any]:
    """Baseline and winner served side by side, measured in ABBA order; cached in the output directory."""
    key = space.config_key({"a": space.config_key(baseline), "b": space.config_key(winner)},
                           [args.repeats, num_prompts, runner.trial_key(baseline, num_prompts)])
    path = os.path.join(args.out, f"remeasure-{key}.json")
    if os.path.exists(path):
        with open(path) as f:
            return json.load(f)
    servers = []
    try:
        for name, cfg in (("baseline", baseline), ("winner", winner)):
            runner.server_starts += 1
            servers.append(ServerProcess(runner.model, [*runner.fixed_args, *space.serve_flags(cfg)],
                                         os.path.join(args.out, "logs", f"remeasure-{name}.log"),
                                         runner.startup_timeout))
            if servers[-1].error:
                return {"repeats": args.repeats, "rounds": [], "error": f"{name}: {servers[-1].error}"}

        def run(server, cfg):
            return lambda i: {"status": "ok", **measure(server, runner.workload, cfg, num_prompts, runner.tokenizer)}

        out = search.interleaved(run(servers[0], baseline), run(servers[1], winner), args.repeats, args.objective)
    finally:
        for s in servers:
            s.stop()
    with open(path, "w") as f:
        json.dump(out, f, indent=1, default=str)
    return out


def tune_main(args: argparse.Namespace) -> tuple[int, list[str]]:
    import torch

    t_start = time.monotonic()
    if args.objective not in search.OBJECTIVES:
        raise ValueError(f"--objective must be one of {', '.join(search.OBJECTIVES)}")
    for flag, v, lo in (("--rungs", args.rungs, 1), ("--eta", args.eta, 2), ("--repeats", args.repeats, 0),
                        ("--num-prompts", args.num_prompts, 1)):
        if v < lo:
            raise ValueError(f"{flag} must be at least {lo}, got {v}")
    seconds = parse_budget(args.budget)
    max_trials = args.max_trials if args.max_trials is not None or seconds is not None else 12
    slo = parse_slo(args.slo)
    fixed_args = shlex.split(args.serve_args or "")
    device = fixed_flags(fixed_args).get("device") or ("cuda" if torch.cuda.is_available() else "cpu")
    dims = build_space(args, device)
    prefix = args.prefix_len if args.dataset == "shared-prefix" else 0
    work = prune.Workload(args.input_len, args.output_len, prefix, args.num_prompts)
    order, preds, pruned = ranked_candidates(args, dims, work, slo, fixed_flags(fixed_args), device)
    wk = {**workload_kwargs(args), "tokenizer": args.tokenizer or args.model or "default"}
    workload = ServeConfig(endpoint=args.endpoint, warmup=args.warmup, slo=slo, timeout=args.timeout,
                           progress=False, **wk)
    tokenizer = load_tokenizer(workload.tokenizer)
    runner = TrialRunner(args.model, fixed_args, workload, args.out, tokenizer, args.startup_timeout)
    sizes = search.rung_sizes(args.num_prompts, args.rungs, args.eta, max(2, args.warmup))
    budget = search.Budget(max_trials, None if seconds is None else seconds * (0.75 if args.repeats else 1.0))

    def run(cfg: dict, n: int, rung: int) -> dict:
        rec = runner.run(cfg, n, rung)
        rec["devices"] = preds.get(space.config_key(cfg), {}).get("devices", 1)
        rec["price_per_hour"] = args.price_per_hour
        rec["prediction"] = preds.get(space.config_key(cfg))
        return rec

    bar, update = search.progress_bar(max_trials, args.objective) if args.progress else (None, None)
    previous = signal.signal(signal.SIGTERM, _interrupt_on_sigterm)
    try:
        try:
            records = search.successive_halving(order, run, sizes, args.eta, budget, args.objective, update)
        finally:
            runner.close()
            if bar is not None:
                bar.close()
        return finish(args, runner, order[0], records, pruned, sizes, time.monotonic() - t_start)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt  # a kill unwinds like Ctrl-C, so the trial server (its own session) is stopped too


def finish(args, runner: TrialRunner, baseline: dict, records: list[dict], pruned: list[dict], sizes: list[int],
           wall_s: float) -> tuple[int, list[str]]:
    """Re-measure, write tune.json and the PNG; the exit status and the report's lines (the CLI prints them)."""
    finals = sorted(search.final_records(records), key=lambda r: search.rank_key(r, args.objective))
    winner = search.pick_winner(records, args.objective)
    rm = None
    if winner is not None and args.repeats and space.config_key(winner["config"]) != space.config_key(baseline):
        rm = remeasure(runner, baseline, winner["config"], args, sizes[-1])
    title = f"tokenmill tune: {args.model or 'default model'}, {args.dataset} {args.input_len} in / " \
            f"{args.output_len} out, objective {args.objective}" + (f", SLA {args.slo}" if args.slo else "")
    lines = [title, report.trials_table(finals, args.objective), *report.pruned_lines(pruned)]
    pngs = report.write_pareto(finals, args.out, title)
    summary = {"tool": "tokenmill tune", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": args.model,
               "objective": args.objective, "slo": args.slo, "strategy": "plan-ranked candidates, successive "
               f"halving ({len(sizes)} rungs of {sizes} prompts, eta {args.eta})", "server_starts":
               runner.server_starts, "measured": sum(not r.get("resumed") for r in records),
               "resumed": sum(bool(r.get("resumed")) for r in records), "wall_s": wall_s,
               "baseline": baseline, "winner": winner and {k: winner[k] for k in ("config", "label", "command")},
               "remeasure": rm, "trials": [{k: v for k, v in r.items() if k != "requests"} for r in records],
               "pruned": pruned, "pareto_png": pngs[0] if pngs else None}
    with open(os.path.join(args.out, "tune.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    lines.append(f"{summary['measured']} trials measured, {summary['resumed']} read back from {args.out}, "
                 f"{runner.server_starts} server starts, {wall_s / 60:.1f} min")
    if rm is not None:
        lines += report.remeasure_lines(rm, args.objective)
    elif winner is not None and args.repeats:
        lines.append("the baseline (every serve flag at its default) won: no configuration to re-measure against it")
    if winner is None:
        return 1, lines + ["no configuration could be measured; see the verdicts above and the logs in " + args.out]
    load = {k: winner["config"].get(k) for k in space.LOAD_KEYS if winner["config"].get(k) is not None}
    lines.append(f"winner: {winner['label']} ({search.verdict(winner)})" + (f"; offered load {load}" if load else ""))
    return 0, lines + [winner["command"]]
