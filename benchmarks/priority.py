"""Priority scheduling under a full KV cache (issue 33): does a high-priority request keep its idle TTFT while
low-priority load saturates the engine?

One `tokenmill serve --scheduling-policy priority` (default model, a small KV cache so that the load fills it),
driven by `tokenmill bench serve` with --priority-classes:
  idle      only high-priority requests, one at a time: the high class's idle TTFT
  priority  high=0 and low=10 requests mixed 1:7 at a concurrency that fills the KV cache
  same      the same load with both classes at priority 10: what the high class gets without priorities (FCFS
            order, ties by arrival)
The phases run idle, priority, same, priority, same, idle, so drift on a shared machine hits each alike. Prints a
JSON result and one line: the high class's TTFT P90 under load / idle (target <= 2x), with and without priorities.

    python benchmarks/priority.py
    python benchmarks/priority.py --kv-cache-memory-bytes 128MiB --concurrency 32 --num-prompts 96 \
        --max-num-batched-tokens 512
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dashboard_overhead import start_server  # noqa: E402  (the server launcher the benchmarks share)

from tokenmill.bench.serve import ServeConfig, run_benchmark  # noqa: E402

KEY = "bench-key"


def phase(url: str, classes, concurrency: int, num_prompts: int, args) -> dict:
    cfg = ServeConfig(base_url=url, api_key=KEY, input_len=args.input_len, output_len=args.output_len,
                      num_prompts=num_prompts, max_concurrency=concurrency, priority_classes=classes,
                      seed=args.seed, progress=False)
    summary = run_benchmark(cfg)["summary"]
    out = {name: {"completed": c["completed"], "ttft_p50_ms": c["ttft_ms"]["median"],
                  "ttft_p90_ms": c["ttft_ms"]["p90"], "tpot_p50_ms": c["tpot_ms"]["median"]}
           for name, c in summary["classes"].items()}
    out["output_tok_s"] = summary["output_throughput"]
    out["failed"] = summary["failed"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-cache-memory-bytes", default="128MiB")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=96, help="requests per loaded phase")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", default="512",
                    help="the step budget: a high-priority request arriving mid-step waits for that step")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    proc, url = start_server(["--scheduling-policy", "priority", "--kv-cache-memory-bytes",
                              args.kv_cache_memory_bytes, "--max-num-seqs", "64", "--no-dashboard",
                              "--max-num-batched-tokens", args.max_num_batched_tokens], args.dtype)
    runs: dict[str, list[dict]] = {"idle": [], "priority": [], "same": []}
    try:
        phase(url, [("high", 0, 1.0)], 1, 4, args)  # warm-up
        order = ("idle", "priority", "same", "priority", "same", "idle")
        for i, name in enumerate(order):
            args.seed += 1  # fresh prompts each phase: no prefix-cache hits across phases
            if name == "idle":
                runs[name].append(phase(url, [("high", 0, 1.0)], 1, 12, args))
            else:
                low = 0 if name == "priority" else 10
                runs[name].append(phase(url, [("high", low, 1.0), ("low", 10, 7.0)], args.concurrency,
                                        args.num_prompts, args))
            print(f"[{i + 1}/{len(order)}] {name}: {json.dumps(runs[name][-1])}", file=sys.stderr)
    finally:
        proc.terminate()
        proc.wait(30)

    def p90(name: str) -> float:
        return statistics.mean(r["high"]["ttft_p90_ms"] for r in runs[name])

    idle = p90("idle")
    result = {"config": vars(args) | {"seed": args.seed}, "runs": runs, "high_ttft_p90_ms": {
        "idle": idle, "loaded_priority": p90("priority"), "loaded_same_priority": p90("same")},
        "low_ttft_p90_ms": {k: statistics.mean(r["low"]["ttft_p90_ms"] for r in runs[k]) for k in ("priority", "same")},
        "ratio_priority": p90("priority") / idle, "ratio_same_priority": p90("same") / idle}
    print(json.dumps(result, indent=1))
    print(f"high-priority TTFT P90: idle {idle:.0f} ms; under low-priority load {p90('priority'):.0f} ms "
          f"({result['ratio_priority']:.2f}x idle, target <= 2x) with priorities, {p90('same'):.0f} ms "
          f"({result['ratio_same_priority']:.2f}x) without")


if __name__ == "__main__":
    main()
