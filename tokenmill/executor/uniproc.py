"""One worker in this process: the degenerate case of every other executor."""
from __future__ import annotations

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor
from tokenmill.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.worker = Worker(config)

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def initialize_cache(self, num_blocks: int) -> None:
        self.worker.initialize_cache(num_blocks)

    def bytes_per_block(self) -> int:
        return self.worker.bytes_per_block()

    def execute_model(self, scheduler_output):
        return self.worker.execute_model(scheduler_output)

    def kernels(self) -> dict:
        return self.worker.kernels

    def shutdown(self) -> None:
        self.worker.shutdown()
