"""Workloads for `tokenmill bench serve`: what to send (a prompt) and how much to ask back (output length).

- `random`: prompts of random common words, lengths uniform in [len*(1-r), len*(1+r)].
- `shared-prefix`: `num_prefixes` system prompts of `prefix_len` tokens shared by many requests, each with
  its own random question (multi-tenant system prompts; what prefix caching is for).
- `sharegpt:PATH`: first human turn of ShareGPT-format conversations (JSON list or JSONL), the answer's
  length as the output length.
- `jsonl:PATH`: one JSON object per line: "prompt" and an output length ("output_len", "max_tokens" or
  "expected_output_len"; default --output-len).
- `random-mm`: `random` prompts, each after `--mm-images-per-request` random images of `--mm-image-size`
  (WxH) sent as PNG data URIs in chat image_url parts (--endpoint chat; a vision-language model). Each image
  is new (smooth random colour fields), so no prefix-cache hit covers one.

With a tokenizer (`--tokenizer`) prompt lengths are exact in its tokens; without one a prompt gets one common
word per requested token, which BPE tokenizers encode as about one token each (the real counts are read
from each response's usage either way). Everything is deterministic for a given seed.
"""
from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger("tokenmill")

_WORDS = (
    "time year people way day man thing woman life child world school state family student group country problem "
    "hand part place case week company system program question work government number night point home water room "
    "mother area money story fact month lot right study book eye job word business issue side kind head house "
    "service friend father power hour game line end member law car city community name president team minute idea "
    "kid body information back parent face others level office door health person art war history party result "
    "change morning reason research girl guy moment air teacher force education food river garden market light "
    "paper music table window street color stone bread horse field ocean train dream letter forest summer winter "
    "make know take see come think look want give use find tell ask seem feel try leave call keep let begin help "
    "show hear play run move live believe bring happen write provide sit stand lose pay meet include continue set "
    "learn lead understand watch follow stop create speak read allow add spend grow open walk win offer remember "
    "good new first last long great little own other old big high different small large next early young "
    "important few public bad same able red blue green quiet bright warm cold simple strong clear open full"
).split()


@dataclass
class BenchRequest:
    prompt: str
    prompt_len: int                 # tokens as the dataset counted them (exact with a tokenizer)
    output_len: int
    system: Optional[str] = None    # shared-prefix: the shared part, sent as a system message for chat
    images: list[str] = field(default_factory=list)  # random-mm: data URIs, before the prompt text

    def messages(self) -> list[dict[str, Any]]:
        if self.images:
            parts = [{"type": "image_url", "image_url": {"url": u}} for u in self.images]
            return [{"role": "user", "content": parts + [{"type": "text", "text": self.prompt}]}]
        if self.system is None:
            return [{"role": "user", "content": self.prompt}]
        return [{"role": "system", "content": self.system},
                {"role": "user", "content": self.prompt[len(self.system):].lstrip()}]


def load_tokenizer(spec: Optional[str]):
    """A Hugging Face tokenizer from a local directory or .gguf file ('default': the built-in model's),
    or None."""
    if not spec:
        return None
    from transformers import AutoTokenizer

    from tokenmill.models.resolution import resolve_model_path  # ~40 ms: `bench --help` imports this module

    path = resolve_model_path(None if spec == "default" else spec)
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - one-line reason for the user
        raise ValueError(f"cannot load a tokenizer from {spec}: {str(e).splitlines()[0]}") from None


class TextMaker:
    """Random text of an exact token count (with a tokenizer) or word count (without)."""

    def __init__(self, tokenizer=None) -> None:
        self.tok = tokenizer

    def count(self, text: str) -> int:
        if self.tok is None:
            return len(text.split())
        return len(self.tok.encode(text, add_special_tokens=False))

    def make(self, rng: random.Random, n: int) -> tuple[str, int]:
        if n <= 0:
            return "", 0
        words = [rng.choice(_WORDS) for _ in range(n)]
        text = " ".join(words)
        if self.tok is None:
            return text, n
        ids = self.tok.encode(text, add_special_tokens=False)
        while len(ids) < n:  # a word is at least one token, so this is rare
            ids += self.tok.encode(" " + rng.choice(_WORDS), add_special_tokens=False)
        text = self.tok.decode(ids[:n])
        return text, self.count(text)


def _lengths(rng: random.Random, mean: int, ratio: float) -> int:
    lo, hi = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return rng.randint(lo, hi)


def random_dataset(n: int, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                   tokenizer=None) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng, maker = random.Random(seed), TextMaker(tokenizer)
    out = []
    for _ in range(n):
        text, n_in = maker.make(rng, _lengths(rng, input_len, range_ratio))
        out.append(BenchRequest(text, n_in, _lengths(rng, output_len, range_ratio)))
    return out


def shared_prefix_dataset(n: int, prefix_len: int, num_prefixes: int, input_len: int, output_len: int,
                          range_ratio: float = 0.0, seed: int = 0, tokenizer=None) -> list[BenchRequest]:
    if num_prefixes < 1:
        raise ValueError(f"--num-prefixes must be at least 1, got {num_prefixes}")
    rng, maker = random.Random(seed), TextMaker(tokenizer)
    prefixes = []
    for i in range(num_prefixes):
        body, _ = maker.make(rng, max(0, prefix_len - 6))
        text = f"You are assistant number {i}. {body}" if prefix_len > 6 else maker.make(rng, prefix_len)[0]
        prefixes.append(text)
    out = []
    for i in range(n):
        system = prefixes[i % num_prefixes]
        question, n_q = maker.make(rng, _lengths(rng, input_len, range_ratio))
        out.append(BenchRequest(system + "\n\n" + question, maker.count(system) + n_q,
                                _lengths(rng, output_len, range_ratio), system=system))
    return out


def _read_json_records(path: str) -> list[Any]:
    if not os.path.isfile(path):
        raise ValueError(f"dataset file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stripped = text.lstrip()
    if stripped.startswith("["):
        data = json.loads(text)
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records")
        return data
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not JSON: {e.msg}") from None
    return records


def _turns(rec: dict) -> list[tuple[str, str]]:
    """(role, text) turns of a ShareGPT record ('conversations' with from/value, or 'messages' with
    role/content)."""
    turns = rec.get("conversations") or rec.get("conversation") or rec.get("messages") or []
    out = []
    for t in turns:
        if not isinstance(t, dict):
            continue
        role = str(t.get("from", t.get("role", ""))).lower()
        text = t.get("value", t.get("content"))
        if isinstance(text, str):
            out.append(("user" if role in ("human", "user") else
                        "assistant" if role in ("gpt", "assistant", "chatgpt", "bard", "model") else role, text))
    return out


def sharegpt_dataset(path: str, n: int, seed: int = 0, tokenizer=None, max_input_len: int = 1024,
                     max_total_len: int = 2048, fixed_output_len: Optional[int] = None) -> list[BenchRequest]:
    """Conversations whose first turn is the user's and second the assistant's; very short ones (< 4
    tokens either way) and very long ones (beyond max_input_len / max_total_len) are skipped."""
    maker = TextMaker(tokenizer)
    records = _read_json_records(path)
    rng = random.Random(seed)
    rng.shuffle(records)
    out = []
    for rec in records:
        if not isinstance(rec, dict):
            continue
        turns = _turns(rec)
        if len(turns) < 2 or turns[0][0] != "user" or turns[1][0] != "assistant":
            continue
        n_in = maker.count(turns[0][1])
        n_out = fixed_output_len or maker.count(turns[1][1])
        if n_in < 4 or n_out < 4 or n_in > max_input_len or n_in + n_out > max_total_len:
            continue
        out.append(BenchRequest(turns[0][1], n_in, n_out))
        if len(out) == n:
            break
    if not out:
        raise ValueError(f"{path}: no usable ShareGPT conversations (need a user turn then an assistant turn)")
    if len(out) < n:
        logger.info("%s: %d usable conversations for %d prompts; reusing them in order", path, len(out), n)
        out = [out[i % len(out)] for i in range(n)]
    return out


def jsonl_dataset(path: str, n: int, default_output_len: int, tokenizer=None) -> list[BenchRequest]:
    maker = TextMaker(tokenizer)
    out = []
    for i, rec in enumerate(_read_json_records(path), 1):
        if not isinstance(rec, dict) or not isinstance(rec.get("prompt"), str):
            raise ValueError(f"{path}: record {i} needs a string field 'prompt'")
        n_out = next((rec[k] for k in ("output_len", "max_tokens", "expected_output_len") if k in rec),
                     default_output_len)
        if not isinstance(n_out, int) or n_out < 1:
            raise ValueError(f"{path}: record {i} has output length {n_out!r}; it must be a positive integer")
        out.append(BenchRequest(rec["prompt"], maker.count(rec["prompt"]), n_out))
    if not out:
        raise ValueError(f"{path}: no records")
    return [out[i % len(out)] for i in range(n)]


def random_mm_dataset(n: int, input_len: int, output_len: int, range_ratio: float, seed: int, tokenizer,
                      image_size: str, images_per_request: int) -> list[BenchRequest]:
    try:
        w, h = (int(v) for v in image_size.lower().split("x"))
    except ValueError:
        raise ValueError(f"--mm-image-size must be WxH, e.g. 448x448, got {image_size!r}") from None
    if min(w, h) < 1 or images_per_request < 1:
        raise ValueError("--mm-image-size sides and --mm-images-per-request must be at least 1")
    out = random_dataset(n, input_len, output_len, range_ratio, seed, tokenizer)
    rng = random.Random(seed + 1)
    for req in out:
        req.images = [_random_image_uri(rng, w, h) for _ in range(images_per_request)]
    return out


def _random_image_uri(rng: random.Random, w: int, h: int) -> str:
    import base64
    import io

    from PIL import Image  # random-mm only

    coarse = Image.frombytes("RGB", (8, 8), bytes(rng.randrange(256) for _ in range(8 * 8 * 3)))
    buf = io.BytesIO()
    coarse.resize((w, h), Image.Resampling.BICUBIC).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def build_dataset(spec: str, n: int, *, input_len: int = 256, output_len: int = 128, range_ratio: float = 0.0,
                  prefix_len: int = 512, num_prefixes: int = 4, seed: int = 0, tokenizer=None,
                  mm_image_size: str = "448x448", mm_images_per_request: int = 1) -> list[BenchRequest]:
    """`n` requests of workload `spec` (random, shared-prefix, sharegpt:PATH, jsonl:PATH, random-mm)."""
    kind, _, path = spec.partition(":")
    if min(input_len, output_len) < 1:
        raise ValueError("--input-len and --output-len must be at least 1")
    if kind == "random" and not path:
        return random_dataset(n, input_len, output_len, range_ratio, seed, tokenizer)
    if kind == "shared-prefix" and not path:
        return shared_prefix_dataset(n, prefix_len, num_prefixes, input_len, output_len, range_ratio, seed, tokenizer)
    if kind == "sharegpt" and path:
        return sharegpt_dataset(path, n, seed, tokenizer)
    if kind == "jsonl" and path:
        return jsonl_dataset(path, n, output_len, tokenizer)
    if kind == "random-mm" and not path:
        return random_mm_dataset(n, input_len, output_len, range_ratio, seed, tokenizer, mm_image_size,
                                 mm_images_per_request)
    raise ValueError(f"unknown dataset {spec!r}; use random, shared-prefix, sharegpt:PATH, jsonl:PATH or random-mm")
