"""Run a function on every rank of a real multi-process gloo world (tests marked `distributed`).

run_ranks(fn, tp, pp, *args) spawns tp * pp processes; each joins torch.distributed through
tokenmill.distributed.init_distributed, runs fn(*args) and sends back its result (picklable). A rank that
raises fails the whole run with that rank's traceback; a run that hangs fails after `timeout` seconds.
fn must be a module-level function (the children are spawned, not forked).
"""
from __future__ import annotations

import os
import queue
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(rank, tp, pp, port, expert_parallel, fn, args, results) -> None:
    try:
        import torch

        torch.set_num_threads(1)
        os.environ.setdefault("TOKENMILL_MATMUL", "panel")
        from tokenmill.distributed import destroy_distributed, init_distributed

        init_distributed(rank, tp, pp, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=60,
                         expert_parallel=expert_parallel)
        try:
            results.put((rank, True, fn(*args)))
        finally:
            destroy_distributed()
    except BaseException:  # noqa: BLE001 - report whatever went wrong on this rank
        results.put((rank, False, traceback.format_exc()))


def run_ranks(fn, tp: int, pp: int = 1, *args, expert_parallel: bool = False, timeout: float = 180.0) -> list:
    """fn(*args)'s result on each rank, in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    world = tp * pp
    procs = [ctx.Process(target=_child, args=(r, tp, pp, port, expert_parallel, fn, args, results), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        for _ in range(world):
            try:
                rank, ok, value = results.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"ranks {sorted(set(range(world)) - set(out))} did not finish in {timeout}s")
            if not ok:
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world)]
