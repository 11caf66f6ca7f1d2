"""`tokenmill bench startup MODEL`: cold and warm starts of a real `tokenmill serve`, N times each.

Cold = an empty TOKENMILL_CACHE_DIR (GGUF conversion, kernel builds, matmul plans all redone); warm = the
same cache once filled. Each start is timed from spawning the process to the first 200 from /health, and its
own start-up ledger (/health?detail=1, startup.py) says where the time went. Prints a JSON result and one
summary line: min / median / max of the total and of every phase.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Optional

import httpx

_POLL_S = 0.05


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_once(model: Optional[str], extra: list[str], env: dict, timeout: float) -> dict:
    """One `tokenmill serve` start: measured spawn -> /health 200, and the server's own ledger."""
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "--log-level", "warning", "serve", *([model] if model else []),
           "--port", str(port), *extra]
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            measured = _wait_healthy(proc, url, t0, timeout)
            detail = httpx.get(url + "/health", params={"detail": 1}, timeout=10).json()
        except RuntimeError as e:
            log.seek(0)
            raise RuntimeError(f"{e}:\n{log.read().decode(errors='replace')[-3000:]}") from None
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    startup = detail["startup"]
    return {"measured_s": measured, "ledger_s": startup["total_seconds"], "phases": startup["phase_seconds"]}


def _wait_healthy(proc: subprocess.Popen, url: str, t0: float, timeout: float) -> float:
    with httpx.Client(timeout=2) as client:
        while time.time() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"tokenmill serve exited with {proc.returncode} before it was healthy")
            try:
                if client.get(url + "/health").status_code == 200:
                    return time.time() - t0
            except httpx.HTTPError:
                pass
            time.sleep(_POLL_S)
    raise RuntimeError(f"tokenmill serve not healthy after {timeout:.0f}s")


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(runs: list[dict]) -> dict:
    names = list(dict.fromkeys(n for r in runs for n in r["phases"]))
    return {"measured_s": _spread([r["measured_s"] for r in runs]),
            "ledger_s": _spread([r["ledger_s"] for r in runs]),
            "phases": {n: _spread([r["phases"].get(n, 0.0) for r in runs]) for n in names}}


def run_startup_bench(model: Optional[str], n: int, extra: list[str], timeout: float = 600.0,
                      cache_dir: Optional[str] = None) -> dict:
    """n cold starts (each on a fresh cache) and n warm ones (on a cache one start filled)."""
    base = dict(os.environ)
    cold, warm = [], []
    scratch = tempfile.mkdtemp(prefix="tokenmill-startup-", dir=cache_dir)
    try:
        for i in range(n):
            cache = os.path.join(scratch, f"cold-{i}")
            cold.append(start_once(model, extra, dict(base, TOKENMILL_CACHE_DIR=cache), timeout))
        warm_env = dict(base, TOKENMILL_CACHE_DIR=os.path.join(scratch, "cold-0"))
        warm = [start_once(model, extra, warm_env, timeout) for _ in range(n)]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"model": model or "default", "runs": n, "args": extra, "load_average": os.getloadavg()[0],
            "cold": summarize(cold), "warm": summarize(warm), "cold_runs": cold, "warm_runs": warm}


def format_table(result: dict) -> str:
    lines = [f"{'phase':<22} {'cold min/med/max s':>22} {'warm min/med/max s':>22}"]
    names = list(dict.fromkeys([*result["cold"]["phases"], *result["warm"]["phases"]]))
    rows = [(n, result["cold"]["phases"].get(n), result["warm"]["phases"].get(n)) for n in names]
    rows += [("total (ledger)", result["cold"]["ledger_s"], result["warm"]["ledger_s"]),
             ("spawn -> /health 200", result["cold"]["measured_s"], result["warm"]["measured_s"])]
    for name, c, w in rows:
        cell = [f"{s['min']:.2f}/{s['median']:.2f}/{s['max']:.2f}" if s else "-" for s in (c, w)]
        lines.append(f"{name:<22} {cell[0]:>22} {cell[1]:>22}")
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    c, w = result["cold"]["measured_s"]["median"], result["warm"]["measured_s"]["median"]
    return (f"startup {result['model']}: cold {c:.2f}s, warm {w:.2f}s to /health 200 (median of {result['runs']}; "
            f"load average {result['load_average']:.1f})")


def add_startup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF dir or .gguf (default: built-in default model)")
    p.add_argument("--num-runs", "-n", type=int, default=3, help="starts of each kind (cold, warm)")
    p.add_argument("--serve-args", default="", help="extra `tokenmill serve` flags as one string, written with =, e.g. "
                                                    "--serve-args='--max-model-len 2048'")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    p.add_argument("--save-result", default=None, help="also write the JSON result to this file")
    p.set_defaults(func=startup_main)


def startup_main(args: argparse.Namespace) -> int:
    import shlex

    if args.num_runs < 1:
        raise ValueError("--num-runs must be at least 1")
    result = run_startup_bench(args.model, args.num_runs, shlex.split(args.serve_args), args.timeout)
    text = json.dumps(result, indent=2)
    print(text)
    if args.save_result:
        with open(args.save_result, "w") as f:
            f.write(text + "\n")
    print(format_table(result))
    print(summary_line(result))
    return 0
