"""The engine core in its own process: a loop around EngineCore.step() fed over ZMQ.

Input (API -> engine, PUSH/PULL): multipart frames [kind, msgpack payload]; kinds ADD (list of
EngineCoreRequest), ABORT (list of engine request ids), SHUTDOWN.
Output (engine -> API, PUSH/PULL): one msgpack-encoded `EngineCoreOutputs` per step, carrying the step's
outputs, the engine stats after it, which requests were scheduled for the first time, and rejections.

A thread of its own reads the input socket (Inbox), so that a request arriving during a step is seen at once:
under --scheduling-policy priority a better-ranked one cuts the step short (step/interrupt.py). When nothing is
running the loop blocks on the inbox (no spinning: the API process needs the cores), waking once a second only
to notice a dead parent. On going idle it hands the heap's freed pages back to the
system (glibc keeps them otherwise: a burst of requests of mixed sizes would hold the process at its high-water
mark for good).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import queue
import shutil
import signal
import sys
import threading
import time
import traceback
from typing import Optional

import msgspec

from tokenmill.messages import EngineCoreOutput, EngineCoreRequest, EngineStats
from tokenmill.startup import Ledger, Phase

logger = logging.getLogger("tokenmill")

ADD, ABORT, SHUTDOWN = b"A", b"X", b"S"
_IDLE_POLL_S = 1.0


@functools.cache
def _malloc_trim():
    libc = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None


def _trim_heap() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim; a no-op elsewhere)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class EngineReady(msgspec.Struct, array_like=True):
    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    pid: int
    kernels: dict = {}  # worker/kernels_report.py: the kernels in use and any fallbacks
    startup: list[Phase] = []  # this process's and the output rank's start-up phases (startup.py)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: Optional[EngineStats] = None
    timestamp: float = 0.0
    scheduled: list[tuple[str, float]] = []   # (engine request id, wall time it was first scheduled)
    rejected: list[tuple[str, str]] = []      # (engine request id, why add_request refused it)
    ready: Optional[EngineReady] = None       # first message only
    fatal: Optional[str] = None               # the engine is about to exit
    fatal_exit: bool = False                  # ... and the server with it: a worker rank died (no restart)


def run_engine_core(config, input_addr: str, output_addr: str, parent_pid: int, log_level: int,
                    ipc_dir: Optional[str] = None, ledger: Optional[Ledger] = None) -> None:
    """Process entry point (multiprocessing spawn target, or engine/prestart.py's process once it has its
    arguments). ipc_dir: the API process's socket folder, removed here if that process died without doing so
    (kill -9). ledger: a prestarted process's start-up ledger (its imports already in it)."""
    # The API process owns shutdown (SIGTERM drain, Ctrl-C): the engine keeps serving until told to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[engine]: %(message)s",
                        datefmt="%H:%M:%S")
    import zmq

    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 5000)
    out.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    code = 0
    try:
        from tokenmill.engine.core import EngineCore  # imports torch: the API process imports this module

        if ledger is None:  # interpreter, spawn bootstrap (unpickling the config) and imports, up to here
            ledger = Ledger("engine")
            ledger.mark("engine process start", ledger.origin)
        engine = EngineCore(config, ledger)
        out.send(encoder.encode(EngineCoreOutputs(ready=EngineReady(
            engine.scheduler.kv.num_blocks, config.cache.block_size, config.model.max_model_len,
            engine.vocab_size, os.getpid(), engine.executor.kernels(), ledger.phases))))
        _EngineLoop(engine, inp, out, encoder, parent_pid).run()
        engine.shutdown()  # worker ranks and KV connectors, explicitly: the exit below skips interpreter teardown
    except Exception as e:  # noqa: BLE001 - report anything to the API process before dying
        from tokenmill.executor.base import WorkerDiedError  # the API process imports this module without it

        died = isinstance(e, WorkerDiedError)  # its message says it all; a traceback would bury it
        logger.error("engine core failed:%s", f" {e}" if died else f"\n{traceback.format_exc()}")
        try:
            out.send(encoder.encode(EngineCoreOutputs(fatal=f"{type(e).__name__}: {e}", fatal_exit=died)))
        except zmq.ZMQError:
            pass
        code = 1
    finally:
        inp.close(linger=0)
        out.close(linger=0 if os.getppid() != parent_pid else 5000)
        ctx.term()
        if ipc_dir is not None and os.getppid() != parent_pid:
            shutil.rmtree(ipc_dir, ignore_errors=True)
    if code != 0:
        sys.exit(code)
    # A clean stop: everything is closed. Skip the interpreter's teardown, which walks every object of torch
    # and the model (about a second of a server's Ctrl-C, which waits for this process, more on a busy machine).
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


class Inbox:
    """The input socket, read and decoded by a thread of its own into a queue the engine loop drains between
    steps. Each arriving request's priority is offered to the step in flight at once (interrupt: the engine's
    StepInterrupt, or None). The thread alone touches the socket until close()."""

    def __init__(self, sock, interrupt) -> None:
        self.sock, self.interrupt = sock, interrupt
        self.queue: queue.Queue = queue.Queue()
        self.add_decoder = msgspec.msgpack.Decoder(list[EngineCoreRequest])
        self.ids_decoder = msgspec.msgpack.Decoder(list[str])
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._read, name="engine-input", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        try:
            while not self.closing.is_set():
                if not self.sock.poll(100):
                    continue
                frames = self.sock.recv_multipart()
                kind = frames[0]
                if kind == ADD:
                    reqs = self.add_decoder.decode(frames[1])
                    if self.interrupt is not None:
                        for req in reqs:
                            self.interrupt.offer(req.priority)
                    self.queue.put((ADD, reqs))
                elif kind == ABORT:
                    self.queue.put((ABORT, self.ids_decoder.decode(frames[1])))
                elif kind == SHUTDOWN:
                    self.queue.put((SHUTDOWN, None))
                    return
        except Exception as e:  # noqa: BLE001 - a bad message or a broken socket ends the engine, in its loop
            self.queue.put((None, e))

    def get(self, timeout: Optional[float] = None):
        """The next (kind, payload), waiting up to timeout seconds (None: not at all); None if there is none."""
        try:
            return self.queue.get(timeout=timeout) if timeout else self.queue.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        self.closing.set()
        self.thread.join()


class _EngineLoop:
    def __init__(self, engine, inp, out, encoder, parent_pid: int) -> None:
        self.engine = engine
        self.inbox = Inbox(inp, engine.step_interrupt)
        self.out, self.encoder = out, encoder
        self.parent_pid = parent_pid
        self.seen: set[str] = set()       # requests already reported as scheduled
        self.rejected: list[tuple[str, str]] = []
        self.stopping = False
        self.stats_sent: Optional[EngineStats] = None

    def run(self) -> None:
        try:
            self._loop()
        finally:
            self.inbox.close()  # before the socket closes

    def _loop(self) -> None:
        engine = self.engine
        while not self.stopping:
            if os.getppid() != self.parent_pid:
                logger.warning("API process is gone; engine exiting")
                return
            if not engine.has_unfinished_requests():
                engine.check_health()  # a worker rank that died while idle ends the engine within a poll
                stats = engine.stats()
                if stats != self.stats_sent or self.rejected:  # tell the API we are idle now
                    self._send([], stats, [])
                    _trim_heap()
                message = self.inbox.get(_IDLE_POLL_S)
                if message is None:
                    continue
                self._take(*message)
            self._drain_input()
            if self.stopping:
                return
            if engine.has_unfinished_requests():
                t = time.time()
                outputs = engine.step()
                self._send(outputs, engine.stats(), self._newly_scheduled(outputs, t))
            elif self.rejected:
                self._send([], engine.stats(), [])

    def _drain_input(self) -> None:
        while not self.stopping:
            message = self.inbox.get()
            if message is None:
                return
            self._take(*message)

    def _take(self, kind: Optional[bytes], payload) -> None:
        if kind == ADD:
            for req in payload:
                try:
                    self.engine.add_request(req)
                except ValueError as e:
                    self.rejected.append((req.request_id, str(e)))
        elif kind == ABORT:
            self.engine.abort_requests(payload)
        elif kind == SHUTDOWN:
            self.stopping = True
        else:
            raise payload  # the input thread's error

    def _newly_scheduled(self, outputs: list[EngineCoreOutput], step_start: float) -> list[tuple[str, float]]:
        """Requests that ran for the first time in this step (queue-time metric). A request either is
        still running after the step or reported an output in it."""
        new = []
        for r in self.engine.scheduler.running:
            if r.request_id not in self.seen:
                self.seen.add(r.request_id)
                new.append((r.request_id, step_start))
        for o in outputs:
            if o.finish_reason is not None:
                if o.request_id not in self.seen and o.new_token_ids:
                    new.append((o.request_id, step_start))
                self.seen.discard(o.request_id)
        return new

    def _send(self, outputs, stats: EngineStats, scheduled) -> None:
        rejected, self.rejected = self.rejected, []
        self.out.send(self.encoder.encode(EngineCoreOutputs(outputs, stats, time.time(), scheduled, rejected)))
        self.stats_sent = stats
