"""MoE expert load travels from the fused MoE layers through the step result and the engine's stats to
/metrics (Prometheus text): every token of every step is routed to top-k experts in every MoE layer."""
from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tokenmill import LLM, SamplingParams
from tokenmill.serve.metrics import ServerMetrics


def test_expert_load_reaches_metrics(tiny):
    llm = LLM(tiny("mixtral"), dtype="float32", seed=0, max_num_batched_tokens=16)
    prompts = [[3 + i % 40 for i in range(n)] for n in (9, 30)]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    stats = llm.engine.stats()
    cfg = llm.engine.config.model.hf_config
    tokens_run = sum(len(p) for p in prompts) + 2 * (5 - 1)  # prompts, then each sampled token but the last
    assert len(stats.expert_load) == cfg.num_hidden_layers
    assert all(len(layer) == cfg.num_local_experts for layer in stats.expert_load)
    assert all(sum(layer) == tokens_run * cfg.num_experts_per_tok for layer in stats.expert_load)

    metrics = ServerMetrics("tiny-mixtral")
    metrics.on_engine_stats(stats)
    samples = {(s.labels.get("layer"), s.labels.get("expert")): s.value
               for fam in text_string_to_metric_families(metrics.render().decode())
               if fam.name == "tokenmill:moe_expert_tokens" for s in fam.samples if s.name.endswith("_total")}
    assert samples[("1", "3")] == stats.expert_load[1][3]
    assert sum(samples.values()) == sum(map(sum, stats.expert_load))
    assert b"tokenmill:moe_expert_load_imbalance" in metrics.render()


def test_dense_model_reports_no_expert_load(tiny):
    llm = LLM(tiny("llama"), dtype="float32")
    llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=2))
    assert llm.engine.stats().expert_load == []
