"""Evaluation tools (`tokenmill eval ...`): quality.py measures what quantization costs against the float model."""
from __future__ import annotations

import argparse
import json


def _quality(args: argparse.Namespace) -> int:
    from tokenmill.eval.quality import evaluate, format_table, iter_quantizations

    results = evaluate(args.model, list(iter_quantizations(args.quantization)), args.dataset,
                       kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, max_tokens=args.max_tokens,
                       window=args.window, device=args.device)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict(results[0]) for r in results], f, indent=2)
    return 0


def add_eval_parser(sub) -> None:
    from tokenmill.config import KV_CACHE_DTYPES

    ev = sub.add_parser("eval", help="evaluate a model (quality under quantization)")
    kinds = ev.add_subparsers(dest="eval_command", required=True)
    q = kinds.add_parser("quality", help="perplexity, top-1 agreement and KL divergence of quantized variants "
                                         "against the unquantized model, side by side")
    q.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face directory or .gguf file (default: built-in SmolLM2-135M-Instruct)")
    q.add_argument("--quantization", default=None,
                   help="one or more of int8,w8a8,fp8,mxfp4,nvfp4 (comma-separated); none = float weights")
    q.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES))
    q.add_argument("--dataset", default=None, help="a text file (default: Python's pydoc topics, English prose)")
    q.add_argument("--max-tokens", type=int, default=4096, help="tokens of the dataset to score")
    q.add_argument("--window", type=int, default=512, help="tokens per scored window (one prefill each)")
    q.add_argument("--dtype", default="auto")
    q.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    q.add_argument("--json", default=None, help="also write the results to this JSON file")
    q.set_defaults(func=_quality)
