"""Start the engine core process before the API process knows its configuration.

Both processes spend most of a warm start importing (torch above all). Started first thing by `tokenmill
serve`, the engine process does its imports while the API process does its own and resolves the model; it
then waits for its arguments on a pipe (`launch`) and runs engine/core_proc.py's loop. The model's
transformers config reaches it as a ConfigSnapshot (config_snapshot.py), so it never imports transformers.
This module stays light (no torch) because the CLI imports it before anything else.
"""
from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import signal

ENGINE_PROCESS_NAME = "tokenmill-engine"
ENGINE_SPINCOUNT = "1000"  # libgomp's spin before a waiting thread sleeps (its default is 300000)


def openmp_wait_env() -> dict[str, str]:
    """How the engine's OpenMP threads wait at a barrier: a short spin (GOMP_SPINCOUNT iterations, tens of
    microseconds), then sleep. Spinning without end stalls the engine ~10x whenever another process (the API
    process, serving HTTP) takes a core from it; sleeping at once (OMP_WAIT_POLICY=PASSIVE) puts a futex wake-up
    in every parallel region, hundreds per decode step: the default model's single-stream decode ran at 43 tok/s
    served that way, 115-148 with this spin, on a 2-core EPYC (and 124 -> 132 tok/s at 64 streams). The variables
    to add to the environment: none where the user set OMP_WAIT_POLICY or GOMP_SPINCOUNT (theirs wins). Benchmarks
    that compare the server with an in-process engine give the latter the same."""
    user = any(k in os.environ for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"))
    return {} if user else {"GOMP_SPINCOUNT": ENGINE_SPINCOUNT}


@contextlib.contextmanager
def engine_env():
    """Environment the engine process starts with (openmp_wait_env)."""
    added = openmp_wait_env()
    os.environ.update(added)
    try:
        yield
    finally:
        for k in added:
            os.environ.pop(k, None)


def _engine_main(conn) -> None:
    """The prestarted process: import, then wait for run_engine_core's arguments (EOF: not needed after all)."""
    # Ctrl-C reaches the whole process group; the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    # The imports are the point: the engine loop and everything a one-process worker builds on. Not
    # transformers: the model's config arrives as a ConfigSnapshot (config_snapshot.py).
    from tokenmill.engine import core, core_proc  # noqa: F401
    from tokenmill.executor import uniproc  # noqa: F401
    from tokenmill.startup import Ledger

    ledger = Ledger("engine")
    ledger.mark("engine process start", ledger.origin)
    try:
        data = conn.recv_bytes()
    except (EOFError, OSError):
        return
    finally:
        conn.close()
    with ledger.phase("engine config"):
        args = pickle.loads(data)
    core_proc.run_engine_core(*args, ledger=ledger)


class PrestartedEngine:
    """An engine process importing in the background; `launch` hands it its arguments, `cancel` ends it."""

    def __init__(self) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_engine_main, args=(child,), name=ENGINE_PROCESS_NAME)
        with engine_env():
            self.proc.start()
        child.close()
        self.launched = False

    def launch(self, args: tuple) -> multiprocessing.Process:
        """Start the engine proper: args are run_engine_core's (config, addresses, parent pid, ...)."""
        from tokenmill import config_snapshot  # ~1 ms, paid after the engine process started

        self.conn.send_bytes(config_snapshot.dumps(args))  # no transformers needed to read it (config_snapshot.py)
        self.conn.close()
        self.launched = True
        return self.proc

    def cancel(self) -> None:
        """End the process if it was never launched (the server failed before it needed it); a launched one
        belongs to its AsyncLLM, which stops it."""
        self.conn.close()
        if not self.launched and self.proc.is_alive():
            self.proc.kill()  # still importing or waiting: nothing to lose
            self.proc.join(5)
