"""A step that a better-ranked arrival cuts short (--scheduling-policy priority).

Without it a high-priority request that arrives during a long step of low-priority prefill waits the whole step
out (a 512-token chunk takes ~1.4 s on a 2-core CPU), then its own. So the engine arms each step that runs
prompt tokens with the best (lowest) priority value in it; the engine process's input thread offers every
arrival's priority as it comes in, and one ranked strictly better trips the interrupt. The model checks it
between layers (LlamaModel.run_layers) and stops there by raising StepInterrupted; the step's KV writes so
far are wasted, never wrong (a recomputed position writes the same values).

Invariant: an interrupted step leaves the worker's copy of each request as a finished step would (its
NewRequests and block and token deltas are applied before the forward pass, and stay true), and the engine
core takes the step back (Scheduler.take_back): no token of it counts as computed, so the next step schedules
the arrival first and the interrupted work runs again after it.

Only where the model runs in the engine's own process (one worker: executor.uniproc), and not with KV
connectors (their plans move blocks around the forward pass).
"""
from __future__ import annotations

import threading
from typing import Optional


class StepInterrupted(Exception):
    """Raised inside the model's forward pass: the step in flight was cut short."""


class StepInterrupt:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: Optional[int] = None  # the best priority value in the step in flight; None: not armed
        self._tripped = False

    def arm(self, priority: int) -> None:
        """The engine, before a step whose best-ranked request has `priority`."""
        with self._lock:
            self._armed, self._tripped = priority, False

    def disarm(self) -> None:
        """The engine, after the step (run or cut short)."""
        with self._lock:
            self._armed, self._tripped = None, False

    def offer(self, priority: int) -> None:
        """The input thread, for each arriving request: trips the step in flight if it ranks strictly better."""
        with self._lock:
            if self._armed is not None and priority < self._armed:
                self._tripped = True

    def check(self) -> None:
        """The model, between layers."""
        if self._tripped:
            raise StepInterrupted
