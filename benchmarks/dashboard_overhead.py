"""Does the dashboard slow the engine? `tokenmill bench serve` against one `tokenmill serve` with no dashboard
open and with 3 open (3 clients reading /dashboard/api/events and decoding every snapshot, as the page does),
interleaved A B A B ... so drift on a shared machine hits both alike. Prints a JSON result and one line:
ratio = output tok/s with 3 dashboards / with none (target >= 0.98).

With --vs-no-dashboard it also runs a second server started with --no-dashboard (no per-step records in the
engine at all) and reports that ratio too.

    python benchmarks/dashboard_overhead.py                     # default model, 3 rounds
    python benchmarks/dashboard_overhead.py --rounds 5 --vs-no-dashboard
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "bench-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = tempfile.NamedTemporaryFile(prefix="tokenmill-dash-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--api-key", KEY,
                             "--dtype", "float32", *extra], stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited; see {log.name}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"server did not start; see {log.name}")


class Viewers:
    """n dashboard clients reading the snapshot stream (and parsing it) until stopped."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.stop, self.snapshots = url, threading.Event(), 0
        self.threads = [threading.Thread(target=self._read, daemon=True) for _ in range(n)]

    def _read(self) -> None:
        with httpx.stream("GET", self.url + "/dashboard/api/events", timeout=None,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    json.loads(line[6:])
                    self.snapshots += 1
                if self.stop.is_set():
                    return

    def __enter__(self) -> "Viewers":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(5)


def bench(url: str, args, seed: int) -> float:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url, "--api-key", KEY,
                        "--dataset", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--max-concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
                        "--seed", str(seed), "--save-result", out.name, "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=ROOT))
        with open(out.name) as f:
            return json.load(f)["summary"]["output_throughput"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--viewers", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vs-no-dashboard", action="store_true")
    args = p.parse_args()

    result: dict = {"viewers": args.viewers, "rounds": args.rounds, "workload": vars(args)}
    proc, url = start_server([])
    try:
        bench(url, args, seed=999)  # warm-up (kernels, first-time paths)
        none, viewed, snaps = [], [], 0
        for i in range(args.rounds):  # every run its own prompts (no prefix-cache hits from an earlier run)
            if i % 2:  # alternate which goes first
                none.append(bench(url, args, seed=2 * i))
            with Viewers(url, args.viewers) as v:
                viewed.append(bench(url, args, seed=2 * i + 1))
            snaps += v.snapshots
            if not i % 2:
                none.append(bench(url, args, seed=2 * i))
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    result.update(tok_s_no_viewer=none, tok_s_viewers=viewed, snapshots_read=snaps,
                  ratio=statistics.mean(viewed) / statistics.mean(none))
    line = (f"dashboard overhead: {statistics.mean(viewed):.1f} tok/s with {args.viewers} dashboards open vs "
            f"{statistics.mean(none):.1f} with none: ratio {result['ratio']:.3f} (target >= 0.98)")
    if args.vs_no_dashboard:
        proc, url = start_server(["--no-dashboard"])
        try:
            bench(url, args, seed=999)
            off = [bench(url, args, seed=2 * i) for i in range(args.rounds)]
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
        result.update(tok_s_no_dashboard=off, ratio_vs_no_dashboard=statistics.mean(none) / statistics.mean(off))
        line += f"; dashboard on, none open vs --no-dashboard: {result['ratio_vs_no_dashboard']:.3f}"
    print(json.dumps(result, indent=2))
    print(line)


if __name__ == "__main__":
    main()
