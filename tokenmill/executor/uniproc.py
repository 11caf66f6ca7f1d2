"""One worker in this process: the degenerate case of every other executor."""
from __future__ import annotations

from concurrent.futures import Future

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor, Method, run_method
from tokenmill.step.interrupt import StepInterrupt
from tokenmill.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        # --scheduling-policy priority: a better-ranked arrival may cut a step short (step/interrupt.py)
        self.step_interrupt = StepInterrupt() if config.scheduler.scheduling_policy == "priority" else None
        self.worker = Worker(config, step_interrupt=self.step_interrupt)

    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None) -> list:
        return [run_method(self.worker, method, args, kwargs or {})]

    def execute_model(self, scheduler_output, non_block: bool = False):
        if not non_block:
            return self.worker.execute_model(scheduler_output)
        fut: Future = Future()
        try:
            fut.set_result(self.worker.execute_model(scheduler_output))
        except Exception as e:  # noqa: BLE001 - delivered where the caller waits, as with the other executors
            fut.set_exception(e)
        return fut

    def shutdown(self) -> None:
        self.worker.shutdown()
