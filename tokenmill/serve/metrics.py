"""Prometheus metrics for /metrics, named `tokenmill:<metric>` in parallel with vLLM's `vllm:<metric>`.

Request-level timings (TTFT, inter-token latency, end-to-end) are measured in the API process, where the
user sees them; engine-side state (running/waiting, KV usage, prefix-cache counters, preemptions, queue
time) arrives with every step's outputs, so scraping costs the engine nothing.
"""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenmill.engine.output_processor import RequestTimes
from tokenmill.messages import EngineStats
from tokenmill.step.p2p_plan import PULL_SECONDS_BUCKETS

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0]
_TOKEN_BUCKETS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000]
FINISH_REASONS = ("stop", "length", "abort")


class ServerMetrics:
    """One registry per server (no process-global state); AsyncLLM calls the on_* hooks."""

    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        lbl = ["model_name"]

        def g(name, doc):
            return Gauge(f"tokenmill:{name}", doc, lbl, registry=r).labels(model_name)

        def c(name, doc):
            return Counter(f"tokenmill:{name}", doc, lbl, registry=r).labels(model_name)

        def h(name, doc, buckets):
            return Histogram(f"tokenmill:{name}", doc, lbl, buckets=buckets, registry=r).labels(model_name)

        self.running = g("num_requests_running", "Requests in the running batch.")
        self.waiting = g("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_usage = g("kv_cache_usage_perc", "KV cache usage (1 = full).")
        self.kv_free_blocks = g("kv_cache_free_blocks", "Free KV cache blocks (including cached, reusable ones).")
        self.kv_total_blocks = g("kv_cache_total_blocks", "KV cache blocks in all.")
        self.prefix_queries = c("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_hits = c("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.external_queries = c("external_prefix_cache_queries",
                                  "Prompt tokens past the device prefix hit looked up in the offloaded KV tiers.")
        self.external_hits = c("external_prefix_cache_hits", "Prompt tokens restored from the offloaded KV tiers.")
        self.prefix_hit_rate = g("prefix_cache_hit_rate", "Looked-up prompt tokens served from any cache tier "
                                 "(device or offloaded), cumulative.")
        self.preemptions = c("num_preemptions", "Requests preempted because the KV cache was full.")
        self.interrupted_steps = c("num_interrupted_steps", "Engine steps cut short for a better-ranked arrival "
                                   "(--scheduling-policy priority); their work ran again after it.")
        self.prompt_tokens = c("prompt_tokens", "Prompt tokens of finished requests.")
        self.prompt_tokens_computed = c("prompt_tokens_computed", "Prompt tokens the model ran: not found in a "
                                        "prefix cache, not restored from a KV tier or transferred from a "
                                        "prefill instance (again after a preemption).")
        self.generation_tokens = c("generation_tokens", "Generated tokens.")
        success = Counter("tokenmill:request_success", "Finished requests (samples) by finish reason.",
                          ["model_name", "finished_reason"], registry=r)
        self.success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        self.ttft = h("time_to_first_token_seconds", "Time to first token.", _TTFT_BUCKETS)
        self.itl = h("inter_token_latency_seconds", "Time between successive output deltas.", _ITL_BUCKETS)
        self.e2e = h("e2e_request_latency_seconds", "Arrival to last token.", _LATENCY_BUCKETS)
        self.queue_time = h("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        self.req_prompt = h("request_prompt_tokens", "Prompt length per request.", _TOKEN_BUCKETS)
        self.req_gen = h("request_generation_tokens", "Generated tokens per request.", _TOKEN_BUCKETS)
        # Speculative decoding (vLLM's spec_decode_* names); zero without it.
        self.spec_drafts = c("spec_decode_num_drafts", "Verification rounds (requests x steps with drafts).")
        self.spec_draft_tokens = c("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_accepted = c("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self._spec_pos = Counter("tokenmill:spec_decode_num_accepted_tokens_per_pos",
                                 "Draft tokens accepted, by position in the draft.", ["model_name", "position"],
                                 registry=r)
        self.spec_acceptance = g("spec_decode_draft_acceptance_rate", "Accepted / drafted tokens (cumulative).")
        self.spec_mean_len = g("spec_decode_mean_acceptance_length",
                               "Tokens emitted per verification round: 1 + accepted / rounds (cumulative).")
        # MoE: expert load, what expert-parallel users tune (zero series for a dense model)
        self._expert_tokens = Counter("tokenmill:moe_expert_tokens", "Tokens routed to each expert, by MoE layer "
                                      "(0 = the model's first MoE layer) and expert.",
                                      ["model_name", "layer", "expert"], registry=r)
        self.expert_imbalance = g("moe_expert_load_imbalance", "Most-loaded expert's tokens over the mean "
                                  "expert's, in the most imbalanced MoE layer (1 = even; cumulative).")
        self._model_name = model_name
        self._last: EngineStats | None = None
        r.register(_TransferCollector(self))

    def set_cache_config(self, block_size: int, num_blocks: int, enable_prefix_caching: bool) -> None:
        """vLLM's cache_config_info, set once the engine is up: a router sizes its view of our cache by it."""
        Gauge("tokenmill:cache_config_info", "KV cache configuration (value 1, settings as labels).",
              ["model_name", "block_size", "num_gpu_blocks", "enable_prefix_caching"], registry=self.registry).labels(
            self._model_name, str(block_size), str(num_blocks), str(enable_prefix_caching)).set(1)
        self.kv_total_blocks.set(num_blocks)

    def set_startup(self, report) -> None:
        """The start-up ledger (startup.StartupReport), set once the server is ready: each phase's share of the
        time from process start to ready (they sum to tokenmill:startup_seconds)."""
        phases = Gauge("tokenmill:startup_phase_seconds", "Seconds each start-up phase added to the time from "
                       "process start to ready (overlapped work counts where it delayed the start).",
                       ["model_name", "phase"], registry=self.registry)
        for name, seconds in report.critical.items():
            phases.labels(self._model_name, name).set(seconds)
        Gauge("tokenmill:startup_seconds", "Process start to ready (serving), seconds.", ["model_name"],
              registry=self.registry).labels(self._model_name).set(report.total)

    # -- hooks (called from AsyncLLM's output loop) -------------------------------------------
    def on_scheduled(self, queue_time: float) -> None:
        self.queue_time.observe(queue_time)

    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_inter_token(self, itl: float) -> None:
        self.itl.observe(itl)

    def on_generation_tokens(self, n: int) -> None:
        self.generation_tokens.inc(n)

    def on_finished(self, reasons: list[str], e2e: float, prompt_tokens: int, generation_tokens: int,
                    times: Optional[RequestTimes] = None) -> None:
        """times: the request's event times (the dashboard reads its token times; not needed here)."""
        for reason in reasons:
            counter = self.success.get(reason)
            if counter is not None:
                counter.inc()
        self.e2e.observe(e2e)
        self.prompt_tokens.inc(prompt_tokens)
        self.req_prompt.observe(prompt_tokens)
        self.req_gen.observe(generation_tokens)

    def on_engine_stats(self, s: EngineStats) -> None:
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_cache_usage)
        self.kv_free_blocks.set(s.num_free_blocks)
        self.kv_total_blocks.set(s.num_blocks)
        last = self._last
        # Engine counters are cumulative; Prometheus counters take increments.
        for counter, name in ((self.prefix_queries, "prefix_cache_queries"), (self.prefix_hits, "prefix_cache_hits"),
                              (self.external_queries, "external_prefix_cache_queries"),
                              (self.external_hits, "external_prefix_cache_hits"),
                              (self.preemptions, "num_preemptions"),
                              (self.interrupted_steps, "num_interrupted_steps"),
                              (self.prompt_tokens_computed, "prompt_tokens_computed")):
            counter.inc(max(getattr(s, name) - (getattr(last, name) if last is not None else 0), 0))
        if s.prefix_cache_queries:
            self.prefix_hit_rate.set((s.prefix_cache_hits + s.external_prefix_cache_hits) / s.prefix_cache_queries)
        self._on_spec_stats(s, last)
        self._on_expert_load(s, last)
        self._last = s

    def _on_spec_stats(self, s: EngineStats, last: EngineStats | None) -> None:
        if not s.spec_num_draft_tokens:
            return
        prev = (last.spec_num_drafts, last.spec_num_draft_tokens, last.spec_num_accepted_tokens,
                last.spec_accepted_per_pos) if last is not None else (0, 0, 0, [])
        self.spec_drafts.inc(max(s.spec_num_drafts - prev[0], 0))
        self.spec_draft_tokens.inc(max(s.spec_num_draft_tokens - prev[1], 0))
        self.spec_accepted.inc(max(s.spec_num_accepted_tokens - prev[2], 0))
        for pos, n in enumerate(s.spec_accepted_per_pos):
            before = prev[3][pos] if pos < len(prev[3]) else 0
            self._spec_pos.labels(self._model_name, str(pos)).inc(max(n - before, 0))
        self.spec_acceptance.set(s.spec_num_accepted_tokens / s.spec_num_draft_tokens)
        if s.spec_num_drafts:
            self.spec_mean_len.set(1.0 + s.spec_num_accepted_tokens / s.spec_num_drafts)

    def _on_expert_load(self, s: EngineStats, last: EngineStats | None) -> None:
        if not s.expert_load:
            return
        prev = last.expert_load if last is not None and last.expert_load else None
        worst = 1.0
        for layer, counts in enumerate(s.expert_load):
            for expert, n in enumerate(counts):
                before = prev[layer][expert] if prev is not None else 0
                if n > before:
                    self._expert_tokens.labels(self._model_name, str(layer), str(expert)).inc(n - before)
            total = sum(counts)
            if total:
                worst = max(worst, max(counts) * len(counts) / total)
        self.expert_imbalance.set(worst)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def spec_decode_counters(prometheus_text: str) -> dict:
    """The speculative-decoding counters in a /metrics scrape (summed over models), for clients such as
    `tokenmill bench` that report acceptance: diff two scrapes taken around a run. Empty when the server
    does not speculate."""
    names = {"tokenmill:spec_decode_num_drafts_total": "num_drafts",
             "tokenmill:spec_decode_num_draft_tokens_total": "num_draft_tokens",
             "tokenmill:spec_decode_num_accepted_tokens_total": "num_accepted_tokens"}
    out: dict = {}
    per_pos: dict[int, float] = {}
    for line in prometheus_text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        key, value = line.rsplit(" ", 1)
        name = key.split("{", 1)[0]
        if name in names:
            out[names[name]] = out.get(names[name], 0.0) + float(value)
        elif name == "tokenmill:spec_decode_num_accepted_tokens_per_pos_total":
            pos = int(key.split('position="', 1)[1].split('"', 1)[0])
            per_pos[pos] = per_pos.get(pos, 0.0) + float(value)
    if per_pos:
        out["accepted_per_pos"] = [per_pos.get(i, 0.0) for i in range(max(per_pos) + 1)]
    return out


# Disaggregated prefill/decode: the transfer connector's cumulative counters (EngineStats.kv_connector).
_TRANSFER_DOCS = {
    "kv_pulls": "Requests whose prompt KV this (decode) instance pulled intact from a prefill instance.",
    "kv_pull_fallbacks": "Pulls that failed (corrupt, timed out, refused): the prompt was recomputed here.",
    "kv_transferred_tokens": "Prompt tokens whose KV arrived by transfer instead of being computed here.",
    "kv_bytes_received": "KV bytes pulled from prefill instances.",
    "kv_bytes_sent": "KV bytes served to decode instances.",
    "kv_sent_requests": "Prefilled requests a decode instance finished pulling from this instance.",
    "kv_hold_timeouts": "Prefilled requests whose blocks were freed unpulled after the hold timeout.",
}


class _TransferCollector:
    """Reads the last EngineStats at scrape time: counters, held requests, and the transfer time histogram
    (its buckets are cumulative counts kept by the connector, step/p2p_plan.py)."""

    def __init__(self, metrics: "ServerMetrics") -> None:
        self.metrics = metrics

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        last, name = self.metrics._last, self.metrics._model_name
        kv = last.kv_connector if last is not None else {}
        for key, doc in _TRANSFER_DOCS.items():
            if key in kv:
                yield _family(CounterMetricFamily, key, doc, name, kv[key])
        if "kv_held_requests" in kv:
            yield _family(GaugeMetricFamily, "kv_held_requests", "Prefilled requests whose blocks wait for a "
                          "decode instance to pull them.", name, kv["kv_held_requests"])
        if kv.get("kv_pull_seconds_count"):
            hist = HistogramMetricFamily("tokenmill:kv_transfer_seconds", "Time to pull one request's prompt KV "
                                         "from a prefill instance (intact pulls).", labels=["model_name"])
            buckets = [(f"{b:g}", kv.get(f"kv_pull_seconds_le_{b:g}", 0)) for b in PULL_SECONDS_BUCKETS]
            hist.add_metric([name], buckets + [("+Inf", kv["kv_pull_seconds_count"])],
                            kv.get("kv_pull_microseconds_sum", 0) / 1e6)
            yield hist


def _family(kind, key: str, doc: str, model_name: str, value: float):
    family = kind(f"tokenmill:{key}", doc, labels=["model_name"])
    family.add_metric([model_name], value)
    return family
