"""`tokenmill serve | generate | router | upgrade | bench | plan | tune | quantize | eval`.

Only the chosen subcommand's arguments are built, so only its modules are imported: `tokenmill --help` and
`tokenmill generate --help` answer without loading torch or the web stack.
"""
from __future__ import annotations

import time

ENTRY_TIME = time.time()  # the start-up ledger's end of "interpreter" and start of "imports" (startup.py)

import argparse  # noqa: E402 - after ENTRY_TIME on purpose
import difflib  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

from tokenmill import __version__  # noqa: E402
from tokenmill.config import KV_CACHE_DTYPES, EngineConfig  # noqa: E402 - a leaf: argparse and dataclasses

LOG_LEVELS = ["debug", "info", "warning", "error"]


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper()), format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")


class _HelpFormatter(argparse.HelpFormatter):
    """Appends each flag's default to its help, unless the help already speaks of one or there is nothing
    to show (None, off switches)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or "default" in text.lower()
                or not (action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE))):
            return text
        return f"{text} (default: %(default)s)".lstrip()


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        """One line and a pointer to --help: argparse's own error first prints the whole usage (57 lines for
        serve), which buries the line that says what is wrong. Subcommands' parsers are of this class too."""
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


def _generate(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.engine.core import EngineCore
    from tokenmill.engine.frontend import eos_token_ids, fan_out, load_tokenizer
    from tokenmill.engine.output_processor import OutputProcessor, RequestState
    from tokenmill.models.resolution import resolve_engine_config
    from tokenmill.sampling_params import SamplingParams

    config = EngineConfig.from_cli_args(args)
    resolve_engine_config(config, install_default=args.install_default_model)
    engine = EngineCore(config)
    tok = load_tokenizer(config)
    sp = SamplingParams(n=1, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                        max_tokens=args.max_tokens, seed=args.seed_sample, ignore_eos=args.ignore_eos)
    if args.chat:
        # imported when this subcommand runs, not at start (module docstring)
        from tokenmill.chat_template import render_chat_template

        text = render_chat_template(tok, [{"role": "user", "content": args.prompt}])
        ids = tok(text, add_special_tokens=False).input_ids
    else:
        ids = tok(args.prompt).input_ids
    proc = OutputProcessor(tok)
    proc.add_request(RequestState("0", args.prompt, ids, sp, tok, delta=True), ["0"])
    for r in fan_out("0", ids, sp, eos_token_ids(config, tok), config.cache.enable_prefix_caching):
        engine.add_request(r)
    first = None
    n_tokens = 0
    while engine.has_unfinished_requests():
        outs, to_abort = proc.process(engine.step())
        engine.abort_requests(to_abort)
        for _, ro in outs:
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
    """args.prestarted: the engine process main() started before building the parser (engine/prestart.py)."""
    if args.disaggregate is not None or args.data_parallel_size != 1:
        args.prestarted.cancel()  # these start their own `tokenmill serve` processes
        # imported when this subcommand runs, not at start (module docstring)
        from tokenmill.fleet.data_parallel import run_data_parallel, run_disaggregated

        return (run_disaggregated if args.disaggregate is not None else run_data_parallel)(args)
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.serve.api_server import run_server
    from tokenmill.startup import Ledger

    ledger = Ledger("api")
    ledger.mark("interpreter", ledger.origin, ENTRY_TIME)
    return run_server(args, ledger, args.prestarted) or 0


def _router(args: argparse.Namespace) -> int:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.fleet.router_command import run_router

    return run_router(args)


# -- tokenmill eval ----------------------------------------------------------------------------------
def _eval_quality(args: argparse.Namespace) -> int:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.eval.quality import evaluate, format_table, iter_quantizations

    spec = args.quantization
    if spec is None and _is_quantized_gguf(args.model):  # measure what serving it would run
        spec = "gguf,gguf-decode"
    results = evaluate(args.model, list(iter_quantizations(spec)), args.dataset,
                       kv_cache_dtype=args.kv_cache_dtype, dtype=args.dtype, max_tokens=args.max_tokens,
                       window=args.window, device=args.device, quantize_lm_head=args.quantize_lm_head)
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([r.as_dict(results[0]) for r in results], f, indent=2)
    return 0


def _is_quantized_gguf(model) -> bool:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.models import default_model, gguf

    path = default_model.default_model_path() if model in (None, "default") else model
    return path.endswith(".gguf") and os.path.isfile(path) and gguf.weights_mode(path) == "native"


def _add_eval_parser(sub) -> None:
    ev = sub.add_parser("eval", help=_COMMANDS["eval"])
    kinds = ev.add_subparsers(dest="eval_command", required=True)
    q = kinds.add_parser("quality", help="perplexity, top-1 agreement and KL divergence of quantized variants "
                                         "against the unquantized model, side by side")
    q.add_argument("model", nargs="?", default=None,
                   help="local Hugging Face directory or .gguf file (default: built-in SmolLM2-135M-Instruct)")
    q.add_argument("--quantization", default=None,
                   help="one or more of int8,w8a8,fp8,mxfp4,nvfp4,int4,int4-g128 (comma-separated); none = "
                        "float weights; gguf = a GGUF's own blocks (the default for a quantized GGUF, whose "
                        "reference is then its dequantized float weights); a folder = a quantized checkpoint of "
                        "the same model (AWQ, GPTQ, compressed-tensors), loaded as it is")
    q.add_argument("--quantize-lm-head", default="both", choices=["no", "yes", "both"],
                   help="measure each method with the LM head in the model dtype (no: the engine's default), "
                        "quantized too (yes: --quantize-lm-head), or both side by side (default: both; the "
                        "quantized-head variants are named <method>+lm_head)")
    q.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage of the quantized variants (the reference keeps the model dtype)")
    q.add_argument("--dataset", default=None, help="a text file (default: Python's pydoc topics, English prose)")
    q.add_argument("--max-tokens", type=int, default=4096, help="tokens of the dataset to score")
    q.add_argument("--window", type=int, default=512, help="tokens per scored window (one prefill each)")
    q.add_argument("--dtype", default="auto", help="model dtype, as in `tokenmill serve --dtype`")
    q.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto = cuda when a CUDA device is visible, else cpu")
    q.add_argument("--json", default=None, help="also write the results to this JSON file")
    q.set_defaults(func=_eval_quality)


def _add_generate_parser(sub) -> None:
    gen = sub.add_parser("generate", help=_COMMANDS["generate"])
    EngineConfig.add_cli_args(gen)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                                                              "whose probability reaches this")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0 = all")
    gen.add_argument("--seed-sample", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--install-default-model", action="store_true",
                     help="pip-install the built-in default model if it is missing")
    gen.set_defaults(func=_generate)


def _add_serve_parser(sub) -> None:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.fleet.serve_command import add_serve_command_args

    srv = sub.add_parser("serve", help=_COMMANDS["serve"])
    add_serve_command_args(srv)
    srv.set_defaults(func=_serve, serve_parser=srv)


def _add_router_parser(sub) -> None:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.fleet.router_command import add_router_args

    rt = sub.add_parser("router", help=_COMMANDS["router"])
    add_router_args(rt)
    rt.set_defaults(func=_router)


def _upgrade(args: argparse.Namespace) -> int:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.fleet.admin import run_upgrade

    print("\n".join(run_upgrade(args)))
    return 0


def _add_upgrade_parser(sub) -> None:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.fleet.admin import add_upgrade_args

    up = sub.add_parser("upgrade", help=_COMMANDS["upgrade"])
    add_upgrade_args(up)
    up.set_defaults(func=_upgrade)


def _bench_matrix(args: argparse.Namespace) -> int:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.tune.matrix import matrix_main

    rc, lines = matrix_main(args)
    print("\n".join(lines))
    return rc


def _add_matrix_parser(p: argparse.ArgumentParser) -> None:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.tune.matrix import add_matrix_args

    add_matrix_args(p)
    p.set_defaults(func=_bench_matrix)


def _add_bench_parser(sub) -> None:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.bench import add_bench_parser

    add_bench_parser(sub, more=[("matrix", "baseline and each technique alone and combined: speedups beside the "
                                           "product of the single ones, JSON + heat map", _add_matrix_parser)])


def _add_plan_parser(sub) -> None:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.plan import add_plan_args

    add_plan_args(sub.add_parser("plan", help=_COMMANDS["plan"]))


def _tune(args: argparse.Namespace) -> int:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.tune.run import tune_main

    rc, lines = tune_main(args)
    print("\n".join(lines))
    return rc


def _add_tune_parser(sub) -> None:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.tune import add_tune_args

    tn = sub.add_parser("tune", help=_COMMANDS["tune"])
    add_tune_args(tn)
    tn.set_defaults(func=_tune)


def _add_quantize_parser(sub) -> None:
    # imported when this subcommand runs, not at start (module docstring)
    from tokenmill.models.export import add_quantize_parser

    add_quantize_parser(sub)


_COMMANDS = {  # name -> help line shown by `tokenmill --help`
    "generate": "generate text from a prompt, streaming tokens to the terminal",
    "serve": "OpenAI-compatible HTTP server",
    "router": "OpenAI-compatible front that routes requests over `tokenmill serve` replicas",
    "upgrade": "rolling upgrade of a router's launched replicas, one at a time, with no failed request",
    "bench": "benchmarks: serve (load generator), sweep (load points), offline, matrix (technique interactions), "
             "startup",
    "plan": "memory and roofline math for a model on given hardware",
    "tune": "find the best serve configuration for a workload and an SLA by measuring real servers",
    "quantize": "write a pre-quantized (fp8, int8, w8a8) copy of a float checkpoint",
    "eval": "evaluate a model (quality under quantization)",
}
_ADD_PARSER = {"generate": _add_generate_parser, "serve": _add_serve_parser, "router": _add_router_parser,
               "upgrade": _add_upgrade_parser,
               "bench": _add_bench_parser, "plan": _add_plan_parser, "tune": _add_tune_parser,
               "quantize": _add_quantize_parser,
               "eval": _add_eval_parser}


def build_parser(command: str | None) -> argparse.ArgumentParser:
    """The CLI parser with `command`'s arguments built in full; the other subcommands are listed only."""
    parser = _Parser(prog="tokenmill", description="LLM inference engine and OpenAI-compatible server")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("--log-level", default="info", choices=LOG_LEVELS, help="logging verbosity")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in _COMMANDS.items():
        if name == command:
            _ADD_PARSER[name](sub)
        else:
            sub.add_parser(name, help=help_text)
    return parser


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:  # argparse has no public listing of a parser's actions
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found |= option_strings(child)
    return found


def _subparser(parser: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def _innermost_parser(parser: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The parser of the deepest subcommand argv names (`tokenmill bench serve ...` -> bench serve's), so an
    error names the command whose --help lists the flag."""
    for arg in argv:
        parser = _subparser(parser, arg)
    return parser


def _check_flags(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Report a misspelled flag as such (argparse would first complain that a required one is missing)."""
    known = option_strings(parser)
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        flag = arg.split("=", 1)[0]
        if not flag.startswith("--") or any(k.startswith(flag) for k in known):  # argparse takes unique prefixes
            continue
        close = difflib.get_close_matches(flag, sorted(known), n=1)
        _innermost_parser(parser, argv[:i]).error(f"unrecognized argument {flag}"
                                                  + (f" (did you mean {close[0]}?)" if close else ""))


def _check_device(args: argparse.Namespace) -> None:
    if getattr(args, "device", None) != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ValueError(f"--device cuda: no CUDA device is available (torch {torch.__version__}"
                         f"{'' if torch.version.cuda else ', a build without CUDA'}); use --device cpu or auto")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = next((a for a in argv if a in _COMMANDS), None)
    engine = None
    if command == "serve" and not {"-h", "--help"} & set(argv):
        # imported when this subcommand runs, not at start (module docstring)
        from tokenmill.engine.prestart import PrestartedEngine

        engine = PrestartedEngine()  # first thing: its imports overlap all of ours (engine/prestart.py)
    try:
        parser = build_parser(command)
        if engine is not None:
            parser.set_defaults(prestarted=engine)
        _check_flags(parser, argv)
        args = parser.parse_args(argv)
        _setup_logging(args.log_level)
        _check_device(args)
        return args.func(args)
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        print(f"tokenmill: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    finally:
        if engine is not None:
            engine.cancel()  # a no-op once the server has handed the process its arguments and stopped it


if __name__ == "__main__":
    sys.exit(main())
