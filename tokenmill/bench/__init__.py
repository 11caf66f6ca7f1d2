"""`tokenmill bench serve | sweep | offline | matrix | startup`: measure a server from the client's side, sweep
load points, measure the engine's offline throughput, measure technique interactions, or time cold and warm
server starts."""
from __future__ import annotations

import argparse
import json


def offline_main(args: argparse.Namespace) -> int:
    from tokenmill.bench.offline import run_offline, summary_line  # as in add_bench_parser

    result = run_offline(args.model_flag or args.model, args)
    text = json.dumps(result, indent=2)
    print(text)
    if args.save_result:
        with open(args.save_result, "w") as f:
            f.write(text + "\n")
    print(summary_line(result))
    return 0


def add_bench_parser(sub, more=()) -> None:
    """Adds `bench` with its subcommands to the CLI's subparsers; `more`: (name, help, add_args) of
    subcommands that tools above bench contribute (the technique matrix, which lives in tune/)."""
    # Only `tokenmill bench` needs these: tune and plan import bench.serve and bench.report, so this package,
    # and would load bench.startup's httpx and rich (~90 ms), bench.serve's asyncio, bench.offline (~2 ms)
    from tokenmill.bench.offline import add_offline_args
    from tokenmill.bench.serve import add_serve_args, serve_main, sweep_main
    from tokenmill.bench.startup import add_startup_args

    bench = sub.add_parser("bench", help="benchmarks: serve (load generator), sweep (load points), offline, "
                                          "matrix (technique interactions), startup (cold/warm start)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("serve", help="load-test any OpenAI-compatible server (TTFT, TPOT, ITL, E2E, throughput)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(p)
    p.set_defaults(func=serve_main)
    p = bsub.add_parser("sweep", help="run `bench serve` at several concurrencies / rates; Pareto plot",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_serve_args(p, sweep=True)
    p.set_defaults(func=sweep_main)
    for name, help_text, add_args in more:
        add_args(bsub.add_parser(name, help=help_text))
    p = bsub.add_parser("offline", help="offline throughput of the engine on a random workload")
    p.add_argument("model", nargs="?", default=None, help="HF dir or .gguf (default: built-in default model)")
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    add_offline_args(p, compare_transformers=False)
    p.set_defaults(func=offline_main)
    add_startup_args(bsub.add_parser("startup", help="cold and warm starts of `tokenmill serve`, N times each, "
                                                     "with min/median/max per start-up phase"))


__all__ = ["add_bench_parser", "offline_main"]
