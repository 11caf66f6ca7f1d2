"""Shared pieces of the benchmarks; they live in the package so `tokenmill bench` uses the same code."""
from __future__ import annotations

from tokenmill.bench.offline import load_average, random_workload, weight_bytes  # noqa: F401
from tokenmill.perf.hardware import copy_bandwidth, read_bandwidth  # noqa: F401
