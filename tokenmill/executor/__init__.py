"""Executors run the model's ranks: uniproc (one rank in this process), mp (processes on this machine), ray
(Ray actors across machines). base.Executor is the interface; BACKENDS names each implementation by module,
so that creating one imports only it (uniproc and mp import torch, ray imports Ray; the API process imports
executor.base for its errors and must load neither)."""
from __future__ import annotations

import importlib

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor

BACKENDS = {"uniproc": ("tokenmill.executor.uniproc", "UniProcExecutor"),
            "mp": ("tokenmill.executor.multiproc", "MultiprocExecutor"),
            "ray": ("tokenmill.executor.ray", "RayExecutor")}


def create_executor(config: EngineConfig) -> Executor:
    """The executor of --distributed-executor-backend (config.parallel; uniproc when unset)."""
    module, name = BACKENDS[config.parallel.distributed_executor_backend or "uniproc"]
    return getattr(importlib.import_module(module), name)(config)
