"""`tokenmill serve --data-parallel-size N`: N engine replicas and the router in front of them, one command;
`tokenmill serve --disaggregate xPyD`: x prefill and y decode instances and the disaggregated router (router/disagg.py).

Each replica is a `tokenmill serve` subprocess with the user's engine flags on its own 127.0.0.1 port and
an equal share of the CPU threads (or its own GPU); the router listens on the user's --host/--port. The
replicas run in their own sessions so a terminal's Ctrl-C reaches only this process, which drains the
router first and then stops them; if this process dies they get SIGTERM from the kernel (Linux). An instance
whose process exits while serving is started again on its port with its command line (Replicas.heal), so the
router, which keeps probing its URL, takes it back once it is healthy.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
from typing import Optional

from tokenmill.config import check_data_parallel_size, peer_address
from tokenmill.fleet.admin import admin_mount
from tokenmill.fleet.launchers import cpu_count, free_port, start_serve_process, stop_process, thread_env
from tokenmill.http.cors import cors_config
from tokenmill.http.server import bind_listening_socket
from tokenmill.kv_transfer.p2p_params import advertised_host
from tokenmill.models.resolution import resolve_model_path
from tokenmill.router.app import add_router_policy_args, make_router, serve_router

logger = logging.getLogger("tokenmill")

# Flags that belong to the launcher and the router, not to a replica.
_LAUNCHER_DESTS = {"data_parallel_size", "router_policy", "router_load_weight", "router_prefix_chunk_chars",
                   "health_check_interval", "health_check_timeout", "prefill_timeout", "disaggregate", "host",
                   "port", "install_default_model", "func", "serve_parser", "command", "log_level", "help",
                   "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials"}


def add_data_parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data parallel")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="run N engine replicas (each its own process, threads split between them) behind a "
                        "router on --port")
    g.add_argument("--disaggregate", default=None, metavar="xPyD",
                   help="disaggregated prefill/decode: x prefill and y decode instances (e.g. 1P1D, 2P1D; threads "
                        "split between them) behind a router on --port that sends each request to both in turn")
    add_router_policy_args(g, policy_flag="--router-policy")


def flags_of(parser: argparse.ArgumentParser, args: argparse.Namespace, skip: set[str]) -> list[str]:
    """The command line that parses back to `args` (flags left at their defaults omitted)."""
    argv: list[str] = []
    for action in parser._actions:
        value = getattr(args, action.dest, None)
        if action.dest in skip or value == action.default or value is None:
            continue
        if not action.option_strings:  # positional
            argv += [str(v) for v in value] if isinstance(value, list) else [str(value)]
        elif isinstance(action, argparse.BooleanOptionalAction):
            argv.append(action.option_strings[0] if value else action.option_strings[1])
        elif action.nargs == 0:  # store_true / store_const
            argv.append(action.option_strings[0])
        elif isinstance(value, list) and action.nargs is None:  # append
            for v in value:
                argv += [action.option_strings[0], str(v)]
        else:
            argv += [action.option_strings[0], *map(str, value if isinstance(value, list) else [value])]
    return argv


def _gpus_for(n: int, device: str, flag: str = "--data-parallel-size") -> Optional[list[str]]:
    """One CUDA device per replica, or None to run on CPU."""
    if device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d for d in visible.split(",") if d] if visible else [str(i) for i in range(torch.cuda.device_count())]
    if len(ids) < n:
        raise ValueError(f"{flag} needs {n} GPUs (one per instance); {len(ids)} visible")
    return ids[:n]


class Replicas:
    """The replica subprocesses, kept running: heal() starts again any that exited."""

    QUICK_EXIT_S = 60.0  # an instance that exits this soon after its start is restarted after a growing pause

    def __init__(self, argv: list[str], n: int, gpus: Optional[list[str]], log_level: str,
                 extra: Optional[list[list[str]]] = None) -> None:
        """extra[i]: flags for replica i only."""
        self.ports = [free_port() for _ in range(n)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        threads = max(1, cpu_count() // n)
        self.argvs = [[*argv, *(extra[i] if extra else [])] for i in range(n)]
        self.envs = [{"CUDA_VISIBLE_DEVICES": gpus[i]} if gpus is not None else thread_env(threads) for i in range(n)]
        self.log_level = log_level
        self.procs: list[subprocess.Popen] = [self._start(i) for i in range(n)]
        self.started_at = [time.monotonic()] * n
        self.quick_exits = [0] * n              # exits in a row, each soon after its start
        self.restart_at: dict[int, float] = {}  # instances that exited -> when to start them again
        self.lock = threading.Lock()            # heal() and stop() never overlap
        self.stopping = False
        self.stopped = threading.Event()
        self.healer: Optional[threading.Thread] = None
        where = f"GPUs {','.join(gpus)}" if gpus is not None else \
            f"{os.environ.get('OMP_NUM_THREADS', threads)} threads each"
        logger.info("started %d replicas on ports %s (%s)", n, ", ".join(map(str, self.ports)), where)

    def _start(self, i: int) -> subprocess.Popen:
        return start_serve_process(self.argvs[i], "127.0.0.1", self.ports[i], self.log_level, self.envs[i])

    def keep_alive(self, interval: float = 1.0) -> None:
        """From now on, check every `interval` seconds for instances to start again (a daemon thread). The
        thread lives until stop() has stopped them: the kernel's PR_SET_PDEATHSIG signal follows the thread
        that started a process, not the process."""
        def run() -> None:
            while not self.stopped.wait(interval):
                with self.lock:
                    if not self.stopping:
                        self.heal()

        self.healer = threading.Thread(target=run, name="tokenmill-replicas-healer", daemon=True)
        self.healer.start()

    def heal(self, now: Optional[float] = None) -> None:
        """Start again, on its port and with its command line, each instance whose process has exited (the router
        keeps its URL and its role, and takes it back once a probe finds it healthy): at once, or after 2, 4 ...
        60 s while it keeps exiting within QUICK_EXIT_S of its start."""
        now = time.monotonic() if now is None else now
        for i, proc in enumerate(self.procs):
            if i in self.restart_at or proc.poll() is None:
                continue
            quick = now - self.started_at[i] < self.QUICK_EXIT_S
            self.quick_exits[i] = self.quick_exits[i] + 1 if quick else 0
            pause = min(2.0 ** self.quick_exits[i], 60.0) if self.quick_exits[i] else 0.0
            logger.warning("instance %s exited with status %s; starting it again%s", self.urls[i], proc.returncode,
                           f" in {pause:.0f}s" if pause else "")
            self.restart_at[i] = now + pause
        for i, at in sorted(self.restart_at.items()):
            if now >= at:
                del self.restart_at[i]
                self.procs[i] = self._start(i)
                self.started_at[i] = now

    def wait_healthy(self, timeout: float) -> None:
        import httpx

        logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every probe at INFO
        deadline = time.monotonic() + timeout
        pending = set(range(len(self.procs)))
        while pending:
            for i in sorted(pending):
                code = self.procs[i].poll()
                if code is not None:
                    raise RuntimeError(f"instance {i} exited with status {code} while starting "
                                       "(see its log above)")
                try:
                    if httpx.get(self.urls[i] + "/health", timeout=2).status_code == 200:
                        pending.discard(i)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"instances {sorted(pending)} not healthy after {timeout:.0f}s")
            time.sleep(0.25)

    def stop(self, timeout: float) -> None:
        with self.lock:
            self.stopping = True  # none is started again from here on
        for p in self.procs:  # all at once: they drain in parallel
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in self.procs:
            stop_process(p, max(0.1, deadline - time.monotonic()))
        self.stopped.set()
        if self.healer is not None:
            self.healer.join()


def _raise_on_sigterm(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM while the replicas start: stop them as Ctrl-C would


def run_data_parallel(args: argparse.Namespace) -> int:
    n = args.data_parallel_size
    check_data_parallel_size(n)
    # Validate the router's flags before starting anything; the replicas' URLs are known once they run.
    make_router(args, [f"http://127.0.0.1:{i + 1}" for i in range(n)])
    # Install / convert the model once here rather than racing N times in the replicas.
    resolve_model_path(args.model_flag or args.model, getattr(args, "install_default_model", False))
    argv = flags_of(args.serve_parser, args, _LAUNCHER_DESTS)
    return _serve_behind_router(args, argv, n, _gpus_for(n, args.device), None,
                                lambda urls: (make_router(args, urls), f"data parallel: {n} replicas"))


def _serve_behind_router(args: argparse.Namespace, argv: list[str], n: int, gpus, extra,
                         build_router) -> int:
    """Start n `tokenmill serve` instances (argv, plus extra[i] for instance i), wait until all are healthy,
    then serve build_router(urls) -> (router, description) on the user's --host/--port; stop them after."""
    cors = cors_config(args)  # the router's; a malformed flag fails before anything starts
    sock = bind_listening_socket(args.host, args.port)  # fail fast on a busy port
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    instances: Optional[Replicas] = None
    try:
        instances = Replicas(argv, n, gpus, args.log_level, extra)
        instances.wait_healthy(args.engine_start_timeout)
        instances.keep_alive()
        signal.signal(signal.SIGTERM, previous)  # the router's server handles signals from here on
        router, description = build_router(instances.urls)
        logger.info("%s behind the %s router on http://%s:%d", description, router.config.policy, args.host,
                    args.port)
        return serve_router(router, sock, args.api_key, args.shutdown_timeout, args.uvicorn_log_level,
                            not getattr(args, "no_dashboard", False), cors, max_body_bytes=args.max_request_body_bytes,
                            body_timeout=args.request_body_timeout,
                            mounts=[admin_mount(router, [], None, 300.0)])  # /admin/*, disabled (no admin key)
    finally:
        signal.signal(signal.SIGTERM, previous)
        sock.close()
        if instances is not None:
            instances.stop(args.shutdown_timeout + 10)


# -- tokenmill serve --disaggregate xPyD ----------------------------------------------------------------
def parse_disaggregate(value: str, data_parallel_size: int = 1) -> tuple[int, int]:
    """'2P1D' -> (2, 1): the numbers of prefill and decode instances."""
    if data_parallel_size != 1:
        raise ValueError("--disaggregate and --data-parallel-size cannot be combined; --disaggregate xPyD already "
                         "runs x + y instances")
    m = re.fullmatch(r"\s*(\d+)\s*[pP]\s*(\d+)\s*[dD]\s*", value)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"--disaggregate expects xPyD with x, y >= 1 (x prefill and y decode instances), "
                         f"e.g. 1P1D or 2P1D; got {value!r}")
    return int(m[1]), int(m[2])


def _kv_transfer_configs(args: argparse.Namespace, x: int, y: int) -> list[dict]:
    """--kv-transfer-config for each instance: the user's config (if any) with its role and a free port; the
    decode instances' allowed_peers list the prefill instances' KV addresses (they pull from no one else)."""
    base = args.kv_transfer_config
    base = dict(json.loads(base) if isinstance(base, str) else base or {})
    base.setdefault("kv_connector", "TokenmillConnector")
    configs = [{**base, "kv_role": "kv_producer" if i < x else "kv_consumer", "kv_port": free_port()}
               for i in range(x + y)]
    host = advertised_host(base.get("kv_host", "127.0.0.1"))
    extra = dict(base.get("kv_connector_extra_config") or {})
    extra["allowed_peers"] = [*extra.get("allowed_peers", []), *(peer_address(host, c["kv_port"]) for c in configs[:x])]
    for c in configs[x:]:
        c["kv_connector_extra_config"] = extra
    return configs


def run_disaggregated(args: argparse.Namespace) -> int:
    """x prefill (kv_producer) and y decode (kv_consumer) instances, then the disaggregated router."""
    x, y = parse_disaggregate(args.disaggregate, args.data_parallel_size)
    fake = [f"http://127.0.0.1:{i + 1}" for i in range(x + y)]
    make_router(args, [], fake[:x], fake[x:])  # the router's flags are checked before anything starts
    resolve_model_path(args.model_flag or args.model, getattr(args, "install_default_model", False))
    gpus = _gpus_for(x + y, args.device, f"--disaggregate {args.disaggregate}")
    extra = [["--kv-transfer-config", json.dumps(c)] for c in _kv_transfer_configs(args, x, y)]
    argv = flags_of(args.serve_parser, args, _LAUNCHER_DESTS | {"kv_transfer_config"})

    def build(urls):
        return (make_router(args, [], urls[:x], urls[x:]), f"disaggregated {args.disaggregate}: prefill on "
                f"{', '.join(urls[:x])}, decode on {', '.join(urls[x:])}")

    return _serve_behind_router(args, argv, x + y, gpus, extra, build)
