"""Priority scheduling under a full KV cache (issue 33): does a high-priority request keep its idle TTFT while
low-priority load saturates the engine?

One `tokenmill serve --scheduling-policy priority` (default model, a small KV cache so that the load fills it).
A probe sends high-priority requests (priority 0), one at a time, at random moments (Poisson arrivals,
--probe-rate; one still running delays the next): a light, latency-sensitive class. The phases:
  idle      the probe alone: the high class's idle TTFT
  priority  the probe while low-priority requests (priority 10) keep --concurrency in flight (closed loop, enough
            to fill the KV cache); the probe starts once the load has run --warm seconds
  same      the same, with the load at priority 0 too: what the probe gets without priorities (FCFS order)
The phases run idle, priority, same, priority, same, idle, so drift on a shared machine hits each alike. Prints a
JSON result and one line: the probe's TTFT P90 (over both phases of a kind pooled) under load / idle (target
<= 2x), with and without priorities, and the low class's output throughput (what the priorities cost it).

    python benchmarks/priority.py
    python benchmarks/priority.py --kv-cache-memory-bytes 128MiB --concurrency 32 --probes 16 \
        --max-num-batched-tokens 512
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dashboard_overhead import start_server  # noqa: E402  (the server launcher the benchmarks share)

from tokenmill.bench.serve import ServeConfig, run_benchmark  # noqa: E402

KEY = "bench-key"


def probe(url: str, seed: int, args) -> dict:
    """The high-priority requests (priority 0), one at a time at Poisson moments: their TTFTs."""
    cfg = ServeConfig(base_url=url, api_key=KEY, input_len=args.input_len, output_len=args.probe_output_len,
                      num_prompts=args.probes, request_rate=args.probe_rate, max_concurrency=1,
                      priority_classes=[("high", 0, 1)], seed=seed, progress=False)
    out = run_benchmark(cfg)
    c = out["summary"]
    return {"completed": c["completed"], "ttft_p50_ms": c["ttft_ms"]["median"], "ttft_p90_ms": c["ttft_ms"]["p90"],
            "ttfts_ms": [r["ttft"] * 1e3 for r in out["requests"] if r["success"]]}


def loaded(url: str, low_priority: int, seed: int, args) -> dict:
    """The probe (priority 0) while the low class saturates the engine; the low class's summary beside it."""
    low: dict = {}
    duration = args.warm + args.probes / args.probe_rate + 10  # outlasts the probe (it waits out its tail)

    def load() -> None:
        cfg = ServeConfig(base_url=url, api_key=KEY, input_len=args.input_len, output_len=args.output_len,
                          duration=duration, max_concurrency=args.concurrency,
                          priority_classes=[("low", low_priority, 1)],
                          seed=seed + 7919, progress=False)
        low.update(run_benchmark(cfg)["summary"])

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(args.warm)
    high = probe(url, seed, args)
    thread.join()
    return {"high": high, "low": {"completed": low["completed"], "failed": low["failed"],
                                  "output_tok_s": low["output_throughput"], "ttft_p50_ms": low["ttft_ms"]["median"]}}


def counter(url: str, name: str) -> float:
    """A counter's value on the server's /metrics."""
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        if fam.name == name:
            return sum(s.value for s in fam.samples if s.name.endswith("_total"))
    raise KeyError(f"{name} is not on {url}/metrics")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-cache-memory-bytes", default="128MiB")
    ap.add_argument("--concurrency", type=int, default=32, help="low-priority requests kept in flight")
    ap.add_argument("--probes", type=int, default=20, help="high-priority requests per phase")
    ap.add_argument("--probe-rate", type=float, default=0.4, help="high-priority requests per second (Poisson)")
    ap.add_argument("--probe-output-len", type=int, default=4)
    ap.add_argument("--warm", type=float, default=20.0, help="seconds of low-priority load before the probe")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", default="512")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--server-arg", action="append", default=[], help="another `tokenmill serve` flag (repeatable)")
    args = ap.parse_args()
    proc, url = start_server(["--scheduling-policy", "priority", "--kv-cache-memory-bytes",
                              args.kv_cache_memory_bytes, "--max-num-seqs", "64", "--no-dashboard",
                              "--max-num-batched-tokens", args.max_num_batched_tokens] + args.server_arg, args.dtype)
    runs: dict[str, list[dict]] = {"idle": [], "priority": [], "same": []}
    try:
        probe(url, 1, argparse.Namespace(**{**vars(args), "probes": 4, "probe_rate": 4.0}))  # warm-up
        order = ("idle", "priority", "same", "priority", "same", "idle")
        for i, name in enumerate(order):
            seed = args.seed + 100 * (i + 1)  # fresh prompts each phase: no prefix-cache hits across phases
            if name == "idle":
                runs[name].append({"high": probe(url, seed, args)})
            else:
                runs[name].append(loaded(url, 10 if name == "priority" else 0, seed, args))
            shown = {k: {f: v for f, v in c.items() if f != "ttfts_ms"} for k, c in runs[name][-1].items()}
            print(f"[{i + 1}/{len(order)}] {name}: {json.dumps(shown)}", file=sys.stderr)
        interrupted = counter(url, "tokenmill:num_interrupted_steps")
    finally:
        proc.terminate()
        proc.wait(30)

    def mean(name: str, cls: str, key: str) -> float:
        return statistics.mean(r[cls][key] for r in runs[name])

    def p90(name: str) -> float:
        """The probe's TTFT P90 over both phases of a kind together (16 samples a phase make a noisy P90)."""
        return float(np.percentile([t for r in runs[name] for t in r["high"]["ttfts_ms"]], 90))

    p90s = {name: p90(name) for name in runs}
    idle = p90s["idle"]
    result = {"config": vars(args), "runs": runs,
              "high_ttft_p90_ms": {"idle": idle, "loaded_priority": p90s["priority"],
                                   "loaded_same_priority": p90s["same"]},
              "ratio_priority": p90s["priority"] / idle, "ratio_same_priority": p90s["same"] / idle,
              "low_output_tok_s": {k: mean(k, "low", "output_tok_s") for k in ("priority", "same")},
              "interrupted_steps": interrupted}
    print(json.dumps(result, indent=1))
    print(f"high-priority TTFT P90: idle {idle:.0f} ms; under low-priority load "
          f"{result['high_ttft_p90_ms']['loaded_priority']:.0f} ms ({result['ratio_priority']:.2f}x idle, target "
          f"<= 2x) with priorities, {result['high_ttft_p90_ms']['loaded_same_priority']:.0f} ms "
          f"({result['ratio_same_priority']:.2f}x) without; low-priority output "
          f"{result['low_output_tok_s']['priority']:.1f} tok/s with, {result['low_output_tok_s']['same']:.1f} without; "
          f"{interrupted:.0f} steps cut short for a high-priority arrival")


if __name__ == "__main__":
    main()
