"""Tensor and pipeline parallel models in real gloo worlds give the single-process model's logits.

Each world loads several tiny models on every rank (one spawn per world: starting processes dominates) and
runs two steps of a flat batch over a paged KV cache (prefills of varied lengths, then decodes and a prefill
chunk that attend to the cached context). Pipeline stages hand their IntermediateTensors on with pp_send /
pp_recv; the last stage's logits are compared with one process's within 1e-4 (float32).
"""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_utils import run_ranks
from gguf_models import ALL_TYPES, quantized_gguf
from tokenmill.models.gguf import gguf_to_hf_dir

pytestmark = pytest.mark.distributed

BLOCK, NUM_BLOCKS = 16, 16
# Two steps: (query lengths, start positions) for three requests, each owning 4 blocks.
STEPS = [([9, 3, 21], [0, 0, 0]), ([1, 5, 1], [9, 3, 21])]


def _load(path: str, quantization=None):
    """quantization: an online method, "<method>+lm_head" to quantize the LM head too, or None."""
    from transformers import AutoConfig

    from tokenmill.layers.attention import get_attention_backend
    from tokenmill.models.loader import load_model

    method, _, head = (quantization or "").partition("+")
    return load_model(path, AutoConfig.from_pretrained(path), torch.float32, "cpu", get_attention_backend("cpu"),
                      max_positions=256, quantization=method or None, quantize_lm_head=bool(head))


def _forward_steps(model) -> list[torch.Tensor]:
    """Every step's logits (on the last pipeline stage; [] elsewhere), stages chained by pp_send/pp_recv."""
    from tokenmill.distributed import IntermediateTensors, pp_rank, pp_recv, pp_send, pp_size
    from tokenmill.models.flat_batch import block_table_array, flat_batch

    attn = model.layers[0].self_attn
    caches = [torch.zeros(2, attn.num_kv_heads, NUM_BLOCKS, BLOCK, attn.head_dim) for _ in model.layers]
    table = block_table_array([list(range(4 * i, 4 * i + 4)) for i in range(3)])
    g = torch.Generator().manual_seed(0)
    logits = []
    for qlens, starts in STEPS:
        ids = torch.randint(3, 390, (sum(qlens),), generator=g).numpy()
        input_ids, meta, _ = flat_batch(ids, np.array(qlens), np.array(starts), table, BLOCK, torch.device("cpu"))
        inter = None
        if pp_rank() > 0:
            shape = (len(ids), model.config.hidden_size)
            inter = IntermediateTensors(*pp_recv([shape, shape], torch.float32, pp_rank() - 1))
        with torch.inference_mode():
            out = model(input_ids, meta, caches, inter)
            if pp_rank() < pp_size() - 1:
                for work in pp_send([out.hidden.contiguous(), out.residual.contiguous()], pp_rank() + 1):
                    work.wait()
            else:
                logits.append(model.compute_logits(out))
    return logits


def _jobs(jobs: list[tuple[str, str, object]]) -> dict:
    """Run on every rank: name -> (logits per step, checkpoint bytes read, qkv weight rows), or the message of
    the ValueError loading raised. Logits travel as numpy arrays: a torch tensor would go through shared
    memory that the exiting child takes with it."""
    out = {}
    for name, path, quantization in jobs:
        try:
            model = _load(path, quantization)
        except ValueError as e:
            out[name] = str(e)
            continue
        qkv = model.layers[0].self_attn.qkv_proj
        out[name] = ([t.numpy() for t in _forward_steps(model)], model.checkpoint_bytes_read, qkv.out_features)
    return out


# -- models ---------------------------------------------------------------------------------------------
def _variant(src: str, dst: str, config_changes: dict, tensors=None) -> str:
    """A copy of a tiny model dir with config changes (and tensors rewritten by `tensors`)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "config.json")) as f:
        config = json.load(f)
    config.update(config_changes)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    if tensors is not None:
        file = os.path.join(dst, "model.safetensors")
        save_file(tensors(load_file(file)), file)
    return dst


def _odd_heads_model(dst: str) -> str:
    """3 query heads, 1 KV head: TP=2 cannot split attention (expert-parallel runs replicate it)."""
    import transformers

    config = transformers.LlamaConfig(vocab_size=400, hidden_size=48, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=3, num_key_value_heads=1, max_position_embeddings=256,
                                      rms_norm_eps=1e-6, initializer_range=0.08, tie_word_embeddings=False)
    torch.manual_seed(7)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(dst)
    return dst


@pytest.fixture(scope="module")
def paths(tiny, tmp_path_factory):
    from tokenmill.models.export import export_quantized

    root = tmp_path_factory.mktemp("tp")
    llama = tiny("llama")
    drop_row = lambda t: {k: (v[:399].clone() if "embed_tokens" in k else v) for k, v in t.items()}  # noqa: E731
    return {
        "llama": llama, "qwen2": tiny("qwen2"), "qwen3": tiny("qwen3"), "mistral": tiny("mistral"),
        "llama_vocab399": _variant(llama, str(root / "v399"), {"vocab_size": 399}, drop_row),
        "fp8_channel_ckpt": export_quantized(llama, str(root / "fp8ct"), "fp8", "compressed-tensors"),
        "fp8_block_ckpt": export_quantized(llama, str(root / "fp8blk"), "fp8", "fp8", block=(8, 16)),
        "int8_ckpt": export_quantized(tiny("qwen2"), str(root / "int8ct"), "int8", "compressed-tensors"),
        "odd_heads": _odd_heads_model(str(root / "odd")),
        # GGUFs served in their blocks: every ggml type (tied head), and a Q4_K_M-like mix (untied, biases)
        "gguf_all_types": gguf_to_hf_dir(quantized_gguf("llama", ALL_TYPES), "native"),
        # (hidden 512: every row-parallel split lands on whole 256-value blocks, so the ranks run the same
        # integer kernels as one process)
        "gguf_kmix": gguf_to_hf_dir(quantized_gguf("qwen2", ("Q4_K", "Q6_K", "Q5_0", "Q8_0"), hidden=512,
                                                   intermediate=1024), "native"),
    }


# name -> (model, online quantization)
TP_JOBS = {
    "llama": ("llama", None),                    # tied head, 2 KV heads split
    "qwen2": ("qwen2", None),                    # q/k/v bias, untied
    "qwen3": ("qwen3", None),                    # q/k norm, head_dim 32
    "mistral": ("mistral", None),                # 1 KV head < TP: replicated; sliding window
    "llama_vocab399": ("llama_vocab399", None),  # vocab not divisible by TP: padded head block
    "int8": ("llama", "int8"), "fp8": ("llama", "fp8"), "nvfp4": ("llama", "nvfp4"), "mxfp4": ("qwen2", "mxfp4"),
    "int8+lm_head": ("mistral", "int8+lm_head"),     # a quantized, vocab-sharded head
    "fp8_channel_ckpt": ("fp8_channel_ckpt", None), "fp8_block_ckpt": ("fp8_block_ckpt", None),
    "int8_ckpt": ("int8_ckpt", None),
    # GGUFs served in their blocks: every ggml type, tied head (hidden 256); a Q4_K_M-like mix (hidden 512)
    "gguf_all_types": ("gguf_all_types", None), "gguf_kmix": ("gguf_kmix", None),
}
PP_JOBS = ("llama", "mistral", "int8", "gguf_all_types")  # tied head on the last stage only; untied; quantized


def _job_list(paths, names):
    return [(n, paths[TP_JOBS[n][0]], TP_JOBS[n][1]) for n in names]


@pytest.fixture(scope="module")
def reference(paths):
    """One process's results for every job."""
    return _jobs(_job_list(paths, TP_JOBS))


# An int8 LM head rounds the final hidden state to a 2^-15 grid of its row max; TP's different float summation
# order (~1e-6 in the hidden state) flips a rounding now and then, which moves a logit by up to ~1.2e-4 here.
# Every other job (int8 with a float head included) is within 1e-4.
# GGUF blocks quantize their activations (per 32 values, twice over in float32) in every layer and the head,
# with the same effect.
QUANTIZED_HEAD = {"int8+lm_head", "int8_ckpt", "gguf_all_types", "gguf_kmix"}


def _atol(job: str) -> float:
    return 2.5e-4 if job in QUANTIZED_HEAD else 1e-4


def _assert_same_logits(ours, ref, what: str, atol: float = 1e-4) -> None:
    assert isinstance(ours, list), f"{what}: {ours}"
    assert len(ours) == len(ref) == len(STEPS), what
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert a.shape == b.shape, f"{what} step {step}: {tuple(a.shape)} vs {tuple(b.shape)}"
        torch.testing.assert_close(torch.from_numpy(a), torch.from_numpy(b), atol=atol, rtol=1e-4,
                                   msg=lambda m: f"{what} step {step}: {m}")
        assert (a.argmax(-1) == b.argmax(-1)).all(), f"{what} step {step}: greedy tokens differ"


@pytest.fixture(scope="module")
def tp2(paths):
    # odd_heads (3 heads) cannot be split over 2 ranks without expert parallelism: its load must be refused
    return run_ranks(_jobs, 2, 1, _job_list(paths, TP_JOBS) + [("odd_heads", paths["odd_heads"], None)])


@pytest.mark.parametrize("job", sorted(TP_JOBS))
def test_tp2_matches_one_process(tp2, reference, job):
    for rank, results in enumerate(tp2):
        _assert_same_logits(results[job][0], reference[job][0], f"{job} TP=2 rank {rank}", _atol(job))


def test_tp2_ranks_read_only_their_slices(tp2, reference):
    """Loading goes through lazy safetensors slices: each rank reads about half of what one process reads
    (norms are replicated), and holds half the query heads."""
    for job in ("llama", "qwen2"):
        full = reference[job][1]
        for rank, results in enumerate(tp2):
            assert 0.4 * full < results[job][1] < 0.6 * full, (job, rank, results[job][1], full)
    # qkv rows: 4 query + 2 + 2 KV heads of 16 in one process; 2 + 1 + 1 per rank; 1 KV head replicated
    assert reference["llama"][2] == 128 and all(r["llama"][2] == 64 for r in tp2)
    assert reference["mistral"][2] == 96 and all(r["mistral"][2] == 64 for r in tp2)


def test_heads_that_do_not_divide_are_refused(tp2):
    for results in tp2:
        assert "attention heads 3 is not divisible by tensor-parallel size 2" in results["odd_heads"]


def test_pp2_matches_one_process(paths, reference):
    pp2 = run_ranks(_jobs, 1, 2, _job_list(paths, PP_JOBS))
    for job in PP_JOBS:
        assert pp2[0][job][0] == [], "only the last stage computes logits"
        _assert_same_logits(pp2[1][job][0], reference[job][0], f"{job} PP=2")
    # untied: the stages split the checkpoint (each reads one layer and one end), neither reads the other's
    full, read = reference["mistral"][1], [pp2[s]["mistral"][1] for s in (0, 1)]
    assert all(0.3 * full < r < 0.7 * full for r in read) and abs(sum(read) - full) < 0.01 * full, (read, full)


def test_tp2_x_pp2_matches_one_process(paths, reference):
    ranks = run_ranks(_jobs, 2, 2, _job_list(paths, PP_JOBS))
    for job in PP_JOBS:
        assert ranks[0][job][0] == [] and ranks[1][job][0] == []
        for rank in (2, 3):
            _assert_same_logits(ranks[rank][job][0], reference[job][0], f"{job} TP=2 x PP=2 rank {rank}")


def test_attention_replicated_under_expert_parallel(paths):
    """3 heads do not split over 2 ranks: with expert parallelism on, attention runs whole on each rank (no
    all-reduce) while the MLP and vocabulary still shard, and the logits are one process's."""
    job = [("odd_heads", paths["odd_heads"], None)]
    ref = _jobs(job)["odd_heads"]
    for rank, results in enumerate(run_ranks(_jobs, 2, 1, job, expert_parallel=True)):
        ours = results["odd_heads"]
        assert ours[2] == ref[2] == (3 + 1 + 1) * 16
        _assert_same_logits(ours[0], ref[0], f"replicated attention rank {rank}")
