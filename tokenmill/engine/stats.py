"""EngineStats: the counters the engine core sends the API process with each step's outputs (queues, KV
blocks, prefix cache, speculation, connectors, per-step records). Its own module because the API process
reads it without importing the engine (and torch)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_free_blocks: int
    num_blocks: int
    # Prompt tokens past the device hit looked up in / supplied by lower KV tiers (vLLM's external_prefix_cache_*)
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # Prompt tokens the model actually ran (cumulative): not prefix-cache hits, not tokens a KV connector
    # supplied (a decode instance's transferred prompts count 0), again after a preemption
    prompt_tokens_computed: int = 0
    # Speculative decoding (cumulative; zero without it)
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_k: int = 0                 # drafts per request in the last step (the controller's choice)
    # MoE: tokens routed to each expert, [MoE layer][expert] (cumulative; empty for a dense model)
    expert_load: list[list[int]] = field(default_factory=list)
    # KV connectors' counters (cumulative): tiers (saved_blocks, host_hit_blocks, ...) and disaggregated
    # transfer (kv_pulls, kv_pull_fallbacks, kv_bytes_received/_sent, kv_held_requests, ...)
    kv_connector: dict[str, int] = field(default_factory=dict)
    # Steps since the last stats (engine/step_records.py STEP_FIELDS); empty unless config.step_records
    steps: list[list[float]] = field(default_factory=list)
    num_cached_free_blocks: int = 0  # free blocks still holding a cached prefix (refreshed a few times a second)
