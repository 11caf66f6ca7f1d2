"""Load generator for any OpenAI-compatible server: `tokenmill bench serve` and `tokenmill bench sweep`.

Generation requests stream (SSE) and are timed from the client's side with a monotonic clock:
- TTFT: send -> first chunk carrying tokens; ITL: gaps between successive chunks carrying tokens;
- E2E: send -> end of stream; TPOT: (E2E - TTFT) / (output tokens - 1).
Token counts come from the response's `usage` (requested with stream_options.include_usage), not from
chunk counts: one chunk may carry several tokens.

--endpoint embeddings sends /v1/embeddings requests (--inputs-per-request prompts each, not streamed): E2E is
their latency, and the summary adds inputs/s.

Arrivals follow a Poisson process at --request-rate (inf: all at once) and never exceed --max-concurrency
in flight; a request waiting for a slot starts its clock when it is sent. Warm-up requests run first and
are not counted. Each sweep point and the warm-up get their own prompts, so no run is flattered by the
server's prefix cache holding an earlier run's prompts.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import logging
import math
import random
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

from tokenmill.bench.datasets import BenchRequest, build_dataset, load_tokenizer
from tokenmill.bench.report import (format_sweep_table, format_table, parse_slo, plot_pareto, plot_serve,
                                    kv_transfer_counters, kv_transfer_summary, spec_decode_summary, summarize)

logger = logging.getLogger("tokenmill")


ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions", "embeddings": "/v1/embeddings"}


@dataclass
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    model: Optional[str] = None            # None: the first model the server lists
    endpoint: str = "completions"          # or "chat", "embeddings"
    inputs_per_request: int = 1            # embeddings: prompts per request (its `input` list)
    api_key: Optional[str] = None
    dataset: str = "random"
    input_len: int = 256
    output_len: int = 128
    range_ratio: float = 0.0
    prefix_len: int = 512
    num_prefixes: int = 4
    mm_image_size: str = "448x448"         # random-mm: each image's WxH
    mm_images_per_request: int = 1         # random-mm
    num_prompts: int = 100
    duration: Optional[float] = None       # seconds; instead of a fixed number of prompts
    request_rate: float = math.inf
    max_concurrency: Optional[int] = None
    warmup: int = 0
    seed: int = 0
    slo: dict[str, float] = field(default_factory=dict)  # seconds
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout: float = 600.0
    tokenizer: Optional[str] = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    # --priority-classes: (name, priority, weight); each request draws a class and sends its priority
    priority_classes: list[tuple[str, int, float]] = field(default_factory=list)
    progress: bool = True

    def validate(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.inputs_per_request < 1:
            raise ValueError(f"--inputs-per-request must be at least 1, got {self.inputs_per_request}")
        if self.num_prompts < 1:
            raise ValueError(f"--num-prompts must be at least 1, got {self.num_prompts}")
        if self.request_rate <= 0:
            raise ValueError(f"--request-rate must be positive (inf: all at once), got {self.request_rate}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be at least 1, got {self.max_concurrency}")
        if self.duration is not None:
            if self.duration <= 0:
                raise ValueError(f"--duration must be positive, got {self.duration}")
            if math.isinf(self.request_rate) and self.max_concurrency is None:
                raise ValueError("--duration needs --max-concurrency or a finite --request-rate "
                                 "(otherwise it would send requests without end)")
        if self.warmup < 0:
            raise ValueError(f"--warmup must be at least 0, got {self.warmup}")
        if self.priority_classes and self.endpoint == "embeddings":
            raise ValueError("--priority-classes is for the completions and chat endpoints")
        if self.dataset == "random-mm" and self.endpoint != "chat":
            raise ValueError("--dataset random-mm sends images in chat messages: use --endpoint chat")

    @property
    def api_base(self) -> str:
        base = self.base_url.rstrip("/")
        return base[:-3] if base.endswith("/v1") else base

    @property
    def url(self) -> str:
        return self.api_base + ENDPOINTS[self.endpoint]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


# -- one request ----------------------------------------------------------------------------------
def _payload(cfg: ServeConfig, req: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {"model": cfg.model, "max_tokens": req.output_len, "temperature": cfg.temperature,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.endpoint == "chat":
        body["messages"] = req.messages()
    else:
        body["prompt"] = req.prompt
    if cfg.ignore_eos:  # vLLM-style extension: makes output lengths exactly what the workload asked for
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    return body


def _carries_tokens(chunk: dict, chat: bool) -> bool:
    """Whether a stream chunk delivers generated tokens: it has text, or an empty text field that is
    neither chat's opening role announcement nor a closing finish-only chunk (servers send those empty
    texts for tokens whose bytes do not yet decode to a whole character)."""
    for choice in chunk.get("choices") or []:
        if chat:
            delta = choice.get("delta") or {}
            if delta.get("content") or delta.get("reasoning_content"):
                return True
            if ("content" in delta or "reasoning_content" in delta) and "role" not in delta \
                    and choice.get("finish_reason") is None:
                return True
        else:
            if choice.get("text"):
                return True
            if choice.get("text") is not None and choice.get("finish_reason") is None:
                return True
    return False


def _error_message(body: bytes) -> str:
    try:
        err = json.loads(body).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:300]
    except (ValueError, AttributeError):
        pass
    return body[:300].decode(errors="replace")


async def send_request(client, cfg: ServeConfig, req: BenchRequest, index: int, t0: float,
                       priority_class: Optional[tuple[str, int, float]] = None) -> dict[str, Any]:
    """Send one streaming request and time it. Never raises for server or network failures: the record
    says what went wrong (`error_kind`: http_<status>, timeout, connect, disconnected, stream_error,
    incomplete_stream, bad_response). priority_class: (name, priority, weight), sent as `priority` and
    recorded as the record's `class`."""
    import httpx

    if cfg.endpoint == "embeddings":
        return await _send_embedding(client, cfg, req, index, t0)
    rec: dict[str, Any] = {"index": index, "start": 0.0, "ttft": None, "itl": [], "e2e": 0.0, "tpot": None,
                           "prompt_tokens": None, "output_tokens": None, "expected_prompt_len": req.prompt_len,
                           "expected_output_len": req.output_len, "success": False, "error_kind": None,
                           "error": None, "usage_missing": False, "connect": 0.0, "connection_reused": True}
    payload = _payload(cfg, req)
    if priority_class is not None:
        rec["class"], rec["priority"] = priority_class[:2]
        payload["priority"] = rec["priority"]
    start = time.perf_counter()
    rec["start"] = start - t0
    usage, content_chunks = None, 0
    try:
        async with client.stream("POST", cfg.url, json=payload, headers=cfg.headers,
                                 extensions={"trace": _ConnectionTrace(rec)}) as resp:
            if resp.status_code != 200:
                rec["error_kind"] = f"http_{resp.status_code}"
                rec["error"] = _error_message(await resp.aread())
            else:
                usage, content_chunks = await _read_stream(resp, rec, start, cfg.endpoint == "chat")
    except httpx.TimeoutException as e:
        rec["error_kind"], rec["error"] = "timeout", f"{type(e).__name__} after {cfg.timeout:g}s"
    except httpx.ConnectError as e:
        rec["error_kind"], rec["error"] = "connect", str(e)[:300] or type(e).__name__
    except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
        rec["error_kind"], rec["error"] = "disconnected", str(e)[:300] or type(e).__name__
    except httpx.HTTPError as e:
        rec["error_kind"], rec["error"] = "http_error", str(e)[:300] or type(e).__name__
    except (ValueError, AttributeError, TypeError) as e:  # malformed JSON in the stream
        rec["error_kind"], rec["error"] = "bad_response", str(e)[:300]
    rec["e2e"] = time.perf_counter() - start
    if rec["error_kind"] is None:
        _count_tokens(rec, usage, req, content_chunks)
    return rec


async def _read_stream(resp, rec: dict[str, Any], start: float, chat: bool) -> tuple[Optional[dict], int]:
    """Read an SSE body to its end, timing the chunks that carry tokens into `rec` (ttft, itl) and noting a
    stream error or a missing [DONE]; returns (the usage chunk's usage, the token-carrying chunks)."""
    last, usage, content_chunks, done = None, None, 0, False
    async for line in resp.aiter_lines():
        now = time.perf_counter()
        if done or not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            done = True
            continue  # read on to the end of the body: a half-read response's connection is closed
        chunk = json.loads(data)
        if "error" in chunk:
            err = chunk["error"]
            rec["error_kind"] = "stream_error"
            rec["error"] = str(err.get("message") if isinstance(err, dict) else err)[:300]
            return usage, content_chunks
        if chunk.get("usage"):
            usage = chunk["usage"]
        if _carries_tokens(chunk, chat):
            content_chunks += 1
            if last is None:
                rec["ttft"] = now - start
            else:
                rec["itl"].append(now - last)
            last = now
    if not done:
        rec["error_kind"] = "incomplete_stream"
        rec["error"] = "the stream ended without [DONE]"
    return usage, content_chunks


def _count_tokens(rec: dict[str, Any], usage: Optional[dict], req: BenchRequest, content_chunks: int) -> None:
    """A successful request's token counts (the server's usage, else the prompt asked for and the chunks seen)
    and its TPOT."""
    rec["success"] = True
    if usage and usage.get("completion_tokens") is not None:
        rec["prompt_tokens"] = usage.get("prompt_tokens")
        rec["output_tokens"] = usage["completion_tokens"]
    else:
        rec["usage_missing"] = True
        rec["prompt_tokens"], rec["output_tokens"] = req.prompt_len, content_chunks
    n, ttft = rec["output_tokens"] or 0, rec["ttft"]
    if ttft is not None and n > 1:
        rec["tpot"] = (rec["e2e"] - ttft) / (n - 1)


class _ConnectionTrace:
    """httpx's `trace` extension (httpcore events): did this request open a connection, and how long did
    setting it up take (TCP connect, TLS)? Sets the record's `connect` (s) and `connection_reused`."""
    _SETUP = ("connection.connect_tcp", "connection.connect_unix_socket", "connection.start_tls")

    def __init__(self, rec: dict[str, Any]) -> None:
        self.rec = rec
        self.started = 0.0

    async def __call__(self, name: str, info: dict) -> None:
        event, _, stage = name.rpartition(".")
        if event not in self._SETUP:
            return
        if stage == "started":
            self.started = time.perf_counter()
            self.rec["connection_reused"] = False
        else:  # complete or failed
            self.rec["connect"] += time.perf_counter() - self.started


@dataclass
class EmbeddingBatch:
    """One /v1/embeddings request: several dataset prompts as its input list."""
    prompts: list[str]
    prompt_len: int
    output_len: int = 0


def _embedding_batches(source: Iterator[BenchRequest], k: int) -> Iterator[EmbeddingBatch]:
    while True:
        reqs = [next(source) for _ in range(k)]
        yield EmbeddingBatch([r.prompt for r in reqs], sum(r.prompt_len for r in reqs))


async def _send_embedding(client, cfg: ServeConfig, req: EmbeddingBatch, index: int, t0: float) -> dict[str, Any]:
    """One /v1/embeddings request, timed send -> whole response (the record's e2e)."""
    import httpx

    rec: dict[str, Any] = {"index": index, "start": 0.0, "ttft": None, "itl": [], "e2e": 0.0, "tpot": None,
                           "prompt_tokens": None, "output_tokens": 0, "inputs": len(req.prompts),
                           "expected_prompt_len": req.prompt_len, "expected_output_len": 0, "success": False,
                           "error_kind": None, "error": None, "usage_missing": False, "connect": 0.0,
                           "connection_reused": True}
    body = {"model": cfg.model, "input": req.prompts, **cfg.extra_body}
    start = time.perf_counter()
    rec["start"] = start - t0
    try:
        resp = await client.post(cfg.url, json=body, headers=cfg.headers,
                                 extensions={"trace": _ConnectionTrace(rec)})
        if resp.status_code != 200:
            rec["error_kind"], rec["error"] = f"http_{resp.status_code}", _error_message(resp.content)
        else:
            out = resp.json()
            if len(out.get("data") or []) != len(req.prompts):
                rec["error_kind"], rec["error"] = "bad_response", f"{len(out.get('data') or [])} embeddings"
            usage = out.get("usage") or {}
            rec["prompt_tokens"] = usage.get("prompt_tokens", req.prompt_len)
            rec["usage_missing"] = "prompt_tokens" not in usage
    except httpx.TimeoutException as e:
        rec["error_kind"], rec["error"] = "timeout", f"{type(e).__name__} after {cfg.timeout:g}s"
    except httpx.HTTPError as e:
        rec["error_kind"], rec["error"] = "http_error", str(e)[:300] or type(e).__name__
    except ValueError as e:
        rec["error_kind"], rec["error"] = "bad_response", str(e)[:300]
    rec["e2e"] = time.perf_counter() - start
    rec["success"] = rec["error_kind"] is None
    return rec


# -- a run ----------------------------------------------------------------------------------------
def request_source(cfg: ServeConfig, tokenizer, seed: int) -> Iterator[BenchRequest]:
    """Requests without end: synthetic datasets draw fresh prompts in chunks of --num-prompts, file
    datasets repeat."""
    chunk = 0
    while True:
        batch = build_dataset(cfg.dataset, cfg.num_prompts, input_len=cfg.input_len, output_len=cfg.output_len,
                              range_ratio=cfg.range_ratio, prefix_len=cfg.prefix_len, num_prefixes=cfg.num_prefixes,
                              seed=seed + 7919 * chunk, tokenizer=tokenizer, mm_image_size=cfg.mm_image_size,
                              mm_images_per_request=cfg.mm_images_per_request)
        yield from batch
        chunk += 1


def arrival_times(rate: float, rng: random.Random) -> Iterator[float]:
    """Send offsets (s) of a Poisson process at `rate` req/s; all zero for inf."""
    t = 0.0
    while True:
        yield t
        if not math.isinf(rate):
            t += rng.expovariate(rate)


async def _prepare(client, cfg: ServeConfig, warmup: list[BenchRequest]) -> None:
    """Before the measured run: the model name (the first the server lists, unless given) and the warm-up
    requests, not recorded (a failed one is logged)."""
    if cfg.model is None:
        cfg.model = await _first_model(client, cfg)
    if not warmup:
        return
    sem = asyncio.Semaphore(cfg.max_concurrency or len(warmup))

    async def warm(r: BenchRequest) -> dict:
        async with sem:
            return await send_request(client, cfg, r, -1, time.perf_counter())

    recs = await asyncio.gather(*(warm(r) for r in warmup))
    bad = [r for r in recs if not r["success"]]
    if bad:
        logger.warning("%d of %d warm-up requests failed (%s: %s)", len(bad), len(recs), bad[0]["error_kind"],
                       bad[0]["error"])


async def _run(cfg: ServeConfig, source: Iterator[BenchRequest], n: Optional[int], warmup: list[BenchRequest],
               progress_desc: str) -> tuple[list[dict], float, dict]:
    import httpx
    from tqdm import tqdm

    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every request at INFO
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    # trust_env=False: measure the server, not a proxy from the environment
    async with httpx.AsyncClient(timeout=httpx.Timeout(cfg.timeout, connect=30.0), limits=limits,
                                 trust_env=False) as client:
        await _prepare(client, cfg, warmup)
        spec_before, kv_before = await _scrape_counters(client, cfg)
        bar = tqdm(total=n, desc=progress_desc, unit="req", disable=not cfg.progress, file=sys.stderr,
                   dynamic_ncols=True, leave=True)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        records: list[dict] = []
        failures = 0

        classes = cfg.priority_classes
        pick = random.Random(cfg.seed + 2)  # the requests' classes, independent of prompts and arrivals

        async def one(r: BenchRequest, i: int, cls: Optional[tuple[str, int, float]]) -> None:
            nonlocal failures
            try:
                rec = await send_request(client, cfg, r, i, t0, cls)
            finally:
                if sem is not None:
                    sem.release()
            records.append(rec)
            failures += not rec["success"]
            bar.set_postfix_str(f"{len(records) - failures} ok, {failures} failed", refresh=False)
            bar.update(1)

        rng = random.Random(cfg.seed + 1)  # arrivals independent of the prompts
        tasks = []
        t0 = time.perf_counter()
        for i, offset in enumerate(arrival_times(cfg.request_rate, rng)):
            if n is not None and i >= n:
                break
            if cfg.duration is not None and time.perf_counter() - t0 >= cfg.duration:
                break
            delay = offset - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is not None:
                await sem.acquire()
            if cfg.duration is not None and time.perf_counter() - t0 >= cfg.duration:
                if sem is not None:
                    sem.release()
                break
            cls = pick.choices(classes, weights=[c[2] for c in classes])[0] if classes else None
            tasks.append(asyncio.create_task(one(next(source), i, cls)))
            if not tasks[-1].done():
                await asyncio.sleep(0)  # let it send before the next one queues behind it
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        bar.close()
        spec_after, kv_after = await _scrape_counters(client, cfg)
        extra = {"spec_decode": spec_decode_summary(spec_before, spec_after),
                 "kv_transfer": kv_transfer_summary(kv_before, kv_after)}
    records.sort(key=lambda r: r["index"])
    return records, duration, extra


async def _scrape_counters(client, cfg: ServeConfig) -> tuple[Optional[dict], Optional[dict]]:
    """The server's speculative-decoding and KV transfer counters from /metrics, or Nones (no /metrics,
    another engine)."""
    import httpx

    from tokenmill.serve.metrics import spec_decode_counters  # prometheus_client: `bench --help` skips it

    try:
        resp = await client.get(cfg.api_base + "/metrics", headers=cfg.headers, timeout=10)
    except httpx.HTTPError:
        return None, None
    if resp.status_code != 200:
        return None, None
    return spec_decode_counters(resp.text), kv_transfer_counters(resp.text)


async def _first_model(client, cfg: ServeConfig) -> str:
    import httpx

    try:
        resp = await client.get(cfg.api_base + "/v1/models", headers=cfg.headers, timeout=30)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach {cfg.api_base}: {e or type(e).__name__}") from None
    if resp.status_code != 200:
        raise RuntimeError(f"{cfg.api_base}/v1/models answered {resp.status_code}: {_error_message(resp.content)}"
                           " (pass --model, and --api-key if the server needs one)")
    models = resp.json().get("data") or []
    if not models:
        raise RuntimeError(f"{cfg.api_base}/v1/models lists no model; pass --model")
    return models[0]["id"]


def run_benchmark(cfg: ServeConfig, tokenizer=None, seed: Optional[int] = None, title: str = "") -> dict[str, Any]:
    """Run one benchmark and return {config, summary, requests}. `seed` picks the prompts (default
    cfg.seed); warm-up prompts come from a different seed so they never prime the prefix cache."""
    cfg.validate()
    seed = cfg.seed if seed is None else seed
    source = request_source(cfg, tokenizer, seed)
    source = itertools.chain([next(source)], source)  # bad dataset specs and files fail before any traffic
    warm_source = request_source(cfg, tokenizer, seed + 104729)
    if cfg.endpoint == "embeddings":
        source = _embedding_batches(source, cfg.inputs_per_request)
        warm_source = _embedding_batches(warm_source, cfg.inputs_per_request)
    warmup = [next(warm_source) for _ in range(cfg.warmup)]
    n = None if cfg.duration is not None else cfg.num_prompts
    cpu = time.process_time()
    records, duration, extra = asyncio.run(_run(cfg, source, n, warmup, title or "bench"))
    summary = summarize(records, duration, cfg.slo)
    summary.update({k: v for k, v in extra.items() if v})  # spec_decode, kv_transfer: when the server has them
    if cfg.endpoint == "embeddings":
        inputs = sum(r["inputs"] for r in records if r["success"])
        summary["input_throughput"] = inputs / duration if duration > 0 else 0.0
    # a busy client delays its own timestamps: its CPU share says whether the numbers can be trusted
    summary["client_cpu_s"] = time.process_time() - cpu
    conf = dataclasses.asdict(cfg)
    conf["slo"] = {k: v * 1e3 for k, v in cfg.slo.items()}
    conf["request_rate"] = "inf" if math.isinf(cfg.request_rate) else cfg.request_rate
    conf.pop("api_key")
    return {"tool": "tokenmill bench serve", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": conf,
            "summary": summary, "requests": records}


# -- CLI ------------------------------------------------------------------------------------------
def parse_rate(text: str) -> float:
    if text.strip().lower() in ("inf", "infinity"):
        return math.inf
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a rate: {text!r} (a number of requests/s, or inf)") from None


def parse_priority_classes(text: str) -> list[tuple[str, int, float]]:
    """'high=0:1,low=10:9' -> [('high', 0, 1.0), ('low', 10, 9.0)]."""
    classes = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([\w.-]+)=(-?\d+):(\d+(?:\.\d*)?)", part)
        if m is None or float(m[3]) <= 0:
            raise argparse.ArgumentTypeError(f"bad priority class {part!r}: use NAME=PRIORITY:WEIGHT with a "
                                             "positive weight, e.g. high=0:1,low=10:9")
        classes.append((m[1], int(m[2]), float(m[3])))
    if len({c[0] for c in classes}) != len(classes):
        raise argparse.ArgumentTypeError(f"priority class names must differ: {text!r}")
    return classes


def _json_obj(text: str) -> dict:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e.msg}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload flags (dataset, lengths, sampling), shared by `bench serve | sweep | matrix` and `tune`."""
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default="random",
                   help="random, shared-prefix, sharegpt:PATH, jsonl:PATH or random-mm (images; --endpoint chat)")
    g.add_argument("--input-len", type=int, default=256, help="prompt tokens (random, shared-prefix question)")
    g.add_argument("--output-len", type=int, default=128, help="output tokens (max_tokens)")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)] (random, shared-prefix)")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of each shared system prompt")
    g.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: how many distinct system prompts")
    g.add_argument("--mm-image-size", default="448x448", help="random-mm: each image's WxH in pixels")
    g.add_argument("--mm-images-per-request", type=int, default=1, help="random-mm: images in each request")
    g.add_argument("--tokenizer", default=None,
                   help="HF directory or .gguf ('default': the built-in model's) for exact prompt lengths; "
                        "without it a prompt gets one common word per requested token")
    g.add_argument("--seed", type=int, default=0, help="seed of the generated workload")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of the requests")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="ask for exactly --output-len tokens (vLLM's ignore_eos extension)")
    g.add_argument("--extra-body", type=_json_obj, default={}, help="JSON merged into every request body")
    g.add_argument("--priority-classes", type=parse_priority_classes, default=[], metavar="NAME=PRIO:WEIGHT,...",
                   help="send each request the `priority` of a class drawn by weight (for a server run with "
                        "--scheduling-policy priority), e.g. high=0:1,low=10:9; the report gives each class's "
                        "TTFT, TPOT and E2E percentiles")


def add_serve_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    g = p.add_argument_group("endpoint")
    g.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (a trailing /v1 is fine)")
    g.add_argument("--model", default=None, help="model name to request (default: the first in /v1/models)")
    g.add_argument("--endpoint", default="completions", choices=list(ENDPOINTS),
                   help="/v1/completions, /v1/chat/completions or /v1/embeddings")
    g.add_argument("--inputs-per-request", type=int, default=1,
                   help="embeddings: prompts in each request's input list")
    g.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    add_workload_args(p)
    g = p.add_argument_group("load")
    if sweep:
        g.add_argument("--max-concurrency", default="1,4,16,64",
                       help="comma-separated points, e.g. 1,4,16,64 ('none' for unlimited)")
        g.add_argument("--request-rate", default="inf", help="comma-separated rates in req/s (inf: all at once)")
    else:
        g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
        g.add_argument("--request-rate", type=parse_rate, default=math.inf,
                       help="Poisson arrival rate in req/s (default inf: all at once)")
    g.add_argument("--num-prompts", type=int, default=100, help="requests to send" + (" per point" if sweep else ""))
    g.add_argument("--duration", type=float, default=None,
                   help="seconds to keep sending (instead of --num-prompts); in-flight requests are awaited")
    g.add_argument("--warmup", type=int, default=0, help="requests sent first and not counted")
    g = p.add_argument_group("report")
    g.add_argument("--slo", default=None,
                   help="goodput SLOs, e.g. ttft=500ms,tpot=50ms,e2e=10s; a _p50/_p90/_p99 suffix (ttft_p90=2s) "
                        "also checks that percentile of the run")
    g.add_argument("--save-result", default=None, metavar="FILE.json",
                   help="write the config, summary and every request's record as JSON")
    g.add_argument("--plot", default=None, metavar="DIR",
                   help="write PNGs: " + ("pareto.png" if sweep else "latency_cdf.png, timeline.png"))
    g.add_argument("--no-progress", dest="progress", action="store_false", help="no live progress bar")


def workload_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """ServeConfig fields from add_workload_args' flags."""
    return dict(dataset=args.dataset, input_len=args.input_len, output_len=args.output_len,
                range_ratio=args.range_ratio, prefix_len=args.prefix_len, num_prefixes=args.num_prefixes,
                mm_image_size=args.mm_image_size, mm_images_per_request=args.mm_images_per_request,
                seed=args.seed, temperature=args.temperature, ignore_eos=args.ignore_eos, tokenizer=args.tokenizer,
                extra_body=args.extra_body, priority_classes=args.priority_classes)


def config_from_args(args: argparse.Namespace, **override: Any) -> ServeConfig:
    kw = dict(base_url=args.base_url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
              inputs_per_request=args.inputs_per_request, num_prompts=args.num_prompts, duration=args.duration,
              request_rate=args.request_rate,
              max_concurrency=args.max_concurrency, warmup=args.warmup, slo=parse_slo(args.slo),
              timeout=args.timeout, progress=args.progress, **workload_kwargs(args))
    kw.update(override)
    return ServeConfig(**kw)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)
    logger.info("wrote %s", path)


def serve_main(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    cfg.validate()
    result = run_benchmark(cfg, load_tokenizer(cfg.tokenizer))
    c = result["config"]
    print(format_table(result["summary"], f"tokenmill bench serve: {c['model']} @ {cfg.api_base} ({cfg.endpoint}, "
                                          f"{cfg.dataset}, rate {c['request_rate']}, "
                                          f"concurrency {cfg.max_concurrency or 'unlimited'})"))
    if args.save_result:
        _write_json(args.save_result, result)
    if args.plot:
        for path in plot_serve(result, args.plot):
            logger.info("wrote %s", path)
    return 0 if result["summary"]["completed"] else 1


def parse_list(text: str, parse) -> list:
    try:
        return [parse(x.strip()) for x in text.split(",") if x.strip()]
    except (ValueError, argparse.ArgumentTypeError) as e:
        raise ValueError(f"cannot parse the list {text!r}: {e}") from None


def sweep_main(args: argparse.Namespace) -> int:
    concs = parse_list(args.max_concurrency, lambda x: None if x.lower() in ("none", "inf") else int(x))
    rates = parse_list(args.request_rate, parse_rate)
    if not concs or not rates:
        raise ValueError("--max-concurrency and --request-rate need at least one value each")
    base = config_from_args(args, max_concurrency=concs[0], request_rate=rates[0])
    base.validate()
    tokenizer = load_tokenizer(base.tokenizer)
    points = []
    for k, (rate, conc) in enumerate((r, c) for r in rates for c in concs):
        cfg = dataclasses.replace(base, max_concurrency=conc, request_rate=rate, extra_body=dict(base.extra_body))
        label = f"conc {conc if conc is not None else 'inf'}, rate {rate:g}"
        result = run_benchmark(cfg, tokenizer, seed=base.seed + 1000 * (k + 1), title=label)
        base.model = cfg.model  # resolved once by the first point
        s = result["summary"]
        logger.info("%s: %.1f out tok/s, %.1f tok/s per user, TTFT p50 %s ms", label, s["output_throughput"],
                    s["per_user_tok_s"]["median"] or 0.0,
                    "-" if s["ttft_ms"]["median"] is None else f"{s['ttft_ms']['median']:.0f}")
        points.append({"max_concurrency": conc, "request_rate": rate, "summary": s, "requests": result["requests"]})
    print(f"tokenmill bench sweep: {base.model} @ {base.api_base} ({base.endpoint}, {base.dataset}, "
          f"{base.num_prompts if base.duration is None else f'{base.duration:g}s'} per point)")
    print(format_sweep_table(points))
    if args.save_result:
        conf = dataclasses.asdict(base)
        conf.pop("api_key")
        conf["slo"] = {k: v * 1e3 for k, v in base.slo.items()}
        conf["max_concurrency"], conf["request_rate"] = concs, ["inf" if math.isinf(r) else r for r in rates]
        out = [{**p, "request_rate": "inf" if math.isinf(p["request_rate"]) else p["request_rate"]} for p in points]
        _write_json(args.save_result, {"tool": "tokenmill bench sweep", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                       "config": conf, "points": out})
    if args.plot:
        for path in plot_pareto(points, args.plot, f"{base.model}: {base.dataset} {base.input_len} in / "
                                                   f"{base.output_len} out"):
            logger.info("wrote %s", path)
    return 0 if any(p["summary"]["completed"] for p in points) else 1
