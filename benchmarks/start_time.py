"""Cold and warm start of `tokenmill generate` on the default model: process start to first streamed token.

Cold = empty tokenmill cache (the GGUF is converted); warm = the second run, cache filled.
Prints a JSON result and one summary line.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time


def first_token_seconds(env: dict) -> float:
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--log-level", "warning", "generate",
                          "--prompt", "The capital of France is", "--max-tokens", "8"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    first = p.stdout.read(1)
    t = time.perf_counter() - t0
    p.communicate(timeout=600)
    if not first or p.returncode:
        raise RuntimeError(f"generate failed (exit {p.returncode})")
    return t


def main() -> None:
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")  # no figure from a slow path (kernels_report.py)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TOKENMILL_CACHE_DIR=cache)
        cold = first_token_seconds(env)
        warm = [first_token_seconds(env) for _ in range(2)]
    result = {"cold_s": cold, "warm_s": min(warm), "warm_runs_s": warm, "load_average": os.getloadavg()[0]}
    print(json.dumps(result, indent=2))
    print(f"start to first token: cold {cold:.1f}s, warm {min(warm):.1f}s (load {result['load_average']:.1f})")


if __name__ == "__main__":
    main()
