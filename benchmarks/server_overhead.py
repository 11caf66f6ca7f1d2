"""Server overhead: the offline-throughput workload through `tokenmill serve` at 64 concurrent streams vs
the offline `LLM` on the same requests, in one run.

Workload (benchmarks/common.py): N requests (256; --quick 64), random prompts of 64-512 tokens, 64-256
output tokens, ignore_eos, greedy. The server gets them as token-id prompts over streaming
/v1/completions (SSE, include_usage) from a minimal asyncio HTTP client (so the client itself takes little
of the CPU the server needs). Also measured over the timed window: CPU seconds of the API process, the
engine process and the client, and the API process's share of the server's CPU.
Prints a JSON result and one summary line.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from tokenmill.engine.prestart import openmp_wait_env  # noqa: E402  (light: no torch)

# Same OpenMP waiting for both sides, set before torch loads: the server's engine process's, for the offline
# baseline too.
os.environ.update(openmp_wait_env())

import httpx  # noqa: E402

from common import load_average, random_workload  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_CLK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK  # utime + stime


def children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(p) for p in f.read().split()]
    return out


def engine_pid(api_pid: int) -> int:
    for pid in children(api_pid):
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
            return pid
    raise RuntimeError("engine process not found")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- offline -------------------------------------------------------------------------------------------
def run_offline(args, engine_kw) -> tuple[dict, int]:
    from tokenmill import LLM, SamplingParams

    llm = LLM(args.model, **engine_kw)
    vocab = llm.config.model.hf_config.vocab_size
    workload = random_workload(args.n, vocab, seed=args.seed)
    llm.generate([{"prompt_token_ids": workload[0][0]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    c0, t0 = time.process_time(), time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    assert n_out == sum(n for _, n in workload)
    result = {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt, "cpu_seconds": cpu,
              "dtype": str(llm.config.model.torch_dtype).removeprefix("torch.")}
    del llm, outs
    gc.collect()
    return result, workload


# -- server --------------------------------------------------------------------------------------------
async def stream_one(host: str, port: int, body: bytes) -> tuple[int, float, float]:
    """POST a streaming completion; returns (completion tokens from the usage chunk, TTFT, end time)."""
    t0 = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (host.encode(), len(body), body))
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        raise RuntimeError(f"server answered {status!r}: {await reader.read(2000)!r}")
    chunked = False
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        if line.lower().startswith(b"transfer-encoding:") and b"chunked" in line.lower():
            chunked = True
    buf, ttft, usage = b"", None, None
    while True:
        if chunked:
            size = int((await reader.readline()).split(b";")[0], 16)
            if size == 0:
                break
            data = await reader.readexactly(size + 2)
            buf += data[:-2]
        else:
            data = await reader.read(65536)
            if not data:
                break
            buf += data
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if ttft is None:
                ttft = time.perf_counter() - t0
            if event.startswith(b'data: {') and b'"usage"' in event:
                usage = json.loads(event[6:])["usage"]
    writer.close()
    if usage is None:
        raise RuntimeError("stream ended without a usage chunk")
    return usage["completion_tokens"], ttft, time.perf_counter()


async def drive(host: str, port: int, workload, concurrency: int, model: str):
    sem = asyncio.Semaphore(concurrency)

    async def one(prompt, n):
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True,
                           "stream": True, "stream_options": {"include_usage": True}}).encode()
        async with sem:
            return await stream_one(host, port, body)

    return await asyncio.gather(*(one(p, n) for p, n in workload))


def run_server(args, workload) -> dict:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="tokenmill-bench-server-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", *([args.model] if args.model else []), "--port", str(port),
           "--dtype", args.dtype, "--served-model-name", "bench", "--max-num-seqs", str(args.max_num_seqs)]
    if args.kv_cache_memory_bytes:
        cmd += ["--kv-cache-memory-bytes", args.kv_cache_memory_bytes]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start:\n{open(log.name).read()[-3000:]}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        eng = engine_pid(proc.pid)
        warm = json.dumps({"model": "bench", "prompt": workload[0][0], "max_tokens": 4, "stream": True,
                           "stream_options": {"include_usage": True}}).encode()
        asyncio.run(stream_one("127.0.0.1", port, warm))
        api0, eng0, cli0 = cpu_seconds(proc.pid), cpu_seconds(eng), time.process_time()
        t0 = time.perf_counter()
        results = asyncio.run(drive("127.0.0.1", port, workload, args.concurrency, "bench"))
        dt = time.perf_counter() - t0
        api_cpu, eng_cpu, cli_cpu = cpu_seconds(proc.pid) - api0, cpu_seconds(eng) - eng0, time.process_time() - cli0
    finally:
        proc.terminate()
        proc.wait(60)
    n_out = sum(r[0] for r in results)
    assert n_out == sum(n for _, n in workload), (n_out, sum(n for _, n in workload))
    ttfts = sorted(r[1] for r in results)
    return {"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt, "concurrency": args.concurrency,
            "ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": ttfts[int(0.99 * (len(ttfts) - 1))],
            "api_cpu_seconds": api_cpu, "engine_cpu_seconds": eng_cpu, "client_cpu_seconds": cli_cpu,
            "api_cpu_share": api_cpu / (api_cpu + eng_cpu), "api_cores": api_cpu / dt, "engine_cores": eng_cpu / dt}


def main() -> None:
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")  # no figure from a slow path (kernels_report.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: built-in default model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--quick", action="store_true", help="64 requests")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--kv-cache-memory-bytes", default=None)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    args.n = 64 if args.quick else args.num_requests

    engine_kw = dict(dtype=args.dtype, max_num_seqs=args.max_num_seqs)
    if args.kv_cache_memory_bytes:
        engine_kw["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    load_before = load_average()
    offline, workload = run_offline(args, engine_kw)
    server = run_server(args, workload)
    ratio = server["output_tok_s"] / offline["output_tok_s"]
    result = {"model": args.model or "default (SmolLM2-135M-Instruct)", "dtype": offline["dtype"],
              "num_requests": args.n, "offline": offline, "server": server, "ratio_server_vs_offline": ratio,
              "load_average": [load_before, load_average()], "cpus": os.cpu_count(),
              "omp_wait": os.environ.get("OMP_WAIT_POLICY") or f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}"}
    print(json.dumps(result, indent=2))
    print(f"server {server['output_tok_s']:.1f} vs offline {offline['output_tok_s']:.1f} out tok/s -> {ratio:.2f}x "
          f"({args.n} reqs, {args.concurrency} streams, {result['dtype']}); API process "
          f"{server['api_cpu_share']:.0%} of server CPU ({server['api_cores']:.2f} cores), "
          f"TTFT p50 {server['ttft_p50_s']:.2f}s; load {load_before:.1f}")


if __name__ == "__main__":
    main()
