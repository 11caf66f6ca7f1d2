"""--task embed, the fronts' half (offline LLM.embed and /v1/embeddings share it): inputs to token ids with the
truncate_prompt_tokens rule, the `dimensions` check, and a pooled vector to what the user gets.

An embedding request is an ordinary engine request whose SamplingParams ask for nothing to be generated; the
engine, running with a pooler (config.PoolerConfig), finishes it once its prompt has run and reports the pooled
vector (scheduler.update, worker/model_runner._pool).

Why the existing EngineCore and scheduler rather than an encoder-specific runner: the scheduler already packs
many prompts into one flat step up to max_num_batched_tokens (the no-padding batching that makes many short
inputs cheap), and the fronts, the engine process, failure isolation, aborts and metrics come for free. The
differences are three small switches: a pooled request finishes after its prompt; an encoder's (or a mean/CLS
pooler's) prompt is never chunked (scheduler.whole_prompts); and an encoder has no KV tensors, its blocks being
bookkeeping only (worker.initialize_cache). A decoder with --task embed keeps chunked prefill and the prefix cache.

truncate_prompt_tokens=k (vLLM's name; -1 = the model's maximum) cuts an input to k tokens on the tokenizer's
truncation side (right for BERT-family and most tokenizers: the first k tokens are kept, and for text the
tokenizer keeps its special tokens [CLS] ... [SEP] inside the k, as sentence-transformers does at its
max_seq_length). Token-id inputs are cut the same way, on the same side. Without it, an input longer than the
model's maximum is refused with an error that names the option.
"""
from __future__ import annotations

from typing import Optional, Union

import numpy as np

from tokenmill.config import PoolerConfig
from tokenmill.sampling_params import SamplingParams

EmbedInput = Union[str, list[int]]


def embed_params() -> SamplingParams:
    return SamplingParams(max_tokens=1, detokenize=False)


def embed_token_ids(tokenizer, prompt: EmbedInput, truncate_prompt_tokens: Optional[int],
                    max_model_len: int) -> list[int]:
    """The input's token ids, cut to truncate_prompt_tokens (see the module docstring). Raises ValueError."""
    k = truncate_prompt_tokens
    if k is not None:
        if k == -1:
            k = max_model_len
        if k < 1:
            raise ValueError(f"truncate_prompt_tokens must be -1 (the model's maximum) or at least 1, got {k}")
        k = min(k, max_model_len)
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("the input is an empty string; each input must contain text")
        if tokenizer is None:
            raise ValueError("a text input needs a tokenizer; send token ids")
        if k is not None:
            return tokenizer(prompt, truncation=True, max_length=k).input_ids
        return tokenizer(prompt).input_ids
    ids = list(prompt)
    if not ids:
        raise ValueError("the input is an empty list of token ids; each input needs at least one token")
    if k is not None and len(ids) > k:
        left = tokenizer is not None and getattr(tokenizer, "truncation_side", "right") == "left"
        ids = ids[-k:] if left else ids[:k]
    return ids


def check_dimensions(pooler: PoolerConfig, dimensions: Optional[int], size: int, model: str) -> None:
    """`dimensions` is allowed only where the model says it was trained for it (Matryoshka: config.json's
    is_matryoshka / matryoshka_dimensions, as vLLM reads them). Raises ValueError."""
    if dimensions is None:
        return
    if not (pooler.is_matryoshka or pooler.matryoshka_dimensions):
        raise ValueError(f"model {model!r} does not support matryoshka representation (its config.json has no "
                         "is_matryoshka or matryoshka_dimensions): `dimensions` is not allowed")
    if pooler.matryoshka_dimensions and dimensions not in pooler.matryoshka_dimensions:
        raise ValueError(f"dimensions={dimensions} is not one the model supports: "
                         f"{', '.join(map(str, pooler.matryoshka_dimensions))}")
    if not 1 <= dimensions <= size:
        raise ValueError(f"dimensions must be between 1 and the model's {size}, got {dimensions}")


def final_vector(pooled: bytes, pooler: PoolerConfig, dimensions: Optional[int]) -> np.ndarray:
    """The float32 vector the user gets: the first `dimensions` entries, normalized again when the model's
    vectors are (a Matryoshka prefix of a unit vector is not one)."""
    vec = np.frombuffer(pooled, dtype="<f4")
    if dimensions is None or dimensions >= vec.shape[0]:
        return vec
    vec = vec[:dimensions]
    if pooler.normalize:
        vec = vec / max(float(np.linalg.norm(vec)), 1e-12)
    return vec.astype("<f4", copy=False)
