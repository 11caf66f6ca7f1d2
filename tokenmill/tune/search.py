"""The search: plan-ranked candidates, then successive halving.

Why this strategy: a trial costs a server start plus a benchmark (tens of seconds to minutes), so the
budget buys tens of trials, not hundreds. The roofline (prune.py) is free and already orders the candidates
by what the hardware allows, so rung 0 measures the best-predicted ones (and the baseline) on a short
workload (num_prompts / eta^(rungs-1)); each later rung re-measures the best 1/eta of the previous one on a
workload eta times longer, ending on the full one. Short runs are noisy, but they only have to separate the
clearly bad from the plausible; the final rung and the interleaved re-measure against the baseline decide.
A configuration that misses the SLA ranks below every one that meets it, whatever its objective.
"""
from __future__ import annotations

import logging
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

logger = logging.getLogger("tokenmill")

OBJECTIVES = ("goodput", "throughput", "per_user_tps", "cost")


def objective_value(rec: dict[str, Any], objective: str) -> Optional[float]:
    """The measured objective, higher is better (cost is negated: $ per million output tokens at the record's
    devices x price_per_hour); None when the trial produced no measurement."""
    s = rec.get("summary")
    if rec.get("status") != "ok" or not s:
        return None
    if objective == "goodput":
        return s.get("goodput", s["request_throughput"])
    if objective == "throughput":
        return s["output_throughput"]
    if objective == "per_user_tps":
        return s["per_user_tok_s"]["median"] or 0.0
    if s["output_throughput"] <= 0:
        return -math.inf
    dollars_per_s = rec.get("devices", 1) * rec.get("price_per_hour", 1.0) / 3600
    return -dollars_per_s / s["output_throughput"] * 1e6


def rank_key(rec: dict[str, Any], objective: str) -> tuple:
    """Sort key, best first: measured, then meets the SLA, then the objective."""
    v = objective_value(rec, objective)
    return (v is None, bool(rec.get("violations")), -(v if v is not None else 0.0))


def verdict(rec: dict[str, Any]) -> str:
    if rec.get("status") == "pruned":
        return "pruned: " + rec["reason"]
    if rec.get("status") != "ok":
        return f"{rec['status']}: {rec['reason']}"
    return "misses SLA: " + "; ".join(rec["violations"]) if rec.get("violations") else "meets SLA"


@dataclass
class Budget:
    max_trials: Optional[int] = None      # measured trials (server-backed runs), resumed ones included
    seconds: Optional[float] = None       # wall time of the search
    start: float = field(default_factory=time.monotonic)

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def time_left(self, share: float = 1.0) -> bool:
        return self.seconds is None or self.elapsed() < self.seconds * share


def rung_sizes(num_prompts: int, rungs: int, eta: int, smallest: int) -> list[int]:
    """Prompts per trial at each rung, the last being the full workload."""
    return [max(smallest, num_prompts // eta ** (rungs - 1 - r)) for r in range(rungs)]


def rung0_count(max_trials: Optional[int], rungs: int, eta: int, available: int) -> int:
    """The most rung-0 candidates whose promotions still fit max_trials."""
    if max_trials is None:
        return available
    n = 1
    while n < available and sum(math.ceil((n + 1) / eta ** r) for r in range(rungs)) <= max_trials:
        n += 1
    return min(n, available)


def successive_halving(candidates: list[dict[str, Any]], run: Callable[[dict, int, int], dict], sizes: list[int],
                       eta: int, budget: Budget, objective: str, progress=None) -> list[dict[str, Any]]:
    """Every trial record, all rungs. candidates: best-predicted first (the baseline among them)."""
    rungs = len(sizes)
    n0 = rung0_count(budget.max_trials, rungs, eta, len(candidates))
    records: list[dict[str, Any]] = []
    current = candidates[:n0]
    for r, size in enumerate(sizes):
        rung_recs = []
        for config in current:
            if rung_recs and not budget.time_left((r + 1) / rungs):
                logger.info("rung %d: time share spent after %d of %d candidates", r, len(rung_recs), len(current))
                break
            rec = run(config, size, r)
            rung_recs.append(rec)
            if progress is not None:
                progress(rec, records + rung_recs)
        records += rung_recs
        ranked = sorted((x for x in rung_recs if objective_value(x, objective) is not None),
                        key=lambda x: rank_key(x, objective))
        current = [x["config"] for x in ranked[:max(1, math.ceil(len(ranked) / eta))]]
        if not current or not budget.time_left():
            break
    return records


def final_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each configuration's record from the highest rung it reached."""
    best: dict[str, dict] = {}
    for rec in records:
        k = rec["label"]
        if k not in best or rec["rung"] > best[k]["rung"]:
            best[k] = rec
    return list(best.values())


def pick_winner(records: list[dict[str, Any]], objective: str) -> Optional[dict[str, Any]]:
    """The best configuration at the highest rung any measured configuration reached."""
    measured = [r for r in records if objective_value(r, objective) is not None]
    if not measured:
        return None
    top = max(r["rung"] for r in measured)
    return min((r for r in measured if r["rung"] == top), key=lambda r: rank_key(r, objective))


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def interleaved(measure_a: Callable[[int], dict], measure_b: Callable[[int], dict], repeats: int,
                objective: str) -> dict[str, Any]:
    """A and B measured `repeats` times each in ABBA order (drift hits both alike); the per-round ratio B/A of
    the objective with its median, min and max."""
    a_vals, b_vals, ratios, rounds = [], [], [], []
    for i in range(repeats):
        order = (("a", measure_a), ("b", measure_b)) if i % 2 == 0 else (("b", measure_b), ("a", measure_a))
        got = {name: fn(i) for name, fn in order}
        va, vb = (objective_value(got[x], objective) for x in ("a", "b"))
        rounds.append({"a": got["a"].get("summary"), "b": got["b"].get("summary"), "a_value": va, "b_value": vb})
        if va is None or vb is None:
            continue
        a_vals.append(va)
        b_vals.append(vb)
        if va != 0:
            ratios.append(vb / va if objective != "cost" else va / vb)  # cost: how many times cheaper
    out: dict[str, Any] = {"repeats": repeats, "rounds": rounds}
    if ratios:
        out.update(a=spread(a_vals), b=spread(b_vals), ratio=spread(ratios))
    return out


def progress_bar(total: Optional[int], objective: str):
    """(bar, update): a tqdm bar over trials whose postfix is the best configuration so far, and the callback
    that advances it."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="tune", unit="trial", file=sys.stderr, dynamic_ncols=True)

    def update(rec: dict[str, Any], so_far: list[dict[str, Any]]) -> None:
        best = pick_winner(so_far, objective)
        v = objective_value(best, objective) if best else None
        bar.set_postfix_str(f"best: {best['label']} {objective} {v:.3g}" if best and v is not None else "best: -",
                            refresh=False)
        bar.update(1)

    return bar, update
