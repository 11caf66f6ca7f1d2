"""Statistics, tables and plots of benchmark results.

Per-request records (seconds, from the client's monotonic clock) go in; a JSON-ready summary, a readable
table and PNGs come out. Percentiles interpolate linearly between closest ranks (numpy's default), so
they can be checked by hand.
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import re
from collections import Counter
from typing import Any, Iterable, Optional, Sequence

logger = logging.getLogger("tokenmill")

PERCENTILES = (50, 90, 99)
SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
_SUMMARY_STAT = {None: "max", 50: "median", 90: "p90", 99: "p99"}  # an SLO key's statistic of a run


def percentile(values: Sequence[float], p: float) -> float:
    """p-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        return float("nan")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {p}")
    xs = sorted(values)
    pos = (len(xs) - 1) * p / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Iterable[float], scale: float = 1.0) -> dict[str, Optional[float]]:
    """mean, median, p90, p99, max (and min, count) of `values` times `scale`; None when empty."""
    xs = [v * scale for v in values if v is not None]
    if not xs:
        return {"count": 0, "mean": None, "median": None, "p90": None, "p99": None, "max": None, "min": None}
    out: dict[str, Optional[float]] = {"count": len(xs), "mean": sum(xs) / len(xs), "median": percentile(xs, 50)}
    for p in PERCENTILES[1:]:
        out[f"p{p}"] = percentile(xs, p)
    out["max"], out["min"] = max(xs), min(xs)
    return out


_DURATION_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s|us)?\s*$")


def parse_duration(text: str) -> float:
    """'500ms' -> 0.5, '2s' -> 2.0, '250' -> 0.25 (plain numbers are milliseconds)."""
    m = _DURATION_RE.match(text)
    if not m:
        raise ValueError(f"cannot parse duration {text!r}; use e.g. 500ms or 2s")
    value, unit = float(m.group(1)), m.group(2) or "ms"
    return value * {"ms": 1e-3, "s": 1.0, "us": 1e-6}[unit]


def slo_key(key: str) -> tuple[str, Optional[int]]:
    """'ttft_p90' -> ('ttft', 90); 'tpot' -> ('tpot', None). Raises ValueError for anything else."""
    metric, sep, pct = key.strip().lower().partition("_p")
    if metric not in SLO_METRICS or (sep and (not pct.isdigit() or int(pct) not in PERCENTILES)):
        raise ValueError(f"bad SLO metric {key!r}: use one of {', '.join(SLO_METRICS)}, optionally with a "
                         f"percentile {', '.join(f'_p{p}' for p in PERCENTILES)} (e.g. ttft_p90)")
    return metric, int(pct) if pct else None


def parse_slo(text: Optional[str]) -> dict[str, float]:
    """'ttft=500ms,tpot_p90=50ms' -> {'ttft': 0.5, 'tpot_p90': 0.05} (seconds).

    A key is a metric (ttft, tpot, itl, e2e), optionally qualified by a percentile (_p50, _p90, _p99). Each
    request is good when its own value is within every limit (for itl: its largest gap, or with a
    percentile that percentile of its gaps); a run meets the SLA when each qualified percentile over all
    requests (each bare metric's maximum) is within its limit (`slo_violations`)."""
    if not text:
        return {}
    slo = {}
    for part in text.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"bad SLO {part!r}: use metric=limit, e.g. ttft_p90=2s,tpot_p90=100ms")
        slo_key(key)
        slo[key.strip().lower()] = parse_duration(value)
    return slo


def _request_value(rec: dict[str, Any], metric: str, pct: Optional[int]) -> Optional[float]:
    if metric != "itl":
        return rec.get(metric)
    gaps = rec.get("itl") or []
    if not gaps:
        return None
    return max(gaps) if pct is None else percentile(gaps, pct)


def meets_slo(rec: dict[str, Any], slo: dict[str, float]) -> bool:
    if not rec["success"]:
        return False
    for key, limit in slo.items():
        metric, pct = slo_key(key)
        value = _request_value(rec, metric, pct)
        if value is None and metric in ("tpot", "itl"):  # one output token: no inter-token time to miss
            continue
        if value is None or value > limit:
            return False
    return True


def slo_violations(summary: dict[str, Any], slo: dict[str, float]) -> list[str]:
    """Why a run misses the SLA: each percentile (or maximum) over the run above its limit; [] if it meets it."""
    if not summary["completed"]:
        return ["no request completed"]
    out = []
    for key, limit in slo.items():
        metric, pct = slo_key(key)
        value = summary[f"{metric}_ms"][_SUMMARY_STAT[pct]]
        if value is not None and value > limit * 1e3:
            out.append(f"{key} {value:.0f}ms > {limit * 1e3:g}ms")
    return out


def summarize(records: list[dict[str, Any]], duration: float, slo: Optional[dict[str, float]] = None) -> dict:
    """The summary of one benchmark run. Token counts come from each response's `usage`."""
    ok = [r for r in records if r["success"]]
    failed = [r for r in records if not r["success"]]
    n_in = sum(r["prompt_tokens"] or 0 for r in ok)
    n_out = sum(r["output_tokens"] or 0 for r in ok)
    tpots = [r["tpot"] for r in ok if r.get("tpot")]
    s: dict[str, Any] = {
        "duration_s": duration, "completed": len(ok), "failed": len(failed),
        "errors": dict(Counter(r["error_kind"] for r in failed)),
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": n_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (n_in + n_out) / duration if duration > 0 else 0.0,
        "mean_concurrency": sum(r["e2e"] for r in ok) / duration if duration > 0 else 0.0,
        "max_concurrency": max_in_flight(records),
        "ttft_ms": distribution((r["ttft"] for r in ok), 1e3),
        "tpot_ms": distribution(tpots, 1e3),
        "itl_ms": distribution((x for r in ok for x in r["itl"]), 1e3),
        "e2e_ms": distribution((r["e2e"] for r in ok), 1e3),
        "per_user_tok_s": distribution(1.0 / t for t in tpots),
        "usage_missing": sum(1 for r in ok if r.get("usage_missing")),
        # Client-side connection set-up (inside TTFT for a request that opened its connection)
        "connections_opened": sum(1 for r in records if not r.get("connection_reused", True)),
        "connections_reused": sum(1 for r in records if r.get("connection_reused", True)),
        "connect_ms": distribution((r["connect"] for r in records if not r.get("connection_reused", True)), 1e3),
        "ttft_after_connect_ms": distribution((r["ttft"] - r.get("connect", 0.0) for r in ok if r["ttft"] is not None),
                                              1e3),
    }
    classes = sorted({(r["priority"], r["class"]) for r in records if "class" in r})
    if classes:  # --priority-classes: each class's latencies (best priority first)
        s["classes"] = {name: _class_summary([r for r in records if r.get("class") == name], prio)
                        for prio, name in classes}
    if slo:
        good = sum(1 for r in records if meets_slo(r, slo))
        s["slo"] = {k: v * 1e3 for k, v in slo.items()}  # ms, as the tables show them
        s["goodput"] = good / duration if duration > 0 else 0.0
        s["slo_attainment"] = good / len(records) if records else 0.0
        s["slo_violations"] = slo_violations(s, slo)
    return s


def _class_summary(records: list[dict[str, Any]], priority: int) -> dict[str, Any]:
    ok = [r for r in records if r["success"]]
    return {"priority": priority, "completed": len(ok), "failed": len(records) - len(ok),
            "ttft_ms": distribution((r["ttft"] for r in ok), 1e3),
            "tpot_ms": distribution((r["tpot"] for r in ok if r.get("tpot")), 1e3),
            "e2e_ms": distribution((r["e2e"] for r in ok), 1e3)}


def max_in_flight(records: list[dict[str, Any]]) -> int:
    events = sorted([(r["start"], 1) for r in records] + [(r["start"] + r["e2e"], -1) for r in records],
                    key=lambda e: (e[0], e[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def _fmt(x: Optional[float], digits: int = 1) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def spec_decode_summary(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """Acceptance over a run from two scrapes of the server's counters (serve.metrics.spec_decode_counters);
    None when the server reports none or did not speculate in between."""
    if before is None or after is None:
        return None
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    if d["num_draft_tokens"] <= 0:
        return None
    per_pos = [a - b for a, b in itertools.zip_longest(after.get("accepted_per_pos", []),
                                                       before.get("accepted_per_pos", []), fillvalue=0.0)]
    return {**{k: int(v) for k, v in d.items()},
            "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"],
            "mean_acceptance_length": 1.0 + d["num_accepted_tokens"] / d["num_drafts"],
            "acceptance_per_position": [p / d["num_drafts"] for p in per_pos]}


# Disaggregated prefill/decode counters a /metrics scrape may hold: an instance's KV connector (kv_*) and the
# disaggregated router's (router_*), each summed over its labels.
KV_TRANSFER_COUNTERS = {
    **{f"tokenmill:{k}{t}": k for k in ("kv_pulls", "kv_pull_fallbacks", "kv_bytes_sent", "kv_bytes_received",
                                         "kv_transferred_tokens", "kv_sent_requests", "kv_hold_timeouts")
       for t in ("", "_total")},
    "tokenmill:router_disagg_fallbacks_total": "router_fallbacks",
    "tokenmill:router_disagg_retries_total": "router_retries",
    "tokenmill:router_prefill_phase_seconds_sum": "router_prefill_phase_s",
    "tokenmill:router_prefill_phase_seconds_count": "router_prefill_phases",
}


def kv_transfer_counters(prometheus_text: str) -> dict:
    """The KV transfer counters in a /metrics scrape (empty for a server without disaggregation)."""
    out: dict = {}
    for line in prometheus_text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        name = KV_TRANSFER_COUNTERS.get(key.split("{", 1)[0])
        if name is not None:
            out[name] = out.get(name, 0.0) + float(value)
    return out


def kv_transfer_summary(before: Optional[dict], after: Optional[dict]) -> Optional[dict]:
    """What changed over a run between two scrapes; None when nothing disaggregated happened."""
    if not before and not after:
        return None
    before, after = before or {}, after or {}
    d = {k: after[k] - before.get(k, 0.0) for k in after}
    if not any(d.values()):
        return None
    out = {k: (round(v, 6) if k == "router_prefill_phase_s" else int(v)) for k, v in d.items()}
    if d.get("router_prefill_phases"):
        out["router_prefill_phase_mean_ms"] = 1e3 * d["router_prefill_phase_s"] / d["router_prefill_phases"]
    return out


def _kv_transfer_line(kt: dict) -> str:
    parts = []
    if "kv_pulls" in kt or "kv_pull_fallbacks" in kt:
        parts.append(f"{kt.get('kv_pulls', 0)} pulls ({kt.get('kv_pull_fallbacks', 0)} fell back to recomputing)")
    for key, label in (("kv_bytes_received", "received"), ("kv_bytes_sent", "sent")):
        if kt.get(key):
            parts.append(f"{kt[key] / 2**20:.1f} MiB {label}")
    if kt.get("kv_transferred_tokens"):
        parts.append(f"{kt['kv_transferred_tokens']} prompt tokens transferred")
    if "router_prefill_phase_mean_ms" in kt:
        parts.append(f"router: prefill phase mean {kt['router_prefill_phase_mean_ms']:.1f} ms, "
                     f"{kt.get('router_retries', 0)} retries, {kt.get('router_fallbacks', 0)} sent without KV params")
    return f"{'kv transfer':<24}" + "; ".join(parts)


def format_table(summary: dict[str, Any], title: str = "") -> str:
    s = summary
    lines = [f"===== {title} =====" if title else "=" * 40]
    errors = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "none"
    lines += [
        f"{'requests':<24}{s['completed']} ok, {s['failed']} failed (errors: {errors})",
        f"{'duration':<24}{s['duration_s']:.2f} s",
        f"{'concurrency':<24}mean {s['mean_concurrency']:.1f}, max {s['max_concurrency']}",
        f"{'tokens':<24}{s['total_input_tokens']} in, {s['total_output_tokens']} out (from usage)",
        f"{'request throughput':<24}{s['request_throughput']:.2f} req/s",
        *([f"{'input throughput':<24}{s['input_throughput']:.2f} inputs/s"] if "input_throughput" in s else []),
        f"{'output throughput':<24}{s['output_throughput']:.1f} tok/s",
        f"{'total throughput':<24}{s['total_token_throughput']:.1f} tok/s",
    ]
    if "goodput" in s:
        slo = ", ".join(f"{k}<={v:g}ms" for k, v in s["slo"].items())
        lines.append(f"{'goodput':<24}{s['goodput']:.2f} req/s ({s['slo_attainment']:.0%} of requests meet {slo})")
        if s.get("slo_violations"):
            lines.append(f"{'SLA':<24}missed: " + "; ".join(s["slo_violations"]))
    if "client_cpu_s" in s:
        lines.append(f"{'client CPU':<24}{s['client_cpu_s']:.2f} s ({s['client_cpu_s'] / s['duration_s']:.0%} of a core"
                     " while measuring)" if s["duration_s"] > 0 else f"{'client CPU':<24}{s['client_cpu_s']:.2f} s")
    if s.get("spec_decode"):
        sd = s["spec_decode"]
        pos = ", ".join(f"{a:.2f}" for a in sd["acceptance_per_position"])
        lines.append(f"{'spec decode':<24}acceptance {sd['acceptance_rate']:.1%} of {sd['num_draft_tokens']} drafted "
                     f"tokens, mean accepted length {sd['mean_acceptance_length']:.2f}, per position [{pos}]")
    if s.get("kv_transfer"):
        lines.append(_kv_transfer_line(s["kv_transfer"]))
    if "connections_opened" in s:
        c = s["connect_ms"]
        lines.append(f"{'connections':<24}{s['connections_opened']} opened (set-up median {_fmt(c['median'], 2)} ms, "
                     f"max {_fmt(c['max'], 2)} ms), {s['connections_reused']} requests reused one")
    if s.get("usage_missing"):
        lines.append(f"{'note':<24}{s['usage_missing']} responses had no usage: their tokens were counted "
                     "from stream chunks")
    lines.append(f"{'':<16}{'mean':>10}{'median':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for label, key in (("TTFT (ms)", "ttft_ms"), ("TPOT (ms)", "tpot_ms"), ("ITL (ms)", "itl_ms"),
                       ("E2E (ms)", "e2e_ms"), ("user tok/s", "per_user_tok_s")):
        d = s[key]
        lines.append(f"{label:<16}" + "".join(f"{_fmt(d[k]):>10}" for k in ("mean", "median", "p90", "p99", "max")))
    for name, c in s.get("classes", {}).items():
        lines.append(f"class {name} (priority {c['priority']}): {c['completed']} ok, {c['failed']} failed")
        for label, key in (("  TTFT (ms)", "ttft_ms"), ("  TPOT (ms)", "tpot_ms"), ("  E2E (ms)", "e2e_ms")):
            d = c[key]
            lines.append(f"{label:<16}" + "".join(f"{_fmt(d[k]):>10}" for k in ("mean", "median", "p90", "p99",
                                                                                  "max")))
    lines.append("=" * len(lines[0]))
    return "\n".join(lines)


def format_sweep_table(points: list[dict[str, Any]]) -> str:
    head = (f"{'conc':>6}{'rate':>8}{'ok':>6}{'err':>5}{'req/s':>8}{'out tok/s':>11}{'tot tok/s':>11}"
            f"{'user tok/s':>12}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}{'ITL p99':>9}{'E2E p50':>9}")
    lines = [head, "-" * len(head)]
    for p in points:
        s = p["summary"]
        conc = "-" if p["max_concurrency"] is None else str(p["max_concurrency"])
        rate = "inf" if math.isinf(p["request_rate"]) else f"{p['request_rate']:g}"
        lines.append(f"{conc:>6}{rate:>8}{s['completed']:>6}{s['failed']:>5}{s['request_throughput']:>8.2f}"
                     f"{s['output_throughput']:>11.1f}{s['total_token_throughput']:>11.1f}"
                     f"{_fmt(s['per_user_tok_s']['median']):>12}{_fmt(s['ttft_ms']['median'], 0):>10}"
                     f"{_fmt(s['ttft_ms']['p99'], 0):>10}{_fmt(s['tpot_ms']['median']):>10}"
                     f"{_fmt(s['itl_ms']['p99'], 0):>9}{_fmt(s['e2e_ms']['median'], 0):>9}")
    lines.append("(latencies in ms; user tok/s = 1/TPOT, median over requests)")
    return "\n".join(lines)


# -- plots ----------------------------------------------------------------------------------------
def pyplot():
    """matplotlib's pyplot on the file-only Agg backend, or None (with a message) when not installed."""
    try:
        import matplotlib
    except ImportError:
        logger.warning("matplotlib is not installed, so no plots were written; "
                       "install it with: pip install 'tokenmill[bench]'")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _cdf(ax, values_ms: list[float], label: str) -> None:
    xs = sorted(values_ms)
    if not xs:
        ax.text(0.5, 0.5, "no data", ha="center", transform=ax.transAxes)
        return
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, where="post")
    for p in PERCENTILES:
        v = percentile(xs, p)
        ax.axvline(v, ls=":", lw=0.8, color="gray")
        ax.text(v, 0.02 + 0.06 * PERCENTILES.index(p), f" p{p} {v:.0f}", fontsize=7, color="dimgray")
    ax.set_xlabel(f"{label} (ms)")
    ax.set_ylabel("fraction of " + ("tokens" if label == "ITL" else "requests"))
    ax.set_title(f"{label} CDF (n={len(xs)})")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)


def plot_serve(result: dict[str, Any], out_dir: str) -> list[str]:
    """latency_cdf.png (TTFT, ITL, E2E) and timeline.png (each request's wait / decode, in-flight count).
    Returns the paths written ([] without matplotlib)."""
    plt = pyplot()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    ok = [r for r in result["requests"] if r["success"]]
    title = f"{result['config']['model']} @ {result['config']['base_url']}"
    paths = []

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    _cdf(axes[0], [r["ttft"] * 1e3 for r in ok if r["ttft"] is not None], "TTFT")
    _cdf(axes[1], [x * 1e3 for r in ok for x in r["itl"]], "ITL")
    _cdf(axes[2], [r["e2e"] * 1e3 for r in ok], "E2E")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "latency_cdf.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    recs = sorted(result["requests"], key=lambda r: r["start"])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(12, 7), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    segments: dict[str, tuple[list, list, list]] = {"waiting for first token": ([], [], []), "streaming": ([], [], []),
                                                     "failed": ([], [], [])}

    def add(kind: str, y: int, x0: float, x1: float) -> None:
        for lst, v in zip(segments[kind], (y, x0, x1)):
            lst.append(v)

    for i, r in enumerate(recs):
        end = r["start"] + r["e2e"]
        if not r["success"]:
            add("failed", i, r["start"], end)
            continue
        first = r["start"] + (r["ttft"] if r["ttft"] is not None else r["e2e"])
        add("waiting for first token", i, r["start"], first)
        add("streaming", i, first, end)
    lw = max(0.5, min(2.0, 300 / max(len(recs), 1)))
    for (kind, (ys, x0, x1)), color in zip(segments.items(), ("tab:orange", "tab:blue", "tab:red")):
        if ys:  # one collection per kind: thousands of requests stay fast to draw
            top.hlines(ys, x0, x1, color=color, lw=lw, label=kind)
    top.legend(loc="upper left", fontsize=8)
    top.set_ylabel("request (by send time)")
    top.set_title(title, fontsize=10)
    events = sorted([(r["start"], 1) for r in recs] + [(r["start"] + r["e2e"], -1) for r in recs])
    ts, counts, cur = [0.0], [0], 0
    for t, d in events:
        cur += d
        ts.append(t)
        counts.append(cur)
    bottom.step(ts, counts, where="post")
    bottom.set_ylabel("in flight")
    bottom.set_xlabel("time since start (s)")
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "timeline.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def plot_pareto(points: list[dict[str, Any]], out_dir: str, title: str = "", name: str = "pareto.png") -> list[str]:
    """pareto.png: per-user tok/s (median 1/TPOT) against total output tok/s, one point per sweep point (labelled
    by its "label", else its load), the Pareto-optimal ones joined."""
    plt = pyplot()
    if plt is None:
        return []
    os.makedirs(out_dir, exist_ok=True)
    xs, ys, labels = [], [], []
    for p in points:
        s = p["summary"]
        if s["per_user_tok_s"]["median"] is None:
            continue
        xs.append(s["per_user_tok_s"]["median"])
        ys.append(s["output_throughput"])
        if "label" in p:
            labels.append(p["label"])
        else:
            rate = "" if math.isinf(p["request_rate"]) else f" rate {p['request_rate']:g}"
            labels.append(("conc " + str(p["max_concurrency"]) if p["max_concurrency"] is not None else "") + rate)
    fig, ax = plt.subplots(figsize=(7, 5))
    ax.scatter(xs, ys, zorder=3)
    for x, y, lab in zip(xs, ys, labels):
        ax.annotate(lab.strip(), (x, y), textcoords="offset points", xytext=(5, 5), fontsize=8)
    front = pareto_front(list(zip(xs, ys)))
    if len(front) > 1:
        ax.plot([x for x, _ in front], [y for _, y in front], "--", color="tab:gray", zorder=2, label="Pareto front")
        ax.legend(fontsize=8)
    ax.set_xlabel("per-user output tok/s (median 1/TPOT)")
    ax.set_ylabel("total output tok/s")
    ax.set_title(title or "throughput vs interactivity", fontsize=10)
    ax.grid(alpha=0.3)
    ax.set_xlim(0, max(xs, default=1) * 1.12)
    ax.set_ylim(0, max(ys, default=1) * 1.12)  # room for the labels
    fig.tight_layout()
    path = os.path.join(out_dir, name)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not beaten on both axes (higher is better on both), sorted by x."""
    front = []
    for x, y in sorted(points, key=lambda p: (-p[0], -p[1])):
        if not front or y > front[-1][1]:
            front.append((x, y))
    return sorted(front)
