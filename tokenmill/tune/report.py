"""What `tokenmill tune` prints and writes: the table of every trial, the Pareto PNG, the winner's command and
its interleaved re-measure against the baseline."""
from __future__ import annotations

from typing import Any, Optional

from tokenmill.bench.report import plot_pareto
from tokenmill.tune.search import objective_value, verdict


def _f(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def trials_table(records: list[dict[str, Any]], objective: str) -> str:
    """One line per trial, best first within each rung's final records."""
    head = (f"{'#':>3} {'rung':>4} {'n':>4}  {'configuration':<44}{'objective':>10}{'goodput':>9}{'out tok/s':>10}"
            f"{'user t/s':>9}{'TTFT p90':>9}{'TTFT p99':>9}{'TPOT p90':>9}{'TPOT p99':>9}{'ITL p99':>8}  verdict")
    lines = [head, "-" * len(head)]
    for i, rec in enumerate(records, 1):
        s = rec.get("summary") or {}
        get = (lambda k, q: (s.get(k) or {}).get(q))
        v = objective_value(rec, objective)
        lines.append(f"{i:>3} {rec.get('rung', '-'):>4} {rec.get('num_prompts', '-'):>4}  {rec['label'][:43]:<44}"
                     f"{_f(v, 3):>10}{_f(s.get('goodput'), 2):>9}{_f(s.get('output_throughput')):>10}"
                     f"{_f(get('per_user_tok_s', 'median')):>9}{_f(get('ttft_ms', 'p90'), 0):>9}"
                     f"{_f(get('ttft_ms', 'p99'), 0):>9}{_f(get('tpot_ms', 'p90')):>9}{_f(get('tpot_ms', 'p99')):>9}"
                     f"{_f(get('itl_ms', 'p99'), 0):>8}  {verdict(rec)[:90]}")
    lines.append("(latencies in ms; goodput in req/s meeting every SLO limit; user t/s = median 1/TPOT; "
                 "n = prompts per trial)")
    return "\n".join(lines)


def pruned_lines(pruned: list[dict[str, Any]], limit: int = 10) -> list[str]:
    if not pruned:
        return []
    lines = [f"{len(pruned)} configuration(s) pruned before measuring (tokenmill plan's memory and roofline):"]
    lines += [f"  {p['label']}: {p['reason']}" for p in pruned[:limit]]
    if len(pruned) > limit:
        lines.append(f"  ... and {len(pruned) - limit} more (tune.json lists them all)")
    return lines


def remeasure_lines(rm: dict[str, Any], objective: str) -> list[str]:
    if "ratio" not in rm:
        return [f"re-measure: no usable measurement in {rm['repeats']} rounds"]
    a, b, r = rm["a"], rm["b"], rm["ratio"]
    what = "times cheaper" if objective == "cost" else f"x the baseline's {objective}"
    return [f"re-measured interleaved, {rm['repeats']} rounds each (ABBA order, full workload):",
            f"  baseline {objective}: median {a['median']:.3g} (min {a['min']:.3g}, max {a['max']:.3g})",
            f"  winner   {objective}: median {b['median']:.3g} (min {b['min']:.3g}, max {b['max']:.3g})",
            f"  winner / baseline per round: median {r['median']:.2f} {what} (min {r['min']:.2f}, max {r['max']:.2f})"]


def write_pareto(records: list[dict[str, Any]], out_dir: str, title: str) -> list[str]:
    points = [{"summary": r["summary"], "label": r["label"]} for r in records
              if r.get("status") == "ok" and r.get("summary")]
    return plot_pareto(points, out_dir, title, name="pareto.png") if points else []
