"""The router's request path: pick a replica, forward, retry elsewhere while nothing has reached the client.

Generation requests (/v1/completions, /v1/chat/completions, /v1/responses) are routed by the policy with the request's
prefix hashes; anything else goes to the least loaded replica. Bytes pass through untouched: status,
body and SSE events are the replica's own. A request is retried on another replica when its replica
fails before answering (connection refused or reset, 503 overloaded/engine dead/draining) and, for streams,
before the first chunk arrived; a stream cut later ends with an in-band error event and `[DONE]`, as a
replica reports its own mid-stream failures. With replica groups (--group) each request first draws a group
by weight among those with a healthy replica, then the policy picks within it.
"""
from __future__ import annotations

import hashlib
import json
import logging
import random
import time
from typing import AsyncIterator, Optional

import httpx
from starlette.responses import Response, StreamingResponse

from tokenmill.config import RouterConfig
from tokenmill.http.errors import APIError
from tokenmill.multimodal.chat import IMAGE_PART_TYPES
from tokenmill.router.index import PrefixIndex, prefix_hashes
from tokenmill.router.metrics import RouterMetrics
from tokenmill.router.policies import Candidate, make_policy
from tokenmill.router.pool import Replica, ReplicaPool

logger = logging.getLogger("tokenmill")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the HTTP layer recomputes are not forwarded.
_HOP_HEADERS = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailer",
                "transfer-encoding", "upgrade", "host", "content-length", "date", "server"}
_SSE_DONE = b"data: [DONE]\n\n"


def forwardable(headers) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_HEADERS}


def _with_router_timing(headers: dict[str, str], arrived: Optional[float], sent: float) -> dict[str, str]:
    """A replica that times its requests (--enable-request-timing: a Server-Timing header) gets the router's
    share added: arrival here to the request leaving for the replica that answered (routing, failed tries)."""
    key = next((k for k in headers if k.lower() == "server-timing"), None)
    if key is not None and arrived is not None:
        headers[key] += f", router;dur={round(1000 * (sent - arrived), 3)}"
    return headers


IMAGE_PARTS = IMAGE_PART_TYPES + ("input_image",)  # chat's, and the Responses API's


def _image_digests(items: list) -> list:
    """Messages (or Responses input items) with each image part replaced by its digest: an image then
    takes one short piece of the routing text, whatever its size (a data: URI may be megabytes), and the same
    image sent again still gives the same text, as the replica's prefix cache (keyed by image content) sees it."""
    out = []
    for item in items:
        content = item.get("content") if isinstance(item, dict) else None
        if isinstance(content, list):
            parts = [{"image": hashlib.sha256(json.dumps(p, sort_keys=True).encode()).hexdigest()[:32]}
                     if isinstance(p, dict) and p.get("type") in IMAGE_PARTS else p for p in content]
            item = {**item, "content": parts}
        out.append(item)
    return out


def routing_text(body: dict) -> str:
    """The part of a generation request that becomes its prompt prefix: the messages (as canonical JSON,
    which keeps shared leading messages a shared leading string), a Responses request's instructions and input
    (in that order, as its prompt has them), or the (first) prompt; images by digest."""
    if isinstance(body.get("messages"), list):
        return json.dumps(_image_digests(body["messages"]), sort_keys=True, ensure_ascii=False)
    if "input" in body:
        items = body["input"]
        text = items if isinstance(items, str) else json.dumps(
            _image_digests(items) if isinstance(items, list) else items, sort_keys=True, ensure_ascii=False)
        instructions = body.get("instructions")
        return f"{instructions}\n{text}" if isinstance(instructions, str) and instructions else text
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch: its prompts land on one replica; route by the first
    return prompt if isinstance(prompt, str) else " ".join(map(str, prompt))


class Router:
    def __init__(self, config: RouterConfig, client: Optional[httpx.AsyncClient] = None,
                 groups: Optional[dict[str, str]] = None, weights: Optional[dict[str, float]] = None) -> None:
        """groups: replica url -> its group name; weights: group -> share of requests (see fleet/groups.py)."""
        self.config = config
        self.client = client or httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=None, write=60.0, pool=None),  # generations may run long
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.policy = make_policy(config.policy, config.load_weight)
        self.index = PrefixIndex()
        self.pool = ReplicaPool(config.replicas, self.client, config.health_check_interval,
                                config.health_check_timeout, on_update=self._on_replica_update, groups=groups)
        self.weights = weights or {}
        self.rng = random.Random()
        self.metrics = RouterMetrics([r.url for r in self.pool.replicas], self.policy.name)
        self.chars_per_token = 4.0  # learned from replies: turns a replica's KV tokens into prefix chunks

    # -- choosing ---------------------------------------------------------------------------------
    def choose(self, candidates: list[Replica], hashes: list[int]) -> tuple[Replica, int]:
        """The policy's pick and how many of the request's prefix chunks it is estimated to hold."""
        options = []
        for r in candidates:
            prefixes = self.index.of(r.url)
            matched = prefixes.matched(hashes)
            options.append(Candidate(r, r.load, matched / len(hashes) if hashes else 0.0, prefixes.fullness))
        pick = self.policy.choose(options)
        return pick.replica, round(pick.cached_fraction * len(hashes))

    def pick_group(self, candidates: list[Replica]) -> list[Replica]:
        """The candidates of one group, drawn by weight among the groups that have candidates (all of them
        while no weights are set)."""
        present = sorted({r.group for r in candidates})
        if len(present) < 2 or not self.weights:
            return candidates
        weights = [self.weights.get(g, 0.0) for g in present]
        if sum(weights) <= 0:  # only unweighted leftovers are up
            weights = [1.0] * len(present)
        group = self.rng.choices(present, weights)[0]
        return [r for r in candidates if r.group == group]

    def add_replica(self, url: str, group: str = "default", healthy: bool = False) -> Replica:
        self.metrics.add_replica(url.rstrip("/"))
        return self.pool.add(url, group, healthy)

    def remove_replica(self, replica: Replica) -> None:
        self.pool.remove(replica)
        self.index.forget(replica.url)
        self.metrics.forget_replica(replica.url)

    def _on_replica_update(self, replica: Replica, was_healthy: bool) -> None:
        if replica not in self.pool.replicas:
            return  # a probe that was under way when it left
        if was_healthy and not replica.healthy:
            self.index.forget(replica.url)  # if it comes back, it comes back with an empty cache
        tokens = replica.kv_capacity_tokens
        chunks = None if tokens is None else int(tokens * self.chars_per_token / self.config.prefix_chunk_chars)
        self.index.of(replica.url).set_capacity(chunks)
        self.metrics.on_replica(replica.url, replica.healthy, replica.load, replica.in_flight)

    def _learn_usage(self, replica: Replica, text: str, content: bytes) -> None:
        try:
            usage = json.loads(content).get("usage") or {}  # chat/completions' names, else the Responses API's
            prompt = int(usage.get("prompt_tokens") or usage.get("input_tokens") or 0)
            details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details") or {}
            cached = int(details.get("cached_tokens") or 0)
        except (ValueError, AttributeError, TypeError):
            return
        self.metrics.on_usage(replica.url, prompt, cached)
        if prompt > 0 and text:
            self.chars_per_token = 0.9 * self.chars_per_token + 0.1 * (len(text) / prompt)

    def routing_key(self, request: dict) -> tuple[str, list[int]]:
        """The request's routing text and its prefix-chunk hashes."""
        text = routing_text(request) if request else ""
        salt, model = request.get("cache_salt"), request.get("model")
        return text, prefix_hashes(text, self.config.prefix_chunk_chars, salt if isinstance(salt, str) else None,
                                   model if isinstance(model, str) else None)

    def ready(self) -> bool:
        """/health answers 200: some replica can take requests."""
        return bool(self.pool.healthy())

    # -- forwarding -------------------------------------------------------------------------------
    async def forward(self, method: str, path: str, query: str, body: bytes, headers) -> Response:
        arrived = time.perf_counter()
        generation = method == "POST" and path in GENERATION_PATHS
        try:
            request = json.loads(body) if generation else {}
        except ValueError:
            request = {}  # the replica answers with its own 400
        if not isinstance(request, dict):
            request = {}
        stream = request.get("stream") is True
        text, hashes = self.routing_key(request)
        url_tail = path + (f"?{query}" if query else "")
        headers = forwardable(headers)
        tried: list[Replica] = []
        last_error = ""
        while True:
            healthy = self.pool.healthy(exclude=tried)
            if not healthy:
                self.metrics.unrouted.inc()
                raise self.unavailable(tried, last_error)
            candidates = self.pick_group(healthy)
            if generation:
                replica, cached = self.choose(candidates, hashes)
                self.metrics.on_routed(replica.url, len(hashes), cached)
                self.index.insert(replica.url, hashes)  # now, so concurrent requests sharing it follow
            else:
                replica = min(candidates, key=lambda r: r.load)
            response = await self._attempt(replica, method, url_tail, body, headers, stream, text,
                                           may_retry=len(healthy) > 1, arrived=arrived)
            if response is not None:
                return response
            tried.append(replica)
            last_error = replica.last_error or "it failed before answering"
            self.metrics.retries.labels(replica.url).inc()

    async def _attempt(self, replica: Replica, method: str, url_tail: str, body: bytes, headers: dict,
                       stream: bool, text: str, may_retry: bool,
                       read_timeout: Optional[float] = None, arrived: Optional[float] = None) -> Optional[Response]:
        """The replica's response, or None when the request should go elsewhere. read_timeout bounds the
        wait for each read (none by default: generations may run long). arrived: when the router got the
        request (perf_counter), for the router's entry in a replica's Server-Timing header."""
        replica.in_flight += 1
        started = time.monotonic()
        generation = url_tail.split("?", 1)[0] in GENERATION_PATHS
        upstream: Optional[httpx.Response] = None
        relayed = False
        sent = time.perf_counter()
        try:
            upstream = await self.client.send(
                self.client.build_request(method, replica.url + url_tail, content=body, headers=headers,
                                          timeout=self._timeout(read_timeout)),
                stream=True)
            if upstream.status_code == 503 and may_retry:  # overloaded or its engine died: others may not be
                replica.last_error = f"answered 503: {(await upstream.aread())[:200]!r}"
                return None
            if stream and upstream.status_code == 200:
                chunks = upstream.aiter_raw()  # raw: the client gets the replica's bytes as they were sent
                first = await anext(chunks, b"")
                if not first:
                    raise httpx.RemoteProtocolError("the stream ended before its first event")
                relayed = True
                first_byte = time.monotonic() - started
                return StreamingResponse(self._relay(replica, upstream, first, chunks,
                                                     lambda failed: self.metrics.on_response(
                                                         replica.group, first_byte, time.monotonic() - started,
                                                         failed, generation)),
                                         status_code=200,
                                         headers=_with_router_timing(forwardable(upstream.headers), arrived, sent))
            content = await upstream.aread()  # decoded, hence no content-encoding in the headers below
            elapsed = time.monotonic() - started
            self.metrics.on_response(replica.group, elapsed, elapsed, upstream.status_code >= 500, generation)
            if upstream.status_code == 200:
                self._learn_usage(replica, text, content)
            headers = {k: v for k, v in forwardable(upstream.headers).items() if k.lower() != "content-encoding"}
            return Response(content, status_code=upstream.status_code,
                            headers=_with_router_timing(headers, arrived, sent))
        except httpx.TransportError as e:
            replica.last_error = f"{type(e).__name__}: {e}"
            self.pool.report_failure(replica, e)
            return None
        except Exception as e:  # noqa: BLE001 - see below
            if upstream is not None:
                raise
            # The client failed before the replica answered: a pooled connection to a replica that just died
            # can make httpcore/anyio raise AttributeError ('NoneType' ... 'getpeername') instead of a
            # transport error. Nothing reached the client, so the request goes elsewhere like any failed send.
            replica.last_error = f"{type(e).__name__}: {e}"
            self.pool.report_failure(replica, e)
            return None
        finally:
            if not relayed:
                replica.in_flight -= 1
                if upstream is not None:
                    await upstream.aclose()

    async def _relay(self, replica: Replica, upstream: httpx.Response, first: bytes,
                     chunks: AsyncIterator[bytes], on_end) -> AsyncIterator[bytes]:
        """The stream's bytes; on_end(failed) when it is over."""
        last, failed = first, False
        try:
            yield first
            async for chunk in chunks:
                last = chunk
                yield chunk
        except httpx.TransportError as e:
            failed = True
            self.metrics.stream_failures.labels(replica.url).inc()
            self.pool.report_failure(replica, e)
            err = APIError(502, f"The replica serving this stream failed: {type(e).__name__}: {e}",
                           code="replica_failed")
            cut = b"" if last.endswith(b"\n\n") else b"\n\n"  # end an event the replica left half-sent
            yield cut + b"data: " + json.dumps(err.body()).encode() + b"\n\n" + _SSE_DONE
        finally:
            replica.in_flight -= 1  # before awaiting: a cancelled relay must still give its slot back
            on_end(failed)
            await upstream.aclose()

    def _timeout(self, read: Optional[float]) -> httpx.Timeout:
        return self.client.timeout if read is None else httpx.Timeout(connect=5.0, read=read, write=60.0, pool=None)

    def unavailable(self, tried: list[Replica], last_error: str) -> APIError:
        if tried:
            return APIError(502, f"{len(tried)} replica(s) failed before answering; last error: {last_error}",
                            code="replicas_failed")
        down = "; ".join(f"{r.url}: {r.last_error or 'not checked yet'}" for r in self.pool.replicas)
        return APIError(503, f"No replica is available ({down}).", code="no_replica_available",
                        headers={"Retry-After": "1"})

    async def aclose(self) -> None:
        await self.client.aclose()
