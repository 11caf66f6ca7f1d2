"""The engine's view on the dashboard (`tokenmill serve`): snapshots, the request table, one request's
per-token timing, and the configuration with `tokenmill plan`'s summary for it. serve/dashboard.py holds
the routes and the stream both this and the router view use."""
from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any, Optional

from fastapi import FastAPI
from starlette.responses import Response

import tokenmill
from tokenmill.engine.output_processor import RequestState
from tokenmill.http.errors import APIError
from tokenmill.serve.dashboard import DashboardStats, mount
from tokenmill.serve.serving import json_response, off_loop

MAX_STEPS_SHOWN = 120    # step timeline bars per snapshot
MAX_OPEN_SHOWN = 64      # open requests in the table
RECENT_FINISHED = 20     # finished requests kept for the table (and their per-token timing)
RATE_WINDOW_S = 2.0      # tok/s over this much of the recent past


class EngineView:
    def __init__(self, state: Any, stats: DashboardStats) -> None:
        self.state, self.stats = state, stats
        self.seen: dict[str, RequestState] = {}   # request id -> its record, open as of the last snapshot
        self.finished: deque = deque(maxlen=RECENT_FINISHED)
        self.rates: deque = deque()               # (monotonic time, generation tokens, prompt tokens)

    # -- snapshot ---------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        now = time.monotonic()
        st, engine = self.stats, self.state.engine
        requests = dict(engine.requests)
        for rid, s in self.seen.items():
            if rid not in requests:
                self.finished.append(s)
        self.seen = requests
        opened = self._open(requests)
        return {"t": time.time(), "engine": self._engine_state(opened), "latency": st.latency(),
                "throughput": self._throughput(now, requests), "num_steps": st.num_steps,
                "steps": st.recent_steps(MAX_STEPS_SHOWN), "requests": self._requests(now, opened),
                "alive": engine.dead is None}

    def _open(self, requests: dict[str, RequestState]) -> list[tuple[RequestState, int, int]]:
        """Every open request with its sequences waiting (sent, not yet scheduled) and running (scheduled,
        not finished): the one count both the tiles and the table are made of, so they cannot disagree. The
        engine's stats are not used here: they lag what the API has sent (they said 0 waiting while the table
        listed 8) and count sequences the table cannot name. A preempted sequence counts as running."""
        unscheduled = self.state.engine.unscheduled
        out = []
        for s in requests.values():
            waiting = sum(e in unscheduled for e in s.engine_ids)
            out.append((s, waiting, max(len(s.engine_ids) - waiting - len(s.finish_reasons), 0)))
        return out

    def _engine_state(self, opened: list) -> dict:
        held = self.state.admission.held
        counts = {"running": sum(r for _, _, r in opened), "waiting": sum(w for _, w, _ in opened) + held,
                  "held": held}
        s = self.stats.engine
        if s is None:
            return counts
        used = s.num_blocks - s.num_free_blocks
        queries = s.prefix_cache_queries
        return {
            **counts, "preemptions": s.num_preemptions,
            "kv": {"total": s.num_blocks, "used": used, "cached_free": s.num_cached_free_blocks,
                   "free": s.num_free_blocks - s.num_cached_free_blocks, "usage": s.kv_cache_usage},
            "prefix": {"queries": queries, "hits": s.prefix_cache_hits,
                       "external_queries": s.external_prefix_cache_queries,
                       "external_hits": s.external_prefix_cache_hits,
                       "device_hit_rate": s.prefix_cache_hits / queries if queries else None,
                       "tier_hit_rate": (s.external_prefix_cache_hits / s.external_prefix_cache_queries
                                         if s.external_prefix_cache_queries else None),
                       "hit_rate": ((s.prefix_cache_hits + s.external_prefix_cache_hits) / queries
                                    if queries else None)},
            "spec": {"drafts": s.spec_num_drafts, "draft_tokens": s.spec_num_draft_tokens,
                     "accepted": s.spec_num_accepted_tokens, "accepted_per_pos": list(s.spec_accepted_per_pos),
                     "acceptance_per_pos": [n / s.spec_num_drafts for n in s.spec_accepted_per_pos]
                     if s.spec_num_drafts else [], "k": s.spec_k},
        }

    def _throughput(self, now: float, requests: dict[str, RequestState]) -> dict:
        st = self.stats
        self.rates.append((now, st.generation_tokens, st.prompt_tokens))
        while len(self.rates) > 2 and self.rates[1][0] < now - RATE_WINDOW_S:
            self.rates.popleft()
        t0, g0, p0 = self.rates[0]
        dt = now - t0
        per_user = [(n - 1) / (t.last_token - t.first_token) for t, n in
                    ((s.times, s.num_generation_tokens) for s in requests.values())
                    if t.first_token is not None and t.last_token > t.first_token and n > 1]
        return {"generation_tok_s": (st.generation_tokens - g0) / dt if dt > 0 else 0.0,
                "prompt_tok_s": (st.prompt_tokens - p0) / dt if dt > 0 else 0.0,
                "per_user_tok_s": statistics.median(per_user) if per_user else None,
                "generation_tokens": st.generation_tokens, "prompt_tokens": st.prompt_tokens,
                "finished_requests": st.finished_requests}

    def _requests(self, now: float, opened: list) -> list[dict]:
        """Rows: the first MAX_OPEN_SHOWN open requests, one row summing the others, one for the sequences
        the API process still holds back (a large request goes to the engine a window at a time), then the
        recently finished. Every open row carries its waiting and running sequences: they add up to the tiles."""
        rows = [self._row(s, "waiting" if w and not r else "running", now, w, r) for s, w, r in opened[:MAX_OPEN_SHOWN]]
        more = opened[MAX_OPEN_SHOWN:]
        if more:
            rows.append({"id": None, "state": "more", "count": len(more), "waiting": sum(w for _, w, _ in more),
                         "running": sum(r for _, _, r in more)})
        held = self.state.admission.held
        if held:
            rows.append({"id": None, "state": "held", "count": held, "waiting": held, "running": 0})
        rows += [self._row(s, "finished", now, 0, 0) for s in reversed(self.finished)]
        return rows

    @staticmethod
    def _row(s: RequestState, state: str, now: float, waiting: int, running: int) -> dict:
        t = s.times
        itl = t.token_times[-1][0] - t.token_times[-2][0] if len(t.token_times) > 1 else None
        return {"id": s.request_id, "state": state, "sequences": len(s.engine_ids), "waiting": waiting,
                "running": running, "prompt_tokens": len(s.prompt_ids),
                "output_tokens": s.num_generation_tokens, "cached_tokens": s.num_cached_tokens,
                "ttft": t.first_token - t.arrival if t.first_token is not None else None, "itl": itl,
                "age": (t.last_token if state == "finished" and t.last_token else now) - t.arrival}

    # -- one request, the configuration ------------------------------------------------------------
    def request_detail(self, rid: str) -> Optional[dict]:
        # open now, open at the last snapshot (finished since: not yet in `finished`), or recently finished
        s = self.state.engine.requests.get(rid) or self.seen.get(rid) or next(
            (f for f in self.finished if f.request_id == rid), None)
        if s is None:
            return None
        return {"id": rid, "prompt_tokens": len(s.prompt_ids), "cached_tokens": s.num_cached_tokens,
                "tokens": [[t - s.times.arrival, n] for t, n in list(s.times.token_times)]}

    def config(self, batch: int) -> dict:
        c, ready = self.state.config, self.state.engine.ready
        spec = c.speculative
        cfg = {"model": self.state.model_name, "path": c.model.model or c.model.model_dir, "device": c.device,
               "dtype": c.model.dtype_name, "quantization": c.model.quantization,
               "kv_cache_dtype": c.cache.kv_cache_dtype,
               "speculative": {"method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens}
               if spec is not None else None,
               "tensor_parallel_size": c.parallel.tensor_parallel_size,
               "pipeline_parallel_size": c.parallel.pipeline_parallel_size,
               "expert_parallel": c.parallel.enable_expert_parallel, "batch_invariant": bool(c.batch_invariant),
               "prefix_caching": c.cache.enable_prefix_caching, "max_model_len": c.model.max_model_len,
               "max_num_seqs": c.scheduler.max_num_seqs,
               "max_num_batched_tokens": c.scheduler.max_num_batched_tokens,
               "block_size": ready.block_size if ready else c.cache.block_size,
               "num_blocks": ready.num_blocks if ready else None}
        return {"config": cfg, "plan": self.plan(batch)}

    def plan(self, batch: int) -> dict:
        """`tokenmill plan` for this model at the current batch and the prompt/output lengths seen so far."""
        # models.shape and perf (~15 ms): only the config page plans; the API process starts without them
        from tokenmill.models.shape import engine_shape
        from tokenmill.perf.roofline import format_plan, make_plan

        c = self.state.config
        hw = _device_figures(c.device)
        if hw is None:
            return {"text": "no figures for this device yet (the engine measures the CPU once at its first start)"}
        st = self.stats
        n = max(st.finished_requests, 1)
        input_len = max(int(st.prompt_tokens / n), 1) if st.finished_requests else 512
        output_len = max(int(st.generation_tokens / n), 1) if st.finished_requests else 128
        kv = c.cache.kv_cache_dtype
        shape, weights = engine_shape(c.model.hf_config, c.model.dtype_name)  # a native GGUF: its blocks' bytes
        p = make_plan(shape, hw, weight_dtype=weights, compute_dtype=c.model.dtype_name,
                      kv_dtype=c.model.dtype_name if kv == "auto" else kv, batch_size=max(batch, 1),
                      input_len=input_len, output_len=output_len, tp=c.parallel.tensor_parallel_size,
                      pp=c.parallel.pipeline_parallel_size)
        return {"text": format_plan(p), "decode_bound": p["decode"]["bound"], "prefill_bound": p["prefill"]["bound"],
                "compute_bound_batch": p["decode"]["compute_bound_batch_size"], "batch_size": p["batch_size"],
                "weight_bytes": p["weight_bytes"], "kv_bytes_per_token": p["kv_bytes_per_token"]}


def _device_figures(device: str):
    """The engine's figures for its device, without touching the device from the API process: the CPU's
    cached measurement, or the catalog entry of the GPU nvidia-smi names."""
    from tokenmill.engine.step_records import local_cpu_figures  # perf, as in EngineView.plan

    if device == "cpu":
        return local_cpu_figures(measure=False)
    import subprocess

    from tokenmill.perf.hardware import get_hardware  # perf, as in EngineView.plan

    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=5).stdout.lower().replace(" ", "")
    except (OSError, subprocess.SubprocessError):
        return None
    key = next((k for k in ("h200", "h100", "b200", "a100", "l40s", "mi300x") if k in name), None)
    return get_hardware(key) if key else None


def mount_engine_dashboard(app: FastAPI, state: Any, stats: DashboardStats) -> EngineView:
    view = EngineView(state, stats)
    mount(app, "engine", view.snapshot, lambda: {"model": state.model_name, "version": tokenmill.__version__})

    @app.get("/dashboard/api/config")
    async def dashboard_config(batch: int = 1) -> Response:
        return json_response(await off_loop(view.config, max(0, min(batch, 1 << 16))))

    @app.get("/dashboard/api/requests/{rid}")
    async def dashboard_request(rid: str) -> Response:
        detail = view.request_detail(rid)
        if detail is None:
            raise APIError(404, f"no open or recently finished request {rid!r}", param="rid", code="not_found")
        return json_response(detail)

    return view
