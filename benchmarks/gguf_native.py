"""tokenmill vs llama.cpp on the same GGUF files, in their own block formats (issue 30).

One sitting, 2 threads (both engines pinned to the same 2 CPUs where the machine has more), the two engines
interleaved file by file (tokenmill, llama.cpp, tokenmill, ...). Per file:
- decode tok/s, single stream, 128 tokens out after a 512-token prompt: llama-bench `-t 2 -p 0 -n 128 -d 512`
  (tg128 at depth 512: the 512 tokens are in the KV cache first, unmeasured; mean of -r runs); tokenmill: one
  request alone (offline engine, ignore_eos), time from its first to its last token, median of the runs (each
  with its own prompt). Also from an empty context ("decode_d0"): llama-bench's plain tg128 beside a tokenmill
  request with a 1-token prompt. The two differ: llama.cpp's CPU attention makes its tg128 at depth 512 0.6-0.8x
  its depth-0 figure on a small model (measured here), so a depth-0 llama.cpp figure against tokenmill after
  512 tokens (this script until 2026-12-06) compared different work;
- prefill tok/s of 512 tokens: llama-bench's pp512; tokenmill: 512 / TTFT of the same request;
- batched decode at 8 and 32 sequences, 128-token prompts, 128 out: llama-batched-bench `-npp 128 -ntg 128
  -npl 8,32` (its S_TG); tokenmill: N requests at once, output tokens per second from the step where every
  request has its first token to the last;
- peak RSS: tokenmill starts twice per file, each start in a process of its own: first (a fresh cache) for the
  single-stream runs, compared with llama-bench's peak RSS; then (warm) for the batched runs, compared with
  llama-batched-bench's (both /usr/bin/time -v). Each start's KV pool holds what its runs need, as llama.cpp's
  context does (-p + -n tokens; -c for the batched runs), not tokenmill's 4 GiB CPU default. Any child
  processes' RSS at the end is reported beside (children_rss_mb);
- bytes tokenmill writes on its first start (a fresh $TOKENMILL_CACHE_DIR, compiled kernels excluded) / file size;
- the read roofline of decode: bytes one token reads, from the GGUF's real tensor sizes (every tensor once; an
  untied embedding one row, a tied one whole, as the LM head) over the copy bandwidth measured here
  (tokenmill.perf.hardware.copy_bandwidth: 512 MiB tensor copy, 2 threads, read + write) gives a tok/s
  ceiling; tokenmill's decode from an empty context (decode_d0: weights only, no KV to read) / ceiling, and
  llama.cpp's by the same measure beside it;
- beside tokenmill's peak RSS, its RSS after importing torch and tokenmill, before any model (no file changes it).
Targets (issue 30): decode >= 1.0x llama.cpp (at both depths), prefill >= 1.2x, batched@32 >= 1.5x, RSS <= 1.3x
llama-bench's, disk <= 1.1x the file, roofline >= 80%.

Files: "default" = the default model's own Q4_1 GGUF; "0.5b-q4_0" ... "1.5b-q4_k_m" = Qwen2-shaped models with
random weights (benchmarks/make_gguf.py writes them once into --dir; its docstring says how they are laid out).

llama.cpp, built as shared/PEERS.md says (the llama-cpp-python 0.3.36 sdist's vendored llama.cpp), outside the
repository (about 8 minutes for these three targets on 2 shared cores):
    mkdir -p /tmp/llamacpp && cd /tmp/llamacpp
    pip download --no-deps --no-binary :all: llama-cpp-python==0.3.36 && tar xzf llama_cpp_python-0.3.36.tar.gz
    cd llama_cpp_python-0.3.36/vendor/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \\
      -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF \\
      -DLLAMA_CURL=OFF
    nice -n 19 cmake --build build -j2 --target llama-bench llama-batched-bench llama-cli

Run (all 7 files: about 30 minutes on a quiet 2-core box; 4 of them took 15; nothing else should run meanwhile):
    python benchmarks/gguf_native.py --llama-bin /tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin
    python benchmarks/gguf_native.py --files default,0.5b-q8_0 --tokenmill-args "--gguf-weights dequantize"
    python benchmarks/gguf_native.py --quick            # smoke test: default model, short runs
Writes --out (markdown, default <dir>/gguf_native.md) and the same stem .json beside it.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_gguf  # noqa: E402  (beside this file)

logger = logging.getLogger("tokenmill")
LLAMA_BIN = "/tmp/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
TARGETS = {"decode": (">=", 1.0), "decode_d0": (">=", 1.0), "prefill": (">=", 1.2), "batched_32": (">=", 1.5),
           "peak_rss_mb": ("<=", 1.3), "batched_peak_rss_mb": ("<=", 1.3), "disk": ("<=", 1.1), "roofline": (">=", 0.8)}
BUSY = 0.05  # share of the CPUs others used above which a sitting is flagged: llama.cpp collapses when shared


@dataclass
class Workload:
    prompt: int = 512       # single stream: prompt tokens
    out: int = 128          # ... and output tokens
    reps: int = 3           # single-stream runs (tokenmill: median; llama-bench: -r, its mean)
    batch_prompt: int = 128
    batch_out: int = 128
    batches: tuple = (8, 32)

    @classmethod
    def quick(cls) -> "Workload":
        return cls(prompt=128, out=32, reps=1, batch_prompt=32, batch_out=32, batches=(8,))

    def kv_tokens(self) -> int:
        return max(self.batches) * (self.batch_prompt + self.batch_out) + self.prompt + self.out


# -- what a file costs per token ----------------------------------------------------------------------------
def bytes_per_token(path: str) -> int:
    """Bytes one decode step reads: every tensor once; an untied embedding only one row (a tied one is the
    LM head, read whole)."""
    import gguf

    reader = gguf.GGUFReader(path)
    names = {t.name for t in reader.tensors}
    total = 0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and "output.weight" in names:
            total += int(t.n_bytes) // int(t.shape[-1])  # gguf-py shapes are (cols, rows): rows last
        else:
            total += int(t.n_bytes)
    return total


def kv_bytes_per_token(path: str) -> int:
    """float32 K and V bytes per token (the most any tokenmill KV dtype takes)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    get = lambda key: reader.fields[f"{arch}.{key}"].contents()  # noqa: E731
    layers, heads, hidden = get("block_count"), get("attention.head_count"), get("embedding_length")
    kv_heads = get("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in reader.fields else heads
    return 2 * layers * kv_heads * (hidden // heads) * 4


# -- the pinning: both engines on the same 2 CPUs -----------------------------------------------------------
def cpu_prefix() -> list[str]:
    cpus = sorted(os.sched_getaffinity(0))
    return ["taskset", "-c", f"{cpus[0]},{cpus[1]}"] if len(cpus) > 2 else []


# -- tokenmill ----------------------------------------------------------------------------------------------
def engine_kwargs(cli: str) -> dict[str, Any]:
    """`tokenmill serve`-style flags (e.g. "--gguf-weights dequantize --dtype float32") -> LLM keyword
    arguments: the ones that differ from serve's defaults, parsed by serve's own parser."""
    from tokenmill.config import EngineConfig

    p = argparse.ArgumentParser(add_help=False)
    EngineConfig.add_cli_args(p)
    given, defaults = vars(p.parse_args(shlex.split(cli))), vars(p.parse_args([]))
    return {k: v for k, v in given.items() if v != defaults[k]}


def _prompt(vocab: int, n: int, seed: int) -> list[int]:
    """A prompt no other request here shares a block with (without prefix caching tokenmill still reuses a
    finished request's blocks for a request of the same id and tokens: each run needs its own)."""
    return [(1000 + 7919 * seed + j) % vocab for j in range(n)]


def _single(llm, prompt_len: int, out_len: int, seed: int) -> dict[str, float]:
    """One request alone: TTFT (prefill + first token) and decode tok/s from its first token to its last."""
    from tokenmill import SamplingParams
    from tokenmill.messages import EngineCoreRequest

    eng = llm.engine
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    eng.add_request(EngineCoreRequest(f"single-{seed}", _prompt(llm.config.model.hf_config.vocab_size, prompt_len,
                                                                  seed), sp))
    t0, n = time.perf_counter(), 0
    while n == 0:
        n += sum(len(o.new_token_ids) for o in eng.step())
    t1 = time.perf_counter()
    while eng.has_unfinished_requests():
        n += sum(len(o.new_token_ids) for o in eng.step())
    return {"ttft_s": t1 - t0, "decode_tok_s": (n - 1) / (time.perf_counter() - t1)}


def _batched(llm, n: int, prompt_len: int, out_len: int) -> float:
    """Output tok/s of n requests decoding together, from the step where every one has its first token."""
    from tokenmill import SamplingParams
    from tokenmill.messages import EngineCoreRequest

    eng, vocab = llm.engine, llm.config.model.hf_config.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True)
    for i in range(n):
        eng.add_request(EngineCoreRequest(f"batch{n}-{i}", _prompt(vocab, prompt_len, 100 + 100 * n + i), sp))
    started: set[str] = set()
    while len(started) < n:
        started.update(o.request_id for o in eng.step() if o.new_token_ids)
    t0, produced = time.perf_counter(), 0
    while eng.has_unfinished_requests():
        produced += sum(len(o.new_token_ids) for o in eng.step())
    return produced / (time.perf_counter() - t0)


def _rss_mb() -> dict[str, float]:
    """This process's peak RSS, from VmHWM: getrusage's ru_maxrss would include the parent's RSS at the fork
    (Linux keeps it across exec), and the parent holds torch and the bandwidth test's buffers."""
    import psutil

    with open("/proc/self/status") as f:
        hwm = next(int(x.split()[1]) for x in f if x.startswith("VmHWM:"))
    children = psutil.Process().children(recursive=True)
    return {"peak_rss_mb": hwm / 1024, "children_rss_mb": sum(c.memory_info().rss for c in children) / 2**20}


def child_main(path: str, kwargs: dict, w: Workload, phase: str) -> dict:
    """In a process of its own (so its peak RSS is the engine's): start, measure one phase, report.
    phase "single": single-stream decode and prefill; "batched": the batched decode runs."""
    import psutil

    from tokenmill import LLM

    rss_imports = psutil.Process().memory_info().rss / 2**20  # torch and the engine, before any model
    t0 = time.perf_counter()
    llm = LLM(path, enable_prefix_caching=False, **kwargs)
    res: dict[str, Any] = {"start_s": time.perf_counter() - t0, "rss_imports_mb": rss_imports,
                           "rss_after_start_mb": psutil.Process().memory_info().rss / 2**20}
    _single(llm, w.prompt, 4, seed=0)  # warm-up: first-call costs (kernel setup for these shapes) out of timings
    if phase == "single":
        res.update(model_dir=os.path.basename(llm.config.model.model_dir), kernels=llm.engine.executor.kernels(),
                   dtype=str(llm.config.model.torch_dtype).removeprefix("torch."))
        runs = [_single(llm, w.prompt, w.out, seed=1 + i) for i in range(w.reps)]
        res["prefill"] = statistics.median(w.prompt / r["ttft_s"] for r in runs)
        res["decode"] = statistics.median(r["decode_tok_s"] for r in runs)
        res["decode_runs"] = [r["decode_tok_s"] for r in runs]
        res["decode_d0"] = statistics.median(_single(llm, 1, w.out, seed=50 + i)["decode_tok_s"]
                                             for i in range(w.reps))
    else:
        for n in w.batches:
            res[f"batched_{n}"] = _batched(llm, n, w.batch_prompt, w.batch_out)
    res.update(_rss_mb())
    return res


def _kernel_cache() -> Optional[str]:
    root = os.environ.get("TOKENMILL_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "tokenmill")
    path = os.path.join(root, "kernels")
    return path if os.path.isdir(path) else None


def _disk_bytes(root: str) -> int:
    """Bytes under root, compiled kernels excluded (they are not the model's)."""
    total = 0
    for d, dirs, fs in os.walk(root):
        dirs[:] = [x for x in dirs if not (d == root and x == "kernels")]
        total += sum(os.path.getsize(os.path.join(d, f)) for f in fs if not os.path.islink(os.path.join(d, f)))
    return total


def run_tokenmill(path: str, kwargs: dict, w: Workload, cache: str, phase: str) -> dict:
    """One start of tokenmill on `path` with TOKENMILL_CACHE_DIR=cache, measuring `phase` (child_main). The KV
    pool holds what the phase needs (fp32-sized), as llama.cpp's context does: -p + -n tokens for llama-bench,
    -c for llama-batched-bench; not tokenmill's 4 GiB CPU default."""
    tokens = w.kv_tokens() if phase == "batched" else w.prompt + w.out + 32
    env = dict(os.environ, TOKENMILL_CACHE_DIR=cache, TOKENMILL_REQUIRE_KERNELS="1", OMP_NUM_THREADS="2")
    kw = dict({"kv_cache_memory_bytes": str(tokens * kv_bytes_per_token(path))}, **kwargs)
    cmd = cpu_prefix() + [sys.executable, os.path.abspath(__file__), "--child", path, json.dumps(kw),
                          json.dumps(asdict(w)), phase]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=3600)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"tokenmill on {path} failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def fresh_cache(kernels: str) -> str:
    """A TOKENMILL_CACHE_DIR holding only the compiled kernels: tokenmill's first start on a file."""
    cache = tempfile.mkdtemp(prefix="tm-gguf-bench-")
    shutil.copytree(kernels, os.path.join(cache, "kernels"), dirs_exist_ok=True)
    return cache


# -- llama.cpp ----------------------------------------------------------------------------------------------
def _timed_run(cmd: list[str], env: dict, timeout: float) -> tuple[str, float]:
    """stdout and peak RSS (MiB, /usr/bin/time -v) of cmd."""
    proc = subprocess.run(["/usr/bin/time", "-v"] + cmd, capture_output=True, text=True, env=env, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed (rc {proc.returncode}): {proc.stderr[-3000:]}")
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr)
    return proc.stdout, int(rss.group(1)) / 1024


def llama_bench(path: str, bin_dir: str, w: Workload) -> dict:
    """pp and tg (tokens/s, mean of -r runs): tg from an empty context (decode_d0) and at depth w.prompt (decode,
    a second run: the prompt's tokens in the KV cache first), and llama-bench's peak RSS over both runs."""
    res: dict[str, Any] = {"peak_rss_mb": 0.0}
    for args, tg_key in ((["-p", str(w.prompt)], "decode_d0"), (["-p", "0", "-d", str(w.prompt)], "decode")):
        out, rss = _timed_run(cpu_prefix() + [os.path.join(bin_dir, "llama-bench"), "-m", path, "-t", "2", *args,
                                              "-n", str(w.out), "-r", str(w.reps), "-o", "json"],
                              dict(os.environ, LD_LIBRARY_PATH=bin_dir), 3600)
        res["peak_rss_mb"] = max(res["peak_rss_mb"], rss)
        for row in json.loads(out):
            key = "prefill" if row["n_prompt"] else tg_key
            res[key], res[key + "_stddev"] = row["avg_ts"], row["stddev_ts"]
            res["build"] = row.get("build_commit")
    return res


def llama_batched_bench(path: str, bin_dir: str, w: Workload) -> dict:
    """S_TG (generated tokens/s once every sequence's prompt is in) per batch size, and the peak RSS."""
    ctx = max(w.batches) * (w.batch_prompt + w.batch_out)
    out, rss = _timed_run(
        cpu_prefix() + [os.path.join(bin_dir, "llama-batched-bench"), "-m", path, "-t", "2", "-c", str(ctx),
                        "-b", "2048", "-ub", "512", "-npp", str(w.batch_prompt), "-ntg", str(w.batch_out),
                        "-npl", ",".join(map(str, w.batches)), "--output-format", "jsonl"],
        dict(os.environ, LD_LIBRARY_PATH=bin_dir), 3600)
    res: dict[str, Any] = {"batched_peak_rss_mb": rss}
    for line in out.splitlines():
        if line.startswith("{") and "speed_tg" in line:
            row = json.loads(line)
            res[f"batched_{row['pl']}"] = row["speed_tg"]
    return res


# -- the table ----------------------------------------------------------------------------------------------
def _mark(value: float, target: str) -> str:
    op, bound = TARGETS[target]
    ok = value >= bound if op == ">=" else value <= bound
    return "ok" if ok else "MISS"


def _cell(r: dict, key: str, fmt: str = "{:.1f}") -> str:
    tm, lc = r["tokenmill"].get(key), r["llama.cpp"].get(key)
    if tm is None:
        return "-"
    if not lc:
        return fmt.format(tm)
    ratio = tm / lc
    mark = f" {_mark(ratio, key)}" if key in TARGETS else ""
    return f"{fmt.format(tm)} / {fmt.format(lc)} = {ratio:.2f}x{mark}"


def table(results: dict, w: Workload) -> str:
    keys = (["decode", "decode_d0", "prefill"] + [f"batched_{n}" for n in w.batches]
            + ["peak_rss_mb", "batched_peak_rss_mb"])
    head = (f"| file (MiB) | decode tok/s (after {w.prompt}) | decode tok/s (empty context) | "
            f"prefill tok/s ({w.prompt}) | "
            + " | ".join(f"batched@{n} tok/s" for n in w.batches)
            + " | peak RSS MiB (vs llama-bench) | batched peak RSS MiB | disk / file | roofline |")
    lines = [head, "|" + "---|" * (len(keys) + 3), ]
    for name, r in results.items():
        disk = r["tokenmill"]["disk_bytes"] / r["file_bytes"]
        cells = [_cell(r, k, "{:.0f}" if k.endswith("rss_mb") else "{:.1f}") for k in keys]
        imports = r["tokenmill"].get("rss_imports_mb")
        if imports is not None:  # what no model size changes: the RSS of importing torch and tokenmill
            cells[keys.index("peak_rss_mb")] += f" (imports {imports:.0f})"
        lc = r.get("llama_roofline_fraction")
        lines.append(f"| {name} ({r['file_bytes'] / 2**20:.0f}) | " + " | ".join(cells)
                     + f" | {disk:.3f} {_mark(disk, 'disk')} | {r['roofline_fraction']:.0%} of "
                       f"{r['roofline_tok_s']:.0f} tok/s {_mark(r['roofline_fraction'], 'roofline')}"
                     + ("" if lc is None else f" (llama.cpp {lc:.0%})") + " |")
    return "\n".join(lines)


def report(meta: dict, results: dict, w: Workload) -> str:
    tgt = ", ".join(f"{k} {op} {v}" for k, (op, v) in TARGETS.items())
    return "\n".join([
        f"# tokenmill vs llama.cpp on the same GGUF files ({meta['date']}, tokenmill {meta['commit']}, "
        f"llama.cpp {meta.get('llama_build')})", "",
        f"CPU: {meta['cpu']}, 2 threads; copy bandwidth (2 threads, read + write) "
        f"{' '.join(f'{x:.1f}' for x in meta['copy_bandwidth_gb_s'])} GB/s (start, after each file; the roofline "
        f"takes the best); load average {meta['load_average'][0]} at the start; others' CPU share per file "
        f"{meta['others_cpu']}",
        f"tokenmill args: {meta['tokenmill_args'] or '(defaults)'}; cells: tokenmill / llama.cpp = ratio; "
        f"targets: {tgt}", *_busy(meta), "", f"`lscpu` {meta['flags_line']}", "", table(results, w), ""])


def _busy(meta: dict) -> list[str]:
    worst = max(meta["others_cpu"].values(), default=0.0)
    if worst <= BUSY:
        return []
    return ["", f"**WARNING: other processes used up to {worst:.0%} of the CPUs while a file was measured "
                f"({meta['others_cpu']}): llama.cpp's spinning threads collapse when they share cores (2 threads "
                "measured 13 tok/s beside 4 busy processes where 1 thread did 69), so these ratios are not a "
                "measurement.**"]


class OthersCpu:
    """The share of all CPUs that processes other than this one and its children used since the last call:
    busy time from /proc/stat less our own (os.times counts every finished child, llama.cpp's and tokenmill's)."""

    def __init__(self) -> None:
        self.last = self._sample()

    @staticmethod
    def _sample() -> tuple[float, float, float]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]
        busy = (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle and iowait
        return busy, sum(os.times()[:4]), time.monotonic()

    def share(self) -> float:
        now = self._sample()
        (busy0, own0, t0), (busy1, own1, t1) = self.last, now
        self.last = now
        return max(0.0, (busy1 - busy0) - (own1 - own0)) / ((t1 - t0) * (os.cpu_count() or 1))


# -- the sitting --------------------------------------------------------------------------------------------
def _cpu() -> tuple[str, str]:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    name = next((x.split(":", 1)[1].strip() for x in out.splitlines() if x.startswith("Model name")), "?")
    flags = next((x.strip() for x in out.splitlines() if x.startswith("Flags")), "Flags: ?")
    return name, re.sub(r"\s+", " ", flags)


def _bandwidth() -> float:
    import torch

    from tokenmill.perf.hardware import copy_bandwidth

    torch.set_num_threads(2)
    return copy_bandwidth()


def _commit() -> str:
    out = subprocess.run(["git", "-C", os.path.dirname(os.path.abspath(__file__)), "rev-parse", "--short", "HEAD"],
                         capture_output=True, text=True)
    return out.stdout.strip() or "?"


def resolve_files(names: list[str], directory: str) -> dict[str, str]:
    from tokenmill.models.default_model import default_model_path

    return {n: default_model_path() if n == "default" else make_gguf.ensure(directory, n) for n in names}


def measure_file(path: str, a: argparse.Namespace, kwargs: dict, w: Workload, kernels: str) -> tuple[dict, dict]:
    """Interleaved: tokenmill's first start (single stream; then the bytes it wrote), llama-bench, tokenmill's
    second start (batched), llama-batched-bench."""
    cache = fresh_cache(kernels)
    try:
        tm = run_tokenmill(path, kwargs, w, cache, "single")
        tm["disk_bytes"] = _disk_bytes(cache)
        shutil.copytree(os.path.join(cache, "kernels"), kernels, dirs_exist_ok=True)  # later files start warm
        lc = {} if a.skip_llamacpp else llama_bench(path, a.llama_bin, w)
        batched = run_tokenmill(path, kwargs, w, cache, "batched")
        tm.update({k: v for k, v in batched.items() if k.startswith("batched_")},
                  batched_peak_rss_mb=batched["peak_rss_mb"], batched_start_s=batched["start_s"])
        if not a.skip_llamacpp:
            lc.update(llama_batched_bench(path, a.llama_bin, w))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return tm, lc


def sitting(a: argparse.Namespace, w: Workload) -> tuple[dict, dict]:
    paths = resolve_files(a.files.split(","), a.dir)
    kwargs = engine_kwargs(a.tokenmill_args)
    kernels = tempfile.mkdtemp(prefix="tm-gguf-bench-kernels-")
    if _kernel_cache():
        shutil.copytree(_kernel_cache(), kernels, dirs_exist_ok=True)
    cpu, flags = _cpu()
    meta: dict[str, Any] = {"cpu": cpu, "flags_line": flags, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                            "commit": _commit(), "tokenmill_args": a.tokenmill_args, "engine_kwargs": kwargs,
                            "workload": asdict(w), "load_average": [round(os.getloadavg()[0], 2)],
                            "copy_bandwidth_gb_s": [_bandwidth() / 1e9]}
    results, meta["others_cpu"] = {}, {}
    others = OthersCpu()
    try:
        for name, path in paths.items():
            logger.info("%s: %s", name, path)
            others.share()
            tm, lc = measure_file(path, a, kwargs, w, kernels)
            meta["others_cpu"][name] = round(others.share(), 3)
            meta.setdefault("llama_build", lc.get("build"))
            results[name] = {"path": path, "file_bytes": os.path.getsize(path),
                             "bytes_per_token": bytes_per_token(path), "tokenmill": tm, "llama.cpp": lc}
            meta["copy_bandwidth_gb_s"].append(_bandwidth() / 1e9)
            logger.info("%s: %s", name, json.dumps(results[name], default=str))
    finally:
        shutil.rmtree(kernels, ignore_errors=True)
    meta["load_average"].append(round(os.getloadavg()[0], 2))
    best = max(meta["copy_bandwidth_gb_s"]) * 1e9  # a busy neighbour only ever lowers a sample
    for r in results.values():
        r["roofline_tok_s"] = best / r["bytes_per_token"]
        r["roofline_fraction"] = r["tokenmill"]["decode_d0"] / r["roofline_tok_s"]
        if r["llama.cpp"].get("decode_d0"):  # the same measure for the peer: what the target asks of an engine
            r["llama_roofline_fraction"] = r["llama.cpp"]["decode_d0"] / r["roofline_tok_s"]
    return meta, results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", default=None, help=f"comma-separated, from: default,{','.join(make_gguf.NAMES)} "
                                                 f"(default: all; --quick: default), or SHAPE-TYPE for a type of "
                                                 f"{','.join(make_gguf.PURE)} (every matrix in it)")
    p.add_argument("--dir", default=make_gguf.default_dir(), help="where the random-weight files are written")
    p.add_argument("--llama-bin", default=LLAMA_BIN, help="llama.cpp's build/bin (llama-bench, llama-batched-bench)")
    p.add_argument("--skip-llamacpp", action="store_true", help="tokenmill only")
    p.add_argument("--tokenmill-args", default="", help='`tokenmill serve` flags, e.g. "--gguf-weights dequantize"')
    p.add_argument("--quick", action="store_true", help="smoke test: short prompts and outputs, one run each")
    p.add_argument("--out", default=None, help="markdown report (default <dir>/gguf_native.md; .json beside it)")
    a = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    a.files = a.files or ("default" if a.quick else ",".join(("default",) + make_gguf.NAMES))
    if not a.skip_llamacpp and not os.path.isfile(os.path.join(a.llama_bin, "llama-bench")):
        p.error(f"no llama-bench in {a.llama_bin}: build llama.cpp (see this file's docstring) or --skip-llamacpp")
    w = Workload.quick() if a.quick else Workload()
    meta, results = sitting(a, w)
    text = report(meta, results, w)
    out = a.out or os.path.join(a.dir, "gguf_native.md")
    with open(out, "w") as f:
        f.write(text)
    with open(os.path.splitext(out)[0] + ".json", "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=2, default=str)
    print(text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "--child":
        result = child_main(sys.argv[2], json.loads(sys.argv[3]), Workload(**json.loads(sys.argv[4])), sys.argv[5])
        print("RESULT " + json.dumps(result, default=str), flush=True)
        sys.exit(0)
    sys.exit(main())
