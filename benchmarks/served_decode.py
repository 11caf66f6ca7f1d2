"""Single-stream decode through `tokenmill serve`, per OpenMP waiting setting of the engine process.

Decode on a CPU runs hundreds of OpenMP parallel regions per step (every linear layer, norm and attention call of
the one-call layer stack), so how an idle OpenMP thread waits for the next region matters as much as the kernels:
a futex sleep and wake-up per region (OMP_WAIT_POLICY=PASSIVE) cost the default model most of its served decode
speed on a 2-core EPYC (41 against 148 tok/s). The engine's default is a short spin (engine/prestart.py).

For each setting (the engine's default, then each --env given), one server: --runs streamed completions of
--tokens tokens (ignore_eos, greedy), one at a time; the first warms up. Prints each setting's median decode
tok/s (tokens after the first over the time from the first to the last) and the runs.

    python benchmarks/served_decode.py
    python benchmarks/served_decode.py --env OMP_WAIT_POLICY=PASSIVE --env OMP_WAIT_POLICY=ACTIVE
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dashboard_overhead import KEY, start_server  # noqa: E402  (the server launcher the benchmarks share)


def decode_rates(url: str, runs: int, tokens: int) -> list[float]:
    rates = []
    for i in range(runs):
        body = {"prompt": f"Story {i}: once upon a time", "max_tokens": tokens, "ignore_eos": True,
                "temperature": 0, "stream": True}
        times = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    times.append(time.perf_counter())
        if i:  # the first run warms up
            rates.append((len(times) - 1) / (times[-1] - times[0]))
    return rates


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--env", action="append", default=[], help="NAME=VALUE for the server (repeatable: one run each)")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args()
    for setting in ["default"] + args.env:
        saved = dict(os.environ)
        if setting != "default":
            name, value = setting.split("=", 1)
            os.environ[name] = value
        try:
            proc, url = start_server(["--no-dashboard"], args.dtype)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        try:
            rates = decode_rates(url, args.runs, args.tokens)
        finally:
            proc.terminate()
            proc.wait(30)
        print(f"{setting}: decode {statistics.median(rates):.1f} tok/s (runs {[round(r, 1) for r in rates]})")


if __name__ == "__main__":
    main()
