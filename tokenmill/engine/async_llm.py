"""AsyncLLM: the API process's side of the engine. Starts the engine core in its own process
(engine/core_proc.py), sends it requests over ZMQ, and runs one asyncio output loop that detokenizes
what comes back (OutputProcessor) and routes the deltas to a per-request asyncio queue.

Nothing here blocks the event loop on the engine: sends are fire-and-forget ZMQ messages and the output
loop awaits its socket. If the engine process dies, every open request fails at once with
EngineDeadError and new ones are refused.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import AsyncIterator, Optional, Union

import msgspec
import zmq
import zmq.asyncio

from tokenmill.config import EngineConfig
from tokenmill.messages import EngineStats, FinishReason, check_fits, check_priority, check_token_ids
from tokenmill.engine.core_proc import ABORT, ADD, SHUTDOWN, EngineCoreOutputs, EngineReady, run_engine_core
from tokenmill.engine.frontend import eos_token_ids, fan_out, load_tokenizer
from tokenmill.engine.output_processor import OutputProcessor, RequestState
from tokenmill.engine.prestart import ENGINE_PROCESS_NAME, PrestartedEngine, engine_env
from tokenmill.lora import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.startup import Ledger, timed
from tokenmill.step.kv_groups import kv_layout
from tokenmill.step.multimodal import ImageInput

logger = logging.getLogger("tokenmill")


class EngineDeadError(RuntimeError):
    """The engine process is gone; the server cannot generate until it is restarted."""


class RequestRejectedError(ValueError):
    """The engine refused a request (it would never fit, its grammar does not compile); the message says why."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request (and only this one: the engine keeps serving)."""


class AsyncLLM:
    def __init__(self, config: EngineConfig, tokenizer=None, stat_logger=None, log_level: int = logging.INFO,
                 ledger: Optional[Ledger] = None, prestarted: Optional[PrestartedEngine] = None) -> None:
        """Starts the engine process at once (or hands `prestarted`, a process already importing, its
        arguments); `tokenizer` None loads the model's own while the engine process starts up (the two
        overlap). ledger (startup.Ledger) gets the "tokenizer" phase; the engine's own phases arrive with its
        ready message (self.ready.startup)."""
        self.config = config
        self.kv_layout = kv_layout(config)  # KV groups, as the engine's scheduler has them (for check_fits)
        self.stat_logger = stat_logger  # duck-typed: serve.metrics.ServerMetrics
        self.unscheduled: set[str] = set()  # engine ids sent but not yet run: the waiting queue as we know it
        self.stats: Optional[EngineStats] = None
        self.ready: Optional[EngineReady] = None
        self.dead: Optional[str] = None
        self.fatal: Optional[str] = None  # why the engine cannot be restarted (a worker rank died): the server stops
        self._shutting_down = False
        self._closing_reason: Optional[str] = None  # set when open requests were cut for shutdown
        self._closed = False
        self._output_task: Optional[asyncio.Task] = None
        self._decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._encoder = msgspec.msgpack.Encoder()

        self.log_level = log_level
        self.num_restarts = 0
        self._backoff = RestartBackoff()
        self._start_timeout = 600.0
        self._restart_task: Optional[asyncio.Task] = None
        self._watched_fd: Optional[int] = None  # the running engine's sentinel, watched by _on_engine_exit
        remove_stale_ipc_dirs()
        self._ipc_dir = tempfile.mkdtemp(prefix=f"{IPC_PREFIX}{os.getpid()}-")
        self._ctx = zmq.asyncio.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._in.bind(f"ipc://{self._ipc_dir}/input")
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(f"ipc://{self._ipc_dir}/output")
        self.proc = self._spawn(prestarted)
        try:
            with timed(ledger, "tokenizer"):
                self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config)
            if self.tokenizer is None:
                raise ValueError("the server needs a tokenizer (detokenization happens in the API process)")
        except BaseException:
            self.shutdown_sync(timeout=2)
            raise
        self.eos_token_ids = eos_token_ids(config, self.tokenizer)
        self.processor = OutputProcessor(self.tokenizer)

    # -- lifecycle -----------------------------------------------------------------------------
    def _spawn(self, prestarted: Optional[PrestartedEngine] = None) -> multiprocessing.Process:
        args = (self.config, f"ipc://{self._ipc_dir}/input", f"ipc://{self._ipc_dir}/output", os.getpid(),
                self.log_level, self._ipc_dir)
        if prestarted is not None:
            proc = prestarted.launch(args)
        else:
            proc = multiprocessing.get_context("spawn").Process(target=run_engine_core, name=ENGINE_PROCESS_NAME,
                                                                args=args)
            with engine_env():
                proc.start()
        logger.info("engine core process started (pid %d)", proc.pid)
        return proc

    async def start(self, timeout: float = 600.0) -> None:
        """Wait for the engine to load its model, then start the output loop."""
        self._start_timeout = timeout
        loop = asyncio.get_running_loop()
        died = loop.create_future()
        loop.add_reader(self.proc.sentinel, lambda: died.done() or died.set_result(None))
        try:
            self.ready = await self._wait_ready(died, timeout)
        finally:
            loop.remove_reader(self.proc.sentinel)
        self._watch_exit(self.proc)
        self._backoff.on_ready(time.monotonic())
        self._output_task = asyncio.create_task(self._output_loop(), name="tokenmill-output-loop")
        logger.info("engine ready: %d KV blocks of %d tokens", self.ready.num_blocks, self.ready.block_size)

    async def _wait_ready(self, died: asyncio.Future, timeout: float) -> EngineReady:
        """The engine's ready message. Outputs a previous engine sent just before it died may still be queued on
        the shared socket ahead of it: they are dropped (read as a failed start, they once cost a restart)."""
        deadline = time.monotonic() + timeout
        while True:
            recv = asyncio.ensure_future(self._out.recv())
            done, _ = await asyncio.wait([recv, died], timeout=max(deadline - time.monotonic(), 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
            if recv not in done:
                recv.cancel()
                if died.done():
                    self.proc.join(1)
                    raise RuntimeError(f"engine core process exited during startup (exit code "
                                       f"{self.proc.exitcode}); see the log above")
                raise RuntimeError(f"engine core did not become ready within {timeout:.0f}s")
            msg = self._decoder.decode(recv.result())
            if msg.ready is not None:
                return msg.ready
            if msg.fatal is not None:
                raise RuntimeError(f"engine core failed to start: {msg.fatal}")

    def _watch_exit(self, proc: multiprocessing.Process) -> None:
        """Call _on_engine_exit(proc) once that engine process ends. One watch at a time, removed by the fd it
        was added with: removing it by `self.proc.sentinel` after a restart had replaced self.proc once left the
        dead engine's fd watched (the API process spinning on it) and marked every new engine dead at once."""
        self._unwatch_exit()
        asyncio.get_running_loop().add_reader(proc.sentinel, self._on_engine_exit, proc)
        self._watched_fd = proc.sentinel

    def _unwatch_exit(self) -> None:
        if self._watched_fd is not None:
            with contextlib.suppress(ValueError, OSError):
                asyncio.get_running_loop().remove_reader(self._watched_fd)
            self._watched_fd = None

    async def shutdown(self, timeout: float = 10.0) -> None:
        if self._shutting_down:
            return
        self._shutting_down = True
        loop = asyncio.get_running_loop()
        self._unwatch_exit()
        if self.proc.is_alive():
            try:
                await asyncio.wait_for(self._in.send_multipart([SHUTDOWN]), 1.0)
            except (asyncio.TimeoutError, zmq.ZMQError):
                pass
            await loop.run_in_executor(None, self.proc.join, timeout)
        for task in (self._output_task, self._restart_task):
            if task is not None:
                task.cancel()
        self._fail_all(EngineDeadError("the server is shutting down"))
        self._close()

    def shutdown_sync(self, timeout: float = 10.0) -> None:
        """For use without an event loop (startup failures, atexit); a no-op after shutdown()."""
        if self._closed:
            return
        self._shutting_down = True
        if self.proc.is_alive():
            try:
                sock = zmq.Context.instance().socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.connect(f"ipc://{self._ipc_dir}/input")
                sock.send_multipart([SHUTDOWN])
                sock.close()
            except zmq.ZMQError:
                pass
            self.proc.join(timeout)
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.proc.is_alive():
            logger.warning("engine core did not exit; killing it")
            self.proc.kill()
            self.proc.join(5)
        self._in.close(linger=0)
        self._out.close(linger=0)
        self._ctx.term()
        shutil.rmtree(self._ipc_dir, ignore_errors=True)

    def _on_engine_exit(self, proc: multiprocessing.Process) -> None:
        self._unwatch_exit()
        if self._shutting_down or proc is not self.proc:
            return
        # Give the output loop a moment to read the engine's own last words (a fatal error message).
        asyncio.get_running_loop().call_later(0.2, self._mark_dead_exited, proc)

    def _mark_dead_exited(self, proc: multiprocessing.Process) -> None:
        if self.dead is None and not self._shutting_down and proc is self.proc:
            proc.join(0.5)
            self._mark_dead(f"the engine process exited unexpectedly (exit code {proc.exitcode})")

    def _mark_dead(self, reason: str, restart: bool = True) -> None:
        if self.dead is not None:
            return
        self.dead = reason
        self._unwatch_exit()  # this engine is done with: the restart ends and replaces it
        logger.error("engine is dead: %s; failing %d open request(s) and %s", reason, len(self.requests),
                     "restarting it" if restart else "stopping the server")
        self._fail_all(EngineDeadError(reason))
        if self._output_task is not None and self._output_task is not asyncio.current_task():
            self._output_task.cancel()
        if not restart:  # a rank's device or node is gone: a restart would fail the same way; the operator decides
            self.fatal = reason
        elif not self._shutting_down:
            self._restart_task = asyncio.get_running_loop().create_task(self._restart(), name="tokenmill-restart")

    async def _restart(self) -> None:
        """Start a fresh engine process on the same sockets; until it is ready, requests get 503 and
        /health reports the outage. Retries with a growing pause (RestartBackoff) if the new engine fails to
        start too, or dies again before it has served for a while."""
        loop = asyncio.get_running_loop()
        while not self._shutting_down:
            self.num_restarts += 1
            await asyncio.sleep(self._backoff.next_delay(time.monotonic()))
            old = self.proc
            if old.is_alive():
                old.kill()
            await loop.run_in_executor(None, old.join, 5)
            if old.exitcode is not None:
                old.close()  # its sentinel fd, now rather than whenever the object is collected
            self.proc = self._spawn()
            try:
                await self.start(timeout=self._start_timeout)
            except RuntimeError as e:
                logger.error("engine restart %d failed: %s", self.num_restarts, e)
                continue
            logger.warning("engine restarted (restart %d); serving again", self.num_restarts)
            self.dead = None
            return

    def fail_open_requests(self, reason: str) -> None:
        """End every open request now with EngineDeadError(reason) (their streams report it) and refuse new
        ones; the engine is about to be stopped."""
        self._closing_reason = reason
        self._fail_all(EngineDeadError(reason))

    def _fail_all(self, exc: Exception) -> None:
        for state in list(self.requests.values()):
            state.queue.put_nowait(exc)
        self.unscheduled.clear()
        self.processor.clear()

    # -- requests ------------------------------------------------------------------------------
    @property
    def requests(self) -> dict[str, RequestState]:
        """The open user requests by id (the output processor's records)."""
        return self.processor.requests

    @property
    def num_waiting(self) -> int:
        return len(self.unscheduled)

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"{self.dead}; it is being restarted")
        if self._shutting_down or self._closing_reason is not None:
            raise EngineDeadError(self._closing_reason or "the server is shutting down")

    def validate(self, prompt_ids: list[int], params: SamplingParams, priority: int = 0) -> None:
        """The checks EngineCore.add_request makes, run here too so that a bad request is refused before
        anything streams. (The engine still checks, and reports a rejection if it disagrees.)"""
        check_token_ids(prompt_ids, params, self.ready.vocab_size)
        check_priority(priority, self.config.scheduler.scheduling_policy)
        r, layout, chunk = self.ready, self.kv_layout, self.config.scheduler.max_num_batched_tokens
        check_fits(len(prompt_ids), params, r.max_model_len, r.block_size, layout.usable_blocks(r.num_blocks),
                   self.config.model.pooler is not None, lambda n: layout.max_blocks(n, r.block_size, chunk))

    def add_request(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams,
                    queue: Optional[asyncio.Queue] = None, cache_salt: Optional[str] = None,
                    kv_transfer_params: Optional[dict] = None, priority: int = 0,
                    lora_request: Optional[LoRARequest] = None,
                    mm_inputs: Optional[list[ImageInput]] = None) -> RequestState:
        """Queue a request; its RequestOutput deltas (or an exception) arrive on the returned record's
        queue, which several requests may share. Raises ValueError for an invalid request.
        kv_transfer_params (disaggregated prefill/decode) and lora_request (its adapter; None: the base model)
        go to every engine request of it; mm_inputs: its prompt's images (frontend.prepare_images)."""
        self.check_alive()
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        self.validate(prompt_ids, params, priority)
        reqs = fan_out(request_id, prompt_ids, params, self.eos_token_ids, self.config.cache.enable_prefix_caching,
                       cache_salt, time.time(), kv_transfer_params, priority=priority, lora_request=lora_request,
                       mm_inputs=mm_inputs)
        payload = self._encoder.encode(reqs)  # before any bookkeeping: a request that cannot be sent leaves none
        ids = [r.request_id for r in reqs]
        state = RequestState(request_id, prompt, prompt_ids, params, self.tokenizer, delta=True,
                             queue=queue if queue is not None else asyncio.Queue())
        self.processor.add_request(state, ids)
        self.unscheduled.update(ids)
        self._in.send_multipart([ADD, payload])
        return state

    async def generate(self, request_id: str, prompt: Optional[str], prompt_ids: list[int], params: SamplingParams,
                       cache_salt: Optional[str] = None, kv_transfer_params: Optional[dict] = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields merged deltas until the request finishes; aborts it if the consumer stops early."""
        state = self.add_request(request_id, prompt, prompt_ids, params, cache_salt=cache_salt,
                                 kv_transfer_params=kv_transfer_params, priority=priority)
        try:
            while True:
                for out in await next_outputs(state.queue):
                    yield out
                    if out.finished:
                        return
        finally:
            if self.requests.get(request_id) is state:  # not finished: the consumer stopped early
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Stop a request now (client gone); its KV blocks return to the pool at the engine's next step."""
        state, ids = self.processor.abort(request_id)
        if state is None:
            return
        self.unscheduled.difference_update(state.engine_ids)
        if self.stat_logger is not None:
            self.stat_logger.on_finished(["abort"], time.monotonic() - state.times.arrival, len(state.prompt_ids),
                                         state.num_generation_tokens, state.times)
        if ids and self.dead is None and not self._shutting_down:
            self._in.send_multipart([ABORT, self._encoder.encode(ids)])

    def _fail_request(self, engine_id: str, reason: str, rejected: bool) -> None:
        """One engine request failed: its whole user request (all samples) ends with the error."""
        state = self.processor.request_of(engine_id)
        if state is not None:
            self.abort(state.request_id)
            state.queue.put_nowait(RequestRejectedError(reason) if rejected else RequestFailedError(reason))

    # -- output loop ---------------------------------------------------------------------------
    async def _output_loop(self) -> None:
        try:
            while True:
                msg = self._decoder.decode(await self._out.recv())
                if msg.fatal is not None:
                    self._mark_dead(f"the engine failed: {msg.fatal}", restart=not msg.fatal_exit)
                    return
                self._handle(msg)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must not leave requests hanging
            logger.exception("output loop failed")
            self._mark_dead(f"the API process's output loop failed: {type(e).__name__}: {e}")

    def _note_scheduled(self, scheduled: list[tuple[str, float]]) -> None:
        """Requests that ran for the first time in this step: their queue time."""
        for eid, t in scheduled:
            self.unscheduled.discard(eid)
            state = self.processor.request_of(eid)
            if state is not None:
                if state.times.scheduled_wall is None:
                    state.times.scheduled_wall = t
                if self.stat_logger is not None:
                    self.stat_logger.on_scheduled(max(t - state.times.arrival_wall, 0.0))

    def _deliver(self, state: RequestState, ro: RequestOutput, now: float, now_wall: float, detok_s: float) -> None:
        """One request's output to its queue, with its times and the metrics' events."""
        sl, times = self.stat_logger, state.times
        times.detokenize_s += detok_s
        n_new = sum(len(c.token_ids) for c in ro.outputs)
        if n_new:
            last = times.last_token
            times.on_tokens(now, now_wall, n_new)
            if sl is not None:
                if last is None:
                    sl.on_first_token(now - times.arrival)
                else:
                    sl.on_inter_token(now - last)
                sl.on_generation_tokens(n_new)
        if ro.finished:
            ro.metrics["timing"] = times.timing(now_wall)
            self.unscheduled.difference_update(state.engine_ids)
            if sl is not None:
                sl.on_finished(state.finish_reasons, now - times.arrival, len(state.prompt_ids),
                               state.num_generation_tokens, times)
        state.queue.put_nowait(ro)

    def _handle(self, msg: EngineCoreOutputs) -> None:
        now = time.monotonic()
        sl = self.stat_logger
        for eid, reason in msg.rejected:
            self._fail_request(eid, reason, rejected=True)
        for out in msg.outputs:
            if out.error is not None:
                self._fail_request(out.request_id, out.error, out.finish_reason == FinishReason.REJECTED)
        self._note_scheduled(msg.scheduled)
        t_detok = time.perf_counter()
        outputs, to_abort = self.processor.process(msg.outputs)
        detok_s = time.perf_counter() - t_detok  # a step's requests are detokenized together: each waited for it
        now_wall = time.time()
        if to_abort:  # stop strings matched: the engine must free those requests
            self._in.send_multipart([ABORT, self._encoder.encode(to_abort)])
        for state, ro in outputs:
            self._deliver(state, ro, now, now_wall, detok_s)
        if msg.stats is not None:
            self.stats = msg.stats
            if sl is not None:
                sl.on_engine_stats(msg.stats)


async def next_outputs(queue: asyncio.Queue) -> list[RequestOutput]:
    """Wait for the next output, then take everything else already queued, merging consecutive deltas of
    each request: a slow consumer gets fewer, larger deltas instead of falling behind. Raises what
    the engine side put on the queue (EngineDeadError, RequestRejectedError)."""
    item: Union[RequestOutput, Exception] = await queue.get()
    items = [item]
    while not queue.empty():
        items.append(queue.get_nowait())
    merged: dict[str, RequestOutput] = {}
    for item in items:
        if isinstance(item, Exception):
            raise item
        prev = merged.get(item.request_id)
        if prev is None:
            merged[item.request_id] = item
        else:
            merge_outputs(prev, item)
    return list(merged.values())


def merge_outputs(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Fold delta b into delta a (same request)."""
    by_index = {c.index: c for c in a.outputs}
    for c in b.outputs:
        prev = by_index.get(c.index)
        if prev is None:
            by_index[c.index] = c
            continue
        prev.text += c.text
        prev.token_ids = prev.token_ids + c.token_ids
        if c.logprobs is not None:
            prev.logprobs = (prev.logprobs or []) + c.logprobs
        prev.cumulative_logprob = c.cumulative_logprob
        prev.finish_reason, prev.stop_reason = c.finish_reason, c.stop_reason
    a.outputs = sorted(by_index.values(), key=lambda c: c.index)
    a.finished = b.finished
    a.num_cached_tokens = b.num_cached_tokens
    a.metrics.update(b.metrics)
    if a.prompt_logprobs is None:
        a.prompt_logprobs = b.prompt_logprobs
    if b.kv_transfer_params is not None:
        a.kv_transfer_params = b.kv_transfer_params
    if b.embedding is not None:
        a.embedding = b.embedding
    return a


@dataclass
class RestartBackoff:
    """The pause before each engine restart: none for the first, then 1, 2, 4 ... seconds up to `cap` while
    failures follow each other (a start that fails, an engine that dies again soon after it was ready); back to
    none once an engine has been ready for `healthy_s` seconds, so an occasional failure is always restarted at
    once instead of after the pause a crash loop long ago left behind."""
    cap: float = 30.0
    healthy_s: float = 10.0
    failures: int = 0                    # restarts since an engine was last healthy for healthy_s
    ready_at: Optional[float] = None     # when the running engine became ready (monotonic seconds)

    def on_ready(self, now: float) -> None:
        self.ready_at = now

    def next_delay(self, now: float) -> float:
        """Seconds to wait before the restart about to happen (now: monotonic seconds)."""
        if self.ready_at is not None and now - self.ready_at >= self.healthy_s:
            self.failures = 0
        self.ready_at = None
        delay = 0.0 if self.failures == 0 else min(2.0 ** (self.failures - 1), self.cap)
        self.failures += 1
        return delay


IPC_PREFIX = "tokenmill-ipc-"


def remove_stale_ipc_dirs() -> None:
    """Socket folders of API processes that died without cleaning up (kill -9): tokenmill-ipc-<pid>-*."""
    tmp = tempfile.gettempdir()
    for name in os.listdir(tmp):
        if not name.startswith(IPC_PREFIX):
            continue
        pid = name[len(IPC_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(tmp, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
