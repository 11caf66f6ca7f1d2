"""Launchers: how the router's fleet (fleet.py) starts and stops `tokenmill serve` replicas.

A launcher's start(argv) runs `tokenmill serve <argv>` on a free port and returns a handle (its URL, alive(),
stop() = SIGTERM then SIGKILL after a timeout, kill() = SIGKILL now) without waiting for it to be healthy.
LocalLauncher runs subprocesses on this machine (the same code `tokenmill serve --data-parallel-size N`
uses); RayLauncher runs each one from a Ray actor placed on a node of a Ray cluster, which is how a fleet
spans machines. Handles are blocking: the fleet calls them from a worker thread.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
from typing import Optional, Protocol

logger = logging.getLogger("tokenmill")

# Flags a launch spec may not set: the launcher picks the address, and one spec is one engine.
_RESERVED = ("--host", "--port", "--data-parallel-size", "-dp", "--disaggregate")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def thread_env(threads: int) -> dict[str, str]:
    """OMP_NUM_THREADS for one replica's engine, unless the user set their own (which is then per replica)."""
    return {} if "OMP_NUM_THREADS" in os.environ else {"OMP_NUM_THREADS": str(max(1, threads))}


def start_serve_process(argv: list[str], host: str, port: int, log_level: str = "info",
                        env: Optional[dict[str, str]] = None) -> subprocess.Popen:
    """`tokenmill serve <argv> --host host --port port` in its own session (a terminal's Ctrl-C reaches only
    the parent, which stops it in order), sent SIGTERM by the kernel if the parent dies (Linux)."""
    cmd = [sys.executable, "-m", "tokenmill.cli", "--log-level", log_level, "serve", *argv, "--host", host,
           "--port", str(port)]
    return subprocess.Popen(cmd, env={**os.environ, **(env or {})}, start_new_session=True,
                            preexec_fn=_die_with_parent)


def stop_process(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM (the server drains), then SIGKILL if it has not exited after `timeout` seconds."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        logger.warning("replica %d did not stop in %.0fs; killing it", proc.pid, timeout)
        proc.kill()
        proc.wait()


def parse_launch(command: str, flag: str = "--launch") -> list[str]:
    """'tokenmill serve MODEL --flag ...' -> the serve arguments ['MODEL', '--flag', ...], checked by the
    serve parser so a typo fails here and not in every replica."""
    words = shlex.split(command)
    if words[:2] != ["tokenmill", "serve"]:
        raise ValueError(f"{flag} expects a `tokenmill serve ...` command, got {command!r}")
    argv = words[2:]
    reserved = [w.split("=", 1)[0] for w in argv if w.split("=", 1)[0] in _RESERVED]
    if reserved:
        raise ValueError(f"{flag}: {reserved[0]} is set by the launcher (one engine per replica, on a free port); "
                         "leave it out")
    # inside: the serve parser imports the OpenAI app (and its engine client) only where a command is launched
    from tokenmill.fleet.serve_command import check_serve_argv

    try:
        check_serve_argv(argv)
    except ValueError as e:
        raise ValueError(f"{flag} {command!r} is not a valid `tokenmill serve` command: {e}") from None
    return argv


class ReplicaHandle(Protocol):
    url: str
    pid: int      # of the `tokenmill serve` process, on its node

    def alive(self) -> bool: ...
    def stop(self, timeout: float) -> None: ...
    def kill(self) -> None: ...


class Launcher(Protocol):
    name: str

    def start(self, argv: list[str]) -> ReplicaHandle: ...
    def close(self) -> None: ...


class LocalHandle:
    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc = proc
        self.url = url
        self.pid = proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float) -> None:
        stop_process(self.proc, timeout)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class LocalLauncher:
    """Replicas as subprocesses of the router on 127.0.0.1, each with `threads` CPU threads
    (OMP_NUM_THREADS, unless the user set it)."""
    name = "local"

    def __init__(self, threads: int, log_level: str = "info") -> None:
        self.threads = max(1, threads)
        self.log_level = log_level

    def start(self, argv: list[str]) -> LocalHandle:
        port = free_port()
        proc = start_serve_process(argv, "127.0.0.1", port, self.log_level, thread_env(self.threads))
        return LocalHandle(proc, f"http://127.0.0.1:{port}")

    def close(self) -> None:
        pass


# -- Ray -------------------------------------------------------------------------------------------------
class ServeActor(LocalHandle):
    """Runs in a Ray actor on some node: one `tokenmill serve` subprocess there, on the node's address (so the
    router on another machine reaches it). A replica's lifetime is the actor's: killing the actor's worker
    sends the subprocess SIGTERM (PR_SET_PDEATHSIG)."""

    def __init__(self, argv: list[str], threads: int, log_level: str) -> None:
        import ray

        host = ray.util.get_node_ip_address()
        port = free_port(host)
        super().__init__(start_serve_process(argv, host, port, log_level, thread_env(threads)),
                         f"http://{host}:{port}")

    def address(self) -> tuple[str, int]:
        return self.url, self.proc.pid


class RayHandle:
    def __init__(self, actor) -> None:
        import ray

        self.actor = actor
        self.url, self.pid = ray.get(actor.address.remote())

    def _call(self, method: str, *args, timeout: Optional[float] = None):
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def alive(self) -> bool:
        import ray

        try:
            return self._call("alive", timeout=10)
        except (ray.exceptions.RayError, TimeoutError):  # its actor (or node) is gone
            return False

    def stop(self, timeout: float) -> None:
        self._end("stop", timeout)

    def kill(self) -> None:
        self._end("kill")

    def _end(self, method: str, *args) -> None:
        import ray

        try:
            self._call(method, *args, timeout=(args[0] + 10) if args else 30)
        except (ray.exceptions.RayError, TimeoutError) as e:
            logger.warning("replica %s: %s through its Ray actor failed (%s); killing the actor", self.url,
                           method, e)
        ray.kill(self.actor)


class RayLauncher:
    """Replicas as Ray actors (1 CPU and `num_gpus` GPUs each, which Ray makes the replica's
    CUDA_VISIBLE_DEVICES; `threads` CPU threads for the engine) on the cluster at `address` (None: the cluster
    this process is connected to, else a local one)."""
    name = "ray"

    def __init__(self, address: Optional[str], threads: int, log_level: str = "info", num_gpus: float = 0) -> None:
        import ray

        if not ray.is_initialized():
            ray.init(address=address, include_dashboard=False, log_to_driver=True)
        self.actor_class = ray.remote(num_cpus=1, num_gpus=num_gpus)(ServeActor)
        self.threads = threads
        self.log_level = log_level

    def start(self, argv: list[str]) -> RayHandle:
        return RayHandle(self.actor_class.remote(argv, self.threads, self.log_level))

    def close(self) -> None:
        pass


def make_launcher(kind: str, ray_address: Optional[str], threads: int, log_level: str = "info",
                  ray_num_gpus: float = 0) -> Launcher:
    if kind == "ray":
        return RayLauncher(ray_address, threads, log_level, ray_num_gpus)
    if ray_address or ray_num_gpus:
        raise ValueError("--ray-address and --ray-num-gpus need --launcher ray")
    return LocalLauncher(threads, log_level)
