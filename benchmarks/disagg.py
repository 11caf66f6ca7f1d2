"""Disaggregated prefill/decode (1P1D, one core each) vs one colocated instance with both cores, one run.

Same model, same workload on both: steady short-prompt chat traffic (Poisson) plus a second, concurrent stream
of long prompts (Poisson at one per --long-period seconds), both driven by the project's load generator
(tokenmill.bench.serve.run_benchmark, the code behind `tokenmill bench serve`). The same seeds give both setups
the same prompts and arrival times.

  colocated  OMP_NUM_THREADS=2 tokenmill serve [MODEL]
  1P1D       OMP_NUM_THREADS=1 tokenmill serve [MODEL] --kv-transfer-config '{..."kv_role": "kv_producer"...}'
             OMP_NUM_THREADS=1 tokenmill serve [MODEL] --kv-transfer-config '{..."kv_role": "kv_consumer"...}'
             tokenmill router --prefill URL --decode URL
             (what `tokenmill serve --disaggregate 1P1D` starts; started by hand here so that the instances'
             /metrics and the transfer probe can reach them)

Reported per setup: ITL P50/P99 and TTFT P50/P99 of the short stream (the decode traffic that a long prefill
stalls), TTFT of the long stream, output tok/s of both streams together, and for 1P1D the KV bytes and transfer
time per request. KV bytes come from the instances' /metrics when they export the connector's counters
(tokenmill:kv_bytes_received...), else from prompt tokens x KV bytes per token (said so in the result). The
transfer time is the decode side's mean pull time (tokenmill:kv_transfer_seconds) when the instance exports it, and
in any case is measured by a probe after the load: a fresh long prompt is prefilled on the
producer directly (max_tokens 1, do_remote_decode), then sent to the consumer with the returned kv_transfer_params;
the consumer's time to first token (the pull: it emits the producer's first token once the KV is in) is compared
with the same request sent without params (the consumer recomputes the prompt) and with a one-token prompt (a
decode step alone). (Runs before the first-token handoff measured the pull plus one decode step there, and
reported transfer_ms as that minus the one-token step.)
`tokenmill plan --disaggregate 1P1D` for the same traffic shape (local-cpu, and Llama-3.1-8B on H100-SXM) is
printed beside the measurement.

    python benchmarks/disagg.py                       # SmolLM2-135M, ~7 minutes on a shared 2-core VM
    python benchmarks/disagg.py --duration 60 --long-input-len 2048 --long-period 20
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

import httpx

from common import load_average

from tokenmill.bench.report import kv_transfer_counters
from tokenmill.bench.serve import ServeConfig, run_benchmark


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A server process in its own process group, its output in a log file."""

    def __init__(self, argv: list[str], threads: Optional[int], log_dir: str, name: str):
        env = dict(os.environ)
        if threads is not None:
            env["OMP_NUM_THREADS"] = str(threads)
        self.log_path = os.path.join(log_dir, name + ".log")
        self.log = open(self.log_path, "w")
        self.name = name
        self.p = subprocess.Popen(argv, env=env, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self.log.close()

    def tail(self, n: int = 15) -> str:
        with open(self.log_path) as f:
            return "".join(f.readlines()[-n:])


def wait_healthy(url: str, procs: list[Proc], timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in procs:
            if p.p.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.p.returncode}:\n{p.tail()}")
        try:
            if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} not healthy after {timeout:.0f} s")


def scrape(url: str) -> dict:
    """The KV transfer counters of `url`'s /metrics, plus the sum and count of the decode side's pull-time
    histogram (tokenmill:kv_transfer_seconds, e8217ac) when it exports one."""
    try:
        text = httpx.get(url + "/metrics", timeout=10, trust_env=False).text
    except httpx.HTTPError:
        return {}
    out = kv_transfer_counters(text)
    for line in text.splitlines():
        for suffix in ("sum", "count"):
            if line.startswith(f"tokenmill:kv_transfer_seconds_{suffix}"):
                out[f"kv_transfer_seconds_{suffix}"] = out.get(f"kv_transfer_seconds_{suffix}", 0.0) + float(
                    line.rsplit(" ", 1)[1])
    return out


def model_id(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30, trust_env=False).json()["data"][0]["id"]


def pct(d: dict) -> dict:
    return {"p50": d.get("median"), "p99": d.get("p99"), "mean": d.get("mean"), "count": d.get("count")}


def workload(args, url: str, seed_offset: int = 0) -> dict:
    """The short and the long stream at once against `url`; both summaries plus the pair's output tok/s."""
    common = dict(base_url=url, dataset="random", progress=False, ignore_eos=True, duration=args.duration)
    short = ServeConfig(input_len=args.input_len, output_len=args.output_len, request_rate=args.request_rate,
                        seed=1 + seed_offset, num_prompts=64, **common)
    long = ServeConfig(input_len=args.long_input_len, output_len=args.long_output_len,
                       request_rate=1.0 / args.long_period, seed=2 + seed_offset, num_prompts=8, **common)
    out: dict = {}

    def run(name: str, cfg: ServeConfig) -> None:
        out[name] = run_benchmark(cfg, title=name)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=run, args=(n, c)) for n, c in (("short", short), ("long", long))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    s, lg = out["short"]["summary"], out["long"]["summary"]
    return {
        "wall_s": wall,
        "short": s, "long": lg,
        "itl_ms": pct(s["itl_ms"]),
        "ttft_ms": pct(s["ttft_ms"]),
        "long_ttft_ms": pct(lg["ttft_ms"]),
        "long_itl_ms": pct(lg["itl_ms"]),
        "requests": {"short": s["completed"], "long": lg["completed"], "failed": s["failed"] + lg["failed"]},
        "output_tok_s": (s["total_output_tokens"] + lg["total_output_tokens"]) / wall,
        "prompt_tokens": s["total_input_tokens"] + lg["total_input_tokens"],
    }


def warm(url: str, args) -> None:
    m = model_id(url)
    rng = random.Random(99)
    for n in (args.input_len, args.long_input_len):
        httpx.post(url + "/v1/completions", json={"model": m, "prompt": [rng.randrange(1000, 20000) for _ in range(n)],
                                                   "max_tokens": 4}, timeout=600, trust_env=False)


def ttft(url: str, body: dict) -> float:
    """Seconds to the first streamed token."""
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=600,
                      trust_env=False) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("no token streamed")


def transfer_probe(prefill_url: str, decode_url: str, n_tokens: int, reps: int = 3) -> dict:
    """The consumer's time to first token for a prefilled prompt (the pull: the producer's first token is
    emitted once it is in) vs recomputing it, vs a one-token prompt (one step alone)."""
    m = model_id(decode_url)
    rng = random.Random(4242)
    pulled, recomputed, step = [], [], []
    for _ in range(reps):
        prompt = [rng.randrange(1000, 20000) for _ in range(n_tokens)]
        r = httpx.post(prefill_url + "/v1/completions", timeout=600, trust_env=False,
                       json={"model": m, "prompt": prompt, "max_tokens": 1,
                             "kv_transfer_params": {"do_remote_decode": True}})
        params = r.json().get("kv_transfer_params")
        if not params:
            return {"error": f"the prefill instance returned no kv_transfer_params: {r.text[:300]}"}
        pulled.append(ttft(decode_url, {"model": m, "prompt": prompt, "max_tokens": 2, "kv_transfer_params": params}))
        other = [rng.randrange(1000, 20000) for _ in range(n_tokens)]
        recomputed.append(ttft(decode_url, {"model": m, "prompt": other, "max_tokens": 2}))
        step.append(ttft(decode_url, {"model": m, "prompt": [rng.randrange(1000, 20000)], "max_tokens": 2}))
    med = lambda xs: sorted(xs)[len(xs) // 2] * 1e3  # noqa: E731
    return {"prompt_tokens": n_tokens, "reps": reps, "ttft_pulled_ms": med(pulled),
            "ttft_recomputed_ms": med(recomputed), "ttft_one_token_ms": med(step),
            "transfer_ms": med(pulled)}


def kv_bytes_per_token(model: Optional[str]) -> tuple[int, str]:
    """Bytes of K and V per token of the served model, from its config (the engine's cache dtype)."""
    from tokenmill.models.resolution import resolve_model_path
    path = resolve_model_path(model, True)
    cfg = json.load(open(os.path.join(path, "config.json")))
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    dtype = cfg.get("torch_dtype", "float32")
    width = {"float32": 4, "bfloat16": 2, "float16": 2}.get(dtype, 4)
    return 2 * cfg["num_hidden_layers"] * kv * head_dim * width, dtype


def plan(model: str, hardware: str, args, rate: float, long_fraction: float) -> str:
    cmd = ["tokenmill", "plan", model, "--hardware", hardware, "--disaggregate", "1P1D",
           "--input-len", str(args.input_len), "--output-len", str(args.output_len),
           "--long-input-len", str(args.long_input_len), "--long-fraction", f"{long_fraction:.3f}",
           "--request-rate", f"{rate:g}"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return " ".join(cmd) + "\n" + (r.stdout or r.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model to serve (default: the built-in SmolLM2-135M)")
    ap.add_argument("--duration", type=float, default=90.0, help="seconds of traffic per setup")
    ap.add_argument("--input-len", type=int, default=64, help="short (chat) prompt tokens")
    ap.add_argument("--output-len", type=int, default=32, help="short requests' output tokens")
    ap.add_argument("--request-rate", type=float, default=0.5, help="short requests/s (Poisson)")
    ap.add_argument("--long-input-len", type=int, default=1024, help="long prompt tokens")
    ap.add_argument("--long-output-len", type=int, default=8, help="long requests' output tokens")
    ap.add_argument("--long-period", type=float, default=15.0, help="mean seconds between long prompts (Poisson)")
    ap.add_argument("--plan-gpu-rate", type=float, default=50.0,
                    help="request rate for the GPU plan (same shape; a GPU is idle at this machine's rate)")
    ap.add_argument("--skip-colocated", action="store_true")
    ap.add_argument("--out", default=None, help="also write the JSON result here")
    args = ap.parse_args()

    load = [load_average()]
    model_args = [args.model] if args.model else []
    result: dict = {"config": vars(args), "cpus": os.cpu_count()}
    log_dir = tempfile.mkdtemp(prefix="tokenmill-disagg-")

    # -- colocated: one instance with both cores ------------------------------------------------------
    if not args.skip_colocated:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        srv = Proc(["tokenmill", "serve", *model_args, "--port", str(port)], 2, log_dir, "colocated")
        try:
            wait_healthy(url, [srv])
            warm(url, args)
            result["colocated"] = workload(args, url)
        finally:
            srv.stop()
        load.append(load_average())

    # -- 1P1D: producer and consumer with one core each, and the router ------------------------------
    pp, dp, rp = free_port(), free_port(), free_port()
    pu, du, ru = (f"http://127.0.0.1:{p}" for p in (pp, dp, rp))

    def kvcfg(role: str) -> str:
        return json.dumps({"kv_connector": "TokenmillConnector", "kv_role": role, "kv_port": free_port()})

    procs = [Proc(["tokenmill", "serve", *model_args, "--port", str(pp), "--kv-transfer-config", kvcfg("kv_producer")],
                  1, log_dir, "prefill"),
             Proc(["tokenmill", "serve", *model_args, "--port", str(dp), "--kv-transfer-config", kvcfg("kv_consumer")],
                  1, log_dir, "decode")]
    try:
        wait_healthy(pu, procs)
        wait_healthy(du, procs)
        procs.append(Proc(["tokenmill", "router", "--prefill", pu, "--decode", du, "--port", str(rp)], None, log_dir,
                          "router"))
        wait_healthy(ru, procs)
        warm(ru, args)
        before = {"prefill": scrape(pu), "decode": scrape(du), "router": scrape(ru)}
        d = workload(args, ru)
        after = {"prefill": scrape(pu), "decode": scrape(du), "router": scrape(ru)}
        counters = {k: {c: after[k][c] - before[k].get(c, 0.0) for c in after[k]} for k in after}
        d["counters"] = counters
        n_req = d["requests"]["short"] + d["requests"]["long"]
        measured = counters["decode"].get("kv_bytes_received")
        per_tok, dtype = kv_bytes_per_token(args.model)
        tokens = counters["decode"].get("kv_transferred_tokens")
        if measured:
            d["kv_bytes_per_request"] = measured / max(n_req, 1)
            d["kv_bytes_source"] = "decode instance /metrics (tokenmill:kv_bytes_received)"
            if tokens:  # the cache's real width (--dtype auto may serve a float32 checkpoint in bf16)
                per_tok = round(measured / tokens)
        else:
            # the decode side pulls every prompt token's KV (it takes the prefill side's first token)
            d["kv_bytes_per_request"] = per_tok * d["prompt_tokens"] / max(n_req, 1)
            d["kv_bytes_source"] = (f"computed: prompt tokens x {per_tok} B/token ({dtype}); the instances' "
                                    "/metrics export no kv_bytes counter")
        d["kv_bytes_per_token"] = per_tok
        d["kv_bytes_long_request"] = per_tok * args.long_input_len
        rc = counters["router"]
        if rc.get("router_prefill_phases"):
            d["router_prefill_phase_mean_ms"] = 1e3 * rc["router_prefill_phase_s"] / rc["router_prefill_phases"]
        d["router_fallbacks"] = rc.get("router_fallbacks", 0)
        dc = counters["decode"]
        if dc.get("kv_transfer_seconds_count"):
            d["pull_ms_mean"] = 1e3 * dc["kv_transfer_seconds_sum"] / dc["kv_transfer_seconds_count"]
        d["transfer_probe"] = transfer_probe(pu, du, args.long_input_len)
        result["1P1D"] = d
    finally:
        for p in reversed(procs):
            p.stop()
    load.append(load_average())
    result["load_average"] = load

    # -- tokenmill plan beside it ---------------------------------------------------------------------
    rate = args.request_rate + 1.0 / args.long_period
    frac = (1.0 / args.long_period) / rate
    result["plan"] = {"local-cpu": plan("SmolLM2-135M", "local-cpu", args, rate, frac),
                      "H100-SXM": plan("Llama-3.1-8B", "H100-SXM", args, args.plan_gpu_rate, frac)}

    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    slim = {k: ({kk: vv for kk, vv in v.items() if kk not in ("short", "long")} if isinstance(v, dict) else v)
            for k, v in result.items() if k != "plan"}
    print(json.dumps(slim, indent=2))
    for k in ("local-cpu", "H100-SXM"):
        print(f"\n--- tokenmill plan ({k}) ---\n{result['plan'][k]}")
    print(f"logs: {log_dir}")
    for name in ("colocated", "1P1D"):
        r = result.get(name)
        if not r:
            continue
        extra = ""
        if name == "1P1D":
            tp = r["transfer_probe"]
            extra = (f"; KV {r['kv_bytes_per_request'] / 2**20:.1f} MiB/request, "
                     f"transfer {tp.get('transfer_ms', float('nan')):.0f} ms per {args.long_input_len}-token prompt")
        print(f"{name}: short ITL P50/P99 {r['itl_ms']['p50']:.1f}/{r['itl_ms']['p99']:.1f} ms, TTFT P50/P99 "
              f"{r['ttft_ms']['p50']:.0f}/{r['ttft_ms']['p99']:.0f} ms, long TTFT P50 {r['long_ttft_ms']['p50']:.0f} ms, "
              f"{r['output_tok_s']:.1f} out tok/s{extra}; load {load}")


if __name__ == "__main__":
    sys.exit(main())
