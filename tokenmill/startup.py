"""The cold-start ledger: where a `tokenmill serve` start spends its time.

Each process that takes part in a start (the API process, the engine core process, each worker rank) keeps one
`Ledger` and wraps its real phase boundaries in `ledger.phase(name)`. Phases are wall-clock intervals
(time.time(), comparable across processes on one machine), so the API process can merge the engine's phases
into its own when the engine reports ready. Some phases overlap (the API process loads the tokenizer while the
engine process loads weights): `critical_path` attributes every instant from the process start to "ready" to
the phase that was still running latest, so the shares sum to the start time exactly and overlapped work only
counts where it delayed the start.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, replace

import msgspec

logger = logging.getLogger("tokenmill")

# The API process of `tokenmill serve` starts without these on a warm start (models/resolution_cache.py);
# the report says whether it did
HEAVY_MODULES = ("torch", "transformers")
OTHER = "other"  # time no phase covers (between phases, scheduler latency on a loaded machine)


class Phase(msgspec.Struct, array_like=True):
    """One timed phase; start and end are wall-clock seconds (time.time())."""
    name: str
    start: float
    end: float
    process: str = "api"

    @property
    def seconds(self) -> float:
        return self.end - self.start


def process_start_time(pid: str = "self") -> float:
    """Wall-clock time at which process `pid` started (interpreter start included), from /proc; the current
    time where /proc is unavailable. /proc/uptime (10 ms) is used instead of the boot time in /proc/stat,
    which is rounded to whole seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in clock ticks
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        now = time.time()
    except (OSError, ValueError, IndexError):
        return time.time()
    return now - (uptime - ticks / os.sysconf("SC_CLK_TCK"))


class Ledger:
    """Phases of one process's start. `phase(name)` times a block; `mark(name, start)` closes a phase that
    began at `start` (a timestamp taken before the ledger existed, e.g. the process start)."""

    def __init__(self, process: str = "api", origin: float | None = None) -> None:
        self.process = process
        self.origin = process_start_time() if origin is None else origin
        self.phases: list[Phase] = []
        self.report: StartupReport | None = None  # once finish() is called: the process is ready


    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.time()
        try:
            yield
        finally:
            self.phases.append(Phase(name, start, time.time(), self.process))

    def mark(self, name: str, start: float, end: float | None = None) -> None:
        self.phases.append(Phase(name, start, time.time() if end is None else end, self.process))

    def mark_since_last(self, name: str) -> None:
        """A phase from the end of this process's latest phase (or its start) to now."""
        ends = [p.end for p in self.phases if p.process == self.process]
        self.mark(name, max(ends, default=self.origin))

    def extend(self, phases: list[Phase]) -> None:
        """Adopt another process's phases (the engine's, a worker rank's)."""
        self.phases.extend(phases)

    def finish(self) -> "StartupReport":
        """The process is ready now: its report, logged as one table."""
        imported = tuple(m for m in HEAVY_MODULES if m in sys.modules)
        self.report = replace(critical_path(self.phases, self.origin, time.time()), imported=imported)
        logger.info("start-up: ready %.2fs after the process started\n%s", self.report.total,
                    self.report.table(self.origin))
        return self.report

    def as_dict(self) -> dict:
        return self.report.as_dict(self.origin) if self.report is not None else {}


def timed(ledger: "Ledger | None", name: str):
    """ledger.phase(name), or nothing when there is no ledger (code shared with the offline front)."""
    return ledger.phase(name) if ledger is not None else contextlib.nullcontext()


@dataclass
class StartupReport:
    """A finished start: the total (process start to ready) and each phase's share of it."""
    total: float
    critical: dict[str, float]     # phase name -> seconds it added to the start (sums to total)
    phases: list[Phase]            # everything recorded, in start order
    imported: tuple[str, ...] = ()  # which of HEAVY_MODULES this process had loaded when it was ready

    def as_dict(self, origin: float) -> dict:
        return {"total_seconds": round(self.total, 4),
                "phase_seconds": {k: round(v, 4) for k, v in self.critical.items()},
                "imported_at_ready": list(self.imported),
                "phases": [{"name": p.name, "process": p.process, "start": round(p.start - origin, 4),
                            "seconds": round(p.seconds, 4)} for p in self.phases]}

    def table(self, origin: float) -> str:
        lines = [f"{'phase':<22} {'process':<8} {'start s':>8} {'took s':>8} {'adds s':>8}"]
        for p in self.phases:
            lines.append(f"{p.name:<22} {p.process:<8} {p.start - origin:8.2f} {p.seconds:8.2f} "
                         f"{self.critical.get(p.name, 0.0):8.2f}")
        if self.critical.get(OTHER):
            lines.append(f"{OTHER:<22} {'':<8} {'':>8} {'':>8} {self.critical[OTHER]:8.2f}")
        lines.append(f"{'ready':<22} {'':<8} {self.total:8.2f} {'':>8} {self.total:8.2f}")
        return "\n".join(lines)


def critical_path(phases: list[Phase], origin: float, ready: float) -> StartupReport:
    """Split [origin, ready] at every phase boundary; each piece goes to the phase covering it that ends
    latest (the one the start was waiting on), or to OTHER when none covers it. Phases of the same name add up."""
    phases = sorted(phases, key=lambda p: p.start)
    cuts = sorted({origin, ready, *(min(max(t, origin), ready) for p in phases for t in (p.start, p.end))})
    critical: dict[str, float] = {p.name: 0.0 for p in phases}
    for a, b in zip(cuts, cuts[1:]):
        covering = [p for p in phases if p.start <= a and p.end >= b]
        name = max(covering, key=lambda p: p.end).name if covering else OTHER
        critical[name] = critical.get(name, 0.0) + (b - a)
    return StartupReport(ready - origin, critical, phases)
