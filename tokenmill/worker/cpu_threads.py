"""CPU threads sized to the cores other processes leave free.

Why: the kernels split each step's work evenly between torch's OpenMP threads, and a thread that finishes
early spins in the barrier for the others. When another process takes a core, the thread sharing it runs at a
fraction of its speed while its partner spins, and the spinning itself takes time the descheduled threads
need: on 2 cores W1 fell to 0.38x of its quiet throughput beside one spinning process, below the 0.5x a lost
core explains. Passive waiting (OMP_WAIT_POLICY=PASSIVE) recovered 0.6x but cost 37% of quiet single-stream
decode speed here (a futex sleep and wake-up per parallel region, hundreds per step). So threads wait by a short
spin (engine/prestart.py's GOMP_SPINCOUNT), and the thread count follows the machine instead: every INTERVAL_S, /proc/stat says how much CPU the
rest of the machine used (everything minus this process), each core's worth of it takes one thread away
(never the last), and the threads come back when the others go quiet. Results do not depend on the thread
count (every kernel fixes its reduction order whatever the split), so this changes speed only.

TOKENMILL_ADAPTIVE_THREADS=0 keeps the thread count fixed.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import Optional

import torch

logger = logging.getLogger("tokenmill")

INTERVAL_S = 0.5
TAKE_AT = 0.75  # another process's CPU use, in cores, that takes a thread away ...
GIVE_BACK_BELOW = 0.5  # ... and the lower figure it must fall under to give it back (no flapping at the edge)

# torch's thread count is per process: (the count a sizer last set, the count it started from), so that the
# next engine in this process starts from the user's count, not from a lowered one it would take as the max.
_lowered: Optional[tuple[int, int]] = None


def _cpu_ticks() -> Optional[tuple[int, int]]:
    """(busy ticks of the whole machine, ticks of this process), or None without Linux's /proc."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
        with open("/proc/self/stat") as f:
            own = f.read().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    except (OSError, ValueError, IndexError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, int(own[11]) + int(own[12])  # user..steal; utime + stime


def threads_for(others_cores: float, max_threads: int, reduced: bool) -> int:
    """Threads to run with when other processes use `others_cores` cores of this machine."""
    taken = math.floor(others_cores + 1 - (GIVE_BACK_BELOW if reduced else TAKE_AT))
    return max(1, min(max_threads, (os.cpu_count() or 1) - max(0, taken)))


class ThreadSizer:
    """Call update() once per step; it samples at most every INTERVAL_S and changes torch's thread count."""

    def __init__(self) -> None:
        if _lowered is not None and torch.get_num_threads() == _lowered[0]:
            torch.set_num_threads(_lowered[1])  # an earlier engine here lowered it and did not give it back
        self.max_threads = torch.get_num_threads()
        self.threads = self.max_threads
        enabled = os.environ.get("TOKENMILL_ADAPTIVE_THREADS", "1") != "0" and self.max_threads > 1
        self._last = _cpu_ticks() if enabled else None
        self._last_time = time.monotonic()
        self._ticks_per_s = os.sysconf("SC_CLK_TCK") if self._last is not None else 0

    def update(self) -> None:
        now = time.monotonic()
        if self._last is None or now - self._last_time < INTERVAL_S:
            return
        sample = _cpu_ticks()
        if sample is None:
            self._last = None
            return
        machine, own = (b - a for a, b in zip(self._last, sample))
        others = max(0, machine - own) / self._ticks_per_s / (now - self._last_time)
        self._last, self._last_time = sample, now
        threads = threads_for(others, self.max_threads, self.threads < self.max_threads)
        if threads != self.threads:
            logger.info("other processes use %.1f cores: running with %d of %d threads", others, threads,
                        self.max_threads)
            torch.set_num_threads(threads)
            self.threads = threads
            global _lowered
            _lowered = (threads, self.max_threads)
