"""`tokenmill serve | generate | router | bench | plan | quantize | eval`."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import time


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


def _generate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    from tokenmill.config import EngineConfig
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.frontend import eos_token_id, fan_out, load_tokenizer
    from tokenmill.engine.output_processor import OutputProcessor, RequestState
    from tokenmill.sampling_params import SamplingParams

    config = EngineConfig.from_cli_args(args)
    config.finalize(install_default=args.install_default_model)
    engine = EngineCore(config)
    tok = load_tokenizer(config)
    sp = SamplingParams(n=1, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, seed=args.seed_sample, ignore_eos=args.ignore_eos)
    if args.chat:
        ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                                      tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids)
    else:
        ids = tok(args.prompt).input_ids
    proc = OutputProcessor(tok)
    proc.add_request(RequestState("0", args.prompt, ids, sp, tok, delta=True), ["0"])
    for r in fan_out("0", ids, sp, eos_token_id(config, tok), config.cache.enable_prefix_caching):
        engine.add_request(r)
    first = None
    n_tokens = 0
    while engine.has_unfinished_requests():
        outs, to_abort = proc.process(engine.step())
        engine.abort_requests(to_abort)
        for ro in outs:
            for c in ro.outputs:
                if first is None and c.token_ids:
                    first = time.perf_counter()
                n_tokens += len(c.token_ids)
                sys.stdout.write(c.text)
                sys.stdout.flush()
    end = time.perf_counter()
    sys.stdout.write("\n")
    if first is not None:
        decode = (n_tokens - 1) / (end - first) if n_tokens > 1 and end > first else 0.0
        print(f"[{n_tokens} tokens; start to first token {first - t0:.2f}s; decode {decode:.1f} tok/s]",
              file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    if args.data_parallel_size != 1:
        from tokenmill.router.data_parallel import run_data_parallel

        return run_data_parallel(args)
    from tokenmill.serve.api_server import run_server

    return run_server(args) or 0


def _router(args: argparse.Namespace) -> int:
    from tokenmill.router.app import run_router

    return run_router(args)


# -- tokenmill eval ----------------------------------------------------------------------------------
def _eval_quality(args: argparse.Namespace) -> int:
    from tokenmill.eval.quality import evaluate, format_table, iter_quantizations

    results = evaluate(args.model, list(iter_quantizations(args.quantization)), args.dataset,
                       kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, max_tokens=args.max_tokens,
                       window=args.window, device=args.device)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict(results[0]) for r in results], f, indent=2)
    return 0


def _add_eval_parser(sub) -> None:
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
    q.set_defaults(func=_eval_quality)


def main(argv: list[str] | None = None) -> int:
    from tokenmill.config import EngineConfig

    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine and OpenAI-compatible server")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt, streaming tokens to the terminal")
    EngineConfig.add_cli_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed-sample", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--install-default-model", action="store_true",
                     help="pip-install the built-in default model if it is missing")
    gen.set_defaults(func=_generate)

    srv = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    EngineConfig.add_cli_args(srv)
    try:
        from tokenmill.serve.api_server import add_serve_args
    except ImportError:
        add_serve_args = None
    if add_serve_args is not None:
        add_serve_args(srv)
    from tokenmill.router.app import add_router_args
    from tokenmill.router.data_parallel import add_data_parallel_args

    add_data_parallel_args(srv)
    srv.set_defaults(func=_serve, serve_parser=srv)

    rt = sub.add_parser("router", help="OpenAI-compatible front that routes requests over `tokenmill serve` replicas")
    add_router_args(rt)
    rt.set_defaults(func=_router)

    from tokenmill.bench import add_bench_parser
    from tokenmill.plan import add_plan_args

    add_bench_parser(sub)
    add_plan_args(sub.add_parser("plan", help="memory and roofline math for a model on given hardware"))

    from tokenmill.models.export import add_quantize_parser

    add_quantize_parser(sub)
    _add_eval_parser(sub)

    args = parser.parse_args(argv)
    _setup_logging(args.log_level)
    try:
        return args.func(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
