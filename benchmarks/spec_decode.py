"""Speculative decoding: measured decode speedup vs no speculation, next to the ideal from the standard formula.

Part 1, an acceptance-controlled synthetic pair built here: a random Llama target whose layers beyond the
first two have zeroed output projections (o_proj, down_proj), so it computes the same function as a 2-layer
draft made of its first layers (same embeddings, final norm and head) at several times the cost. Gaussian
noise on those zeroed projections makes the target disagree with the draft: acceptance falls. For
acceptance ~100%, ~70%, ~40% and k = 1..6: single-stream and batched decode tok/s with and without
speculation (draft_model), the measured per-token acceptance a (accepted / evaluated draft positions), the
measured draft/target step-cost ratio c (decode step time of the
draft alone over the target alone, same batch), and the ideal speedup (1 - a^(k+1)) / ((1 - a)(1 + k c)).
Then a batch sweep at ~70%: where does speculation (fixed k) stop paying on this machine, and what does the
adaptive mode (k in 0..max_k picked from measured acceptance and step costs) make of it?

Part 2, real weights (the default model, SmolLM2-135M-Instruct): n-gram (prompt lookup) on a copy-heavy
workload (human-eval prompts: "repeat this function, renamed"), and draft_model with a quantized copy of the
default model (when this build has weight quantization), single stream and at batch 8 and 32.

Every speedup is the median over --repeats rounds of a ratio of two runs made back to back in this process
(the load of other processes comes and goes between rounds). Prints a JSON result and one summary line.
"""
from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import random
import tempfile
import time

import torch

logger = logging.getLogger("tokenmill")


# -- the synthetic pair ------------------------------------------------------------------------------------
def build_pair(root: str, layers: int, draft_layers: int, hidden: int, inter: int, heads: int, vocab: int,
               seed: int = 0) -> tuple[str, str]:
    from safetensors.torch import load_file, save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=4096,
                      rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.05,
                      bos_token_id=0, eos_token_id=1)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float()
    target = os.path.join(root, "target-0")
    model.save_pretrained(target)
    w = load_file(os.path.join(target, "model.safetensors"))
    for i in range(draft_layers, layers):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            w[f"model.layers.{i}.{name}"].zero_()
    save_file(w, os.path.join(target, "model.safetensors"), metadata={"format": "pt"})
    draft = os.path.join(root, "draft")
    cfg.num_hidden_layers = draft_layers
    cfg.save_pretrained(draft)
    save_file({k: v for k, v in w.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < draft_layers},
              os.path.join(draft, "model.safetensors"), metadata={"format": "pt"})
    return target, draft


def noisy_target(base: str, sigma: float, draft_layers: int, layers: int) -> str:
    """The target with N(0, sigma^2) on its zeroed projections (the draft is unchanged)."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = base.replace("target-0", f"target-{sigma:.5f}")
    if os.path.isdir(path):
        return path
    shutil.copytree(base, path)
    w = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    for i in range(draft_layers, layers):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            t = w[f"model.layers.{i}.{name}"]
            t.add_(torch.randn(t.shape, generator=g) * sigma)
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


# -- measurement -------------------------------------------------------------------------------------------
def make_llm(model: str, spec: dict | None, **kw):
    from tokenmill import LLM

    return LLM(model, speculative_config=spec, **kw)


def decode_run(llm, prompts: list[list[int]], out_len: int) -> dict:
    """Decode tok/s of a batch: time from every request having its first token to the last token
    (prefill excluded), and the speculation counters of the run."""
    from tokenmill import SamplingParams
    from tokenmill.messages import EngineCoreRequest

    eng = llm.engine
    before = eng.stats()
    counters = eng.scheduler.spec.counters if eng.scheduler.spec is not None else None
    evaluated0 = counters.num_evaluated_tokens if counters else 0
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(EngineCoreRequest(f"b{time.monotonic_ns()}-{i}", p, sp))
    got = {}
    t0 = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] = got.get(o.request_id, 0) + len(o.new_token_ids)
        if t0 is None and len(got) == len(prompts) and all(got.values()):
            t0, first = time.perf_counter(), sum(got.values())
    dt = time.perf_counter() - t0
    total = sum(got.values())
    assert total == len(prompts) * out_len, (total, len(prompts), out_len)
    after = eng.stats()
    drafts = after.spec_num_drafts - before.spec_num_drafts
    drafted = after.spec_num_draft_tokens - before.spec_num_draft_tokens
    accepted = after.spec_num_accepted_tokens - before.spec_num_accepted_tokens
    assert eng.scheduler.kv.is_whole()
    evaluated = (counters.num_evaluated_tokens if counters else 0) - evaluated0
    return {"tok_s": (total - first) / dt, "seconds": dt, "drafts": drafts, "drafted": drafted,
            "accepted": accepted, "evaluated": evaluated}


def per_token_acceptance(r: dict) -> float:
    """a = accepted / evaluated draft positions (a position is evaluated when all drafts before it were
    accepted): the maximum-likelihood a of the i.i.d. model behind the speedup formula."""
    return r["accepted"] / r["evaluated"] if r["evaluated"] else 0.0


def ideal_speedup(a: float, k: int, c: float) -> float:
    if a >= 1.0 - 1e-9:
        return (k + 1) / (1 + k * c)
    return (1 - a ** (k + 1)) / ((1 - a) * (1 + k * c))


def _busy_fraction(interval: float = 0.3) -> float:
    """Share of all CPUs busy (any process) over `interval` seconds, from /proc/stat."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    t0, i0 = snap()
    time.sleep(interval)
    t1, i1 = snap()
    return 1.0 - (i1 - i0) / max(t1 - t0, 1)


def wait_quiet(threshold: float = 0.25, max_wait: float = 45.0) -> None:
    """Measure only while other processes leave the cores alone (we are idle while checking)."""
    deadline = time.monotonic() + max_wait
    while time.monotonic() < deadline and _busy_fraction() > threshold:
        time.sleep(1.0)


def paired(fns: list, rounds: int) -> list[dict]:
    """Run the fns in rounds (A B C, A B C, ...). Other processes' load comes and goes on a scale of seconds,
    so ratios are taken within a round; each result carries the per-round tok/s list ("runs") and the
    median run's counters."""
    runs: list[list[dict]] = [[] for _ in fns]
    for _ in range(rounds):
        wait_quiet()
        for i, fn in enumerate(fns):
            runs[i].append(fn())
    out = []
    for rs in runs:
        med = sorted(rs, key=lambda r: r["tok_s"])[len(rs) // 2]
        out.append({**med, "runs": [r["tok_s"] for r in rs],
                    **{key: sum(r[key] for r in rs) for key in ("drafts", "drafted", "accepted", "evaluated")}})
    return out


def median_ratio(a: dict, b: dict) -> float:
    """Median over rounds of a's tok/s / b's tok/s."""
    rs = sorted(x / y for x, y in zip(a["runs"], b["runs"]))
    return rs[len(rs) // 2]


def rand_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(length)] for _ in range(n)]


# -- part 1 ------------------------------------------------------------------------------------------------
def synthetic(args) -> dict:
    root = tempfile.mkdtemp(prefix="tokenmill-spec-")
    L, Ld = args.layers, args.draft_layers
    base, draft = build_pair(root, L, Ld, args.hidden, args.intermediate, args.heads, args.vocab)
    kw = dict(dtype="float32", skip_tokenizer_init=True, kv_cache_memory_bytes=args.kv_bytes,
              max_model_len=1024, max_num_seqs=256)
    out_len, plen = args.out_len, args.prompt_len
    one = rand_prompts(1, plen, args.vocab, 1)
    many = rand_prompts(args.batch, plen, args.vocab, 2)

    # Calibrate the noise for the wanted acceptances (k = 3, single stream, short runs).
    def acceptance_of(sigma: float) -> float:
        llm = make_llm(noisy_target(base, sigma, Ld, L), {"method": "draft_model", "model": draft,
                                                           "num_speculative_tokens": 3}, **kw)
        r = decode_run(llm, rand_prompts(2, plen, args.vocab, 3), 48)
        return per_token_acceptance(r)

    levels = {"~100%": 0.0}
    for name, want in (("~70%", 0.70), ("~40%", 0.40)):
        lo, hi = 1e-4, 0.2  # log-bisection on sigma; keep the closest probe
        tried = []
        for _ in range(args.calibration_steps):
            sigma = (lo * hi) ** 0.5
            a = acceptance_of(sigma)
            tried.append((abs(a - want), sigma))
            logger.info("calibration: sigma %.5f -> a %.2f (want %.2f)", sigma, a, want)
            if abs(a - want) < 0.04:
                break
            lo, hi = (sigma, hi) if a > want else (lo, sigma)
        levels[name] = min(tried)[1]

    draft_llm = make_llm(draft, None, **kw)
    rows, sweep = [], []
    for level, sigma in levels.items():
        target = noisy_target(base, sigma, Ld, L)
        base_llm = make_llm(target, None, **kw)
        for batch, prompts in (("1", one), (str(args.batch), many)):
            for k in range(1, args.max_k + 1):
                spec_llm = make_llm(target, {"method": "draft_model", "model": draft, "num_speculative_tokens": k},
                                    **kw)
                b, d, s = paired([lambda: decode_run(base_llm, prompts, out_len),
                                  lambda: decode_run(draft_llm, prompts, out_len),
                                  lambda: decode_run(spec_llm, prompts, out_len)], args.repeats)
                c = median_ratio(b, d)  # step time ratio draft / target
                a = per_token_acceptance(s)
                measured = median_ratio(s, b)
                ideal = ideal_speedup(a, k, c)
                rows.append({"acceptance": level, "sigma": sigma, "batch": int(batch), "k": k,
                             "base_tok_s": round(b["tok_s"], 1), "spec_tok_s": round(s["tok_s"], 1),
                             "draft_tok_s": round(d["tok_s"], 1), "a": round(a, 3), "c": round(c, 3),
                             "accept_rate": round(s["accepted"] / max(s["drafted"], 1), 3),
                             "speedup": round(measured, 3), "ideal": round(ideal, 3),
                             "of_ideal": round(measured / ideal, 3)})
                logger.info("%s", rows[-1])
                del spec_llm

    # Batch sweep at ~70% acceptance: where does speculation stop paying?
    target = noisy_target(base, levels["~70%"], Ld, L)
    base_llm = make_llm(target, None, **kw)
    spec_llm = make_llm(target, {"method": "draft_model", "model": draft, "num_speculative_tokens": args.sweep_k},
                        **kw)
    stop_at = None
    for B in args.sweep:
        prompts = rand_prompts(B, plen, args.vocab, 10 + B)
        adaptive_llm = make_llm(target, {"method": "draft_model", "model": draft, "adaptive": True,
                                         "num_speculative_tokens": args.max_k}, **kw)
        decode_run(adaptive_llm, prompts, 2 * args.sweep_out_len)  # let it measure its options first
        b, s, ad = paired([lambda: decode_run(base_llm, prompts, args.sweep_out_len),
                           lambda: decode_run(spec_llm, prompts, args.sweep_out_len),
                           lambda: decode_run(adaptive_llm, prompts, args.sweep_out_len)], args.repeats)
        speedup = median_ratio(s, b)
        sweep.append({"batch": B, "k": args.sweep_k, "base_tok_s": round(b["tok_s"], 1),
                      "spec_tok_s": round(s["tok_s"], 1), "speedup": round(speedup, 3),
                      "accept_rate": round(s["accepted"] / max(s["drafted"], 1), 3),
                      "adaptive_speedup": round(median_ratio(ad, b), 3),
                      "adaptive_k_last": adaptive_llm.engine.scheduler.spec.last_k})
        logger.info("%s", sweep[-1])
        if stop_at is None and speedup < 1.0:
            stop_at = B
    return {"pair": {"target_layers": L, "draft_layers": Ld, "hidden": args.hidden, "vocab": args.vocab,
                     "noise_sigma": levels},
            "rows": rows, "batch_sweep": sweep, "speculation_stops_paying_at_batch": stop_at}


# -- part 2 ------------------------------------------------------------------------------------------------
def copy_prompts(tokenizer, n: int) -> list[list[int]]:
    import importlib.metadata

    path = importlib.metadata.distribution("human-eval").locate_file("human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        problems = [json.loads(line) for line in f]
    out = []
    for p in problems[:n]:
        msg = ("Repeat the following Python code exactly, but rename the function to `solution`. "
               "Output only the code.\n\n" + p["prompt"].strip())
        text = tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True,
                                             tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False).input_ids)
    return out


def real_weights(args) -> dict:
    kw = dict(dtype="float32", kv_cache_memory_bytes="1GiB", max_num_seqs=256)
    base_llm = make_llm(None, None, **kw)
    prompts = copy_prompts(base_llm.get_tokenizer(), max(args.real_batches))
    res = {"ngram": [], "quantized_self_draft": []}
    ngram = make_llm(None, {"method": "ngram", "num_speculative_tokens": args.ngram_k, "prompt_lookup_min": 2,
                            "prompt_lookup_max": 5}, **kw)
    qdraft = None
    if "draft_model" not in args.real_methods:
        res["quantized_self_draft"] = "not run (--real-methods)"
    else:
        try:
            qdraft = make_llm(None, {"method": "draft_model", "model": base_llm.config.model.model_dir,
                                     "num_speculative_tokens": args.draft_k,
                                     "quantization": args.draft_quantization}, **kw)
        except ValueError as e:
            res["quantized_self_draft"] = f"not available: {e}"
    for B in args.real_batches:
        ps = prompts[:B]
        fns = [lambda: decode_run(base_llm, ps, args.real_out_len), lambda: decode_run(ngram, ps, args.real_out_len)]
        if qdraft is not None:
            fns.append(lambda: decode_run(qdraft, ps, args.real_out_len))
        runs = paired(fns, args.repeats)
        b = runs[0]
        for name, r in zip(["ngram", "quantized_self_draft"], runs[1:]):
            res[name].append({"batch": B, "base_tok_s": round(b["tok_s"], 1), "spec_tok_s": round(r["tok_s"], 1),
                              "speedup": round(median_ratio(r, b), 3),
                              "accept_rate": round(r["accepted"] / max(r["drafted"], 1), 3),
                              "mean_accepted_len": round(1 + r["accepted"] / max(r["drafts"], 1), 2)})
            logger.info("%s %s", name, res[name][-1])
    return res


def main() -> None:
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")  # no figure from a slow path (kernels_report.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--out-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8, help="the batched case of the k table")
    ap.add_argument("--max-k", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per comparison (median of paired ratios)")
    ap.add_argument("--calibration-steps", type=int, default=6)
    ap.add_argument("--sweep", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--sweep-k", type=int, default=2)
    ap.add_argument("--sweep-out-len", type=int, default=32)
    ap.add_argument("--kv-bytes", default="256MiB")
    ap.add_argument("--real-batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--real-out-len", type=int, default=96)
    ap.add_argument("--ngram-k", type=int, default=4)
    ap.add_argument("--draft-k", type=int, default=4)
    ap.add_argument("--draft-quantization", default="int8")
    ap.add_argument("--real-methods", nargs="+", default=["ngram", "draft_model"],
                    choices=["ngram", "draft_model"], help="part 2: ngram always runs; draft_model is optional")
    ap.add_argument("--skip-synthetic", action="store_true", help="run only part 2 (real weights)")
    ap.add_argument("--skip-real", action="store_true")
    ap.add_argument("--save-result", default=None)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("tokenmill").setLevel(logging.WARNING)
    logger.setLevel(logging.INFO)

    result = {"threads": torch.get_num_threads(), "load_average_start": os.getloadavg()[0]}
    def save() -> None:
        if args.save_result:
            with open(args.save_result, "w") as f:
                json.dump(result, f, indent=2)

    if not args.skip_synthetic:
        result["synthetic"] = synthetic(args)
        save()
    if not args.skip_real:
        result["real"] = real_weights(args)
    result["load_average_end"] = os.getloadavg()[0]
    print(json.dumps(result, indent=2))
    save()
    parts = []
    syn = result.get("synthetic")
    if syn:
        b1 = [r for r in syn["rows"] if r["batch"] == 1]
        parts.append("batch-1 measured/ideal min %.2f (k=1..%d, 3 acceptance levels); best speedup %.2fx; "
                     "speculation stops paying at batch %s" % (min(r["of_ideal"] for r in b1), args.max_k,
                                                               max(r["speedup"] for r in b1),
                                                               syn["speculation_stops_paying_at_batch"]))
    real = result.get("real")
    if real and real["ngram"]:
        parts.append("ngram on copy prompts: " + ", ".join(f"B={r['batch']} {r['speedup']:.2f}x (acc {r['accept_rate']:.0%})"
                                                           for r in real["ngram"]))
    print("spec_decode: " + "; ".join(parts))


if __name__ == "__main__":
    main()
