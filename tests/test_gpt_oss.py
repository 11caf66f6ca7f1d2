"""gpt-oss against transformers, float32: the tiny random model of tests/models.py (GPT_OSS_ARCHS: sliding and
full layers alternating with a window shorter than the prompts, YaRN rope, q/k/v/o biases, non-zero sinks, 4
experts top-2 with router and expert biases, a swiglu_limit the activations reach) through the engine (chunked
prefill, preemption, a prefix-cache hit, TP=2 and EP); the same model's experts as an MXFP4 checkpoint (OpenAI's
*_blocks / *_scales layout, quantized here) against transformers on its dequantized copy; the attention sinks
in the C kernel against the torch path; the plan preset; the harmony reasoning parser, and the chat API giving
it special tokens."""
from __future__ import annotations

import json
import os
import random
import shutil

import pytest
import torch

from test_attention import _run_step
from test_gemma3 import (GREEDY, _assert_matches, check_chunked_preempted_matches_transformers,
                         check_prefix_hit_matches_transformers)
from test_model_exactness import _hf_reference, _prompts
from test_parallel_engine import _check_plan_agrees
from tokenmill import LLM
from tokenmill.layers.attention import cpu_kernels
from tokenmill.layers.attention.cpu import PagedAttentionBackend


def test_greedy_matches_transformers_with_chunking_and_preemption(tiny):
    path = tiny("gpt_oss")
    # prompts of 1..300 tokens (the window is 24) in 64-token steps, and a cache too small for ~800 tokens of
    # work, so preemption is certain
    kernels = check_chunked_preempted_matches_transformers(path)
    assert kernels["decoder_stack"].startswith("off: gpt-oss layers") and kernels["attention"] == "cpu-paged-c"


def test_prefix_cache_hit_matches_transformers(tiny):
    check_prefix_hit_matches_transformers(tiny("gpt_oss"))


def test_sinks_and_biases_matter(tiny, tmp_path):
    """The features under test change the output: zeroing the sinks, or the expert biases, moves the logprobs."""
    from safetensors.torch import load_file, save_file

    src = tiny("gpt_oss")
    prompt = _prompts(400)[3][:40]
    base = _hf_reference(src, [prompt])[0][1][0]
    for suffix in ("sinks", "experts.down_proj_bias"):
        dst = tmp_path / suffix
        shutil.copytree(src, dst)
        tensors = load_file(os.path.join(src, "model.safetensors"))
        save_file({k: torch.zeros_like(v) if k.endswith(suffix) else v for k, v in tensors.items()},
                  os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        assert (_hf_reference(str(dst), [prompt])[0][1][0] - base).abs().max() > 0.01, suffix


@pytest.mark.skipif(not cpu_kernels.supports(torch.float32), reason="no C compiler")
@pytest.mark.parametrize("D", [32, 64])  # the generic loops, and the D=64 specialised item
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_sinks_in_c_kernel_match_torch(D, dtype, tol):
    """Decodes and short chunks with sinks through paged_attention.c equal the torch path (SDPA-free)."""
    sinks = torch.linspace(-2.0, 3.0, 8)
    lens, query = [1, 17, 40, 33, 100], [1, 1, 3, 1, 16]
    ctx = [n - q for n, q in zip(lens, query)]
    a, ref = _run_step(PagedAttentionBackend("cpu"), dtype, 8, 2, None, query, ctx, bs=16, D=D, sinks=sinks)
    b, _ = _run_step(PagedAttentionBackend("cpu", use_kernel=False), dtype, 8, 2, None, query, ctx, bs=16, D=D,
                     sinks=sinks)
    torch.testing.assert_close(a.float(), b.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(a.float(), ref, atol=tol, rtol=tol)


def test_sink_attention_runs_in_query_chunks(monkeypatch):
    """The torch path with sinks bounds its scores (SINK_SCORES_BYTES) by taking query rows in chunks: with a
    budget of a few rows, a prefill chunk and a decode still equal the dense reference."""
    from tokenmill.layers.attention import cpu

    monkeypatch.setattr(cpu, "SINK_SCORES_BYTES", 4 * 64 * 2 * 5)
    out, ref = _run_step(PagedAttentionBackend("cpu", use_kernel=False), torch.float32, 8, 2, 12, [1, 30], [40, 10],
                         bs=16, sinks=torch.linspace(-2.0, 3.0, 8))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


# -- MXFP4 checkpoint -----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def mxfp4_dirs(tiny, tmp_path_factory):
    """The tiny model with its experts quantized to MXFP4 as OpenAI ships gpt-oss (gate_up_proj_blocks
    [E, 2I, H/32, 16], _scales [E, 2I, H/32], down likewise, biases float, quantization_config mxfp4), and
    the same model dequantized by transformers' own MXFP4 decoder (the reference)."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from tokenmill.layers.quantization.fp4_codec import quantize_mxfp4

    src = tiny("gpt_oss")
    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    tensors = load_file(os.path.join(src, "model.safetensors"))
    packed, dequantized = {}, {}
    for name, t in tensors.items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            packed[name] = dequantized[name] = t
            continue
        w = t.transpose(1, 2).contiguous()  # transformers' [E, in, out] -> [E, out, in]
        pairs = [quantize_mxfp4(w[e]) for e in range(w.shape[0])]
        blocks = torch.stack([p[0] for p in pairs]).reshape(*w.shape[:2], -1, 16)
        scales = torch.stack([p[1] for p in pairs])
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        dequantized[name] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    out = {}
    for kind, weights in (("mxfp4", packed), ("dequantized", dequantized)):
        dst = root / kind
        shutil.copytree(src, dst)
        save_file(weights, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        if kind == "mxfp4":
            with open(dst / "config.json") as f:
                config = json.load(f)
            config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
                "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
            with open(dst / "config.json", "w") as f:
                json.dump(config, f)
        out[kind] = str(dst)
    return out


def test_mxfp4_checkpoint_matches_its_dequantized_model(mxfp4_dirs, tiny):
    llm = LLM(mxfp4_dirs["mxfp4"], dtype="float32", max_num_batched_tokens=64, kv_cache_memory_bytes=64 << 20)
    moe = llm.engine.executor.collective_rpc(lambda w: w.model)[0].layers[0].mlp
    assert moe.w13_weight.dtype == torch.uint8 and type(moe.quant_method).__name__ == "Mxfp4MoEMethod"
    prompts = _prompts(400)[:4]  # 1, 300, 5 and 77 tokens: decode-sized and MKL-sized expert batches
    refs = _hf_reference(mxfp4_dirs["dequantized"], prompts)
    _assert_matches(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False), refs)
    float_refs = _hf_reference(tiny("gpt_oss"), prompts[:1])
    assert (float_refs[0][1][0] - refs[0][1][0]).abs().max() > 1e-3  # the quantization is really there


def test_mxfp4_blocks_without_quantization_config_are_refused(mxfp4_dirs, tmp_path):
    dst = tmp_path / "noqc"
    shutil.copytree(mxfp4_dirs["mxfp4"], dst)
    with open(dst / "config.json") as f:
        config = json.load(f)
    del config["quantization_config"]
    with open(dst / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="is MXFP4 but config.json has no quantization_config") as info:
        LLM(str(dst), dtype="float32", kv_cache_memory_bytes=16 << 20)
    assert "\n" not in str(info.value)


@pytest.mark.distributed
def test_tensor_parallel_matches_transformers(tiny, mxfp4_dirs):
    """TP=2 (mp executor: 4 query heads and 2 KV heads, the sinks, each expert's width, its gate/up biases and
    its down bias's columns split over the ranks; MXFP4: each rank's packed rows, and its columns of the down
    blocks and scales), and TP=2 with expert parallelism (2 whole experts a rank, biases whole), against
    transformers; each float rank holds what tokenmill plan counts."""
    prompts = [p[:40] for p in _prompts(400)[1:4]]
    refs = {path: _hf_reference(ref, prompts) for path, ref in
            ((tiny("gpt_oss"), tiny("gpt_oss")), (mxfp4_dirs["mxfp4"], mxfp4_dirs["dequantized"]))}
    for path, ep in ((tiny("gpt_oss"), False), (tiny("gpt_oss"), True), (mxfp4_dirs["mxfp4"], False)):
        llm = LLM(path, dtype="float32", tensor_parallel_size=2, enable_expert_parallel=ep,
                  max_num_batched_tokens=16, kv_cache_memory_bytes=64 << 20)
        try:
            if path == tiny("gpt_oss"):
                _check_plan_agrees(llm)  # each rank's weights (biases, sinks) and KV per token
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
        finally:
            llm.engine.shutdown()
        _assert_matches(outs, refs[path])


def test_plan_preset_counts_what_transformers_builds():
    """tokenmill plan's gpt-oss-120b: the parameters of transformers' own model of that config (built on the meta
    device: 116.8B), and a sequence's KV bytes with the sliding layers held to their 128-token window."""
    import transformers

    from tokenmill.models.shape import load_model_shape
    from tokenmill.perf.memory import PRESETS

    shape = load_model_shape("openai/gpt-oss-120b")
    fields = {k: v for k, v in PRESETS["gpt-oss-120b"].items() if k != "model_type"}
    with torch.device("meta"):
        model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**fields))
    assert shape.params_total == sum(p.numel() for p in model.parameters())
    per_layer = 2 * 8 * 64 * 2  # K and V, 8 KV heads of 64, bf16
    assert shape.kv_bytes_per_token("bf16") == 36 * per_layer
    assert shape.kv_bytes_per_seq("bf16", 32768) == 18 * per_layer * 32768 + 18 * per_layer * 128


# -- harmony reasoning parser ---------------------------------------------------------------------------------
PROMPT = "<|start|>user<|message|>What is 2+2?<|end|><|start|>assistant"
HARMONY_CASES = [  # (prompt, output, (reasoning, answer))
    (PROMPT, "<|channel|>analysis<|message|>User asks 2+2. That is 4.<|end|><|start|>assistant<|channel|>final"
     "<|message|>The answer is **4**.<|return|>", ("User asks 2+2. That is 4.", "The answer is **4**.")),
    (PROMPT, "<|channel|>analysis<|message|>Think <|end of it", ("Think <|end of it", None)),  # cut off
    (PROMPT, "<|channel|>final<|message|>4", (None, "4")),  # no analysis
    (PROMPT, "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>c", ("ab", "c")),
    (PROMPT, "<|channel|>analysis<|message|>hm<|end|><|start|>assistant<|channel|>commentary to=functions.f "
     "<|constrain|>json<|message|>{\"x\": 1}<|call|>", ("hm", "{\"x\": 1}")),  # commentary: content
    (PROMPT, "plain text, no harmony", (None, "plain text, no harmony")),
    (PROMPT + "<|channel|>final<|message|>", "42<|return|>", (None, "42")),  # the prompt opened the answer
    (PROMPT + "<|channel|>analysis<|message|>", "so<|end|><|start|>assistant<|channel|>final<|message|>ok",
     ("so", "ok")),
    (PROMPT, "", (None, None)),
]


@pytest.mark.parametrize("prompt,output,expected", HARMONY_CASES)
def test_harmony_parser_whole_and_at_every_split(prompt, output, expected):
    from tokenmill.serve.reasoning import get_parser

    parser = get_parser("openai_gptoss")
    assert parser.split(output, prompt) == expected
    for trial in range(60):
        rng = random.Random(trial)
        stream, got, i = parser.stream(prompt), ["", ""], 0
        while i < len(output):
            j = i + (1 if trial == 0 else rng.randint(1, 9))  # trial 0: a character at a time
            for k, part in enumerate(stream.feed(output[i:j], last=j >= len(output))):
                got[k] += part
            i = j
        assert (got[0] or None, got[1] or None) == expected, (trial, got)


def test_harmony_parser_keeps_special_tokens_and_names_the_answer_start():
    from tokenmill.serve.reasoning import get_parser

    parser = get_parser("openai_gptoss")
    assert parser.keep_special_tokens and parser.end == "<|channel|>final<|message|>"
    assert parser.state_after(PROMPT) == "open"
    assert parser.state_after(PROMPT + "<|channel|>final<|message|>") == "answer"
    assert parser.state_after(PROMPT + "<|channel|>analysis<|message|>") == "reasoning"


def test_chat_api_gives_the_parser_special_tokens(tiny, tmp_path):
    """Served with --reasoning-parser openai_gptoss, chat detokenizes with special tokens (harmony's markers are
    special tokens): the tiny model with its <|im_start|> special token renamed <|message|>, made to write it by a
    logit bias after a prompt that ends in a message header, answers with the later ones as content, whole and
    streamed (skipping special tokens, as chat does by default, would leave nothing)."""
    import httpx

    from server_utils import ServerProc, sse_events

    dst = tmp_path / "renamed"
    shutil.copytree(tiny("gpt_oss"), dst)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dst / name).write_text((dst / name).read_text().replace("<|im_start|>", "<|message|>"))
    server = ServerProc(str(dst), "--reasoning-parser", "openai_gptoss")
    try:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
                "chat_template": "{{ messages[0]['content'] }}<|start|>assistant", "logit_bias": {"1": 100}}
        message = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
        assert (message["content"], message["reasoning_content"]) == ("<|message|><|message|>", None)
        with httpx.stream("POST", server.url + "/v1/chat/completions", json={**body, "stream": True},
                          timeout=60) as r:
            events = sse_events(r.iter_lines())
        deltas = [e["choices"][0]["delta"] for e in events[:-1] if e["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "<|message|><|message|>"
        assert not any(d.get("reasoning_content") for d in deltas)
    finally:
        server.stop()
