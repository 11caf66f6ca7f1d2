"""Request-rate traces for `tokenmill plan --trace`: reading them, and a synthetic diurnal one.

A trace is JSONL in one of two forms (not mixed):
- one line per time bucket: {"t": seconds, "rate": requests/s}; the rate holds until the next line's t (the
  last line lasts as long as the one before it, or --bucket-s when it is alone);
- one line per request: {"t": arrival seconds}; arrivals are counted into buckets of --bucket-s from t = 0.
Either form may carry "input_len" / "output_len" per line (tokens); the replay only reports their mean against
the workload the replica's capacity was measured with.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any, Iterable, Optional


@dataclass(frozen=True)
class Interval:
    t: float        # start, seconds
    dt: float       # length, seconds
    rate: float     # requests/s arriving during it


@dataclass(frozen=True)
class Trace:
    intervals: list[Interval]
    form: str                            # "buckets" or "requests"
    mean_input_len: Optional[float] = None
    mean_output_len: Optional[float] = None

    @property
    def duration_s(self) -> float:
        return sum(iv.dt for iv in self.intervals)

    @property
    def requests(self) -> float:
        return sum(iv.rate * iv.dt for iv in self.intervals)


def _number(obj: dict, key: str, where: str, minimum: float = 0.0) -> Optional[float]:
    v = obj.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < minimum:
        raise ValueError(f"{where}: {key!r} must be a number >= {minimum:g}, got {v!r}")
    return float(v)


def _lines(path: str) -> Iterable[tuple[str, dict[str, Any]]]:
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not JSON ({e.msg}); a trace line is {{\"t\": s, \"rate\": req/s}} "
                                 "or {\"t\": arrival_s}") from None
            if not isinstance(obj, dict) or _number(obj, "t", where) is None:
                raise ValueError(f"{where}: each line needs \"t\" (seconds >= 0), got {line.strip()[:60]}")
            yield where, obj


def load_trace(path: str, bucket_s: float = 60.0) -> Trace:
    if bucket_s <= 0:
        raise ValueError(f"--bucket-s must be > 0, got {bucket_s}")
    rows = [(where, obj, _number(obj, "t", where), _number(obj, "rate", where)) for where, obj in _lines(path)]
    if not rows:
        raise ValueError(f"{path}: the trace is empty")
    with_rate = sum(rate is not None for *_, rate in rows)
    if with_rate not in (0, len(rows)):
        raise ValueError(f"{path}: {with_rate} of {len(rows)} lines have \"rate\": use one form, buckets "
                         "({\"t\", \"rate\"}) or requests ({\"t\"}), not both")
    lens = {k: [_number(obj, k, where, 1) for where, obj, *_ in rows] for k in ("input_len", "output_len")}
    means = {k: sum(v) / len(v) if v and None not in v else None for k, v in lens.items()}
    if with_rate:
        intervals, form = _buckets([(where, t, rate) for where, _, t, rate in rows], bucket_s), "buckets"
    else:
        intervals, form = _count(sorted(t for _, _, t, _ in rows), bucket_s), "requests"
    return Trace(intervals, form, means["input_len"], means["output_len"])


def _buckets(rows: list[tuple[str, float, float]], bucket_s: float) -> list[Interval]:
    for (_, t0, _), (where, t1, _) in zip(rows, rows[1:]):
        if t1 <= t0:
            raise ValueError(f"{where}: bucket times must increase, got t={t1:g} after t={t0:g}")
    starts = [t for _, t, _ in rows]
    ends = starts[1:] + [starts[-1] + (starts[-1] - starts[-2] if len(starts) > 1 else bucket_s)]
    return [Interval(t, end - t, rate) for (_, t, rate), end in zip(rows, ends)]


def _count(arrivals: list[float], bucket_s: float) -> list[Interval]:
    counts = [0] * (int(arrivals[-1] // bucket_s) + 1)
    for t in arrivals:
        counts[int(t // bucket_s)] += 1
    return [Interval(i * bucket_s, bucket_s, c / bucket_s) for i, c in enumerate(counts)]


def diurnal(hours: float, peak_rate: float, trough_rate: Optional[float] = None, bucket_s: float = 60.0,
            seed: int = 0, noise: float = 0.05) -> list[dict[str, float]]:
    """A day's shape: lowest at 04:00, highest at 16:00 (a raised cosine between --trough-rate and
    --peak-rate), each bucket's rate times (1 + noise x a seeded normal draw)."""
    trough = peak_rate / 10 if trough_rate is None else trough_rate
    if not 0 <= trough <= peak_rate or peak_rate <= 0 or hours <= 0 or bucket_s <= 0:
        raise ValueError(f"--make-trace diurnal needs --hours > 0, --bucket-s > 0 and 0 <= --trough-rate <= "
                         f"--peak-rate with --peak-rate > 0 (got {hours:g} h, {trough:g} .. {peak_rate:g} req/s)")
    rng = random.Random(seed)
    out = []
    for i in range(math.ceil(hours * 3600 / bucket_s)):
        t = i * bucket_s
        shape = 0.5 - 0.5 * math.cos(2 * math.pi * (t / 3600 - 4) / 24)
        rate = (trough + (peak_rate - trough) * shape) * max(0.0, 1 + noise * rng.gauss(0, 1))
        out.append({"t": t, "rate": round(rate, 4)})
    return out


def write_trace(path: str, rows: list[dict[str, float]]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
