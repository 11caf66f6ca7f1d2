"""`tokenmill eval quality`: what quantization costs in quality, measured against the unquantized model.

The text file is tokenized once and cut into windows of `--window` tokens (teacher forcing: each window is one
prefill). Every configuration runs in the engine's own worker (same loader, kernels and KV cache, so
`--kv-cache-dtype` is measured too) and yields the next-token distribution at every position. Reported side by
side: perplexity on the text; and against the unquantized reference, top-1 agreement (same argmax) and the mean
KL divergence KL(reference || quantized) in nats per token. All compared models are loaded at once.

For a GGUF model the reference is its dequantized float weights (`--gguf-weights dequantize`), the variant
named `gguf` is the file's own blocks as the engine serves them by default (`--gguf-weights native`; measured
by default when no --quantization is given), and online methods quantize the dequantized weights. A window is
one prefill, and the blocks' prefill path multiplies dequantized weight tiles (exact in float32), so
`gguf-decode` scores the same blocks with every position through the decode kernel (int8 activations per
32 values: batch-invariant mode sends every row count there), which is what generated tokens go through.

Online quantization leaves the LM head in the model dtype unless `--quantize-lm-head`; `quantize_lm_head`
("no", "yes" or "both"; the CLI defaults to both) picks which of the two each quantization is measured with.
Variants with the head quantized too are named `<method>+lm_head`.

A variant may also be a folder holding a quantized checkpoint of the same model (AWQ, GPTQ, compressed-tensors,
fp8...): it is loaded as it is and scored against the float reference (`<quant_method> (<folder name>)`).
"""
from __future__ import annotations

import logging
import math
import os
import time
from dataclasses import dataclass, field
from typing import Iterator, Optional

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.layers import batch_invariant
from tokenmill.layers.quantization.gguf_blocks import block_bytes
from tokenmill.models.flat_batch import flat_batch
from tokenmill.models.resolution import resolve_engine_config
from tokenmill.worker.worker import Worker

logger = logging.getLogger("tokenmill")

GGUF_VARIANT, GGUF_DECODE = "gguf", "gguf-decode"  # a GGUF's own blocks (--gguf-weights native) as variants
LM_HEAD_CHOICES = ("no", "yes", "both")  # evaluate(quantize_lm_head=); spelled out in cli.py too (no torch there)


@dataclass
class QualityResult:
    name: str
    quantization: Optional[str]
    kv_cache_dtype: str
    quantize_lm_head: bool = False
    tokens: int = 0
    nll_sum: float = 0.0
    agree: int = 0
    kl_sum: float = 0.0
    weight_bytes: int = 0
    seconds: float = 0.0
    _n_compared: int = field(default=0, repr=False)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / max(self.tokens, 1))

    def as_dict(self, reference: Optional["QualityResult"] = None) -> dict:
        d = {"name": self.name, "quantization": self.quantization, "quantize_lm_head": self.quantize_lm_head,
             "kv_cache_dtype": self.kv_cache_dtype,
             "tokens": self.tokens, "perplexity": round(self.perplexity, 4),
             "weight_mb": round(self.weight_bytes / 1e6, 1), "seconds": round(self.seconds, 2)}
        if reference is not None and self is not reference:
            d["top1_agreement"] = round(self.agree / max(self._n_compared, 1), 4)
            d["kl_divergence"] = round(self.kl_sum / max(self._n_compared, 1), 6)
            d["perplexity_change"] = round(self.perplexity / reference.perplexity - 1.0, 4)
        return d


def _windows(ids: list[int], window: int) -> list[list[int]]:
    return [ids[i:i + window] for i in range(0, len(ids) - 1, window) if len(ids[i:i + window]) > 1]


class _Scorer:
    """Runs whole sequences through a worker's model as single prefills and returns log-probs [L, V]."""

    def __init__(self, config, decode_kernels: bool = False) -> None:
        self.decode_kernels = decode_kernels  # score through the decode kernels (see the module doc)
        self.worker = Worker(config)
        self.block_size = config.cache.block_size
        self.max_len = config.model.max_model_len
        # each KV group (step/kv_groups.py) gets blocks of its own for the longest sequence
        self.blocks_per_group = -(-self.max_len // self.block_size)
        self.worker.initialize_cache(len(self.worker.kv_layout.groups) * self.blocks_per_group)

    @torch.inference_mode()
    def logprobs(self, ids: list[int]) -> torch.Tensor:
        L = len(ids)
        layout, nb = self.worker.kv_layout, -(-L // self.block_size)
        tables = np.stack([np.arange(g * self.blocks_per_group, g * self.blocks_per_group + nb, dtype=np.int64)[None, :]
                           for g in range(len(layout.groups))])  # [G, 1, nb]
        input_ids, meta, _ = flat_batch(np.asarray(ids, dtype=np.int64), np.array([L]), np.array([0]), tables,
                                        self.block_size, self.worker.model.embed_tokens.weight.device,
                                        layout.layer_group)
        model = self.worker.model
        batch_invariant.enable(self.decode_kernels)
        try:
            hidden = model(input_ids, meta, self.worker.runner.kv_caches)
            return model.compute_logits(hidden).float().log_softmax(-1).cpu()
        finally:
            batch_invariant.enable(False)

    def weight_bytes(self) -> int:
        seen, total = set(), 0
        for p in self.worker.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total + block_bytes(self.worker.model)  # a GGUF's blocks are views, not parameters


def _config(model: Optional[str], quantization: Optional[str], kv_cache_dtype: str, dtype: str, window: int,
            device: str, quantize_lm_head: bool = False):
    native = quantization in (GGUF_VARIANT, GGUF_DECODE)  # other variants of a GGUF start from its floats
    return resolve_engine_config(EngineConfig.from_kwargs(model=model, quantization=None if native else quantization,
                                    quantize_lm_head=quantize_lm_head, kv_cache_dtype=kv_cache_dtype,
                                    gguf_weights="native" if native else "dequantize",
                                    dtype=dtype, max_model_len=window, device=device,
                                    kv_cache_memory_bytes=64 * 2**20))


def read_dataset(path: Optional[str]) -> str:
    if path is None:  # a long English text that ships with Python
        from pydoc_data.topics import topics

        return "\n\n".join(topics[k] for k in sorted(topics))
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


def _variants(model: Optional[str], quantizations: list[Optional[str]], heads: tuple, kv_cache_dtype: str,
              dtype: str, window: int, device: str) -> list[tuple[str, "EngineConfig"]]:
    """(name, engine config) of each variant compared with the reference."""
    configs = []
    for q in quantizations:
        if q and os.path.isdir(q):  # a quantized checkpoint of the same model, as it is
            cfg = _config(q, None, kv_cache_dtype, dtype, window, device)
            configs.append((f"{cfg.model.quantization or 'float'} ({os.path.basename(os.path.normpath(q))})", cfg))
            continue
        for head in heads if q not in (None, GGUF_VARIANT, GGUF_DECODE) else (False,):  # none, or the file's own
            name = "+".join(x for x in (q, "lm_head" if head else None,
                                        None if kv_cache_dtype == "auto" else f"kv {kv_cache_dtype}") if x)
            configs.append((name or "reference (again)",
                            _config(model, q, kv_cache_dtype, dtype, window, device, head)))
    return configs


def evaluate(model: Optional[str], quantizations: list[Optional[str]], dataset: Optional[str] = None,
             kv_cache_dtype: str = "auto", dtype: str = "auto", max_tokens: int = 4096, window: int = 512,
             device: str = "auto", quantize_lm_head: str = "no") -> list[QualityResult]:
    """The reference (no quantization, model-dtype KV cache) and each quantization, window by window (all
    models stay loaded: nothing of size vocab x tokens is kept). quantize_lm_head: "no" (the head keeps the
    model dtype, the engine's default), "yes" (`--quantize-lm-head`) or "both" (two variants per method)."""
    from transformers import AutoTokenizer

    if quantize_lm_head not in LM_HEAD_CHOICES:
        raise ValueError(f"quantize_lm_head must be one of {', '.join(LM_HEAD_CHOICES)}, got {quantize_lm_head!r}")
    heads = {"no": (False,), "yes": (True,), "both": (False, True)}[quantize_lm_head]

    # Every long step logs a line first: a first run converts a GGUF, and quantizing on load takes a while.
    logger.info("quality: resolving the model (a GGUF file is converted once and cached)")
    ref_cfg = _config(model, None, "auto", dtype, window, device)
    tok = AutoTokenizer.from_pretrained(ref_cfg.model.tokenizer)
    text = read_dataset(dataset)
    ids = tok(text[: max_tokens * 16]).input_ids[:max_tokens]  # tokens are far fewer than 16 chars each
    if len(ids) < 2:
        raise ValueError("the dataset holds fewer than 2 tokens")
    windows = _windows(ids, window)
    logger.info("quality: %d tokens in %d windows of up to %d", sum(len(w) for w in windows), len(windows), window)
    configs = [("reference", ref_cfg)] + _variants(model, quantizations, heads, kv_cache_dtype, dtype, window, device)
    scorers, results = [], []
    for i, (name, cfg) in enumerate(configs):
        logger.info("quality: loading model %d/%d: %s%s", i + 1, len(configs), name,
                    f" (quantizing the weights to {cfg.model.quantization})" if cfg.model.quantization else "")
        scorer = _Scorer(cfg, decode_kernels=name == GGUF_DECODE)
        scorers.append(scorer)
        results.append(QualityResult(name, cfg.model.quantization, cfg.cache.kv_cache_dtype,
                                     cfg.model.quantize_lm_head, weight_bytes=scorer.weight_bytes()))
    for i, w in enumerate(windows):
        logger.info("quality: scoring window %d/%d with %d model(s)", i + 1, len(windows), len(scorers))
        target = torch.tensor(w[1:])
        ref = None
        for scorer, res in zip(scorers, results):
            t0 = time.perf_counter()
            lp = scorer.logprobs(w)[:-1]  # position t predicts token t + 1
            if ref is not None and lp.shape != ref.shape:
                raise ValueError(f"{res.name} has a vocabulary of {lp.shape[-1]}, the reference {ref.shape[-1]}: "
                                 "a checkpoint compared must be a quantized copy of the same model")
            res.seconds += time.perf_counter() - t0
            res.nll_sum -= float(lp.gather(1, target[:, None]).sum())
            res.tokens += len(target)
            if ref is None:
                ref = lp
                continue
            res.agree += int((lp.argmax(-1) == ref.argmax(-1)).sum())
            res.kl_sum += float((ref.exp() * (ref - lp)).sum())
            res._n_compared += lp.shape[0]
    return results


def format_table(results: list[QualityResult]) -> str:
    ref = results[0]
    rows = [("", [r.name for r in results]),
            ("weights (MB)", [f"{r.weight_bytes / 1e6:.1f}" for r in results]),
            ("perplexity", [f"{r.perplexity:.3f}" for r in results]),
            ("  change", ["-"] + [f"{r.perplexity / ref.perplexity - 1:+.2%}" for r in results[1:]]),
            ("top-1 agreement", ["-"] + [f"{r.agree / max(r._n_compared, 1):.2%}" for r in results[1:]]),
            ("KL(ref||q) nats/tok", ["-"] + [f"{r.kl_sum / max(r._n_compared, 1):.5f}" for r in results[1:]])]
    width = max(12, *(len(c) for _, cols in rows for c in cols)) + 2
    lines = [f"{label:<20}" + "".join(f"{c:>{width}}" for c in cols) for label, cols in rows]
    lines.append(f"({ref.tokens} predicted tokens)")
    if any(r.quantization for r in results):
        lines.append("(LM head: in the model dtype, the default; quantized too in the +lm_head variants, "
                     "--quantize-lm-head)")
    return "\n".join(lines)


def iter_quantizations(spec: Optional[str]) -> Iterator[Optional[str]]:
    """'int8,fp8' -> int8, fp8; 'none' stands for the unquantized weights (e.g. to measure a KV dtype alone),
    'gguf' / 'gguf-decode' for a GGUF's own blocks."""
    for part in (spec or "none").split(","):
        part = part.strip()
        yield None if part in ("", "none") else part
