"""`tokenmill plan`: parameter, memory and roofline arithmetic against hand-worked examples; the CLI;
`--log-step-stats` in the engine."""
from __future__ import annotations

import json
import logging
import math
import os
import re

import pytest

from tokenmill.cli import main
from tokenmill.plan import get_hardware, load_model_shape, make_plan
from tokenmill.perf.hardware import Hardware, measure_local_cpu
from tokenmill.perf.memory import ModelShape, memory_plan
from tokenmill.perf.roofline import compute_bound_batch, decode_cost, prefill_cost

GiB = 2**30
H100 = get_hardware("h100")


def test_llama_8b_parameters_by_hand():
    s = load_model_shape("Llama-3.1-8B")
    attn = 4096 * 4096 * 2 + 2 * 4096 * 1024        # q, o + k, v (8 KV heads x 128)
    mlp = 3 * 4096 * 14336
    per_layer = attn + mlp + 2 * 4096               # + two RMSNorms
    embed = 128256 * 4096                           # untied: embedding and LM head
    assert s.params_total == 32 * per_layer + 2 * embed + 4096 == s.params_active
    assert s.params_total == pytest.approx(8.03e9, rel=0.002)


def test_kv_bytes_per_token():
    assert load_model_shape("Llama-3.1-8B").kv_bytes_per_token("bf16") == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert load_model_shape("Llama-3.1-8B").kv_bytes_per_token("fp8") == 64 * 1024
    # MLA: one latent (512) + the rope key (64) per layer, not per head
    assert load_model_shape("DeepSeek-V3").kv_bytes_per_token("bf16") == 61 * (512 + 64) * 2


@pytest.mark.parametrize("name,total,active", [
    ("Llama-3.1-70B", 70.6e9, 70.6e9), ("Llama-3.1-405B", 405.9e9, 405.9e9), ("Qwen3-0.6B", 0.596e9, 0.596e9),
    ("Qwen3-8B", 8.19e9, 8.19e9), ("Qwen3-32B", 32.8e9, 32.8e9), ("Qwen3-235B-A22B", 235.1e9, 22.2e9),
    ("Mixtral-8x7B", 46.7e9, 12.9e9), ("DeepSeek-V3", 671e9, 37.5e9), ("SmolLM2-135M", 134.5e6, 134.5e6)])
def test_presets_match_model_cards(name, total, active):
    s = load_model_shape(name)
    assert s.params_total == pytest.approx(total, rel=0.005)
    assert s.params_active == pytest.approx(active, rel=0.01)


def test_preset_lookup_is_forgiving():
    assert load_model_shape("meta-llama/llama-3.1-8b-instruct").name == "Llama-3.1-8B"
    assert load_model_shape(None).name in ("SmolLM2-135M", "SmolLM2-135M-Instruct.Q4_1")  # preset or its GGUF
    with pytest.raises(ValueError, match="does not exist.*or name a preset"):
        load_model_shape("no-such-model")


def test_local_config_json_alone(tmp_path, tiny):
    import shutil

    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(f"{tiny('qwen3')}/config.json", d / "config.json")
    s = load_model_shape(str(d))
    cfg = json.loads((d / "config.json").read_text())
    assert (s.hidden_size, s.num_layers, s.num_kv_heads, s.head_dim) == (64, 2, 2, 32) and s.qk_norm
    # exact against the real module's parameter count
    import torch
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**cfg))
    assert s.params_total == sum(p.numel() for p in model.parameters())


def test_param_count_matches_transformers_for_moe_and_mla():
    """Shapes shrunk from the presets, counted against the real modules (meta device: no memory)."""
    import torch
    import transformers

    cases = [
        dict(model_type="mixtral", hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, num_local_experts=4, num_experts_per_tok=2),
        dict(model_type="qwen3_moe", hidden_size=64, intermediate_size=96, moe_intermediate_size=48,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=300,
             num_experts=8, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[0],
             tie_word_embeddings=False),
        dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, vocab_size=300, n_routed_experts=8,
             n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=24, kv_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
             tie_word_embeddings=False),
    ]
    for cfg in cases:
        try:
            hf_cfg = transformers.AutoConfig.for_model(**cfg)
        except (ValueError, KeyError):
            pytest.skip(f"transformers lacks {cfg['model_type']}")
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
        s = ModelShape.from_hf_config(hf_cfg.to_dict())
        # DeepSeek-V3's routers hold their correction bias as a buffer: weights all the same
        bias = sum(b.numel() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias"))
        assert s.params_total == sum(p.numel() for p in model.parameters()) + bias, cfg["model_type"]


def test_h100_ratio_and_verdicts():
    assert H100.ops_per_byte("bf16") == pytest.approx(295, rel=0.01)
    p = make_plan(load_model_shape("Llama-3.1-8B"), H100, "bf16", "bf16", batch_size=1, input_len=2048,
                  output_len=256)
    assert p["decode"]["bound"] == "memory" and p["prefill"]["bound"] == "compute"
    assert p["prefill"]["arithmetic_intensity"] > 295 > p["decode"]["arithmetic_intensity"]
    # batch-1 decode ~ one pass over the weights (+ the KV): <= 3.35e12 / 16.06e9 ~ 209 tok/s
    wb = p["weight_bytes"]
    assert wb == 2 * p["params_total"]
    ctx = 2048 + 128
    expect = 3.35e12 / (wb + (ctx + 1) * 131072)
    assert p["decode"]["tokens_per_s_per_user"] == pytest.approx(expect, rel=1e-6)
    assert p["decode"]["tokens_per_s_total"] == p["decode"]["tokens_per_s_per_user"]
    # prefill of 2048 tokens: compute-bound, so TTFT >= FLOPs / peak; the LM head runs for the last token only
    head = 128256 * 4096
    flops = 2 * (p["params_total"] - 2 * head) * 2048 + 2 * head + 32 * 2 * 32 * 256 * 2048 * 2049 / 2
    assert p["prefill"]["flops"] == pytest.approx(flops)
    assert p["prefill"]["ttft_s"] == pytest.approx(flops / 989.4e12)


def test_decode_crossover_batch():
    s = load_model_shape("Llama-3.1-8B")
    # short context: intensity ~ B * 2P / (W + B * C * kvb) reaches 295 at a few hundred sequences
    b = compute_bound_batch(s, 128, 295, "bf16", "bf16")
    assert b is not None and 300 < b < 700
    assert decode_cost(s, b, 128, "bf16", "bf16").arithmetic_intensity >= 295
    assert decode_cost(s, b - 1, 128, "bf16", "bf16").arithmetic_intensity < 295
    # long context: each sequence's KV reads grow as fast as its FLOPs (~4 FLOP/byte with GQA x4): never
    assert compute_bound_batch(s, 8192, 295, "bf16", "bf16") is None
    p = make_plan(s, H100, input_len=8192, output_len=0)
    assert p["decode"]["compute_bound_batch_size"] is None


def test_memory_fit_and_min_gpus():
    s = load_model_shape("Llama-3.1-8B")
    m = memory_plan(s, "bf16", "bf16", 4096, 80 * GiB, 1, 0.9)
    assert m.kv_bytes_per_seq == 4096 * 128 * 1024 == 512 * 2**20
    assert m.max_concurrent_seqs == int((0.9 * 80 * GiB - m.weight_bytes) // (512 * 2**20))
    assert m.min_gpus == 1
    # 70B bf16: 141 GB of weights; 1.5x that needs 3 x 80 GiB
    assert memory_plan(load_model_shape("Llama-3.1-70B"), "bf16", "bf16", 4096, 80 * GiB).min_gpus == 3
    assert memory_plan(load_model_shape("Llama-3.1-405B"), "fp8", "fp8", 4096, 80 * GiB).min_gpus == 8
    too_big = make_plan(load_model_shape("Llama-3.1-70B"), H100)
    assert too_big["max_concurrent_seqs"] == 0 and any("no room" in n for n in too_big["notes"])
    assert make_plan(load_model_shape("Llama-3.1-70B"), H100, tp=4)["max_concurrent_seqs"] > 0


def test_moe_decode_touches_only_routed_experts():
    s = load_model_shape("Mixtral-8x7B")
    one = decode_cost(s, 1, 1024, "bf16", "bf16")
    many = decode_cost(s, 256, 1024, "bf16", "bf16")
    assert one.bytes < 0.35 * s.params_total * 2          # ~2 of 8 experts per layer
    assert many.bytes > s.params_total * 2                # all experts (+ KV)
    assert prefill_cost(s, 1, 2048, "bf16", "bf16").bytes > s.params_total * 2 * 0.99


def test_fp8_on_a100_falls_back_to_bf16():
    p = make_plan(load_model_shape("Llama-3.1-8B"), get_hardware("a100"), weight_dtype="fp8")
    assert p["compute_dtype"] == "bf16" and p["weight_bytes"] == p["params_total"]
    assert any("no fp8" in n for n in p["notes"])


def test_local_cpu_is_measured():
    hw = measure_local_cpu(("fp32",), bandwidth_bytes=32 * 2**20, matmul_n=256, reps=2)
    assert hw.measured and hw.bandwidth > 1e8 and hw.flops["fp32"] > 1e8 and hw.memory_bytes > 2**30


def test_cli_json_keys(capsys):
    assert main(["plan", "Llama-3.1-8B", "--hardware", "h100", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    for key in ("params_total", "params_active", "weight_bytes", "kv_bytes_per_token", "max_concurrent_seqs",
                "min_gpus"):
        assert isinstance(p[key], int), key
    assert set(p["prefill"]) >= {"arithmetic_intensity", "bound"}
    assert set(p["decode"]) >= {"arithmetic_intensity", "bound", "tokens_per_s_per_user", "tokens_per_s_total"}
    assert p["prefill"]["bound"] == "compute" and p["decode"]["bound"] == "memory"
    assert p["kv_bytes_per_token"] == 131072


def test_cli_text_and_errors(capsys):
    assert main(["plan", "DeepSeek-V3", "--hardware", "H200", "--tp", "8", "--weight-dtype", "fp8"]) == 0
    out = capsys.readouterr().out
    assert "671" in out and "active" in out and "compute-bound" in out
    assert main(["plan", "Llama-3.1-8B", "--hardware", "tpu-v9"]) == 2
    assert "unknown hardware" in capsys.readouterr().err
    assert main(["plan", "--list"]) == 0
    assert "MI300X" in capsys.readouterr().out


def test_hardware_catalog_sanity():
    for name in ("h100", "h200", "b200", "a100", "l40s", "mi300x"):
        hw = get_hardware(name)
        assert isinstance(hw, Hardware) and hw.flops["bf16"] > 1e14 and hw.bandwidth > 5e11
        assert hw.flops["fp32"] < hw.flops["bf16"] and math.isfinite(hw.ops_per_byte("bf16"))


def test_log_step_stats(tiny, caplog):
    from tokenmill import LLM, SamplingParams

    llm = LLM(tiny("llama"), dtype="float32", log_step_stats=True, kv_cache_memory_bytes="16MiB")
    with caplog.at_level(logging.INFO, logger="tokenmill"):
        llm.generate(["Hello, world!", "The quick brown fox"], SamplingParams(max_tokens=3, ignore_eos=True),
                     use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if re.match(r"step \d+: ", r.getMessage())]
    assert len(lines) == 3  # one prefill step (+ first token), two decode steps
    assert "batch 2" in lines[-1] and "2 tokens" in lines[-1] and "MFU" in lines[-1] and "MBU" in lines[-1]
    llm.engine.shutdown()


# -- parallelism (issue 17, item 7) -------------------------------------------------------------------------
def _parallel(name, hw="h100", **kw):
    return make_plan(load_model_shape(name), get_hardware(hw), "bf16", "bf16", **kw)["parallel"]


def test_tp2_weights_per_device_by_hand():
    """Llama-3.1-8B: every matrix is split in two (8 KV heads, 128256 vocab rows), norms replicated."""
    h, inter, vocab = 4096, 14336, 128256
    sharded = 32 * (2 * h * h + 2 * h * 1024 + 3 * h * inter) + 2 * vocab * h  # q,o + k,v + MLP; embed + head
    replicated = 32 * 2 * h + h                                                 # RMSNorms + final norm
    par = _parallel("Llama-3.1-8B", tp=2)
    assert par["stages"][0]["weight_bytes"] == 2 * (sharded // 2 + replicated)
    assert par["stages"][0]["kv_bytes_per_token"] == 2 * 32 * 4 * 128 * 2      # 4 of 8 KV heads per rank


def test_kv_heads_replicate_when_fewer_than_ranks():
    """Qwen3-235B-A22B (4 KV heads) on TP=8: each rank keeps one KV head, a quarter of the K/V weights and
    cache, not an eighth; experts are 1/8 per rank under TP and EP alike."""
    from tokenmill.perf.parallel import Split, attention_params_per_rank, stage_params

    s = load_model_shape("Qwen3-235B-A22B")
    h, d = 4096, 128
    assert attention_params_per_rank(s, 8) == 2 * h * 64 * d / 8 + 2 * h * 1 * d + 2 * d  # q,o/8 + k,v + q/k norm
    tp, ep = _parallel("Qwen3-235B-A22B", tp=8), _parallel("Qwen3-235B-A22B", tp=8, expert_parallel=True)
    assert tp["stages"][0]["kv_bytes_per_token"] == 94 * 2 * 1 * d * 2
    assert tp["stages"][0]["weight_bytes"] == ep["stages"][0]["weight_bytes"]
    experts = 94 * 128 * 3 * h * 1536
    router_norms = 94 * (h * 128 + 2 * h) + h
    table = 151936 // 8 * h
    expect = 94 * attention_params_per_rank(s, 8) + experts / 8 + router_norms + 2 * table
    assert stage_params(s, Split(8, 1, True))[0] == pytest.approx(expect)


def test_pp_stages_sum_to_the_whole_and_largest_stage():
    from tokenmill.perf.parallel import Split, layers_per_stage, stage_params

    s = load_model_shape("Llama-3.1-70B")
    assert sum(stage_params(s, Split(1, 2))) == s.params_total
    assert layers_per_stage(80, 3) == [27, 27, 26]
    assert _parallel("Llama-3.1-70B", pp=3)["largest_stage"] == 0       # one more layer + the embedding
    assert _parallel("Llama-3.1-70B", pp=2)["largest_stage"] == 1       # the LM head (+ final norm)
    tied = load_model_shape("Qwen3-0.6B")                               # the last stage needs its own head copy
    assert sum(stage_params(tied, Split(1, 2))) == tied.params_total + 151936 * 1024
    pp2 = _parallel("Llama-3.1-70B", tp=4, pp=2)
    assert [st["kv_bytes_per_token"] for st in pp2["stages"]] == [40 * 2 * 2 * 128 * 2] * 2


def test_comm_bytes_and_time_by_hand():
    """70B, TP=8 x PP=2 over 2 nodes: 161 all-reduces of 8192 x 2 bytes per token (2 per layer + embedding),
    a ring sends 2 x 7/8 of each; the stage boundary sends hidden + residual on InfiniBand."""
    par = _parallel("Llama-3.1-70B", tp=8, pp=2, batch_size=4)
    c = par["comm_per_token"]
    payload = 8192 * 2
    assert (c["all_reduce_payload"], c["all_reduces"]) == (payload, 161)
    assert c["tp_sent"] == 161 * 2 * 7 / 8 * payload
    assert c["logits_gather_sent"] == 7 * 16032 * 2                     # 128256 / 8 rows from each other rank
    assert c["pp_sent_per_boundary"] == 2 * payload
    nv, ib = 450e9, 50e9
    assert par["decode_comm"]["tp_s"] == pytest.approx(162 * 5e-6 + 4 * (c["tp_sent"] + c["logits_gather_sent"]) / nv)
    assert par["decode_comm"]["pp_s"] == pytest.approx(10e-6 + 4 * 2 * payload / ib)
    assert par["decode_step_s"] == pytest.approx(par["decode_compute_s"] + par["decode_comm"]["total_s"])
    # MoE: the all-to-all comparison figure is top_k x hidden out and back per token per MoE layer
    moe = _parallel("Qwen3-235B-A22B", tp=8, expert_parallel=True)["comm_per_token"]
    assert moe["all_to_all_per_moe_layer"] == 2 * 8 * 4096 * 2 and moe["moe_layers"] == 94


def test_ep_busiest_rank_matches_sampling():
    """The expected busiest rank's experts (binomial model) against routing sampled uniformly."""
    import random

    from tokenmill.perf.parallel import Split, busiest_rank_experts

    s = load_model_shape("Qwen3-235B-A22B")
    rng = random.Random(0)
    for tokens in (1, 4):
        busiest = []
        for _ in range(2000):
            touched = {e for _ in range(tokens) for e in rng.sample(range(128), 8)}
            busiest.append(max(sum(1 for e in touched if e // 16 == r) for r in range(8)))
        mean, expect = busiest_rank_experts(s, Split(8, 1, True), tokens)
        assert expect == pytest.approx(sum(busiest) / len(busiest), rel=0.03)
        assert busiest_rank_experts(s, Split(8, 1, False), tokens) == (mean, mean)   # TP: every rank a slice
    ep1 = _parallel("Qwen3-235B-A22B", "h200", tp=8, expert_parallel=True)
    tp1 = _parallel("Qwen3-235B-A22B", "h200", tp=8)
    assert ep1["decode_step_s"] > tp1["decode_step_s"]                   # batch 1: EP waits on its busiest rank
    ep256 = _parallel("Qwen3-235B-A22B", "h200", tp=8, expert_parallel=True, batch_size=256)
    assert ep256["moe"]["decode_imbalance_s"] == pytest.approx(0, abs=1e-9)  # every expert busy: balanced


@pytest.mark.parametrize("model,hw,nodes,per_node,expect", [
    ("Llama-3.1-70B", "h100", 1, 8, "TP=8"), ("Llama-3.1-70B", "h100", 2, 8, "TP=8 x PP=2"),
    ("Qwen3-235B-A22B", "h200", 1, 8, "TP=8 with EP"), ("Qwen3-235B-A22B", "h100", 2, 8, "TP=8 x PP=2 with EP"),
    ("SmolLM2-135M", "h100", 1, 8, "TP=1 x PP=8"), ("Qwen3-235B-A22B", "h100", 1, 8, "None")])
def test_rules_pick(model, hw, nodes, per_node, expect):
    from tokenmill.perf.parallel import choose_split

    c = choose_split(load_model_shape(model), get_hardware(hw), "bf16", nodes, per_node)
    assert str(c["split"]) == expect
    if c["split"] is None:                                               # 438 GiB of bf16 weights on 8 x 80 GiB
        assert c["min_devices"] == 9 and "does not fit" in c["reasons"][0]


def test_cli_parallel_lines(capsys):
    assert main(["plan", "Llama-3.1-70B", "--hardware", "h100", "--num-nodes", "2", "--devices-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "on 16 x H100-SXM" in out and "split             TP=8 x PP=2" in out
    for line in ("per device        stage 1 (40 layers + LM head)", "largest stage     1", "TP traffic", "PP traffic",
                 "decode comm", "InfiniBand-NDR", "100GbE", "rules pick        TP=8 x PP=2"):
        assert line in out, line
    assert main(["plan", "Qwen3-235B-A22B", "--hardware", "h200", "-tp", "8", "--enable-expert-parallel",
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["parallel"]["expert_parallel"] and p["parallel"]["moe"]["experts_per_rank"] == 16
    assert p["max_concurrent_seqs"] == p["parallel"]["max_concurrent_seqs"]
    assert main(["plan", "Llama-3.1-8B", "--hardware", "h100", "-tp", "2", "--interconnect", "pcie",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parallel"]["decode_comm"]["tp_link"] == "PCIe-Gen5-x16"


@pytest.mark.parametrize("args,message", [
    (["-tp", "3"], "--tensor-parallel-size 3 does not divide the model's 64 attention heads (8 KV heads); "
                   "sizes that work: 1, 2, 4, 8, 16, 32, 64"),
    (["-pp", "81"], "--pipeline-parallel-size 81 is more than the model's 80 layers"),
    (["-tp", "0"], "must be at least 1"),
    (["-tp", "2", "--enable-expert-parallel"], "needs a mixture-of-experts model; Llama-3.1-70B is dense"),
    (["-tp", "8", "-pp", "2", "--num-nodes", "1"], "needs 16 devices; 1 node(s) x 8 have 8"),
    (["--num-nodes", "0"], "--num-nodes must be at least 1"),
    (["-tp", "2", "--interconnect", "carrier-pigeon"], "unknown interconnect 'carrier-pigeon'")])
def test_cli_refuses_bad_parallel_flags(capsys, args, message):
    assert main(["plan", "Llama-3.1-70B", "--hardware", "h100", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


# -- disaggregated prefill/decode (issue 18, item 5) --------------------------------------------------------
def _disagg(model="Llama-3.1-70B", xpyd=(2, 2), rate=4.0, input_len=4096, output_len=256, **kw):
    from tokenmill.plan.disagg import Traffic, disagg_plan

    traffic_kw = {k: kw.pop(k) for k in ("long_fraction", "long_input_len") if k in kw}
    return disagg_plan(load_model_shape(model), H100, *xpyd, Traffic(rate, input_len, output_len, **traffic_kw),
                       **kw)


def test_disagg_kv_bytes_and_transfer_time_by_hand():
    """70B: 80 layers x 8 KV heads x 128 x (K and V) x 2 bytes per token; TP=4 ranks each send their shard on
    their own InfiniBand NDR NIC (50 GB/s, 10 us)."""
    from tokenmill.perf.hardware import get_interconnect

    p = _disagg(input_len=4096)
    nbytes = 4096 * 80 * 8 * 128 * 2 * 2
    assert p["tp"] == 4 and p["devices"] == 16                  # 141 GB of weights x 1.5 -> 3 H100s -> TP=4
    assert p["disaggregated"]["kv_bytes_per_request"][4096] == nbytes == 1_342_177_280
    assert p["disaggregated"]["kv_transfer_s"][4096] == pytest.approx(10e-6 + nbytes / (4 * 50e9))
    nv = _disagg(input_len=4096, kv_dtype="fp8", link=get_interconnect("nvlink"))
    assert nv["disaggregated"]["kv_bytes_per_request"][4096] == nbytes // 2
    assert nv["disaggregated"]["kv_transfer_s"][4096] == pytest.approx(5e-6 + nbytes / 2 / (4 * 450e9))
    eight = _disagg("Llama-3.1-8B", (1, 1), input_len=1000)     # TP=1: one NIC
    assert eight["tp"] == 1
    assert eight["disaggregated"]["kv_transfer_s"][1000] == pytest.approx(10e-6 + 1000 * 32 * 8 * 128 * 4 / 50e9)


def test_disagg_queue_and_little_law():
    """M/D/1 wait by hand; the decode pool's batch satisfies Little's law B = rate x (output - 1) x step(B)."""
    from tokenmill.plan.disagg import mg1

    q = mg1(2.0, [(1.0, 0.1)])
    assert q["rho"] == pytest.approx(0.2) and q["wait_s"] == pytest.approx(0.2 * 0.1 / (2 * 0.8))
    assert q["wait_p99_s"] == pytest.approx(q["wait_s"] / 0.2 * math.log(20))
    assert mg1(10.0, [(1.0, 0.1)])["wait_s"] == math.inf
    p = _disagg(rate=4.0)
    dec = p["disaggregated"]["decode"]
    assert dec["decode_batch"] == pytest.approx(4.0 / 2 * 255 * dec["step_s"], rel=1e-6)
    co = p["colocated"]   # every running request gets one token per step: tokens/s = B / mean step
    assert co["decode_batch"] / co["itl_mean_s"] == pytest.approx(4.0 / 4 * 255, rel=1e-6)


def test_disagg_colocated_itl_p99_grows_with_prompt_length():
    """A colocated decode step that carries a prompt chunk lasts the chunk's compute: longer prompts, longer
    chunks (up to --max-num-batched-tokens) and more of them. The decode pool's steps carry no prefill: they
    grow only by the KV they read."""
    co, dis = [], []
    for n in (256, 1024, 2048, 4096, 8192):
        p = _disagg(rate=2.0, input_len=n)
        assert not p["colocated"]["saturated"] and not p["disaggregated"]["saturated"]
        co.append(p["colocated"]["itl_p99_s"])
        dis.append(p["disaggregated"]["itl_p99_s"])
    assert co == sorted(co) and co[-1] > 5 * co[0]
    assert max(dis) < 1.2 * min(dis)
    assert co[-1] > 5 * dis[-1]
    # more than 1% of the steps carry a chunk: P99 is the longest chunk's step; fewer: a plain decode step
    busy, idle = _disagg(rate=4.0)["colocated"], _disagg(rate=0.2)["colocated"]
    assert busy["mixed_step_fraction"] > 0.01 and busy["itl_p99_s"] == busy["chunk_step_s"]
    assert idle["mixed_step_fraction"] < 0.01 and idle["itl_p99_s"] == idle["decode_step_s"]


def test_disagg_verdict_flips_across_break_even():
    p = _disagg(rate=1.0)
    be, top = p["break_even_rate"], p["disaggregated_max_rate"]
    assert be is not None and 0 < be < top < p["colocated_max_rate"]     # 2P2D: 4k prompts load the prefill pool
    below, above = _disagg(rate=0.8 * be), _disagg(rate=1.2 * be)
    assert not below["pays"] and below["verdict"].startswith("disaggregation wastes hardware here: at ")
    assert "prefill pool is" in below["verdict"] and "it would pay from" in below["verdict"]
    assert above["pays"] and above["verdict"].startswith("pays: colocated ITL P99 ")
    over = _disagg(rate=1.1 * top)                                        # xPyD's prefill pool cannot keep up
    assert not over["pays"] and over["disaggregated"]["prefill"]["saturated"]
    assert "the prefill pool of 2P2D saturates" in over["verdict"]
    # the same flip over the share of long prompts at a fixed rate
    mix = _disagg("Llama-3.1-8B", (1, 1), rate=2.0, input_len=512, long_fraction=0.05, long_input_len=8192)
    f = mix["break_even_long_fraction"]
    assert f is not None and 0.05 < f < 1
    lo = _disagg("Llama-3.1-8B", (1, 1), rate=2.0, input_len=512, long_fraction=0.9 * f, long_input_len=8192)
    hi = _disagg("Llama-3.1-8B", (1, 1), rate=2.0, input_len=512, long_fraction=min(1.0, 1.1 * f),
                 long_input_len=8192)
    assert not lo["pays"] and hi["pays"]


def test_cli_disaggregate_lines(capsys):
    assert main(["plan", "Llama-3.1-70B", "--hardware", "H100-SXM", "--disaggregate", "2P2D", "--input-len", "4096",
                 "--output-len", "256", "--request-rate", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Llama-3.1-70B on H100-SXM, 2P2D vs colocated: 4 instances of TP=4 = 16 devices")
    for line in ("  traffic           4 req/s (Poisson); prompts 100% of 4096 tokens, 256 output tokens",
                 "  KV per request    1.25 GiB (4096 tokens x 320 KiB); transfer 6.7 ms over 4 x InfiniBand-NDR",
                 "    TTFT            mean ", "    ITL             P50 ", "of steps carry a prompt chunk",
                 "  2P2D              2 prefill + 2 decode instances", "    prefill pool    ",
                 "    decode pool     ITL P50 = P99 = ", "  break-even        2P2D pays from ",
                 "  verdict           pays: colocated ITL P99 ", "  assumes           step time = roofline"):
        assert line in out, line
    assert main(["plan", "Llama-3.1-8B", "--hardware", "h100", "--disaggregate", "1p1d", "--input-len", "512",
                 "--request-rate", "1", "--long-fraction", "0.05", "--long-input-len", "8192", "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["xpyd"] == "1P1D" and p["classes"] == [[0.95, 512], [0.05, 8192]]
    assert p["verdict"].startswith("disaggregation wastes hardware here") and p["break_even_long_fraction"] > 0.05
    assert set(p["colocated"]) >= {"itl_p50_s", "itl_p99_s", "ttft", "prefill_busy", "decode_batch"}
    assert set(p["disaggregated"]) >= {"itl_p99_s", "ttft", "prefill", "decode", "kv_transfer_s"}


# local-cpu: one machine (2 threads), served whole or split; a fixed stand-in for the measured loopback KV link
LOCAL_CPU = Hardware("local-cpu", 24 * GiB, 20e9, {"fp32": 100e9}, measured=True, details={"threads": 2})


def test_disagg_local_cpu_is_one_machine_split_or_not():
    """On local-cpu colocated is one instance with every core (what `tokenmill serve` runs) and 1P1D two instances
    with half of them each (what --disaggregate starts): half the FLOP/s and bandwidth, so their steps take twice
    as long and every prompt queues on one half-machine. The KV a decode instance receives is CPU work on its
    own cores: each pull stretches the decode step beside it by the transfer time."""
    from tokenmill.plan.disagg import Traffic, disagg_plan, layouts
    from tokenmill.perf.hardware import Interconnect

    shape = load_model_shape("SmolLM2-135M")
    kw = dict(weight_dtype="fp32", kv_dtype="fp32", compute_dtype="fp32")
    lay = layouts(shape, LOCAL_CPU, 1, 1, 1, chunk=2048, **kw)
    assert lay.colocated_instances == 1 and lay.receive_on_decode_cores
    assert (lay.colocated.peak, lay.colocated.bandwidth) == (100e9, 20e9)
    assert (lay.disaggregated.peak, lay.disaggregated.bandwidth) == (50e9, 10e9)
    assert sum(lay.disaggregated.prefill_chunks(1024)) == pytest.approx(2 * sum(lay.colocated.prefill_chunks(1024)))
    assert lay.disaggregated.decode_step(1, 100) == pytest.approx(2 * lay.colocated.decode_step(1, 100))
    gpu = layouts(shape, H100, 1, 1, 1, chunk=2048, **kw)   # catalog hardware: x + y like instances either way
    assert gpu.colocated is gpu.disaggregated and gpu.colocated_instances == 2 and not gpu.receive_on_decode_cores

    link = Interconnect("loopback-TCP", 150e6, 1e-3, "node", "a stand-in for the measured link")
    # benchmarks/disagg.py's traffic: 0.5 chat req/s (64 tokens) + one 1024-token prompt per 15 s, 32 out
    p = disagg_plan(shape, LOCAL_CPU, 1, 1, Traffic(0.5667, 64, 32, 0.1176, 1024), link=link, **kw)
    co, dis = p["colocated"], p["disaggregated"]
    assert co["instances"] == 1 and co["rate_per_instance"] == pytest.approx(0.5667)
    xfer = dis["kv_transfer_s"]
    assert xfer[1024] == pytest.approx(1e-3 + 1024 * 2 * 30 * 3 * 64 * 4 / 150e6)  # 30 layers x 3 KV heads x 64
    dec = dis["decode"]
    assert dec["receiving"] == pytest.approx(0.5667 * (0.8824 * xfer[64] + 0.1176 * xfer[1024]), rel=1e-3)
    assert dis["itl_p50_s"] == dec["step_s"] == pytest.approx(2 * co["itl_p50_s"], rel=0.05)
    assert dis["itl_p99_s"] == pytest.approx(dec["step_s"] + xfer[64])  # > 1% of the gaps wait on a chat pull
    assert dis["ttft"]["mean_s"] > 2 * co["ttft"]["mean_s"]
    assert p["verdict"].startswith("pays: colocated ITL P99 ")     # a chat prompt's chunk step vs a pull's stall
    assert "1/2 of its FLOP/s and memory bandwidth" in p["notes"][0]


def test_cli_disaggregate_local_cpu_measures_the_kv_link(capsys):
    import torch

    threads = torch.get_num_threads()
    assert main(["plan", "SmolLM2-135M", "--hardware", "local-cpu", "--disaggregate", "1P1D", "--input-len", "64",
                 "--output-len", "32", "--long-input-len", "1024", "--long-fraction", "0.12", "--request-rate", "0.5",
                 "--json"]) == 0
    p = json.loads(capsys.readouterr().out)
    assert p["kv_link"] == "loopback-TCP" and "measured now" in p["kv_link_about"]
    assert 0 < p["kv_link_bandwidth"] < math.inf and p["kv_link_latency"] >= 0
    assert p["colocated"]["instances"] == 1 and torch.get_num_threads() == threads


@pytest.mark.parametrize("args,message", [
    (["--disaggregate", "2P0D"], "--disaggregate takes xPyD: x >= 1 prefill and y >= 1 decode instances "
                                 "(e.g. 1P1D, 2P4D), got '2P0D'"),
    (["--disaggregate", "PD"], "got 'PD'"),
    (["--disaggregate", "2x2"], "got '2x2'"),
    (["--disaggregate", "1P1D", "-pp", "2"], "--disaggregate plans instances of -tp devices each"),
    (["--disaggregate", "1P1D", "-tp", "3"], "--tensor-parallel-size 3 does not divide"),
    (["--disaggregate", "1P1D", "--long-fraction", "0.1"], "--long-fraction needs --long-input-len"),
    (["--disaggregate", "1P1D", "--request-rate", "-1"], "--request-rate must be >= 0"),
    (["--disaggregate", "1P1D", "--output-len", "1"], "--output-len must be at least 2"),
    (["--disaggregate", "1P1D", "-tp", "1"], "the weights leave no KV room")])
def test_cli_refuses_bad_disaggregate(capsys, args, message):
    assert main(["plan", "Llama-3.1-70B", "--hardware", "h100", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1


@pytest.fixture(scope="module")
def kmix_gguf():
    """Tiny GGUFs whose 2-D weights take Q4_K, Q6_K, Q8_0 in turn (norms F32): qwen2 (untied LM head) and
    llama (the LM head is the embedding's blocks)."""
    from gguf_models import quantized_gguf

    types = ("Q4_K", "Q6_K", "Q8_0")
    return {"untied": quantized_gguf("qwen2", types, hidden=512, intermediate=1024),
            "tied": quantized_gguf("llama", types, hidden=512, intermediate=1024)}


def _file_tensors(path):
    """{name: (ggml type, bytes)} straight from gguf-py's reader: the reference the plan must meet (but for
    llama's rope_freqs, which the engine reads as the rope's config, not as a weight)."""
    import gguf

    return {t.name: (t.tensor_type.name, int(t.n_bytes)) for t in gguf.GGUFReader(path).tensors
            if t.name != "rope_freqs.weight"}


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_gguf_plan_weights_are_the_files_block_bytes(capsys, kmix_gguf, which):
    """Served in its own blocks, a GGUF's planned weight memory is the sum of its tensors' bytes (Q4_K 4.5 bits
    per weight, Q6_K 6.5625, Q8_0 8.5, norms F32), not 16 or 32 bits per weight; decode reads every tensor once
    but only one row per token of an untied embedding (a tied head reads the embedding's blocks in full)."""
    path = kmix_gguf[which]
    tensors = _file_tensors(path)
    total = sum(b for _, b in tensors.values())
    assert {k for k, _ in tensors.values()} == {"Q4_K", "Q6_K", "Q8_0", "F32"}
    assert main(["plan", path, "--hardware", "h100", "--batch-size", "1", "--input-len", "16",
                 "--output-len", "0", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weight_dtype"] == "gguf" and plan["weight_bytes"] == total
    assert plan["gguf"]["bytes"] == total and 4.5 < plan["gguf"]["bits_per_weight"] < 8.5
    assert set(plan["gguf"]["types"]) == {"Q4_K", "Q6_K", "Q8_0", "F32"}
    shape = load_model_shape(path)
    embd = tensors["token_embd.weight"][1]
    read = total if which == "tied" else total - embd + embd // shape.vocab_size
    one_token = decode_cost(shape, 1, 0, "gguf", "bf16").bytes - shape.kv_bytes_per_token("bf16")
    assert one_token == pytest.approx(read, rel=1e-9)
    assert memory_plan(shape, "gguf", "bf16", 16, 2**34).weight_bytes == total


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_gguf_plan_weights_are_what_the_engine_loads(kmix_gguf, which):
    """The engine's native load (blocks memory-mapped, norms float, a tied head = the embedding's blocks) takes
    exactly the bytes the plan counts."""
    import torch
    from transformers import AutoConfig

    from tokenmill.layers.attention import get_attention_backend
    from tokenmill.models.gguf import gguf_to_hf_dir
    from tokenmill.models.loader import load_model

    path = kmix_gguf[which]
    d = gguf_to_hf_dir(path, "native")
    model = load_model(d, AutoConfig.from_pretrained(d), torch.float32, "cpu", get_attention_backend("cpu"), 256)
    assert model.checkpoint_bytes_read == load_model_shape(path).weight_bytes("gguf")


def test_log_step_stats_counts_a_native_gguf_blocks(kmix_gguf):
    """--log-step-stats' MBU on a GGUF served in its own blocks counts the blocks' bytes, not float weights."""
    from tokenmill import LLM
    from tokenmill.perf.roofline import decode_cost

    path = kmix_gguf["untied"]
    llm = LLM(path, dtype="float32", log_step_stats=True, kv_cache_memory_bytes="16MiB")
    try:
        stats = llm.engine.step_stats
        assert stats.weight_dtype == "gguf" and stats.shape.gguf.total == load_model_shape(path).gguf.total
        float_bytes = decode_cost(stats.shape, 1, 0, "fp32", "fp32").bytes
        assert decode_cost(stats.shape, 1, 0, stats.weight_dtype, "fp32").bytes < float_bytes / 3
    finally:
        llm.engine.shutdown()


def test_gguf_plan_splits_block_bytes_and_prints_bits(capsys, kmix_gguf):
    path = kmix_gguf["untied"]
    total = sum(b for _, b in _file_tensors(path).values())
    assert main(["plan", path, "--hardware", "h100", "-pp", "2", "--json"]) == 0
    stages = json.loads(capsys.readouterr().out)["parallel"]["stages"]
    assert sum(st["weight_bytes"] for st in stages) == pytest.approx(total, rel=1e-6)
    assert main(["plan", path, "--hardware", "h100"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"weights gguf,", out) and re.search(r"bits/weight \((Q\d_\w+ \d+%, ){2}", out), out
    # TP=4 gives the attention output 128 input columns per rank: less than a K-quant block (256 values)
    assert main(["plan", path, "--hardware", "h100", "-tp", "2"]) == 0
    assert "float32" not in capsys.readouterr().out
    assert main(["plan", path, "--hardware", "h100", "-tp", "4"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"note: TP=4 .* cut Q\d_K blocks: the engine holds those shards as float32", out), out


def test_gguf_plan_dequantize_counts_float_weights(capsys, kmix_gguf):
    path = kmix_gguf["untied"]
    assert main(["plan", path, "--hardware", "h100", "--gguf-weights", "dequantize", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["weight_dtype"] == "bf16" and "gguf" not in plan
    assert plan["weight_bytes"] == 2 * load_model_shape(path).params_total
    with pytest.raises(SystemExit) as e:
        main(["plan", path, "--gguf-weights", "packed"])
    assert e.value.code == 2


def test_default_model_plan_is_its_q4_1_blocks(capsys):
    from tokenmill.models.gguf import weight_bits
    from tokenmill.models.shape import default_gguf

    if default_gguf() is None:
        pytest.skip("default model not installed")
    assert main(["plan", "--hardware", "h100", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    # Q4_1 layers (5 bits), a Q8_0 embedding (8.5 bits, a fifth of the weights), F32 norms
    assert plan["weight_dtype"] == "gguf" and 5.0 <= plan["gguf"]["bits_per_weight"] < 6.0
    bits, _ = weight_bits(default_gguf())  # the loader's own tensor table (gguf-py's reader takes 3 s on this file)
    assert plan["weight_bytes"] == pytest.approx(bits * plan["gguf"]["weights"] / 8, rel=1e-12)


def test_int4_counts_its_q4_1_scales():
    from tokenmill.perf.memory import dtype_bytes

    assert dtype_bytes("int4") * 8 == 5.0  # 4-bit values + an fp16 scale and min per 32
    with pytest.raises(ValueError, match="gguf:<bits per weight>"):
        dtype_bytes("gguf:lots")
