"""One worker process per rank on this machine, joined by torch.distributed (gloo on CPU, NCCL on CUDA).

Two ZMQ channels over ipc:// in a private folder, both ordered:
- commands, parent XPUB -> every rank's SUB: [seq, kind, payload]. A step's SchedulerOutput is encoded once
  (tokenmill/step/) and published once; every rank receives the same bytes, steps and RPCs in one order.
- replies, every rank's PUSH -> parent PULL: [seq, kind, payload]. A step's result comes from the output rank
  only; an RPC's from every rank; an error from whichever rank raised.
A receiver thread resolves the pending calls' Futures; a death-watch thread fails every pending call when a
rank dies, and kills the other ranks, which would otherwise wait in a collective for the dead one.
"""
from __future__ import annotations

import logging
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Optional

import zmq

from tokenmill import step
from tokenmill.config import EngineConfig
from tokenmill.executor.base import (COLLECTIVE_FAILED, Executor, Method, WorkerDiedError, collective_failed,
                                     run_method)

logger = logging.getLogger("tokenmill")

STEP, RPC, QUIT = b"S", b"C", b"Q"                     # parent -> ranks
OUTPUT, RESULT, ERROR, READY, FAILED = b"O", b"R", b"E", b"Y", b"F"  # ranks -> parent
START_TIMEOUT_S = float(os.environ.get("TOKENMILL_WORKER_START_TIMEOUT_S", "900"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def describe_exit(code: Optional[int]) -> str:
    if code == COLLECTIVE_FAILED:
        return "exited after a collective failed (a peer hung or died; see its log)"
    if code is not None and code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            pass
    return f"exited with code {code}"


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.ranks = _Ranks(config, self.world_size, self.output_rank)
        # Worker processes never outlive this executor: garbage collection or interpreter exit ends them.
        self._finalizer = weakref.finalize(self, self.ranks.close)
        try:
            self.ranks.start()
        except BaseException:
            self.shutdown()
            raise

    def collective_rpc(self, method: Method, args: tuple = (), kwargs: dict | None = None) -> list:
        payload = pickle.dumps((method, tuple(args), kwargs or {}))
        return self._wait(self.ranks.submit(RPC, payload, self.world_size, as_list=True))

    def execute_model(self, scheduler_output, non_block: bool = False):
        fut = self.ranks.submit(STEP, step.encode(scheduler_output), 1, as_list=False)
        return fut if non_block else self._wait(fut)

    def _wait(self, fut: Future) -> Any:
        # No deadline on a step (a long prefill is legitimate): the receiver fails the future when a rank dies,
        # and the ranks' collectives time out; the loop guards against the receiver itself being gone.
        while True:
            try:
                return fut.result(timeout=1.0)
            except FutureTimeout:
                self.check_health()

    def check_health(self) -> None:
        self.ranks.check()

    def shutdown(self) -> None:
        self._finalizer()


class _Proc:
    """A rank's process, started with `python -c` rather than multiprocessing's spawn, which would re-run the
    user's script (an offline `LLM(..., tensor_parallel_size=2)` in a script without a __main__ guard). A pidfd
    (Linux >= 5.3) becomes readable when it exits; without one the death watch polls."""

    def __init__(self, rank: int, args: tuple, ipc_dir: str) -> None:
        self.rank = rank
        path = os.path.join(ipc_dir, f"rank{rank}.args")  # a file, not stdin: a pipe would block past 64 KiB
        with open(path, "wb") as f:
            pickle.dump((rank, *args), f)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))  # the parent's imports
        self.popen = subprocess.Popen([sys.executable, "-c", "from tokenmill.executor.multiproc import worker_entry; "
                                       "worker_entry()", path], stdin=subprocess.DEVNULL, env=env)
        self.pid = self.popen.pid
        try:
            self.fd: Optional[int] = os.pidfd_open(self.pid)
        except (AttributeError, OSError):
            self.fd = None

    def exited(self, events: dict) -> bool:
        return (self.fd in events) if self.fd is not None else self.popen.poll() is not None

    @property
    def exitcode(self) -> Optional[int]:
        try:
            return self.popen.wait(1)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.kill()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class _Ranks:
    """The worker processes and the two channels to them. Holds no reference to the executor, so the
    executor can be garbage collected (and its finalizer end the processes) while the receiver thread runs."""

    def __init__(self, config: EngineConfig, world_size: int, output_rank: int) -> None:
        self.config, self.world_size, self.output_rank = config, world_size, output_rank
        self.failure: Optional[BaseException] = None
        self.closing = False
        self.procs: list[_Proc] = []
        self.pending: dict[int, _Call] = {}
        self.lock = threading.Lock()
        self.seq = 0
        self.threads: list[threading.Thread] = []
        self.ipc_dir = tempfile.mkdtemp(prefix="tokenmill-mp-")
        self.ctx = zmq.Context()
        self.commands = self.ctx.socket(zmq.XPUB)
        self.commands.setsockopt(zmq.XPUB_VERBOSE, 1)  # one subscription message per rank, duplicates too
        self.commands.setsockopt(zmq.SNDHWM, 0)  # never drop a step, however far a rank falls behind
        self.commands.bind(f"ipc://{self.ipc_dir}/commands")
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.setsockopt(zmq.RCVHWM, 0)
        self.replies.setsockopt(zmq.RCVTIMEO, 100)  # the receiver looks at `closing` this often
        self.wake_r, self.wake_w = os.pipe()  # wakes the death watch at close
        self.replies.bind(f"ipc://{self.ipc_dir}/replies")

    # -- start-up ------------------------------------------------------------------------------------
    def start(self) -> None:
        init_method = f"tcp://127.0.0.1:{free_port()}"
        args = (self.config, init_method, f"ipc://{self.ipc_dir}/commands", f"ipc://{self.ipc_dir}/replies",
                os.getpid(), logging.getLogger("tokenmill").getEffectiveLevel())
        self.procs = [_Proc(rank, args, self.ipc_dir) for rank in range(self.world_size)]
        t0 = time.monotonic()
        self._wait_ready()
        logger.info("%d worker processes ready in %.1fs (mp executor)", self.world_size, time.monotonic() - t0)
        self.threads = [threading.Thread(target=self._receive, name="tokenmill-mp-receiver", daemon=True),
                        threading.Thread(target=self._watch, name="tokenmill-mp-watch", daemon=True)]
        for t in self.threads:
            t.start()

    def _wait_ready(self) -> None:
        """Until every rank has subscribed to the commands and built its Worker; a rank that fails or dies
        meanwhile raises here with its own message."""
        poller = zmq.Poller()
        poller.register(self.commands, zmq.POLLIN)
        poller.register(self.replies, zmq.POLLIN)
        self._register_procs(poller)
        subscribed, ready = 0, set()
        deadline = time.monotonic() + START_TIMEOUT_S
        while subscribed < self.world_size or len(ready) < self.world_size:
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker ranks {sorted(set(range(self.world_size)) - ready)} did not start "
                                   f"within {START_TIMEOUT_S:.0f}s")
            events = dict(poller.poll(self._poll_ms(1000)))
            if self.commands in events:
                subscribed += self.commands.recv()[:1] == b"\x01"
            if self.replies in events:
                _, kind, payload = self.replies.recv_multipart()
                rank, message = pickle.loads(payload)
                if kind == FAILED:
                    raise RuntimeError(f"worker rank {rank} failed to start: {message}")
                ready.add(rank)
            for p in self.procs:
                if p.exited(events) and not self.replies.poll(500):  # its last words (why it failed) come first
                    raise RuntimeError(f"worker rank {p.rank} (pid {p.pid}) {describe_exit(p.exitcode)} during "
                                       "start-up; see its log above")

    def _register_procs(self, poller) -> None:
        for p in self.procs:
            if p.fd is not None:
                poller.register(p.fd, zmq.POLLIN)

    def _poll_ms(self, ms: int) -> int:
        return ms if all(p.fd is not None for p in self.procs) else min(ms, 200)

    # -- calls ---------------------------------------------------------------------------------------
    def submit(self, kind: bytes, payload: bytes, expected: int, as_list: bool) -> Future:
        self.check()
        call = _Call(expected, as_list)
        with self.lock:
            self.seq += 1
            seq = self.seq
            self.pending[seq] = call
        self.commands.send_multipart([struct.pack("<Q", seq), kind, payload])
        return call.future

    def check(self) -> None:
        if self.failure is not None:
            raise self.failure
        if not self.closing and not all(t.is_alive() for t in self.threads):
            raise WorkerDiedError("the mp executor's receiver or watch thread is gone")

    def _receive(self) -> None:
        """Receiver thread: replies -> Futures (a blocking receive: the lowest latency per step)."""
        try:
            while not self.closing:
                try:
                    seq_b, kind, payload = self.replies.recv_multipart()
                except zmq.Again:  # RCVTIMEO: look at `closing` now and then
                    continue
                self._on_reply(struct.unpack("<Q", seq_b)[0], kind, payload)
        except zmq.ZMQError:
            if not self.closing:
                raise

    def _on_reply(self, seq: int, kind: bytes, payload: bytes) -> None:
        if kind == OUTPUT:
            rank, value = self.output_rank, step.decode_runner_output(payload)
        else:
            rank, value = pickle.loads(payload)
        with self.lock:  # whoever pops a call from `pending` owns its future
            call = self.pending.get(seq)
            if call is None:
                return  # it already failed (another rank's error, a death)
            done = kind == ERROR or call.add(rank, value)
            if done:
                del self.pending[seq]
        if kind == ERROR:
            call.future.set_exception(RuntimeError(f"worker rank {rank}: {value}"))
        elif done:
            call.resolve()

    def _watch(self) -> None:
        """Death-watch thread: a rank's pidfd becomes readable when it exits."""
        fds = [p.fd for p in self.procs if p.fd is not None] + [self.wake_r]
        while not self.closing:
            ready = select.select(fds, [], [], 0.2 if len(fds) <= len(self.procs) else None)[0]
            dead = [p for p in self.procs if (p.fd in ready if p.fd is not None else p.popen.poll() is not None)]
            if dead and not self.closing:
                self._on_death(dead[0])
                return

    def _on_death(self, p: _Proc) -> None:
        self.failure = WorkerDiedError(f"worker rank {p.rank} (pid {p.pid}) {describe_exit(p.exitcode)}; the "
                                       "engine cannot continue without it")
        logger.error("%s", self.failure)
        self._kill_all()
        with self.lock:
            calls, self.pending = list(self.pending.values()), {}
        for call in calls:
            call.future.set_exception(self.failure)

    # -- shutdown ------------------------------------------------------------------------------------
    def _kill_all(self) -> None:
        for p in self.procs:
            p.kill()
        for p in self.procs:
            p.exitcode  # reap

    def close(self) -> None:
        """Ask the ranks to quit, kill what is left after a few seconds, release the sockets."""
        if self.closing:
            return
        self.closing = True
        os.write(self.wake_w, b"x")
        if self.procs and self.failure is None:
            try:
                self.commands.send_multipart([struct.pack("<Q", 0), QUIT, b""], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            deadline = time.monotonic() + 5
            for p in self.procs:
                try:
                    p.popen.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        self._kill_all()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join(2)
        for p in self.procs:
            p.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.commands.close(linger=0)
        self.replies.close(linger=0)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)


class _Call:
    """A pending step or RPC: done when `expected` ranks have answered (a list in rank order, or the one
    result)."""

    def __init__(self, expected: int, as_list: bool) -> None:
        self.future: Future = Future()
        self.expected, self.as_list = expected, as_list
        self.results: dict[int, Any] = {}

    def add(self, rank: int, value: Any) -> bool:
        self.results[rank] = value
        return len(self.results) == self.expected

    def resolve(self) -> None:
        values = [self.results[r] for r in sorted(self.results)]
        self.future.set_result(values if self.as_list else values[0])


# -- the rank's process ------------------------------------------------------------------------------------
def _watch_parent(parent_pid: int) -> None:
    """A rank must not outlive the engine: exit once the parent is gone (even when it was SIGKILLed)."""
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)


def worker_entry() -> None:
    """A rank process's `python -c` entry: its arguments come pickled in the file named by argv[1]."""
    with open(sys.argv[1], "rb") as f:
        args = pickle.load(f)
    _worker_main(*args)


def _worker_main(rank: int, config: EngineConfig, init_method: str, commands_addr: str, replies_addr: str,
                 parent_pid: int, log_level: int) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group; the parent decides
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s %(name)s[rank {rank}]: %(message)s",
                        datefmt="%H:%M:%S")
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()
    ctx = zmq.Context()
    replies = ctx.socket(zmq.PUSH)
    replies.setsockopt(zmq.SNDHWM, 0)
    replies.connect(replies_addr)
    commands = ctx.socket(zmq.SUB)
    commands.setsockopt(zmq.RCVHWM, 0)
    commands.connect(commands_addr)
    commands.setsockopt(zmq.SUBSCRIBE, b"")
    worker, code = None, 1
    try:
        worker = _start_worker(rank, config, init_method)
        replies.send_multipart([b"", READY, pickle.dumps((rank, None))])
        code = _serve(rank, worker, commands, replies, config)
    except BaseException as e:  # noqa: BLE001 - the parent reports it; the traceback goes to this rank's log
        logger.error("%s:\n%s", "start-up failed" if worker is None else "failed", traceback.format_exc())
        if worker is None:
            replies.send_multipart([b"", FAILED, pickle.dumps((rank, f"{type(e).__name__}: {e}"))])
    finally:
        if worker is not None:
            worker.shutdown()
            if code != COLLECTIVE_FAILED:  # a broken world's teardown could wait on the lost peer
                # torch.distributed (~2 ms): the engine process imports this module too; only ranks need it
                from tokenmill.distributed import destroy_distributed

                destroy_distributed()
        replies.close(linger=2000)
        commands.close(linger=0)
        ctx.term()  # returns once the last replies (an error, a start-up failure) are delivered
    os._exit(code)  # skips the interpreter's slow teardown of torch (the engine waits on this exit)


def _start_worker(rank: int, config: EngineConfig, init_method: str):
    from tokenmill.worker.worker import Worker, init_worker_process  # models and layers: not in the engine process

    local_rank = rank % max(1, _cuda_count()) if config.device == "cuda" else 0
    init_worker_process(config, rank, init_method, local_rank)
    return Worker(config, rank=rank)


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def _serve(rank: int, worker, commands, replies, config: EngineConfig) -> int:
    """Run the commands in order until QUIT (returns 0) or a failed collective (returns COLLECTIVE_FAILED).
    Every rank runs every step; only the output rank answers it."""
    output_rank = (config.parallel.pipeline_parallel_size - 1) * config.parallel.tensor_parallel_size
    while True:
        seq, kind, payload = commands.recv_multipart()
        if kind == QUIT:
            return 0
        try:
            if kind == STEP:
                out = worker.execute_model(step.decode_scheduler_output(payload))
                if rank == output_rank:
                    replies.send_multipart([seq, OUTPUT, step.encode(out)])
            else:
                method, args, kwargs = pickle.loads(payload)
                replies.send_multipart([seq, RESULT, pickle.dumps((rank, run_method(worker, method, args, kwargs)))])
        except Exception as e:  # noqa: BLE001 - the engine decides (a failed step rolls its requests back)
            logger.error("%s failed:\n%s", "step" if kind == STEP else "rpc", traceback.format_exc())
            replies.send_multipart([seq, ERROR, pickle.dumps((rank, f"{type(e).__name__}: {e}"))])
            if collective_failed(e, config.parallel.world_size):
                return COLLECTIVE_FAILED
