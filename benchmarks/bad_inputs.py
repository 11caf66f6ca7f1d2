"""A hostile client's requests against a real `tokenmill serve` (the built-in default model): the bad-input
set of tests/test_hardening.py and tests/test_reliability.py plus issue 29's crafted requests (huge prompt
lists, 20k-100k tools, chat_template_kwargs that try to lift the template sandbox, 100k metadata keys, an
8 MB token-id body, kv_transfer_params aimed at a port, Responses text formats, half-sent bodies, ...).

Measured: each request's status and time (a 5xx, a timeout or a dropped connection is a failure), the API
process's peak RSS over the whole run (/proc/<pid>/status VmHWM; target < 2 GB), and the worst delay they
cause a concurrent short request (a 2-token completion sent every 0.2 s from another thread: its slowest
latency minus its median before the bad set; target < 1 s) and /health. Prints a JSON result and one
summary line.

    python benchmarks/bad_inputs.py [--json out.json]
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
sys.path.insert(0, os.path.join(ROOT, "tests"))
from test_hardening import BAD_COMPLETIONS  # noqa: E402  (the suite's own list, so the two stay one set)

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
BIG_PROMPTS = [f"Prompt {i:04d}: list the first prime numbers, then" for i in range(2048)]  # ~100 KB


def _tools(n: int) -> list:
    return [{"type": "function", "function": {"name": f"t{i}"}} for i in range(n)]


def cases() -> list[tuple[str, str, object]]:
    """(name, path, body): body is a dict (sent as JSON) or str (raw JSON text)."""
    c: list[tuple[str, str, object]] = []
    for extra, param in BAD_COMPLETIONS:
        c.append((f"completions {extra[:40]}", "/v1/completions",
                  '{"prompt": "Hello", "max_tokens": 4, %s' % extra[1:]))
    deep: dict = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    c += [
        ("n 1e6", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "n": 1000000}),
        ("best_of 1000", "/v1/completions", {"prompt": "hi", "max_tokens": 1, "best_of": 1000}),
        ("lone surrogate", "/v1/completions", '{"prompt": "\\ud800 hi"}'),
        ("lone surrogate chat", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
        ("lone surrogate tokenize", "/tokenize", '{"prompt": "\\ud800 hi"}'),
        ("tool_choice required, no tools", "/v1/chat/completions", {**CHAT, "tool_choice": "required"}),
        ("schema $ref file://", "/v1/chat/completions", {**CHAT, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "file:///etc/passwd"}}}}),
        ("65 stop strings", "/v1/completions", {"prompt": "hi", "stop": ["x"] * 65}),
        ("1001-char stop", "/v1/completions", {"prompt": "hi", "stop": ["x" * 1001]}),
        ("1025 logit_bias", "/v1/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}),
        ("schema 41 deep", "/v1/completions", {"prompt": "hi", "guided_json": deep}),
        ("70k regex", "/v1/completions", {"prompt": "hi", "guided_regex": "a" * 70000}),
        ("9 MB prompt (body limit)", "/v1/completions", {"prompt": "word " * 1800000}),
        ("1 MB prompt", "/v1/completions", {"prompt": "word " * 200000}),
        ("1 MB chat message", "/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 200000}]}),
        ("1 MB tokenize", "/tokenize", {"prompt": "word " * 200000}),
        ("detokenize [true]", "/detokenize", {"tokens": [True]}),
        ("prompt [true]", "/v1/completions", {"prompt": [True, 2], "max_tokens": 1}),
        ("repetition_penalty 1e-300", "/v1/completions", {"prompt": "hi", "repetition_penalty": 1e-300}),
        ("seed 2^64", "/v1/completions", '{"prompt": "hi", "seed": 18446744073709551616}'),
        ("metadata 100k keys", "/v1/chat/completions", {**CHAT, "metadata": {f"k{i}": "v" for i in range(100000)}}),
        ("metadata 100k keys responses", "/v1/responses", {"input": "hi", "max_output_tokens": 2,
                                                           "metadata": {f"k{i}": "v" for i in range(100000)}}),
        # issue 29, defect 7
        ("[[1]]*20000 n=128 (100 KB)", "/v1/completions", {"prompt": [[1]] * 20000, "max_tokens": 1, "n": 128}),
        ("1000 prompts n=128 (5 KB)", "/v1/completions", {"prompt": [[1]] * 1000, "max_tokens": 1, "n": 128}),
        ("8 MB of token ids", "/v1/completions", '{"prompt": [[' + ",".join(["1"] * 3_900_000) + ']]}'),
        ("200k extra fields", "/v1/completions", '{"prompt": "hi", "max_tokens": 1, '
         + ",".join(f'"x{i}": 1' for i in range(200000)) + "}"),
        ("JSON nested 100k deep", "/v1/completions", '{"prompt": "hi", "x": ' + "[" * 100000 + "]" * 100000 + "}"),
        # defect 8: tools
        ("20k tools", "/v1/chat/completions", {**CHAT, "tools": _tools(20000), "tool_choice": "required"}),
        ("20k tools tokenize", "/tokenize", {**CHAT, "tools": _tools(20000)}),
        ("100k tools (4 MB)", "/v1/chat/completions", {**CHAT, "tools": _tools(100000)}),
        # defect 9: chat_template_kwargs and the template sandbox
        ("template 2e8 chars + kwargs", "/v1/chat/completions", {
            **CHAT, "chat_template": "{{ 'x' * 200000000 }}", "chat_template_kwargs": {"max_chars": 1e9, "timeout_s": 1e9}}),
        ("template 2e8 chars tokenize", "/tokenize", {
            **CHAT, "chat_template": "{% for i in range(100000000) %}xx{% endfor %}",
            "chat_template_kwargs": {"max_chars": 1e9, "timeout_s": 1e9}}),
        # defect 10: kv_transfer_params
        ("kv_transfer remote_port abc", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "abc",
            "remote_block_ids": [0], "remote_request_id": "x"}}),
        ("kv_transfer remote_port 1", "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 1, "kv_transfer_params": {
            "do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1,
            "remote_block_ids": [0], "remote_request_id": "x"}}),
        # defect 12: Responses text formats
        *[(f"responses text.format {f!r}", "/v1/responses", {"input": "hi", "max_output_tokens": 2,
                                                              "text": {"format": f}, "stream": s})
          for f in ("json", 5, []) for s in (False, True)],
    ]
    return c


def _post(client: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, str):
        return client.post(path, content=body.encode(), headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


class Prober:
    """From its own thread: a 2-token completion every 0.2 s and its latency (and /health's)."""

    def __init__(self, url: str) -> None:
        self.url, self.samples, self.health = url, [], []
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as c:
            while not self.stop.wait(0.2):
                t0 = time.monotonic()
                try:
                    r = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
                    if r.status_code != 200:
                        self.failures.append(f"{r.status_code} {r.text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.samples.append((time.monotonic(), time.monotonic() - t0))
                t0 = time.monotonic()
                c.get("/health")
                self.health.append(time.monotonic() - t0)


def vm_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith(field)).split()[1])


def half_sent_body(port: int) -> tuple[str, float]:
    """A body that stops arriving: the server should answer (408) and close, not hold it."""
    s = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
    s.settimeout(90)
    try:
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        return (data.split(b"\r\n", 1)[0].decode() or "closed"), time.monotonic() - t0
    except socket.timeout:
        return "held open", time.monotonic() - t0
    finally:
        s.close()


def big_allowed_request(url: str, seconds: float) -> str:
    """The largest request the default limits allow (2048 prompts, ~100 KB), streamed for `seconds` and then
    closed (its disconnect aborts the rest)."""
    body = {"prompt": BIG_PROMPTS, "max_tokens": 1, "temperature": 0, "stream": True}
    with httpx.Client(base_url=url, timeout=600) as c, c.stream("POST", "/v1/completions", json=body) as r:
        t0 = time.monotonic()
        for _ in r.iter_lines():
            if time.monotonic() - t0 > seconds:
                break
        return str(r.status_code)


def start_server(port: int, log) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port), "--max-model-len", "1024",
           "--kv-cache-memory-bytes", "256MiB"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                            env=dict(os.environ, PYTHONPATH=ROOT))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"server exited ({proc.returncode}); log: {log.name}")
        time.sleep(0.5)
    raise RuntimeError("server did not start")


def run() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="bad-inputs-server-", suffix=".log", delete=False)
    proc = start_server(port, log)
    try:
        prober = Prober(url)
        prober.thread.start()
        deadline = time.monotonic() + 60  # the first requests may warm up slowly (kernels, caches)
        while len(prober.samples) < 10 and time.monotonic() < deadline:
            time.sleep(0.2)
        baseline = statistics.median(x for _, x in prober.samples)
        rss_start = vm_kib(proc.pid, "VmRSS")
        half = {}
        half_thread = threading.Thread(target=lambda: half.update(zip(("status", "s"), half_sent_body(port))))
        half_thread.start()
        results = []
        with httpx.Client(base_url=url, timeout=300) as c:
            for name, path, body in cases():
                t0 = time.monotonic()
                try:
                    r = _post(c, path, body)
                    status, msg = r.status_code, r.text[:160]
                except httpx.HTTPError as e:
                    status, msg = 0, repr(e)[:160]
                results.append({"name": name, "path": path, "status": status, "s": round(time.monotonic() - t0, 3),
                                "message": msg, "window": (t0, time.monotonic())})
        t0 = time.monotonic()
        big = big_allowed_request(url, 15.0)
        results.append({"name": "2048 prompts, 100 KB (allowed; 15 s streamed, then closed)",
                        "path": "/v1/completions", "status": int(big), "s": round(time.monotonic() - t0, 3),
                        "message": "", "window": (t0, time.monotonic())})
        half_thread.join()
        time.sleep(1.0)
        prober.stop.set()
        prober.thread.join()
        healthy = httpx.get(url + "/health", timeout=10).status_code == 200
        for r in results:  # the slowest probe that finished while this request ran (or within 1 s after it)
            a, b = r.pop("window")
            r["probe_worst_ms"] = round(max((x for t, x in prober.samples if a <= t <= b + 1.0), default=0) * 1000)
        worst = max(x for _, x in prober.samples)
        return {"cases": results, "half_sent_body": half, "api_peak_rss_mib": vm_kib(proc.pid, "VmHWM") / 1024,
                "api_rss_start_mib": rss_start / 1024, "api_rss_end_mib": vm_kib(proc.pid, "VmRSS") / 1024,
                "probe_baseline_ms": baseline * 1000, "probe_worst_ms": worst * 1000,
                "worst_delay_ms": (worst - baseline) * 1000, "health_worst_ms": max(prober.health) * 1000,
                "probe_failures": prober.failures[:10], "healthy_after": healthy, "server_log": log.name,
                "server_errors": [r for r in results if r["status"] >= 500 or r["status"] == 0]}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the result here")
    args = ap.parse_args()
    res = run()
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    bad = res["server_errors"]
    print(f"bad inputs: {len(res['cases'])} requests, {len(bad)} got 5xx/no answer; API peak RSS "
          f"{res['api_peak_rss_mib']:.0f} MiB (target < 2048); worst delay of a concurrent 2-token request "
          f"{res['worst_delay_ms']:.0f} ms (target < 1000), /health worst {res['health_worst_ms']:.0f} ms; "
          f"half-sent body: {res['half_sent_body']}; healthy after: {res['healthy_after']}")


if __name__ == "__main__":
    main()
