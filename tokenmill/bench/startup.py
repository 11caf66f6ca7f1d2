"""`tokenmill bench startup MODEL`: cold and warm starts of a real `tokenmill serve`, N times each.

Cold = an empty TOKENMILL_CACHE_DIR (GGUF conversion, kernel builds, matmul plans all redone); warm = the
same cache once filled. Each start is timed from spawning the process to the first 200 from /health, and its
own start-up ledger (/health?detail=1, startup.py) says where the time went. Prints a JSON result and one
summary line: min / median / max of the total and of every phase.

--busy-neighbour runs every start beside a process spinning on one core (issue 29: warm starts were 2.47 s
quiet and 5.9-9.4 s beside one). --compare-with DIR interleaves a warm start of another tokenmill source tree
(e.g. `git worktree add /tmp/before <commit>`) after each warm start, on the same cache and beside the same
neighbour: before and after measured in one sitting.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Optional

import httpx

from tokenmill.fleet.launchers import free_port, stop_process

_POLL_S = 0.05


@contextlib.contextmanager
def busy_neighbour(spinning: bool):
    """A process spinning on one core (a pure Python loop) while the block runs, if `spinning`; yields it."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if spinning else None
    try:
        yield proc
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def _spawned(cmd: list[str], url: str, env: dict, timeout: float, what: str, cwd: Optional[str] = None):
    """Spawn cmd, wait for its /health 200 and yield the seconds that took; the process is stopped after."""
    with tempfile.TemporaryFile() as log:
        t0 = time.time()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
        try:
            try:
                measured = _wait_healthy(proc, url, t0, timeout, what)
            except RuntimeError as e:
                log.seek(0)
                raise RuntimeError(f"{e}:\n{log.read().decode(errors='replace')[-3000:]}") from None
            yield measured
        finally:
            stop_process(proc, 30)


def start_once(model: Optional[str], extra: list[str], env: dict, timeout: float, source: Optional[str] = None) -> dict:
    """One `tokenmill serve` start: measured spawn -> /health 200, and the server's own ledger. source: another
    tokenmill source tree to run instead of this one (`python -m` puts its working directory first on the path)."""
    port = free_port()
    if source is not None:
        env = dict(env, PYTHONPATH=os.pathsep.join(filter(None, [source, env.get("PYTHONPATH")])))
        model = os.path.abspath(model) if model and os.path.exists(model) else model
    cmd = [sys.executable, "-m", "tokenmill.cli", "--log-level", "warning", "serve", *([model] if model else []),
           "--port", str(port), *extra]
    url = f"http://127.0.0.1:{port}"
    with _spawned(cmd, url, env, timeout, "tokenmill serve", cwd=source) as measured:
        detail = httpx.get(url + "/health", params={"detail": 1}, timeout=10).json()
    startup = detail["startup"]
    return {"measured_s": measured, "ledger_s": startup["total_seconds"], "phases": startup["phase_seconds"]}


def llama_server_once(binary: str, gguf: str, extra: list[str], timeout: float) -> dict:
    """One llama.cpp `llama-server` start on the same GGUF: spawn -> /health 200 (it answers 503 while
    loading the model)."""
    port = free_port()
    cmd = [binary, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), *extra]
    with _spawned(cmd, f"http://127.0.0.1:{port}", dict(os.environ), timeout, "llama-server") as measured:
        return {"measured_s": measured}


def _wait_healthy(proc: subprocess.Popen, url: str, t0: float, timeout: float, what: str) -> float:
    with httpx.Client(timeout=2) as client:
        while time.time() - t0 < timeout:
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode} before it was healthy")
            try:
                if client.get(url + "/health").status_code == 200:
                    return time.time() - t0
            except httpx.HTTPError:
                pass
            time.sleep(_POLL_S)
    raise RuntimeError(f"{what} not healthy after {timeout:.0f}s")


def _spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def summarize(runs: list[dict]) -> dict:
    names = list(dict.fromkeys(n for r in runs for n in r["phases"]))
    return {"measured_s": _spread([r["measured_s"] for r in runs]),
            "ledger_s": _spread([r["ledger_s"] for r in runs]),
            "phases": {n: _spread([r["phases"].get(n, 0.0) for r in runs]) for n in names}}


@dataclass
class Peer:
    """llama.cpp's llama-server, started on the same GGUF between tokenmill's warm starts."""
    binary: str
    gguf: str
    args: list[str]


def run_startup_bench(model: Optional[str], n: int, extra: list[str], timeout: float = 600.0,
                      cache_dir: Optional[str] = None, cold_runs: Optional[int] = None,
                      peer: Optional[Peer] = None, neighbour: bool = False,
                      compare_with: Optional[str] = None) -> dict:
    """cold_runs (default n) cold starts, each on a fresh cache, then n warm ones on a cache the first start
    filled (one unmeasured start fills it when there are no cold runs); with a peer, a llama-server start
    after each warm start, and with compare_with (a tokenmill source tree), a warm start of that tree
    (interleaved: both see the same machine; which goes first alternates). neighbour: all of it beside a
    process spinning on one core."""
    base = dict(os.environ)
    cold_runs = n if cold_runs is None else cold_runs
    cold, warm, peer_runs, other = [], [], [], []
    scratch = tempfile.mkdtemp(prefix="tokenmill-startup-", dir=cache_dir)
    try:
        with busy_neighbour(neighbour):
            for i in range(max(cold_runs, 1)):
                started = start_once(model, extra, dict(base, TOKENMILL_CACHE_DIR=os.path.join(scratch, f"cold-{i}")),
                                     timeout)
                if i < cold_runs:
                    cold.append(started)
            warm_env = dict(base, TOKENMILL_CACHE_DIR=os.path.join(scratch, "cold-0"))
            for i in range(n):
                if compare_with is not None and i % 2 == 1:
                    other.append(start_once(model, extra, warm_env, timeout, compare_with))
                warm.append(start_once(model, extra, warm_env, timeout))
                if compare_with is not None and i % 2 == 0:
                    other.append(start_once(model, extra, warm_env, timeout, compare_with))
                if peer is not None:
                    peer_runs.append(llama_server_once(peer.binary, peer.gguf, peer.args, timeout))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    result = {"model": model or "default", "runs": n, "cold_runs": cold_runs, "args": extra,
              "busy_neighbour": neighbour, "load_average": os.getloadavg()[0],
              "cold": summarize(cold) if cold else None, "warm": summarize(warm), "cold_starts": cold,
              "warm_starts": warm}
    if compare_with is not None:
        result["compare"] = {"source": compare_with, "warm": summarize(other), "warm_starts": other}
    if peer is not None:
        measured = [r["measured_s"] for r in peer_runs]
        result["llama_server"] = {"binary": peer.binary, "gguf": peer.gguf, "args": peer.args,
                                  "measured_s": _spread(measured), "starts": peer_runs,
                                  "warm_ratio": result["warm"]["measured_s"]["median"] / statistics.median(measured)}
    return result


def format_table(result: dict) -> str:
    cold, warm = result["cold"] or {"phases": {}}, result["warm"]
    lines = [f"{'phase':<22} {'cold min/med/max s':>22} {'warm min/med/max s':>22}"]
    names = list(dict.fromkeys([*cold["phases"], *warm["phases"]]))
    rows = [(n, cold["phases"].get(n), warm["phases"].get(n)) for n in names]
    rows += [("total (ledger)", cold.get("ledger_s"), warm["ledger_s"]),
             ("spawn -> /health 200", cold.get("measured_s"), warm["measured_s"])]
    if "llama_server" in result:
        rows.append(("llama-server", None, result["llama_server"]["measured_s"]))
    for name, c, w in rows:
        cell = [f"{s['min']:.2f}/{s['median']:.2f}/{s['max']:.2f}" if s else "-" for s in (c, w)]
        lines.append(f"{name:<22} {cell[0]:>22} {cell[1]:>22}")
    if "compare" in result:
        lines.append(_compare_table(result["compare"], warm))
    return "\n".join(lines)


def _compare_table(compare: dict, warm: dict) -> str:
    """Warm starts of the compared tree beside this one's, phase by phase (min/median/max s)."""
    other = compare["warm"]
    lines = [f"\nwarm starts, {compare['source']} vs this tree:",
             f"{'phase':<22} {'compared min/med/max s':>22} {'this min/med/max s':>22}"]
    names = list(dict.fromkeys([*other["phases"], *warm["phases"]]))
    rows = [(n, other["phases"].get(n), warm["phases"].get(n)) for n in names]
    rows.append(("spawn -> /health 200", other["measured_s"], warm["measured_s"]))
    for name, a, b in rows:
        cell = [f"{s['min']:.2f}/{s['median']:.2f}/{s['max']:.2f}" if s else "-" for s in (a, b)]
        lines.append(f"{name:<22} {cell[0]:>22} {cell[1]:>22}")
    return "\n".join(lines)


def summary_line(result: dict) -> str:
    w = result["warm"]["measured_s"]["median"]
    cold = f"cold {result['cold']['measured_s']['median']:.2f}s, " if result["cold"] else ""
    beside = ", beside a busy neighbour" if result.get("busy_neighbour") else ""
    line = (f"startup {result['model']}: {cold}warm {w:.2f}s to /health 200 (median of {result['runs']}{beside}; "
            f"load average {result['load_average']:.1f})")
    if "compare" in result:
        line += (f"; {result['compare']['source']}, interleaved: warm "
                 f"{result['compare']['warm']['measured_s']['median']:.2f}s")
    if "llama_server" in result:
        peer = result["llama_server"]
        line += (f"; llama-server {peer['measured_s']['median']:.2f}s on the same GGUF, interleaved: warm start "
                 f"{peer['warm_ratio']:.1f}x llama-server's")
    return line


def add_startup_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="HF dir or .gguf (default: built-in default model)")
    p.add_argument("--num-runs", "-n", type=int, default=3, help="warm starts (and cold ones, unless --cold-runs)")
    p.add_argument("--cold-runs", type=int, default=None, help="cold starts (default: --num-runs; 0: warm only)")
    p.add_argument("--serve-args", default="", help="extra `tokenmill serve` flags as one string, written with =, e.g. "
                                                    "--serve-args='--max-model-len 2048'")
    p.add_argument("--llama-server-bin", default=None, help="also time llama.cpp's llama-server (this binary) on "
                                                           "the same GGUF, one start after each warm start")
    p.add_argument("--llama-server-args", default="", help="extra llama-server flags as one string")
    p.add_argument("--busy-neighbour", action="store_true", help="run every start beside a process spinning on "
                                                                 "one core")
    p.add_argument("--compare-with", default=None, metavar="DIR",
                   help="another tokenmill source tree (e.g. a git worktree of an older commit): one warm start of "
                        "it beside each warm start of this one, interleaved, on the same cache")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")
    p.add_argument("--save-result", default=None, help="also write the JSON result to this file")
    p.set_defaults(func=startup_main)


def _peer(args: argparse.Namespace) -> Optional[Peer]:
    import shlex

    if args.llama_server_bin is None:
        return None
    if not os.access(args.llama_server_bin, os.X_OK):
        raise ValueError(f"--llama-server-bin {args.llama_server_bin}: not an executable file")
    if args.model is None:
        from tokenmill.models.default_model import default_model_path  # importlib.metadata: `bench --help` skips it

        gguf = default_model_path()
    elif args.model.endswith(".gguf") and os.path.isfile(args.model):
        gguf = args.model
    else:
        raise ValueError(f"--llama-server-bin needs a .gguf model (or the default one), not {args.model}")
    return Peer(args.llama_server_bin, gguf, shlex.split(args.llama_server_args))


def startup_main(args: argparse.Namespace) -> int:
    import shlex

    if args.num_runs < 1:
        raise ValueError("--num-runs must be at least 1")
    if args.cold_runs is not None and args.cold_runs < 0:
        raise ValueError("--cold-runs must be 0 or more")
    if args.compare_with is not None and not os.path.isfile(os.path.join(args.compare_with, "tokenmill", "cli.py")):
        raise ValueError(f"--compare-with {args.compare_with}: not a tokenmill source tree (no tokenmill/cli.py)")
    result = run_startup_bench(args.model, args.num_runs, shlex.split(args.serve_args), args.timeout,
                               cold_runs=args.cold_runs, peer=_peer(args), neighbour=args.busy_neighbour,
                               compare_with=os.path.abspath(args.compare_with) if args.compare_with else None)
    text = json.dumps(result, indent=2)
    print(text)
    if args.save_result:
        with open(args.save_result, "w") as f:
            f.write(text + "\n")
    print(format_table(result))
    print(summary_line(result))
    return 0
