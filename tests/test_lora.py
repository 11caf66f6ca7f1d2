"""Multi-LoRA serving (issue 33): a tiny random Llama and three PEFT adapters built here with `peft` (B matrices
randomized: PEFT starts them at zero), against transformers + peft in float32; batches mixing adapters and the
base model (on one rank and on two: tensor parallel), fewer adapter slots than adapters in flight, the prefix
cache keyed by adapter, the adapter checks, and load/unload through the HTTP server."""
from __future__ import annotations

import json
import os

import pytest
import torch

from models import hf_model
from test_gemma3 import _assert_matches
from test_model_exactness import MAX_TOKENS
from tokenmill import LLM, LoRARequest, SamplingParams
from tokenmill.lora import read_adapter_config

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
PROMPT_LENS = [3, 70, 20, 41]

# name -> (rank, alpha, targets, rslora): attention only, MLP and two of q/k/v (rslora), and all seven
ADAPTERS = {
    "attn": (8, 16, ["q_proj", "k_proj", "v_proj", "o_proj"], False),
    "mlp": (4, 8, ["gate_proj", "up_proj", "down_proj", "q_proj", "v_proj"], True),
    "all": (16, 8, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], False),
}


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    """(base path, {name: LoRARequest}) with each adapter saved by peft."""
    from peft import LoraConfig, get_peft_model

    base = tiny("llama")
    root = tmp_path_factory.mktemp("adapters")
    requests = {}
    for i, (name, (r, alpha, targets, rslora)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(100 + i)
        model = get_peft_model(hf_model(base), LoraConfig(r=r, lora_alpha=alpha, target_modules=targets,
                                                          use_rslora=rslora, lora_dropout=0.0))
        with torch.no_grad():
            for pname, param in model.named_parameters():
                if "lora_B" in pname:
                    param.normal_(0, 0.2)
        model.save_pretrained(str(root / name))
        requests[name] = LoRARequest(name, i + 1, str(root / name))
    return base, requests


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, 300, (n,), generator=g).tolist() for n in PROMPT_LENS]


def _reference(base: str, lora: LoRARequest | None, prompts):
    """transformers (+ peft) greedy tokens and per-step logprobs."""
    model = hf_model(base)
    if lora is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, lora.lora_path).eval()
    refs = []
    with torch.inference_mode():
        for p in prompts:
            out = model.generate(input_ids=torch.tensor([p]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
            refs.append((out.sequences[0, len(p):].tolist(), [s[0].float().log_softmax(-1) for s in out.logits]))
    return refs


def _generate(llm: LLM, prompts, loras):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False, lora_request=loras)


@pytest.fixture(scope="module")
def alone(adapters):
    """Each adapter's (and the base's) outputs run alone, checked against transformers + peft once."""
    base, reqs = adapters
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16, block_size=16,
              max_num_batched_tokens=32)
    prompts = _prompts()
    outs = {}
    for name, lora in [("base", None)] + list(reqs.items()):
        outs[name] = _generate(llm, prompts, lora)
        _assert_matches(outs[name], _reference(base, lora, prompts))
    assert len({tuple(outs[name][1].outputs[0].token_ids) for name in outs}) == 4, "each adapter changes the output"
    return outs


def _assert_same(outs, ref_outs, atol: float = 1e-4) -> None:
    for out, ref in zip(outs, ref_outs):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        for lp, ref_lp in zip(out.outputs[0].logprobs, ref.outputs[0].logprobs):
            for t, v in lp.items():
                assert abs(v.logprob - ref_lp[t].logprob) < atol


def _mixed(reqs):
    """Every prompt under every adapter and the base, interleaved, as one generate call."""
    names = ["base"] + list(reqs)
    jobs = [(name, i, p) for i, p in enumerate(_prompts()) for name in names]
    return jobs, [reqs.get(name) for name, _, _ in jobs]


def test_each_adapter_matches_transformers_peft(alone):
    assert set(alone) == {"base", "attn", "mlp", "all"}


def test_mixed_batch_gives_each_request_its_tokens_alone(adapters, alone):
    """Three adapters and the base in the same steps, with chunked prefill and preemption."""
    base, reqs = adapters
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, block_size=16,
              max_num_batched_tokens=48, num_gpu_blocks_override=16)
    jobs, loras = _mixed(reqs)
    outs = _generate(llm, [p for _, _, p in jobs], loras)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must exercise preemption"
    assert llm.engine.scheduler.kv.is_whole()
    for (name, i, _), out in zip(jobs, outs):
        _assert_same([out], [alone[name][i]])


def test_tensor_parallel_gives_each_request_its_tokens_alone(adapters, alone):
    """Two ranks (gloo): each holds its slices of every adapter (column-parallel q|k|v and gate|up: B's rows;
    row-parallel o and down: A's columns, the shrunk all-reduced), and the mixed batch gives the one-rank tokens."""
    base, reqs = adapters
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16, block_size=16,
              max_num_batched_tokens=48, tensor_parallel_size=2)
    try:
        jobs, loras = _mixed(reqs)
        outs = _generate(llm, [p for _, _, p in jobs], loras)
        for (name, i, _), out in zip(jobs, outs):
            _assert_same([out], [alone[name][i]])
    finally:
        llm.engine.shutdown()


def test_cpu_decoder_stack_applies_adapters(adapters, alone, monkeypatch):
    """Decode steps with adapter rows run in the one-call C stack (each token its own slot's A and B), agreeing
    with the layer-by-layer masked matmuls."""
    from tokenmill.models.cpu_stack import CpuStack

    taken = []
    run = CpuStack.run

    def spy(self, input_ids, meta):
        out = run(self, input_ids, meta)
        taken.append((meta.adapters, out is not None))
        return out

    monkeypatch.setattr(CpuStack, "run", spy)
    base, reqs = adapters
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16)
    jobs, loras = _mixed(reqs)
    prompts = [p for _, _, p in jobs]
    outs = _generate(llm, prompts, loras)
    assert (True, True) in taken, "no adapter step ran in the C stack"
    for (name, i, _), out in zip(jobs, outs):
        _assert_same([out], [alone[name][i]])
    model = llm.engine.executor.collective_rpc(lambda w: w.model)[0]
    monkeypatch.setattr(model, "use_cpu_stack", False)
    taken.clear()
    _assert_same(_generate(llm, prompts, loras), outs)
    assert not taken


def test_fewer_slots_than_adapters_in_flight(adapters, alone, monkeypatch):
    """--max-loras 2 and --max-cpu-loras 2 with three adapters: requests wait for a slot (never more than two
    adapters in a step), adapters are dropped from host memory and loaded again, and every output is right."""
    base, reqs = adapters
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=16)
    sched = llm.engine.scheduler
    seen = []
    schedule = sched.schedule

    def spy():
        out = schedule()
        seen.append({sched.requests[s.request_id].lora_int_id for s in out.scheduled} - {0})
        return out

    monkeypatch.setattr(sched, "schedule", spy)
    jobs, loras = _mixed(reqs)
    outs = _generate(llm, [p for _, _, p in jobs], loras)
    assert max(len(s) for s in seen) == 2
    for (name, i, _), out in zip(jobs, outs):
        _assert_same([out], [alone[name][i]])


def test_prefix_cache_is_keyed_by_adapter(adapters, alone):
    base, reqs = adapters
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=16)
    prompt = _prompts()[1]  # 70 tokens: 4 full blocks
    first = _generate(llm, [prompt], None)
    under_adapter = _generate(llm, [prompt], reqs["attn"])
    again = _generate(llm, [prompt], reqs["attn"])
    assert first[0].num_cached_tokens == 0 and under_adapter[0].num_cached_tokens == 0
    assert again[0].num_cached_tokens == 64
    _assert_same(under_adapter + again, [alone["attn"][1]] * 2)


def _folder(tmp_path, **config) -> str:
    path = tmp_path / "adapter"
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                          "target_modules": ["q_proj"], **config}))
    (path / "adapter_model.safetensors").write_bytes(b"")
    return str(path)


@pytest.mark.parametrize("config, message", [
    ({"r": 32}, "rank 32, more than --max-lora-rank 16"),
    ({"use_dora": True}, "DoRA"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"target_modules": ["q_proj", "embed_tokens"]}, "target modules ['embed_tokens'] are not supported"),
    ({"target_modules": ".*proj"}, "regular expression"),
    ({"bias": "all"}, "LoRA biases"),
])
def test_unsupported_adapters_are_refused(tmp_path, config, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_adapter_config(_folder(tmp_path, **config), 16)


def test_adapter_paths_are_checked(tmp_path):
    assert read_adapter_config(_folder(tmp_path, use_rslora=True), 16).scaling == pytest.approx(16 / 8 ** 0.5)
    with pytest.raises(ValueError, match="is not a directory"):
        read_adapter_config(os.path.join(_folder(tmp_path), "adapter_config.json"))
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        read_adapter_config(str(tmp_path))


def test_adapter_whose_weights_do_not_fit_fails_alone(adapters, alone, tmp_path):
    """Its config passes the front's checks; its tensors fail in the worker: that request errors, the rest run."""
    from safetensors.torch import save_file

    base, _ = adapters
    path = _folder(tmp_path, r=4)
    key = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{key}.lora_A.weight": torch.randn(4, 63), f"{key}.lora_B.weight": torch.randn(64, 4)},
              os.path.join(path, "adapter_model.safetensors"))
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    outs = _generate(llm, _prompts()[:1] * 2, [None, LoRARequest("bad", 9, path)])
    assert outs[1].outputs[0].finish_reason == "error"
    _assert_same(outs[:1], alone["base"][:1])
    assert llm.engine.scheduler.kv.is_whole()


def test_lora_settings_are_checked():
    from tokenmill.config import EngineConfig
    from tokenmill.serve.lora import LoRAAdapters, parse_lora_modules

    assert EngineConfig.from_kwargs(model="m", max_loras=3).lora is None  # without enable_lora
    config = EngineConfig.from_kwargs(model="m", enable_lora=True, max_loras=3).lora
    assert (config.max_loras, config.max_lora_rank, config.max_cpu_loras) == (3, 16, 3)
    with pytest.raises(ValueError, match=r"--max-cpu-loras \(1\) must be at least --max-loras \(2\)"):
        EngineConfig.from_kwargs(model="m", enable_lora=True, max_loras=2, max_cpu_loras=1)
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == [("a", "/x"), ("b", "/y=z")]
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["/x"])
    with pytest.raises(Exception, match="--enable-lora"):
        LoRAAdapters(None, "base").load("a", "/x")


def test_lora_request_needs_enable_lora(adapters):
    base, reqs = adapters
    llm = LLM(base, dtype="float32", kv_cache_memory_bytes=16 << 20)
    with pytest.raises(ValueError, match="enable_lora=True"):
        _generate(llm, [[5, 6, 7]], reqs["attn"])


@pytest.fixture(scope="module")
def lora_server(adapters):
    from server_utils import API_KEY, ServerProc

    base, reqs = adapters
    server = ServerProc(base, "--served-model-name", "base", "--enable-lora", "--max-loras", "2",
                        "--max-lora-rank", "16", "--lora-modules", f"attn={reqs['attn'].lora_path}", api_key=API_KEY)
    yield server
    server.stop()


def _complete(http, model: str, prompt: list[int]):
    return http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                              "temperature": 0.0, "ignore_eos": True})


def test_http_serves_adapters_by_model_name_and_loads_them_at_run_time(adapters, alone, lora_server, tmp_path):
    import httpx

    _, reqs = adapters
    prompt = _prompts()[2]
    with httpx.Client(base_url=lora_server.url, headers=lora_server.headers, timeout=60) as http:
        models = {m["id"]: m["parent"] for m in http.get("/v1/models").json()["data"]}
        assert models == {"base": None, "attn": "base"}
        for name in ("base", "attn"):
            r = _complete(http, name, prompt)
            assert r.status_code == 200 and r.json()["model"] == name
            assert r.json()["choices"][0]["text"] == alone[name][2].outputs[0].text
        assert _complete(http, "mlp", prompt).status_code == 404
        chat = http.post("/v1/chat/completions", json={"model": "attn", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "Hello"}]})
        assert chat.status_code == 200 and chat.json()["model"] == "attn", chat.text

        load = {"lora_name": "mlp", "lora_path": reqs["mlp"].lora_path}
        assert httpx.post(lora_server.url + "/v1/load_lora_adapter", json=load).status_code == 401  # no key
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 200
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 400  # the name is taken
        assert _complete(http, "mlp", prompt).json()["choices"][0]["text"] == alone["mlp"][2].outputs[0].text
        assert {m["id"] for m in http.get("/v1/models").json()["data"]} == {"base", "attn", "mlp"}

        for bad in ("/etc/passwd", str(tmp_path), reqs["mlp"].lora_path + "/adapter_config.json"):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == "lora_path", r.text

        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"}).status_code == 200
        assert _complete(http, "mlp", prompt).status_code == 404
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "mlp"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert http.post("/v1/load_lora_adapter", json=load).status_code == 200  # again, as a new load
        assert _complete(http, "mlp", prompt).json()["choices"][0]["text"] == alone["mlp"][2].outputs[0].text


def test_waiting_adapter_is_not_starved(adapters):
    """--max-loras 1: with `attn` running, an `mlp` request waits, and a later `attn` request waits behind it (so
    `attn` drains and `mlp` gets the slot); a base-model request, which needs no slot, goes ahead."""
    from tokenmill.messages import EngineCoreRequest

    base, reqs = adapters
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=16, kv_cache_memory_bytes=16 << 20)
    sp = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    order = [("a1", reqs["attn"]), ("m1", reqs["mlp"]), ("a2", reqs["attn"]), ("b1", None)]
    for rid, lora in order:
        llm.engine.add_request(EngineCoreRequest(rid, [5, 6, 7], sp, lora_request=lora))
    sched = llm.engine.scheduler
    llm.engine.step()
    assert [r.request_id for r in sched.running] == ["a1", "b1"]
    assert [r.request_id for r in sched.waiting] == ["m1", "a2"]
    started = []
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
        started += [r.request_id for r in sched.running if r.request_id not in started]
    assert started.index("m1") < started.index("a2")


def test_adapters_over_a_quantized_base(adapters, monkeypatch):
    """The delta comes after the layer's own quant_method: an int8 base runs adapters too, in the C stack and
    layer by layer alike (to 1e-3: int8 activations turn the paths' last-bit differences into a grid step)."""
    base, reqs = adapters
    llm = LLM(base, dtype="float32", quantization="int8", enable_lora=True, max_loras=2, max_lora_rank=16,
              kv_cache_memory_bytes=16 << 20)
    prompts = _prompts()[:2]
    with_adapter = _generate(llm, prompts, reqs["all"])
    plain = _generate(llm, prompts, None)
    assert [o.outputs[0].token_ids for o in with_adapter] != [o.outputs[0].token_ids for o in plain]
    monkeypatch.setattr(llm.engine.executor.collective_rpc(lambda w: w.model)[0], "use_cpu_stack", False)
    _assert_same(_generate(llm, prompts, reqs["all"]), with_adapter, atol=1e-3)
