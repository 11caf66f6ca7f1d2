"""Executors hide where the workers live (this process, child processes, Ray actors).
The engine core talks only to this interface."""
from __future__ import annotations

from tokenmill.config import EngineConfig


class Executor:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def create(config: EngineConfig) -> "Executor":
        from tokenmill.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config)

    def determine_num_blocks(self) -> int:
        raise NotImplementedError

    def initialize_cache(self, num_blocks: int) -> None:
        raise NotImplementedError

    def bytes_per_block(self) -> int:
        raise NotImplementedError

    def execute_model(self, scheduler_output):
        raise NotImplementedError

    def kernels(self) -> dict:
        """layers/kernels_report.report of the worker(s): the kernels in use and any fallbacks."""
        raise NotImplementedError

    def shutdown(self) -> None:
        pass
