"""Does the dashboard slow the engine? `tokenmill bench serve` against one `tokenmill serve` with no dashboard
open and with 3 open, interleaved A B / B A per round so drift on a shared machine hits both alike. Prints a
JSON result and one line: ratio = output tok/s with 3 dashboards / with none (target >= 0.98), as the ratio
of the means and the median of the per-round ratios, and the server's own CPU seconds per output token in
both arms (less noisy than tok/s on a small shared machine: it counts what the server spent, not what it
was given).

The 3 viewers read /dashboard/api/events as the page does, from a separate process at nice 19
(--viewer-nice) on raw sockets, without decoding the JSON: a dashboard runs in a browser on the user's
machine, not on the server's cores, and on a 2-core box a heavier client would measure itself, not the
server. The result separates the API process's CPU per output token from the engine's and gives the
viewers' own CPU seconds. Each snapshot says what it cost the server to build and encode (snapshot_ms);
the result has those too.

With --vs-no-dashboard it also runs a second server started with --no-dashboard (no per-step records in the
engine at all) and reports that ratio too.

    python benchmarks/dashboard_overhead.py                     # default model, 6 rounds
    python benchmarks/dashboard_overhead.py --rounds 10 --vs-no-dashboard
"""
from __future__ import annotations

import argparse
import json
import os
import re
import selectors
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
COST_RE = re.compile(rb'"snapshot_ms":([0-9.]+)')


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], dtype: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log = tempfile.NamedTemporaryFile(prefix="tokenmill-dash-bench-", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--api-key", KEY,
                             "--dtype", dtype, *extra], stdout=log, stderr=subprocess.STDOUT, env=env)
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


def viewer_main(url: str, n: int) -> None:
    """The viewer process: n streams until SIGTERM, then one JSON line (snapshots read, their snapshot_ms,
    this process's CPU seconds). A lean client on raw sockets: the bytes are read as a browser would, but
    the JSON is not decoded (that happens on the user's machine); each snapshot's cost is picked out of it."""
    host, port = url.removeprefix("http://").split(":")
    request = (f"GET /dashboard/api/events HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}\r\n"
               "Accept: text/event-stream\r\n\r\n").encode()
    sel = selectors.DefaultSelector()
    for _ in range(n):
        sock = socket.create_connection((host, int(port)))
        sock.sendall(request)
        sock.setblocking(False)
        sel.register(sock, selectors.EVENT_READ, bytearray())
    stop, costs = threading.Event(), []
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        for key, _ in sel.select(timeout=0.5):
            buf = key.data
            buf += key.fileobj.recv(1 << 20)
            *events, rest = bytes(buf).split(b"\n\n")
            buf[:] = rest
            costs += [float(m.group(1)) for e in events if (m := COST_RE.search(e))]
    cpu = os.times()
    print(json.dumps({"snapshots": len(costs), "snapshot_ms": costs, "cpu_s": cpu.user + cpu.system}), flush=True)


class Viewers:
    """n dashboard clients in their own (niced) process while the `with` block runs."""

    def __init__(self, url: str, n: int, nice: int) -> None:
        self.cmd = [sys.executable, os.path.abspath(__file__), "--viewer-of", url, "--viewers", str(n)]
        self.nice, self.result = nice, {"snapshots": 0, "snapshot_ms": []}

    def __enter__(self) -> "Viewers":
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=lambda: os.nice(self.nice))
        time.sleep(1.0)  # connected and receiving before the load starts
        return self

    def __exit__(self, *exc) -> None:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=30)
        self.result = json.loads(out.strip().splitlines()[-1])


def cpu_seconds(pid: int) -> dict[str, float]:
    """User + system CPU seconds of the API process and of its children (the engine), from /proc."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"api": 0.0, "engine": 0.0}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry) == pid or int(fields[1]) == pid:  # fields[1]: ppid
            out["api" if int(entry) == pid else "engine"] += (int(fields[11]) + int(fields[12])) / tick
    return out


def bench(server: subprocess.Popen, url: str, args, seed: int) -> dict:
    """One `tokenmill bench serve` run: output tok/s and the server's CPU seconds per output token."""
    cpu0 = cpu_seconds(server.pid)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        subprocess.run([sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url, "--api-key", KEY,
                        "--dataset", "random", "--input-len", str(args.input_len), "--output-len", str(args.output_len),
                        "--max-concurrency", str(args.concurrency), "--num-prompts", str(args.num_prompts),
                        "--seed", str(seed), "--save-result", out.name, "--no-progress"],
                       check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, PYTHONPATH=ROOT))
        with open(out.name) as f:
            summary = json.load(f)["summary"]
    cpu1, n = cpu_seconds(server.pid), summary["total_output_tokens"]
    api, engine = (1e3 * (cpu1[k] - cpu0[k]) / n for k in ("api", "engine"))
    return {"tok_s": summary["output_throughput"], "cpu_ms_per_token": api + engine, "api_cpu_ms_per_token": api,
            "engine_cpu_ms_per_token": engine}


def run_rounds(server: subprocess.Popen, url: str, args) -> dict:
    bench(server, url, args, seed=999)  # warm-up (kernels, first-time paths)
    none, viewed, costs, viewer_cpu = [], [], [], []
    for i in range(args.rounds):  # every run its own prompts (no prefix-cache hits from an earlier run)
        if i % 2:  # alternate which goes first
            none.append(bench(server, url, args, seed=2 * i))
        with Viewers(url, args.viewers, args.viewer_nice) as v:
            viewed.append(bench(server, url, args, seed=2 * i + 1))
        costs += v.result["snapshot_ms"]
        viewer_cpu.append(v.result["cpu_s"])
        if not i % 2:
            none.append(bench(server, url, args, seed=2 * i))
    tok = lambda runs: [r["tok_s"] for r in runs]  # noqa: E731
    cpu = lambda runs: [r["cpu_ms_per_token"] for r in runs]  # noqa: E731
    costs = [c for c in costs if c > 0]  # the first snapshot of a stream reports no earlier one
    return {"tok_s_no_viewer": tok(none), "tok_s_viewers": tok(viewed),
            "cpu_ms_per_token_no_viewer": cpu(none), "cpu_ms_per_token_viewers": cpu(viewed),
            "ratio": statistics.mean(tok(viewed)) / statistics.mean(tok(none)),
            "ratio_median_of_rounds": statistics.median(v / n for v, n in zip(tok(viewed), tok(none))),
            "cpu_ratio": statistics.mean(cpu(viewed)) / statistics.mean(cpu(none)),
            **{f"{k}_{arm}": statistics.mean(r[k] for r in runs) for k in ("api_cpu_ms_per_token",
               "engine_cpu_ms_per_token") for arm, runs in (("no_viewer", none), ("viewers", viewed))},
            "viewer_cpu_s": viewer_cpu,
            "snapshots_read": len(costs),
            "snapshot_ms": {"mean": statistics.mean(costs), "max": max(costs)} if costs else None}


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--viewers", type=int, default=3)
    p.add_argument("--viewer-nice", type=int, default=19, help="niceness of the viewers' process (0: as the server)")
    p.add_argument("--num-prompts", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--vs-no-dashboard", action="store_true")
    p.add_argument("--viewer-of", help=argparse.SUPPRESS)  # internal: run as the viewers' process
    args = p.parse_args()
    if args.viewer_of:
        return viewer_main(args.viewer_of, args.viewers)

    result: dict = {"viewers": args.viewers, "rounds": args.rounds, "workload": vars(args),
                    "load_average": os.getloadavg()}
    proc, url = start_server([], args.dtype)
    try:
        result.update(run_rounds(proc, url, args))
    finally:
        stop(proc)
    line = (f"dashboard overhead: {statistics.mean(result['tok_s_viewers']):.1f} tok/s with {args.viewers} dashboards "
            f"open vs {statistics.mean(result['tok_s_no_viewer']):.1f} with none: ratio {result['ratio']:.3f} "
            f"(median of rounds {result['ratio_median_of_rounds']:.3f}; target >= 0.98); server CPU per token "
            f"{result['cpu_ratio']:.3f}x")
    if result["snapshot_ms"]:
        line += f"; snapshot {result['snapshot_ms']['mean']:.2f} ms mean ({result['snapshots_read']} read)"
    if args.vs_no_dashboard:
        proc, url = start_server(["--no-dashboard"], args.dtype)
        try:
            bench(proc, url, args, seed=999)
            off = [bench(proc, url, args, seed=2 * i)["tok_s"] for i in range(args.rounds)]
        finally:
            stop(proc)
        result.update(tok_s_no_dashboard=off,
                      ratio_vs_no_dashboard=statistics.mean(result["tok_s_no_viewer"]) / statistics.mean(off))
        line += f"; dashboard on, none open vs --no-dashboard: {result['ratio_vs_no_dashboard']:.3f}"
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))
    print(line)


if __name__ == "__main__":
    main()
