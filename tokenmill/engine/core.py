"""EngineCore: the loop both fronts drive. One step = schedule -> execute -> update."""
from __future__ import annotations

import gc
import logging
import time
from collections import deque
from typing import Optional

import numpy as np

from tokenmill.config import EngineConfig
from tokenmill.engine.scheduler import Scheduler
from tokenmill.executor import create_executor
from tokenmill.executor.base import WorkerDiedError
from tokenmill.kv_transfer import make_scheduler_connector
from tokenmill.messages import (EngineCoreOutput, EngineCoreRequest, EngineStats, Request, check_priority,
                                check_token_ids)
from tokenmill.startup import Ledger
from tokenmill.step.interrupt import StepInterrupted
from tokenmill.step.multimodal import check_images

logger = logging.getLogger("tokenmill")
MAX_FAILED_STEPS = 32  # consecutive failed steps after which the engine gives up (and is restarted)


class EngineCore:
    def __init__(self, config: EngineConfig, ledger: Optional[Ledger] = None) -> None:
        """ledger (startup.Ledger): gets the output rank's phases and "kv allocation"."""
        self.config = config
        t0 = time.perf_counter()
        ledger = ledger or Ledger(origin=0.0)
        self.executor = create_executor(config)
        ledger.extend(self.executor.startup_phases())
        with ledger.phase("kv allocation"):
            num_blocks = self.executor.determine_num_blocks()
            self.executor.initialize_cache(num_blocks)
        bs = config.cache.block_size
        gib = num_blocks * self.executor.bytes_per_block() / 2**30
        logger.info("KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s)", num_blocks, bs, num_blocks * bs, gib,
                    config.cache.kv_cache_dtype)
        connector = make_scheduler_connector(config, self.executor.bytes_per_block())
        if connector is not None and config.cache.kv_offloading_size:
            cc = config.cache
            logger.info("KV tiers: host RAM %.2f GiB%s", cc.kv_offloading_size,
                        f", disk {cc.kv_offloading_disk_size:.4g} GiB under {cc.kv_offloading_disk_dir}"
                        if cc.kv_offloading_disk_dir else "")
        self.scheduler = Scheduler(config, num_blocks, connector)
        # Priority policy: a better-ranked arrival cuts a long step short (step/interrupt.py); offer() each one.
        self.step_interrupt = self.executor.step_interrupt if connector is None else None
        layout = self.scheduler.kv_layout
        if layout.frees_blocks or layout.one_group_reason:  # a model with sliding-window layers
            logger.info("KV groups: %s", layout.describe())
        self.vocab_size = config.model.hf_config.vocab_size
        self.image_token_id = getattr(config.model.hf_config, "image_token_id", None)  # a VLM's placeholder
        self.num_failed_steps = 0  # in a row; past MAX_FAILED_STEPS the engine itself is broken
        self.step_stats = None
        if config.log_step_stats:
            from tokenmill.engine.step_stats import StepStatsLogger  # perf, models.shape (~13 ms): with log_step_stats

            self.step_stats = StepStatsLogger(config)
        self.step_records = None
        if config.step_records:
            from tokenmill.engine.step_records import StepRecorder  # perf (~11 ms): only with step records

            self.step_records = StepRecorder(config)
        # Pipeline parallel: steps in flight, oldest first: (scheduler output, its future, submit time).
        self.num_in_flight = config.parallel.pipeline_parallel_size
        self.batch_queue: deque = deque()
        self.expert_load: Optional[np.ndarray] = None  # MoE: cumulative tokens per [MoE layer, expert]
        # The model, tokenizer and kernels' objects live as long as the engine: out of the collector's reach,
        # a full collection no longer walks them every few hundred steps (~5% of a 1.5B GGUF's decode).
        gc.collect()
        gc.freeze()
        logger.info("engine ready in %.1fs", time.perf_counter() - t0)

    def add_request(self, req: EngineCoreRequest) -> None:
        """Raises ValueError (nothing queued) for a request that could never run."""
        if req.request_id in self.scheduler.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        check_token_ids(req.prompt_token_ids, req.sampling_params, self.vocab_size)
        check_priority(req.priority, self.config.scheduler.scheduling_policy)
        if req.lora_request is not None and self.config.lora is None:
            raise ValueError(f"request for LoRA adapter {req.lora_request.lora_name!r}, but this engine runs "
                             "without --enable-lora")
        check_images(req.prompt_token_ids, req.mm_inputs, self.image_token_id)
        self.scheduler.check_fits(len(req.prompt_token_ids), req.sampling_params)
        if self.scheduler.connector is not None:  # e.g. kv_transfer_params naming a pull source not allowed
            self.scheduler.connector.check_request(req)
        self.scheduler.add_request(Request(req, self.config.model.max_model_len))

    def abort_requests(self, request_ids) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[EngineCoreOutput]:
        if self.num_in_flight > 1:
            return self._step_pipelined()
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if not sched.needs_worker:
            return self.scheduler.take_pending()
        # With nothing scheduled the worker still drops finished requests' state and runs KV transfers.
        result = self._execute(sched, lambda: self._run(sched))
        return self._fold_in(sched, result, t0)

    def _run(self, sched):
        """The worker's result for sched. A step that runs prompt tokens (long) is armed with its best priority."""
        interrupt = self.step_interrupt
        if interrupt is None or sched.num_batched_tokens <= len(sched.scheduled):
            return self.executor.execute_model(sched)
        interrupt.arm(min(self.scheduler.requests[s.request_id].priority for s in sched.scheduled))
        try:
            return self.executor.execute_model(sched)
        finally:
            interrupt.disarm()

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Pipeline parallel: with P stages, up to P steps are in flight so that every stage works on one.
        While there is room, schedule (requests in flight are not schedulable) and submit without waiting;
        when the queue is full or nothing new could run, wait for the oldest step and fold it in."""
        if len(self.batch_queue) < self.num_in_flight:
            sched = self.scheduler.schedule()
            if sched.needs_worker:
                self.batch_queue.append((sched, self.executor.execute_model(sched, non_block=True),
                                         time.perf_counter()))
                if not sched.empty and len(self.batch_queue) < self.num_in_flight:
                    return self.scheduler.take_pending()
        if not self.batch_queue:
            return self.scheduler.take_pending()
        sched, future, t0 = self.batch_queue.popleft()
        return self._fold_in(sched, self._execute(sched, future.result), t0)

    def _fold_in(self, sched, result, t0: float) -> list[EngineCoreOutput]:
        outputs = self.scheduler.update(sched, result, time.perf_counter() - t0) if result is not None else []
        if result is not None and result.expert_load is not None:
            load = np.asarray(result.expert_load, dtype=np.int64)
            self.expert_load = load if self.expert_load is None else self.expert_load + load
        if not sched.empty:
            seconds = time.perf_counter() - t0
            if self.step_stats is not None:
                self.step_stats.log(sched, seconds)
            if self.step_records is not None:
                self.step_records.record(sched, seconds)
        return self.scheduler.take_pending() + outputs

    def _execute(self, sched, run):
        """run()'s result (the worker's for sched), or None when it raised: the step's requests are rolled
        back and run alone until the culprit is found (Scheduler.roll_back), and the others keep going; or None
        when it was cut short for a better-ranked arrival (Scheduler.take_back)."""
        try:
            result = run()
        except WorkerDiedError:
            raise  # not a request's fault: nothing to isolate, the engine cannot go on
        except StepInterrupted:  # a better-ranked request arrived: it runs next, this step's work after it
            logger.debug("step of %d tokens cut short for a better-ranked arrival", sched.num_batched_tokens)
            self.scheduler.take_back(sched)
            return None
        except Exception as e:  # noqa: BLE001 - one request's failure must not end the engine for all
            self.num_failed_steps += 1
            error = f"the engine failed to run this request: {type(e).__name__}: {e}"
            if self.num_failed_steps > MAX_FAILED_STEPS or not sched.scheduled:
                self.scheduler.roll_back(sched, error)  # the step is over either way: its blocks come back
                raise
            logger.exception("step failed for request(s) %s; isolating the cause",
                             ", ".join(s.request_id for s in sched.scheduled[:8]))
            self.scheduler.roll_back(sched, error)
            return None
        self.num_failed_steps = 0
        return result

    def stats(self) -> EngineStats:
        s, kv = self.scheduler, self.scheduler.kv
        stats = EngineStats(s.num_running, s.num_waiting, kv.usage, kv.num_queries, kv.num_hits,
                            s.num_preemptions, kv.pool.num_free, kv.num_usable_blocks, kv.num_external_queries,
                            kv.num_external_hits, s.num_prompt_tokens_computed, s.num_interrupted_steps)
        if s.spec is not None:
            c = s.spec.counters
            stats.spec_num_drafts, stats.spec_num_draft_tokens = c.num_drafts, c.num_draft_tokens
            stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos = c.num_accepted_tokens, list(c.accepted_per_pos)
            stats.spec_k = s.spec.last_k
        if self.expert_load is not None:
            stats.expert_load = self.expert_load.tolist()
        if s.connector is not None:
            stats.kv_connector = s.connector.counters()
        if self.step_records is not None:
            stats.steps = self.step_records.drain()
            stats.num_cached_free_blocks = self.step_records.cached_free_blocks(kv.pool)
        return stats

    def check_health(self) -> None:
        """Raises WorkerDiedError once a worker rank is gone (for loops that wait while idle)."""
        self.executor.check_health()

    def shutdown(self) -> None:
        self.executor.shutdown()
