"""One trial: a real `tokenmill serve` subprocess with a configuration, driven by `tokenmill bench serve`'s
load generator (run_benchmark), recorded as JSON in the output directory under the configuration's hash.

A server that exits or does not answer /health in time is a failed start, recorded with the last lines of
its log; a run in which no request completes is a failed benchmark. Trials of the same server flags at
different loads reuse one server (each run on it gets fresh prompts, so its prefix cache flatters none).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional

from tokenmill.bench.report import slo_violations
from tokenmill.bench.serve import ServeConfig, run_benchmark
from tokenmill.tune.space import config_key, describe, serve_command, serve_flags, server_part

logger = logging.getLogger("tokenmill")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _log_tail(path: str, lines: int = 6) -> str:
    try:
        with open(path, errors="replace") as f:
            tail = [ln.rstrip() for ln in f.readlines() if ln.strip()][-lines:]
    except OSError:
        return ""
    return " | ".join(tail)


class ServerProcess:
    """`tokenmill serve <args> --port N` in its own process group; `error` says why it did not come up."""

    def __init__(self, model: Optional[str], args: list[str], log_path: str, startup_timeout: float) -> None:
        import httpx

        logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every health poll at INFO
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.error: Optional[str] = None
        self.runs = 0  # benchmark runs served so far (each takes new prompts)
        cmd = [sys.executable, "-m", "tokenmill.cli", "serve", *([model] if model else []), *args,
               "--host", "127.0.0.1", "--port", str(self.port)]
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.error = f"server exited with status {self.proc.returncode}: {_log_tail(log_path)}"
                return
            try:
                if httpx.get(self.url + "/health", timeout=2, trust_env=False).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.error = f"server not healthy after {startup_timeout:g}s: {_log_tail(log_path)}"
        self.stop()

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to the server's process group (data-parallel replicas included), SIGKILL if it lingers."""
        if self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class TrialRunner:
    """Runs and records trials in `out_dir` (trials/<hash>.json, logs/<hash>.log); a trial whose JSON exists
    is read back instead of measured."""

    def __init__(self, model: Optional[str], fixed_args: list[str], workload: ServeConfig, out_dir: str,
                 tokenizer=None, startup_timeout: float = 600.0) -> None:
        self.model, self.fixed_args, self.workload = model, fixed_args, workload
        self.out_dir, self.tokenizer, self.startup_timeout = out_dir, tokenizer, startup_timeout
        self.server_starts = 0
        self._server: Optional[ServerProcess] = None
        self._server_flags: Optional[list[str]] = None
        self._failed: dict[tuple[str, ...], ServerProcess] = {}  # flags that did not start: not retried
        for sub in ("trials", "logs"):
            os.makedirs(os.path.join(out_dir, sub), exist_ok=True)

    def trial_path(self, key: str) -> str:
        return os.path.join(self.out_dir, "trials", f"{key}.json")

    def trial_key(self, config: dict[str, Any], num_prompts: int) -> str:
        return config_key(config, [self.model, self.fixed_args, num_prompts, _workload_id(self.workload)])

    def load(self, key: str) -> Optional[dict]:
        path = self.trial_path(key)
        if not os.path.exists(path):
            return None
        with open(path) as f:
            return json.load(f)

    def server(self, config: dict[str, Any]) -> ServerProcess:
        """A healthy server for config's flags (the running one if its flags are the same), or one whose
        `error` says why it could not start."""
        flags = serve_flags(config)
        if self._server is not None and self._server_flags == flags:
            return self._server
        if tuple(flags) in self._failed:
            return self._failed[tuple(flags)]
        self.close()
        self.server_starts += 1
        log = os.path.join(self.out_dir, "logs", f"{config_key(server_part(config))}.log")
        server = ServerProcess(self.model, [*self.fixed_args, *flags], log, self.startup_timeout)
        if server.error is None:
            self._server, self._server_flags = server, flags
        else:
            self._failed[tuple(flags)] = server
        return server

    def close(self) -> None:
        if self._server is not None:
            self._server.stop()
        self._server = self._server_flags = None

    def run(self, config: dict[str, Any], num_prompts: int, rung: int = 0) -> dict[str, Any]:
        """The trial's record: measured now, or read back from an earlier run."""
        key = self.trial_key(config, num_prompts)
        rec = self.load(key)
        if rec is not None:
            rec["resumed"] = True
            return rec
        t0 = time.perf_counter()
        rec = {"key": key, "config": config, "label": describe(config), "rung": rung, "num_prompts": num_prompts,
               "command": serve_command(self.model, self.fixed_args, config), "status": "ok", "reason": None,
               "violations": [], "summary": None}
        server = self.server(config)
        if server.error is not None:
            rec.update(status="failed_start", reason=server.error)
        else:
            rec.update(measure(server, self.workload, config, num_prompts, self.tokenizer))
        rec["wall_s"] = time.perf_counter() - t0
        with open(self.trial_path(key), "w") as f:
            json.dump(rec, f, indent=1, default=str)
        return rec


def _workload_id(w: ServeConfig) -> dict[str, Any]:
    d = dataclasses.asdict(w)
    for k in ("base_url", "model", "progress", "api_key", "num_prompts", "max_concurrency", "request_rate"):
        d.pop(k, None)
    return d


def measure(server: ServerProcess, workload: ServeConfig, config: dict[str, Any], num_prompts: int,
            tokenizer=None) -> dict[str, Any]:
    """One benchmark run against a healthy server: {status, reason, violations, summary, requests}."""
    cfg = dataclasses.replace(workload, base_url=server.url, num_prompts=num_prompts,
                              max_concurrency=config.get("max_concurrency"),
                              request_rate=config.get("request_rate") or float("inf"),
                              extra_body=dict(workload.extra_body), slo=dict(workload.slo))
    seed = workload.seed + 7919 * server.runs  # a reused server never sees the same prompts twice
    server.runs += 1
    try:
        result = run_benchmark(cfg, tokenizer, seed=seed, title=describe(config))
    except (RuntimeError, ValueError, OSError) as e:
        return {"status": "bench_failed", "reason": str(e)}
    s = result["summary"]
    if not s["completed"]:
        return {"status": "bench_failed", "reason": f"no request completed (errors: {s['errors']})", "summary": s}
    return {"summary": s, "violations": slo_violations(s, workload.slo) if workload.slo else [],
            "requests": result["requests"]}
