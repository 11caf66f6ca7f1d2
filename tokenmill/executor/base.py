"""Executors hide where the workers live (this process, child processes, Ray actors).

The engine core talks only to this interface. Every rank runs the same Worker; the engine sends every step to
every rank (their runners keep per-request state between steps) and reads the result of the output rank only:
the last pipeline stage's tensor-parallel rank 0, which holds the sampled tokens.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Union

from tokenmill.config import EngineConfig
from tokenmill.step.interrupt import StepInterrupt

Method = Union[str, Callable[..., Any]]
COLLECTIVE_FAILED = 70  # a rank's exit status after a failed collective


def collective_failed(e: BaseException, world_size: int) -> bool:
    """A collective that timed out or lost a peer (NCCL: DistError; gloo: a RuntimeError from its transport).
    The ranks are then out of step and the communicator cannot be trusted: the rank exits (COLLECTIVE_FAILED),
    so the executor sees a dead rank and stops the engine instead of running on a broken world."""
    import torch.distributed as dist

    return world_size > 1 and (isinstance(e, getattr(dist, "DistError", ())) or "gloo" in str(e))


class WorkerDiedError(RuntimeError):
    """A worker rank is gone (killed, crashed, out of memory): the engine cannot go on without it."""


def run_method(worker, method: Method, args: tuple, kwargs: dict) -> Any:
    """A collective_rpc call on one rank: a Worker method by name, or fn(worker, *args, **kwargs)."""
    fn = getattr(worker, method) if isinstance(method, str) else (lambda *a, **k: method(worker, *a, **k))
    return fn(*args, **kwargs)


def _kernels(worker) -> dict:
    return worker.kernels


def _startup_phases(worker) -> list:
    return worker.ledger.phases


class Executor:
    # The interrupt of the model's steps (step/interrupt.py), where the model runs in this process under
    # --scheduling-policy priority; else None.
    step_interrupt: Optional[StepInterrupt] = None

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        pc = config.parallel
        self.world_size = pc.world_size
        self.output_rank = (pc.pipeline_parallel_size - 1) * pc.tensor_parallel_size

    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None) -> list:
        """Call `method` on every rank's Worker (a method name, or a function taking the worker first; it
        must pickle by reference, i.e. be module-level, outside uniproc); returns the results in rank order."""
        raise NotImplementedError

    def execute_model(self, scheduler_output, non_block: bool = False):
        """The output rank's ModelRunnerOutput; with non_block, a Future of it (results in submission order)."""
        raise NotImplementedError

    def determine_num_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_blocks"))  # every rank must hold every block

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def bytes_per_block(self) -> int:
        """A block's bytes over all ranks (each holds its own heads / layers of it)."""
        return sum(self.collective_rpc("bytes_per_block"))

    def kernels(self) -> dict:
        """worker/kernels_report.report of the output rank: the kernels in use and any fallbacks."""
        return self.collective_rpc(_kernels)[self.output_rank]

    def startup_phases(self) -> list:
        """The output rank's start-up phases (startup.Phase: kernels, weight load, weight packing)."""
        return self.collective_rpc(_startup_phases)[self.output_rank]

    def check_health(self) -> None:
        """Raise WorkerDiedError if a rank is gone (the engine loop calls this while idle too)."""

    def shutdown(self) -> None:
        pass

