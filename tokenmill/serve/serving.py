"""What both generation endpoints share: admitting prompts to the engine (overload check, validation),
iterating their outputs, usage accounting, SSE framing, and aborting on disconnect."""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Optional

import msgspec
from starlette.responses import Response, StreamingResponse

from tokenmill.engine.async_llm import EngineDeadError, RequestFailedError, RequestRejectedError, next_outputs
from tokenmill.http.errors import APIError, bad_request
from tokenmill.kv_transfer.p2p_params import check_request_params
from tokenmill.lora import LoRARequest
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams
from tokenmill.step.multimodal import ImageInput

if TYPE_CHECKING:
    from tokenmill.serve.api_server import ServerState

logger = logging.getLogger("tokenmill")
_json = msgspec.json.Encoder()


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


def json_response(body: dict, status: int = 200) -> Response:
    return Response(_json.encode(body), status_code=status, media_type="application/json")


def sse(body: dict) -> bytes:
    return b"data: " + _json.encode(body) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def engine_error(e: Exception) -> APIError:
    if isinstance(e, RequestRejectedError):
        return bad_request(str(e))
    if isinstance(e, EngineDeadError):  # restarting (or shutting down): a client may retry
        return APIError(503, f"The engine is not available: {e}", code="engine_unavailable",
                        headers={"Retry-After": "5"})
    if isinstance(e, RequestFailedError):
        return APIError(500, str(e), code="request_failed")
    return APIError(500, f"Internal error: {type(e).__name__}: {e}")


@dataclass
class Prompt:
    text: Optional[str]
    token_ids: list[int]
    mm_inputs: list[ImageInput] = field(default_factory=list)  # its images, placeholders widened (serve/images.py)


# No tokenizer packs more characters than this into a token on average, so a longer text cannot fit the
# context: it is refused before tokenizing (megabytes of text cost seconds of tokenizer CPU).
MAX_CHARS_PER_TOKEN = 64


def check_text_length(state: "ServerState", text: str, param: str = "prompt") -> None:
    limit = state.config.model.max_model_len * MAX_CHARS_PER_TOKEN
    if len(text) > limit:
        raise bad_request(f"the {param} has {len(text)} characters; a model with a context of "
                          f"{state.config.model.max_model_len} tokens accepts at most {limit}", param)


async def off_loop(fn, *args, **kwargs):
    """Run tokenization, template rendering and other heavy per-request work in a worker thread, so one large
    request never stalls the event loop that serves every other stream (tokenizers release the GIL)."""
    return await asyncio.to_thread(fn, *args, **kwargs)


# Request fields that may ask for grammar-constrained output (structured output, tool_choice, Responses' format)
GRAMMAR_FIELDS = frozenset({"response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                            "tools", "text"})
_grammar_support_loaded = False


def _import_grammar_support() -> None:
    global _grammar_support_loaded
    try:
        import xgrammar  # noqa: F401
    except ImportError:
        pass  # structured.validate says how to install it, where it is needed
    _grammar_support_loaded = True


async def load_grammar_support(req: Any) -> None:
    """Structured output validates grammars with xgrammar, which imports torch: seconds of imports the API
    process skipped to start fast (models/resolution_cache.py). The first request that may need it imports
    it in a worker thread, so the streams already running keep going; later ones skip this."""
    if not _grammar_support_loaded and GRAMMAR_FIELDS & req.model_fields_set:
        await off_loop(_import_grammar_support)


async def tokenize_text(state: "ServerState", text: str, add_special_tokens: bool = True,
                        param: str = "prompt") -> list[int]:
    check_text_length(state, text, param)
    return await off_loop(lambda: state.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)


# Prompt tokens of one request that may wait unstarted in the engine. A later request waits behind at most
# this much of its prefill and shares each of its steps with about as much. On a busy 2-core CPU (load 4-6),
# a 2-token request beside a 2048-prompt one took at most 1.1-1.4 s with 128 and 0.3-0.6 s with 64. The cost:
# such a request, alone, prefills in smaller steps: 430-453 one-token completions in 12 s against 456-641
# unwindowed (128: 469-485) on a quiet one. Single-prompt requests (and n > 1 samples of one prompt, sent
# together) are not windowed, and separate requests never are. One prompt longer than this still goes, alone.
WINDOW_TOKENS = 64


@dataclass
class Admission:
    """Sequences admitted but still held in the API process: a Generation feeds a large request to the engine
    a window at a time. One per server (ServerState.admission)."""
    held: int = 0


def num_waiting(state: "ServerState") -> int:
    """Sequences (engine requests) waiting for their first step: the larger of the API's count of those sent
    and not yet scheduled (AsyncLLM.num_waiting; the engine's stats lag while it drains a large input or runs
    a long step: they said 0 with 2000 waiting) and the engine's own (which also counts preempted ones), plus
    those the API process still holds back. What --max-waiting-requests, /metrics and /health count."""
    engine = state.engine
    stats = engine.stats
    return max(engine.num_waiting, stats.num_waiting if stats is not None else 0) + state.admission.held


def check_admission(state: "ServerState", num_sequences: int) -> None:
    """--max-waiting-requests counts sequences (prompts x n): one request carrying 2000 of them was admitted
    under a limit of 3. A request larger than the limit could never be admitted: 400, not 503."""
    limit = state.args.max_waiting_requests
    if limit is None:
        return
    if num_sequences > limit:
        raise bad_request(f"this request carries {num_sequences} sequences (prompts x n); this server queues at "
                          f"most {limit} (--max-waiting-requests): send fewer prompts or a smaller n", "n")
    waiting = num_waiting(state)
    if waiting + num_sequences > limit:
        raise APIError(503, f"The server is overloaded: {waiting} sequences are waiting and this request adds "
                            f"{num_sequences} (--max-waiting-requests {limit}); retry later.", code="overloaded",
                       headers={"Retry-After": "1"})


class Generation:
    """One HTTP request's prompts in the engine (one engine request per prompt per sample), sharing one
    output queue. Iterate it for (prompt index, RequestOutput delta); close() aborts what is unfinished.

    Every prompt is validated at once (a bad one is a 400 before anything streams), but prompts go to the
    engine a window at a time: at most --max-num-seqs of this request's sequences and WINDOW_TOKENS of their
    prompt tokens wait unstarted there, and more are sent as those start. The engine schedules in arrival
    order, so a request of 2048 prompts now queues in front of a later request by one window, not by all of
    its prompts (1000 prompts x n=128 once made a 4-token request wait 398 s); running samples still fill
    the batch."""

    def __init__(self, state: "ServerState", base_id: str, prompts: list[Prompt], params: SamplingParams,
                 cache_salt: Optional[str] = None, kv_transfer_params: Optional[dict] = None,
                 priority: int = 0, lora_request: Optional[LoRARequest] = None) -> None:
        engine = state.engine
        try:
            engine.check_alive()
        except EngineDeadError as e:
            raise engine_error(e) from None
        try:  # a KV pull from a peer the operator did not list: refused before the engine could connect
            check_request_params(kv_transfer_params, state.config.kv_transfer)
        except ValueError as e:
            raise bad_request(str(e), "kv_transfer_params") from None
        check_admission(state, len(prompts) * params.n)
        self.engine = engine
        self.queue: asyncio.Queue = asyncio.Queue()
        self.prompts = prompts
        self.params = params
        self.ids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        self.index = {rid: i for i, rid in enumerate(self.ids)}
        self.open: set[str] = set()
        self.cached_tokens = [0] * len(prompts)
        self.num_generated = 0
        self.kv_transfer_params: Optional[dict] = None  # what a finished engine request returned
        self.timing_enabled = bool(getattr(state.args, "enable_request_timing", False))
        self.timings: list[dict[str, float]] = []  # of finished prompts (RequestTimes.timing)
        self._request_kw = {"cache_salt": cache_salt, "kv_transfer_params": kv_transfer_params,
                            "priority": priority, "lora_request": lora_request}
        self._pending = deque(range(len(prompts)))  # prompts not yet sent to the engine
        self._unstarted: dict[str, int] = {}        # sent, no output yet: engine id -> prompt tokens x n
        self._window = max(1, state.config.scheduler.max_num_seqs)
        self._admission = state.admission
        self._admission.held += len(prompts) * params.n
        try:
            for p in prompts:
                engine.validate(p.token_ids, params, priority)
            self._feed()
        except ValueError as e:
            self.close()
            msg = str(e)
            param = next((p for p in ("max_tokens", "logit_bias", "stop_token_ids", "priority") if p in msg), "prompt")
            raise bad_request(msg, param) from None
        except EngineDeadError as e:
            self.close()
            raise engine_error(e) from None

    def _feed(self) -> None:
        """Send prompts while the window has room (one prompt always goes when none waits unstarted)."""
        n = self.params.n
        while self._pending:
            i = self._pending[0]
            tokens = len(self.prompts[i].token_ids) * n
            if self._unstarted and (len(self._unstarted) * n + n > self._window
                                    or sum(self._unstarted.values()) + tokens > WINDOW_TOKENS):
                return
            self._pending.popleft()
            self._admission.held -= n
            rid = self.ids[i]
            self.engine.add_request(rid, self.prompts[i].text, self.prompts[i].token_ids, self.params,
                                    queue=self.queue, mm_inputs=self.prompts[i].mm_inputs, **self._request_kw)
            self.open.add(rid)
            self._unstarted[rid] = tokens

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        while self.open:
            try:
                outs = await next_outputs(self.queue)
            except (EngineDeadError, RequestRejectedError, RequestFailedError) as e:
                self.close()
                raise engine_error(e) from None
            for ro in outs:
                i = self.index[ro.request_id]
                self._unstarted.pop(ro.request_id, None)
                self.cached_tokens[i] = ro.num_cached_tokens
                self.num_generated += sum(len(c.token_ids) for c in ro.outputs)
                if ro.kv_transfer_params is not None:
                    self.kv_transfer_params = ro.kv_transfer_params
                if ro.finished:
                    self.open.discard(ro.request_id)
                    if "timing" in ro.metrics:
                        self.timings.append(ro.metrics["timing"])
                yield i, ro
            if self._pending:
                self._feed_more()

    def _feed_more(self) -> None:
        try:
            self._feed()
        except (ValueError, EngineDeadError) as e:  # validated already: only an engine that died gets here
            self.close()
            raise engine_error(e) from None

    def close(self) -> None:
        self._admission.held -= len(self._pending) * self.params.n
        self._pending.clear()
        for rid in list(self.open):
            self.engine.abort(rid)
        self.open.clear()

    def timing_ms(self) -> dict[str, float]:
        """The request ledger in milliseconds: each part's longest value over the request's prompts."""
        keys = ("queue", "prefill", "decode", "detokenize", "total")
        return {k: round(1000 * max((t[k] for t in self.timings), default=0.0), 3) for k in keys}

    def usage(self) -> dict:
        prompt = sum(len(p.token_ids) for p in self.prompts)
        return {"prompt_tokens": prompt, "total_tokens": prompt + self.num_generated,
                "completion_tokens": self.num_generated,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}


def with_kv_transfer_params(body: dict, gen: Generation) -> dict:
    """A response (or a stream's finishing chunk) carries the finished request's kv_transfer_params as a
    top-level field when the engine returned some, as vLLM's do."""
    if gen.kv_transfer_params is not None:
        body["kv_transfer_params"] = gen.kv_transfer_params
    return body


TIMING_HEADER = "server-timing"  # the W3C Server-Timing format: `queue;dur=1.2, prefill;dur=30.5` (ms)


def server_timing(timing_ms: dict[str, float]) -> str:
    return ", ".join(f"{k};dur={v}" for k, v in timing_ms.items())


def with_timing_header(response: Response, gen: Generation) -> Response:
    """--enable-request-timing: a finished (non-streamed) response carries the request ledger in a header."""
    if gen.timing_enabled and response.status_code == 200:
        response.headers[TIMING_HEADER] = server_timing(gen.timing_ms())
    return response


def _with_timing_field(chunk: bytes, gen: Generation) -> bytes:
    """An SSE chunk with the request ledger added as a top-level `timing` field (milliseconds); a named
    event's `event:` line (/v1/responses) is kept."""
    head, sep, data = chunk.partition(b"data: ")
    if not sep:
        return chunk
    body = msgspec.json.decode(data)
    body["timing"] = {f"{k}_ms": v for k, v in gen.timing_ms().items()}
    return head + sse(body)


async def _timed_chunks(chunks: AsyncIterator[bytes], gen: Generation) -> AsyncIterator[bytes]:
    """--enable-request-timing: the last chunk before [DONE] carries the request ledger. Chunks pass through
    at once until the generation has finished; only then is each one held back until the next shows
    whether it was the last."""
    held: Optional[bytes] = None
    async for chunk in chunks:
        if chunk == SSE_DONE and held is not None:
            held = _with_timing_field(held, gen)
        if held is not None:
            yield held
            held = None
        if gen.open or chunk == SSE_DONE:
            yield chunk
        else:
            held = chunk
    if held is not None:  # a stream without [DONE] (/v1/responses): its last event carries it
        yield _with_timing_field(held, gen)


def stream_response(chunks: AsyncIterator[bytes], gen: Generation) -> StreamingResponse:
    """SSE response. The generator's finally (client gone, server shutting down) aborts what is open."""
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    if gen.timing_enabled:  # the timing is known only at the end; the header says where it will be
        chunks = _timed_chunks(chunks, gen)
        headers[TIMING_HEADER] = 'stream;desc="in the timing field of the last chunk"'

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        except APIError as e:  # headers are gone: report in-band, as OpenAI and vLLM do
            yield sse(e.body())
            yield SSE_DONE
        finally:
            gen.close()

    return StreamingResponse(body(), media_type="text/event-stream", headers=headers)
