"""int4 weights as ggml Q4_1 blocks: `--quantization int4` and AWQ / GPTQ / compressed-tensors pack-quantized
checkpoints.

Each checkpoint is built here from random int4 values packed with numpy in that format's layout (as AutoAWQ,
AutoGPTQ and compressed-tensors write them), with the config.json quantization_config those tools write. A
small independent unpacker reads the files back into the reference weights scale * (q - zero), which are also
saved as a plain float checkpoint (the int4 values are the float model's round-to-nearest ones, jittered, so
the model stays a sensible one). Checked: (a) each layer's blocks dequantize to the reference within the
bound the repacking allows (m = fp16(-scale * zero): 2^-11 of |scale * zero|, awq_gptq.py's docstring), and d
is fp16(scale) exactly; (b) the quantized checkpoint's greedy tokens (4 prompts x 12) equal the float
reference's up to each sequence's first difference, which may only come at a near-tie of the reference (top
two within 0.05 nats: the kernel's activation rounding -- 8 bits per 32 values for bf16, about 16 for float32
models -- may flip those, so equality is not guaranteed), and teacher-forced over 256 tokens in windows of 32
rows (every matmul on the integer kernel) top-1 agreement is >= 95%, KL < 1e-3 nats and perplexity within 1%
(measured: top-1 96.8-100%, KL ~2.6e-5, perplexity within 0.05%); (c) bad checkpoints are one-line
ValueErrors.
"""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

HIDDEN, INTER, LAYERS = 128, 256, 2  # every K (128, 256) divides by groups of 32, 64 and 128
PROJ = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj"]
MERGED = {"self_attn.qkv_proj": PROJ[:3], "self_attn.o_proj": [PROJ[3]], "mlp.gate_up_proj": PROJ[4:6],
          "mlp.down_proj": [PROJ[6]]}
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny float Llama (tied head) whose K sizes allow groups of 128: (dir, {name: float tensor})."""
    import transformers
    from safetensors.torch import load_file

    from models import build_tokenizer

    path = str(tmp_path_factory.mktemp("int4") / "float")
    tok = build_tokenizer(path)
    config = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=INTER,
                                      num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.05,
                                      tie_word_embeddings=True, eos_token_id=tok.eos_token_id,
                                      bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(77)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    return path, load_file(os.path.join(path, "model.safetensors"))


# -- the formats, written with numpy ------------------------------------------------------------------------
def _pack8(v: np.ndarray, axis: int, order=range(8)) -> np.ndarray:
    """uint values 0..15 -> int32 words along axis: nibble i of word w holds element 8w + order[i]."""
    v = np.moveaxis(v.astype(np.uint32), axis, -1)
    out = np.zeros(v.shape[:-1] + (v.shape[-1] // 8,), np.uint32)
    for i, j in enumerate(order):
        out |= v[..., j::8] << np.uint32(4 * i)
    return np.ascontiguousarray(np.moveaxis(out, -1, axis)).view(np.int32)


def _unpack8(w: np.ndarray, axis: int, order=range(8)) -> np.ndarray:
    w = np.moveaxis(w.view(np.uint32), axis, -1)
    out = np.zeros(w.shape[:-1] + (w.shape[-1] * 8,), np.uint8)
    for i, j in enumerate(order):
        out[..., j::8] = (w >> np.uint32(4 * i)) & 0xF
    return np.moveaxis(out, -1, axis)


def _write_awq(t, q, s, z, g, sym):  # q [N, K], s and z [N, K/g]
    t["qweight"] = _pack8(q.T, 1, AWQ_ORDER)
    t["qzeros"] = _pack8(z.T, 1, AWQ_ORDER)
    t["scales"] = s.T.astype(np.float16)


def _read_awq(t, g):
    q, z = _unpack8(t["qweight"], 1, AWQ_ORDER).T, _unpack8(t["qzeros"], 1, AWQ_ORDER).T
    return q, t["scales"].T.astype(np.float32), z.astype(np.float32)


def _write_gptq(t, q, s, z, g, sym):
    t["qweight"] = _pack8(q.T, 0)
    t["qzeros"] = _pack8(z.T - 1, 1)  # the historical "zero - 1": zeros 1..16 (the nibble + 1, as exllama reads it)
    t["scales"] = s.T.astype(np.float16)
    t["g_idx"] = (np.arange(q.shape[1]) // g).astype(np.int32)


def _write_gptq2(t, q, s, z, g, sym):  # checkpoint_format gptq_v2 (GPTQModel): the zeros themselves
    _write_gptq(t, q, s, z + 1, g, sym)


def _read_gptq2(t, g):
    q, s, z = _read_gptq(t, g)
    return q, s, z - 1


def _read_gptq(t, g):
    assert np.array_equal(t["g_idx"], np.arange(len(t["g_idx"])) // g)
    z = _unpack8(t["qzeros"], 1).T.astype(np.float32) + 1
    return _unpack8(t["qweight"], 0).T, t["scales"].T.astype(np.float32), z


def _write_ct(t, q, s, z, g, sym):
    t["weight_packed"] = _pack8(q, 1)  # signed values + 8, the unsigned nibbles
    t["weight_scale"] = s.astype(np.float16)
    if not sym:  # compressed-tensors writes zero points for asymmetric weights only
        t["weight_zero_point"] = _pack8(z, 0)
    t["weight_shape"] = np.array(q.shape, np.int64)


def _read_ct(t, g):
    z = _unpack8(t["weight_zero_point"], 0).astype(np.float32) if "weight_zero_point" in t else None
    q = _unpack8(t["weight_packed"], 1)
    s = t["weight_scale"].astype(np.float32)
    return q, s, np.full(s.shape, 8, np.float32) if z is None else z


def _qc(fmt, g, sym=False):
    if fmt == "awq":
        return {"quant_method": "awq", "bits": 4, "group_size": g, "version": "gemm", "zero_point": True,
                "modules_to_not_convert": None}
    if fmt in ("gptq", "gptq2"):
        return {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False, "sym": sym,
                "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
                "checkpoint_format": "gptq_v2" if fmt == "gptq2" else "gptq"}
    weights = {"num_bits": 4, "type": "int", "symmetric": sym, "group_size": g, "strategy": "group",
               "actorder": None, "dynamic": False, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}}}


WRITE = {"awq": _write_awq, "gptq": _write_gptq, "gptq2": _write_gptq2, "ct": _write_ct}
READ = {"awq": _read_awq, "gptq": _read_gptq, "gptq2": _read_gptq2, "ct": _read_ct}


def _rtn(w, g, sym, rng, zeros):
    """Round-to-nearest int4 of a float weight [N, K] per group of g (so the model stays a sensible one), its
    scales jittered by up to 10% and some q moved by one (so nothing depends on round-to-nearest): q uint8
    [N, K], scale fp16 and zero uint8 [N, K/g]. zeros: the zero range the format can hold (GPTQ: 1..16)."""
    N, K = w.shape
    x = w.reshape(N, K // g, g)
    if sym:
        s = np.abs(x).max(-1) / 7.5
        z = np.full(s.shape, 8.0)
    else:
        lo, hi = np.minimum(x.min(-1), 0), np.maximum(x.max(-1), 0)
        s = (hi - lo) / 15
        z = np.clip(np.round(-lo / s), *zeros)
    s = (s * rng.uniform(0.9, 1.1, s.shape)).astype(np.float16)
    q = np.round(x / s.astype(np.float32)[..., None] + z[..., None]) + rng.integers(-1, 2, x.shape) * (
        rng.random(x.shape) < 0.1)
    return np.clip(q, 0, 15).astype(np.uint8).reshape(N, K), s, z.astype(np.uint8)


def _copy_dir(src, dst):
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))


def _build(base, root, fmt, g, sym=False, seed=0, mutate=None):
    """(quantized dir, float reference dir, {hf projection name: (q, scale, zero, reference weight)})."""
    src, floats = base
    rng = np.random.default_rng(seed)
    qdir, fdir = os.path.join(root, f"{fmt}-g{g}"), os.path.join(root, f"{fmt}-g{g}-float")
    _copy_dir(src, qdir)
    _copy_dir(src, fdir)
    qt = {k: v for k, v in floats.items() if not any(p in k for p in PROJ)}
    ft, ref = dict(qt), {}
    for layer in range(LAYERS):
        for p in PROJ:
            name = f"model.layers.{layer}.{p}"
            N, K = floats[f"{name}.weight"].shape
            q, s, z = _rtn(floats[f"{name}.weight"].numpy(), g, sym, rng, (1, 16) if fmt == "gptq" else (0, 15))
            t = {}
            WRITE[fmt](t, q, s, z, g, sym)
            rq, rs, rz = READ[fmt](t, g)  # the independent unpacker: what the files stand for
            assert np.array_equal(rq, q) and np.array_equal(rs, s.astype(np.float32)) and np.array_equal(rz, z)
            w = np.repeat(rs, g, axis=1) * (rq.astype(np.float32) - np.repeat(rz, g, axis=1))
            ref[name] = (rq, rs, rz, torch.from_numpy(w))
            qt.update({f"{name}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in t.items()})
            ft[f"{name}.weight"] = ref[name][3]
    cfg = json.load(open(os.path.join(src, "config.json")))
    cfg["quantization_config"] = _qc(fmt, g, sym)
    if mutate:
        mutate(cfg, qt)
    json.dump(cfg, open(os.path.join(qdir, "config.json"), "w"))
    save_file(qt, os.path.join(qdir, "model.safetensors"))
    save_file(ft, os.path.join(fdir, "model.safetensors"))
    return qdir, fdir, ref


def _load(model_dir):
    from transformers import AutoConfig

    from tokenmill.layers.attention import get_attention_backend
    from tokenmill.models.loader import load_model

    return load_model(model_dir, AutoConfig.from_pretrained(model_dir), torch.float32, "cpu",
                      get_attention_backend("cpu"), max_positions=256)


# -- (a) the blocks stand for the checkpoint's weights ------------------------------------------------------
@pytest.mark.parametrize("fmt,g,sym", [("awq", 128, False), ("awq", 32, False), ("gptq", 128, False),
                                       ("gptq", 64, True), ("gptq2", 32, False), ("ct", 128, False),
                                       ("ct", 32, True)])
def test_blocks_match_the_checkpoint_dequantization(base, tmp_path, fmt, g, sym):
    from tokenmill.layers.quantization.awq_gptq import CheckpointInt4Method
    from tokenmill.layers.quantization.int4 import unpack_q4_1

    qdir, _, ref = _build(base, str(tmp_path), fmt, g, sym)
    model = _load(qdir)
    checked = 0
    for layer in range(LAYERS):
        for ours, theirs in MERGED.items():
            m = model.get_submodule(f"layers.{layer}.{ours}")
            assert isinstance(m.quant_method, CheckpointInt4Method) and m.quant_method.block_linear is not None
            parts = [ref[f"model.layers.{layer}.{p}"] for p in theirs]
            w_ref = torch.cat([r[3] for r in parts])
            scale = torch.cat([torch.from_numpy(np.repeat(r[1], g // 32, axis=1)) for r in parts])
            zero = torch.cat([torch.from_numpy(np.repeat(r[2], g // 32, axis=1)) for r in parts])
            got = m.quant_method.dequantized_weight(m)
            # m = fp16(-scale * zero): 2^-11 relative (2^-25 absolute in fp16's subnormal range), plus float32
            # rounding of d * q + m
            bound = (2.0 ** -11 * (scale * zero).abs() + 2.0 ** -25).repeat_interleave(32, 1) + 1e-6 * w_ref.abs()
            assert ((got - w_ref).abs() <= bound).all(), (layer, ours, float((got - w_ref).abs().max()))
            q, d, _ = unpack_q4_1(_q4_1_blocks(m), m.in_features)
            assert torch.equal(d, scale.half())  # the checkpoint's fp16 scales, exactly
            assert torch.equal(q, torch.cat([torch.from_numpy(r[0]) for r in parts]))
            checked += 1
    assert checked == 4 * LAYERS
    assert model.lm_head.quant_method.__class__.__name__ == "UnquantizedLinearMethod"  # tied head stays float


# -- (b) whole model against the float reference ------------------------------------------------------------
def _greedy(model_dir, prompts, **kw):
    """Each prompt's 12 greedy tokens and, at each, the margin in nats between the top two candidates."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model_dir, kv_cache_memory_bytes=2**22, block_size=16, max_num_seqs=4, **kw)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2), use_tqdm=False)
    margins = []
    for o in out:
        top = [sorted((v.logprob for v in step.values()), reverse=True) for step in o.outputs[0].logprobs]
        margins.append([t[0] - t[1] for t in top])
    return [o.outputs[0].token_ids for o in out], margins


def _assert_follows(quant, ref, tie=0.05):
    """The quantized model's greedy tokens equal the reference's up to each sequence's first difference, which
    may only come where the reference's own top two are within `tie` nats (a near-tie that the kernel's
    activation rounding may flip; past it the contexts differ and nothing more is compared). Returns the
    fraction of positions that agree."""
    (qt, _), (rt, rm) = quant, ref
    agree = 0
    for a, b, margin in zip(qt, rt, rm):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        assert first == len(b) or margin[first] < tie, (a, b, first, margin[first])
        agree += first
    return agree / sum(len(b) for b in rt)


PROMPTS = [list(range(3, 3 + n)) for n in (5, 11, 17)] + [[40, 41, 40, 41, 7, 9, 300]]


@pytest.mark.parametrize("fmt", ["awq", "gptq", "ct"])
def test_greedy_tokens_follow_the_float_reference(base, tmp_path, fmt):
    from tokenmill.eval.quality import evaluate

    qdir, fdir, _ = _build(base, str(tmp_path), fmt, 128 if fmt != "ct" else 32, seed=1)
    _assert_follows(_greedy(qdir, PROMPTS), _greedy(fdir, PROMPTS))
    # teacher-forced, windows of 32 rows: every matmul runs the integer kernel (float32 x: ggml.MAX_ROWS_F32)
    from tokenmill.layers.quantization import ggml

    assert ggml.MAX_ROWS_F32 >= 32
    ref, quant = evaluate(fdir, [qdir], max_tokens=256, window=32, quantize_lm_head="no")
    d = quant.as_dict(ref)
    assert d["quantization"] == ("compressed-tensors" if fmt == "ct" else fmt)
    assert d["top1_agreement"] >= 0.95 and d["kl_divergence"] < 1e-3 and abs(d["perplexity_change"]) < 0.01, d


def test_online_int4_blocks_and_greedy_tokens(base):
    """--quantization int4: every 32-block's d and m are fp16 of its (max - min) / 15 and min, and q the nearest
    grid point of those; teacher-forced, its next-token distributions stay close to the float model's."""
    from tokenmill.layers.quantization.int4 import Int4LinearMethod, unpack_q4_1

    path, floats = base
    model = _load_online(path, "int4")
    w = torch.cat([floats[f"model.layers.1.{p}.weight"] for p in MERGED["mlp.gate_up_proj"]])
    m = model.get_submodule("layers.1.mlp.gate_up_proj")
    assert isinstance(m.quant_method, Int4LinearMethod)
    q, d, mn = unpack_q4_1(_q4_1_blocks(m), m.in_features)
    blocks = w.reshape(w.shape[0], -1, 32)
    assert torch.equal(mn, blocks.amin(-1).half())
    assert torch.equal(d, ((blocks.amax(-1) - blocks.amin(-1)) / 15).half())
    grid = q.float().reshape(blocks.shape) * d.float()[..., None] + mn.float()[..., None]
    assert ((grid - blocks).abs() <= d.float()[..., None] / 2 * (1 + 1e-3) + 1e-7).all()  # nearest point
    assert torch.allclose(m.quant_method.dequantized_weight(m), grid.reshape(w.shape))
    assert model.lm_head.quant_method.__class__.__name__ == "UnquantizedLinearMethod"
    # against the float model itself: the random model's next-token distributions are nearly flat (perplexity
    # ~480 over 400 tokens), so top-1 flips easily (66% agree here) while the distributions stay close:
    # measured KL 0.007 nats, perplexity +0.26%
    from tokenmill.eval.quality import evaluate

    ref, quant = evaluate(path, ["int4"], max_tokens=256, window=32, quantize_lm_head="no")
    d = quant.as_dict(ref)
    assert d["kl_divergence"] < 0.02 and abs(d["perplexity_change"]) < 0.02, d


def test_online_int4_g128_repeats_the_group_in_its_blocks(base):
    from tokenmill.layers.quantization.int4 import unpack_q4_1

    model = _load_online(base[0], "int4-g128")
    m = model.get_submodule("layers.0.mlp.down_proj")
    _, d, mn = unpack_q4_1(_q4_1_blocks(m), m.in_features)
    assert torch.equal(d, d[:, ::4].repeat_interleave(4, 1)) and torch.equal(mn, mn[:, ::4].repeat_interleave(4, 1))


def _load_online(path, method):
    from transformers import AutoConfig

    from tokenmill.layers.attention import get_attention_backend
    from tokenmill.models.loader import load_model

    return load_model(path, AutoConfig.from_pretrained(path), torch.float32, "cpu", get_attention_backend("cpu"),
                      max_positions=256, quantization=method)


# -- (c) bad checkpoints ------------------------------------------------------------------------------------
def _weights_field(ct_key: str, key: str, value):
    """A mutation setting one field of the quantization config: compressed-tensors' weights args or AWQ/GPTQ's."""
    def mutate(cfg, tensors):
        qc = cfg["quantization_config"]
        if "config_groups" in qc:
            qc["config_groups"]["group_0"]["weights"][ct_key] = value
        else:
            qc[key] = value
    return mutate


def _bits(n):
    return _weights_field("num_bits", "bits", n)


def _group(n):
    return _weights_field("group_size", "group_size", n)


def _shuffled_g_idx(cfg, tensors):
    cfg["quantization_config"]["desc_act"] = True
    g_idx = tensors["model.layers.0.mlp.down_proj.g_idx"]
    tensors["model.layers.0.mlp.down_proj.g_idx"] = g_idx[torch.randperm(len(g_idx), generator=torch.Generator()
                                                                          .manual_seed(0))].contiguous()


@pytest.mark.parametrize("fmt,g,mutate,match", [
    ("awq", 128, _bits(8), "awq checkpoints with 8-bit weights are not supported"),
    ("gptq", 128, _bits(3), "gptq checkpoints with 3-bit weights are not supported"),
    ("ct", 32, _bits(2), "2-bit int weights are not supported"),
    ("gptq", 64, _shuffled_g_idx, "g_idx reorders the groups"),
    ("awq", 128, _group(256), "group size 256 does not divide its input size 128"),
    ("ct", 32, _group(16), "group_size 16 is not supported"),
    ("awq", 32, _group(64), "qzeros of shape .* does not fit"),
])
def test_bad_checkpoints_are_one_line_errors(base, tmp_path, fmt, g, mutate, match):
    from tokenmill import LLM

    qdir, _, _ = _build(base, str(tmp_path), fmt, g, mutate=mutate)
    with pytest.raises(ValueError, match=match) as e:
        LLM(qdir, kv_cache_memory_bytes=2**22)
    assert "\n" not in str(e.value)


def test_row_parallel_split_must_fall_on_blocks():
    from torch import nn

    from tokenmill.layers.linear import Sharding
    from tokenmill.layers.quantization.int4 import check_input_split

    layer = nn.Module()
    layer.sharding = Sharding(96, (48, 48), (64,), ((0, 64),), (64,), tp=2)
    with pytest.raises(ValueError, match="cut the 32-value int4 blocks"):
        check_input_split(layer, "x")
    layer.sharding = Sharding(128, (64, 64), (64,), ((0, 64),), (64,), tp=2)
    check_input_split(layer, "x")


# -- tensor parallelism: each rank's blocks are its slice of one process's ----------------------------------
def _rank_weights(jobs):
    """On each rank: job -> {layer name: (dequantized weight, sharding)} of the int4 layers."""
    from tokenmill.layers.quantization.int4 import Q4BlockMethod

    out = {}
    for name, path, quantization in jobs:
        model = _load_online(path, quantization)
        out[name] = {n: (m.quant_method.dequantized_weight(m).numpy(), m.sharding) for n, m in model.named_modules()
                     if isinstance(getattr(m, "quant_method", None), Q4BlockMethod)}
    return out


@pytest.mark.distributed
def test_tp2_ranks_hold_their_slices_of_the_blocks(base, tmp_path):
    """Column-parallel rows (q|k|v, gate|up) and row-parallel columns (o, down: a split at 64 inside AWQ's
    groups of 128) give each rank exactly the blocks of its part of the one-process weight."""
    from dist_utils import run_ranks

    jobs = [("awq", _build(base, str(tmp_path), "awq", 128)[0], None),
            ("gptq", _build(base, str(tmp_path), "gptq", 32, sym=True)[0], None),
            ("ct", _build(base, str(tmp_path), "ct", 64)[0], None), ("int4", base[0], "int4")]
    ranks = run_ranks(_rank_weights, 2, 1, jobs)
    for name, path, quantization in jobs:
        full = _rank_weights([(name, path, quantization)])[name]
        assert len(full) == 4 * LAYERS
        for layer, (w, _) in full.items():
            for rank, results in enumerate(ranks):
                got, s = results[name][layer]
                offsets = np.cumsum((0,) + s.full_sizes)
                rows = np.concatenate([np.arange(o + a, o + a + n) for o, (a, n) in zip(offsets, s.out_ranges)])
                want = w[rows][:, s.in_range[0]:s.in_range[0] + s.in_range[1]]
                assert s.tp == 2 and np.array_equal(got, want), (name, layer, rank)


@pytest.mark.parametrize("layout", ["awq", "gptq", "ct"])
def test_a_slice_reads_as_the_slice_of_the_whole(layout):
    """Field.read of any rows and any 32-aligned columns (starts inside a packed word or a group) equals that
    part of the whole tensor's read."""
    from tokenmill.layers.quantization import awq_gptq

    fields = {"awq": awq_gptq.awq_layout(), "gptq": awq_gptq.gptq_layout(False),
              "ct": awq_gptq.pack_quantized_layout(False)}[layout].fields
    N, K, g = 40, 512, 128
    gen = torch.Generator().manual_seed(3)
    for f in fields:
        n = -(-N // 8) if f.n_pack else N
        k = K // g if f.grouped else K // 8 if f.k_pack else K
        stored = torch.randint(-2**31, 2**31 - 1, (n, k) if f.n_axis == 0 else (k, n), generator=gen,
                               dtype=torch.int64).to(torch.int32 if f.n_pack or f.k_pack else torch.float32)
        whole = f.read(stored, N, K, g, (0, N), (0, K))
        per = 32 if f.grouped else 1
        for rows, cols in [((5, 11), (32, 96)), ((13, 27), (160, 320)), ((0, 40), (448, 64))]:
            part = f.read(stored, N, K, g, rows, cols)
            want = whole[rows[0]:rows[0] + rows[1], cols[0] // per:(cols[0] + cols[1]) // per]
            assert torch.equal(part, want), (f.name, rows, cols)


# -- MoE experts --------------------------------------------------------------------------------------------
def _experts(worker):
    from tokenmill.layers.fused_moe import FusedMoE

    return [(type(m.quant_method).__name__, m.intermediate_size, m.w13_weight.data.clone(), m.w2_weight.data.clone())
            for m in worker.model.modules() if isinstance(m, FusedMoE)]


def test_online_int4_reaches_the_experts(tiny, caplog):
    """Mixtral's experts (hidden 64, intermediate 128) become Q4_1 blocks, each the quantization of the float
    expert, and run as x through their dequantized weights; Qwen3-MoE's (intermediate 48, not whole blocks) stay float, said once."""
    from tokenmill import LLM
    from tokenmill.layers.quantization.int4 import dequantize_q4_1, quantize_q4_1

    ref = LLM(tiny("mixtral"), dtype="float32", kv_cache_memory_bytes=2**22)
    llm = LLM(tiny("mixtral"), dtype="float32", quantization="int4", kv_cache_memory_bytes=2**22)
    floats = ref.engine.executor.collective_rpc(_experts)[0]
    quant = llm.engine.executor.collective_rpc(_experts)[0]
    assert quant and all(kind == "Int4MoEMethod" for kind, *_ in quant)
    for (_, n, w13, w2), (_, _, b13, b2) in zip(floats, quant):
        assert torch.equal(b13[0], quantize_q4_1(w13[0])) and torch.equal(b2[1], quantize_q4_1(w2[1]))
        assert (dequantize_q4_1(b2[1], n) - w2[1]).abs().max() < w2[1].abs().max() / 15  # within a step
    err, scale = llm.engine.executor.collective_rpc(_expert_error)[0]
    assert err <= 0.02 * scale, (err, scale)  # the kernel's 8-bit activation rounding, far below this
    assert all(len(t) == 12 for t in _greedy_llm(llm, PROMPTS))  # the experts run in the engine
    with caplog.at_level("WARNING", logger="tokenmill"):
        llm = LLM(tiny("qwen3_moe"), dtype="float32", quantization="int4", kv_cache_memory_bytes=2**22)
    assert "MoE experts' sizes are not multiples of 32" in caplog.text
    assert all(kind == "UnquantizedMoEMethod" for kind, *_ in llm.engine.executor.collective_rpc(_experts)[0])


def _expert_error(worker):
    """max |expert 0's output - the same expert over its dequantized blocks in float32|, and max |reference|."""
    from tokenmill.layers.activation import silu_and_mul
    from tokenmill.layers.fused_moe import FusedMoE
    from tokenmill.layers.quantization.int4 import dequantize_q4_1

    moe = next(m for m in worker.model.modules() if isinstance(m, FusedMoE))
    x = torch.randn(3, moe.hidden_size, generator=torch.Generator().manual_seed(0))
    w13 = dequantize_q4_1(moe.w13_weight.data[0], moe.hidden_size)
    w2 = dequantize_q4_1(moe.w2_weight.data[0], moe.intermediate_size)
    ref = silu_and_mul(x @ w13.t()) @ w2.t()
    with torch.inference_mode():
        got = moe.quant_method.apply(moe, 0, x)
    return float((got - ref).abs().max()), float(ref.abs().max())


def _greedy_llm(llm, prompts):
    from tokenmill import SamplingParams

    out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                       SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in out]


def test_layers_the_checkpoint_leaves_float_stay_float():
    """AWQ's modules_to_not_convert and the LM head (GPTQ quantizes it only with lm_head: true) keep the float
    linear method."""
    from tokenmill.layers.quantization.awq_gptq import AwqConfig, CheckpointInt4Method, GptqConfig

    awq = AwqConfig.from_checkpoint({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm",
                                     "modules_to_not_convert": ["mlp.down_proj"]})
    assert awq.get_linear_method(None, "layers.0.mlp.down_proj", ["model.layers.0.mlp.down_proj"]) is None
    assert awq.get_linear_method(None, "lm_head", ["lm_head"]) is None
    assert isinstance(awq.get_linear_method(None, "layers.0.o_proj", ["model.layers.0.self_attn.o_proj"]),
                      CheckpointInt4Method)
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 128}
    assert GptqConfig.from_checkpoint(qc).get_linear_method(None, "lm_head", ["lm_head"]) is None
    head = GptqConfig.from_checkpoint({**qc, "lm_head": True}).get_linear_method(None, "lm_head", ["lm_head"])
    assert isinstance(head, CheckpointInt4Method)
    with pytest.raises(ValueError, match="awq version 'gemv' is not supported"):
        AwqConfig.from_checkpoint({"quant_method": "awq", "bits": 4, "version": "gemv"})


def _q4_1_blocks(m):
    """The layer's Q4_1 blocks, whatever layout its kernel runs them in (an x8 repack where the CPU has it)."""
    from tokenmill.layers.quantization import ggml

    return ggml.unpacked(m.quant_method.block_linear.parts[0], m.in_features).data
