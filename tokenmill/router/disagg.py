"""Disaggregated prefill/decode behind the router (`tokenmill router --prefill URL... --decode URL...`).

Each generation request runs in two phases, as vLLM's disaggregated proxy does:
1. prefill: a copy with max_tokens 1, stream false, n 1 and `"kv_transfer_params": {"do_remote_decode": true}`
   goes to a prefill instance chosen by the router's policy (prefix-aware by default); its response carries
   the finished request's `kv_transfer_params` (where its KV blocks wait to be pulled);
2. decode: the original request plus those params goes to the decode instance with the least load (then the
   most free KV), whose response (stream or not) is relayed to the client byte for byte. The params carry the
   prefill instance's sampled token (first_token_id): the decode instance emits it as its first output and
   computes no prompt token (kv_transfer/p2p_scheduler.py says when it does not take it).
A failing prefill instance is retried on another one; with none left, or when a prefill instance answers
without params (no connector there), the decode instance gets the original request and recomputes the
prompt (counted in router_disagg_fallbacks_total). A decode instance failing before its first byte is
retried on another with the same params (its KV pull may then fail: the engine recomputes).
A client's own `kv_transfer_params` are dropped before either phase: they would name the address the decode
instance connects to, and only a prefill instance's answer may (the decode instance also pulls only from the
prefill instances its --kv-transfer-config lists: kv_transfer/p2p_params.py).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Optional

from starlette.responses import Response

from tokenmill.config import RouterConfig
from tokenmill.router.forward import GENERATION_PATHS, Router, forwardable
from tokenmill.router.pool import Replica

logger = logging.getLogger("tokenmill")

# Fields that must not reach the one-token prefill request: they conflict with max_tokens 1 / stream false /
# n 1, or cost work whose result is thrown away.
_NOT_FOR_PREFILL = ("stream_options", "best_of", "min_tokens", "prompt_logprobs", "echo")


def prefill_request(request: dict, path: str) -> dict:
    """The prefill phase's copy of a client request to `path`."""
    body = {k: v for k, v in request.items() if k not in _NOT_FOR_PREFILL}
    body.update(max_tokens=1, stream=False, n=1, kv_transfer_params={"do_remote_decode": True})
    if path.startswith("/v1/chat/"):
        body["max_completion_tokens"] = 1
    elif path.startswith("/v1/responses"):  # its own name for the limit (n and max_tokens are ignored there)
        body["max_output_tokens"] = 1
    return body


def is_batch(request: dict) -> bool:
    """A /v1/completions request with several prompts (its prefill would return one params per prompt)."""
    p = request.get("prompt")
    return isinstance(p, list) and len(p) > 1 and isinstance(p[0], (str, list))


def kv_params_of(content: bytes) -> Optional[dict]:
    try:
        params = json.loads(content).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return None
    return params if isinstance(params, dict) else None


class DisaggRouter(Router):
    def __init__(self, config: RouterConfig, prefill: list[str], decode: list[str],
                 prefill_timeout: float = 300.0, client=None) -> None:
        """config.replicas: the prefill URLs, then the decode URLs."""
        super().__init__(config, client)
        self.prefill_urls = {u.rstrip("/") for u in prefill}
        self.decode_urls = {u.rstrip("/") for u in decode}
        self.prefill_timeout = prefill_timeout
        self.metrics.add_disagg(sorted(self.prefill_urls), sorted(self.decode_urls))
        self._turn = 0

    def _healthy(self, urls: set[str], tried: list[Replica]) -> list[Replica]:
        return [r for r in self.pool.healthy(exclude=tried) if r.url in urls]

    def ready(self) -> bool:
        return bool(self._healthy(self.decode_urls, []))  # without a prefill instance, decode recomputes

    def choose_decode(self, candidates: list[Replica]) -> Replica:
        """Least load, then the most free KV; equals rotate."""
        self._turn += 1
        start = self._turn % len(candidates)
        rotated = candidates[start:] + candidates[:start]
        return min(rotated, key=lambda r: (r.load, -r.free_kv_tokens))

    async def forward(self, method: str, path: str, query: str, body: bytes, headers) -> Response:
        try:
            request = json.loads(body) if method == "POST" and path in GENERATION_PATHS else None
        except ValueError:
            request = None
        if not isinstance(request, dict):  # not a generation (or not JSON: an instance answers the 400)
            return await super().forward(method, path, query, body, headers)
        if "kv_transfer_params" in request:  # the router's to set, never a client's (see the module docstring)
            request = {k: v for k, v in request.items() if k != "kv_transfer_params"}
            body = json.dumps(request).encode()
        url_tail = path + (f"?{query}" if query else "")
        headers = forwardable(headers)
        text, hashes = self.routing_key(request)
        t0 = time.monotonic()
        params, answer = await self._prefill(url_tail, request, headers, text, hashes)
        self.metrics.prefill_seconds.observe(time.monotonic() - t0)
        if answer is not None:
            return answer
        if params is not None:
            body = json.dumps({**request, "kv_transfer_params": params}).encode()
        return await self._decode(url_tail, body, headers, request.get("stream") is True, text)

    async def _prefill(self, url_tail: str, request: dict, headers: dict, text: str,
                       hashes: list[int]) -> tuple[Optional[dict], Optional[Response]]:
        """(the kv_transfer_params for the decode phase or None, or a prefill instance's 4xx to answer with:
        the request itself is at fault, and the decode instance would say the same)."""
        if is_batch(request):
            self.metrics.fallbacks.labels("batch").inc()
            return None, None
        body = json.dumps(prefill_request(request, url_tail)).encode()
        tried: list[Replica] = []
        while candidates := self._healthy(self.prefill_urls, tried):
            replica, cached = self.choose(candidates, hashes)
            self.metrics.on_routed(replica.url, len(hashes), cached)
            self.metrics.role_requests.labels("prefill", replica.url).inc()
            self.index.insert(replica.url, hashes)
            response = await self._attempt(replica, "POST", url_tail, body, headers, False, text, may_retry=True,
                                           read_timeout=self.prefill_timeout)
            if response is not None and response.status_code < 500:
                if response.status_code != 200:
                    return None, response
                params = kv_params_of(response.body)
                if params is None:
                    self.metrics.fallbacks.labels("no_kv_transfer_params").inc()
                return params, None
            tried.append(replica)
            self.metrics.role_retries.labels("prefill").inc()
            self.metrics.retries.labels(replica.url).inc()
            logger.warning("prefill instance %s failed (%s); trying another", replica.url,
                           replica.last_error or f"status {response.status_code}")
        self.metrics.fallbacks.labels("prefill_failed").inc()
        return None, None

    async def _decode(self, url_tail: str, body: bytes, headers: dict, stream: bool, text: str) -> Response:
        tried: list[Replica] = []
        last_error = ""
        while True:
            candidates = self._healthy(self.decode_urls, tried)
            if not candidates:
                self.metrics.unrouted.inc()
                raise self.unavailable(tried, last_error)
            replica = self.choose_decode(candidates)
            self.metrics.role_requests.labels("decode", replica.url).inc()
            response = await self._attempt(replica, "POST", url_tail, body, headers, stream, text,
                                           may_retry=len(candidates) > 1)
            if response is not None:
                return response
            tried.append(replica)
            last_error = replica.last_error or "it failed before answering"
            self.metrics.role_retries.labels("decode").inc()
            self.metrics.retries.labels(replica.url).inc()
