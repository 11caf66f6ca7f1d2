"""`tokenmill serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn).

The API process does HTTP, chat templates, tokenization and detokenization; the engine core runs in its
own process behind AsyncLLM. Endpoints: /v1/models, /v1/completions, /v1/chat/completions, /v1/responses
(serve/responses.py, a translation over the chat path), /v1/embeddings (with --task embed, which serves it
instead of the generation endpoints), /tokenize, /detokenize, /health, /version, /metrics, /dashboard.
SIGTERM stops accepting connections, lets in-flight requests
finish for up to --shutdown-timeout seconds (then aborts them), stops the engine and exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import secrets
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn, Optional

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from starlette.requests import Request
from starlette.responses import Response

import tokenmill
from tokenmill.serve.admin import ADMIN_KEY_HELP, DrainMiddleware, DrainState, check_admin
from tokenmill.serve.cors import add_cors, add_cors_args, cors_config
from tokenmill.serve.errors import APIError, bad_request, install_error_handlers
from tokenmill.serve.serving import Admission, load_grammar_support, num_waiting
from tokenmill.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     EmbeddingRequest, RequestLimits, ResponsesRequest, TokenizeRequest)
from tokenmill.startup import Ledger

logger = logging.getLogger("tokenmill")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on")
    g.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize and /detokenize (default: $TOKENMILL_API_KEY)")
    g.add_argument("--admin-key", default=os.environ.get("TOKENMILL_ADMIN_KEY"), help=ADMIN_KEY_HELP)
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 + Retry-After while this many sequences (prompts x n of each request) wait for "
                        "the engine; a request carrying more than this gets 400 (default: no limit)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish before aborting them")
    g.add_argument("--chat-template", default=None,
                   help="Jinja chat template overriding the tokenizer's: a file path, the template itself, or a "
                        "shipped one by name (hermes_tools: ChatML with tool calls, for --tool-call-parser hermes)")
    from tokenmill.serve.tool_parsers import TOOL_PARSERS

    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="serve tool_choice 'auto' (OpenAI's default with tools): the model decides whether to call "
                        "tools, and its output is read with --tool-call-parser")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how the model writes tool calls (hermes: Qwen/Hermes <tool_call>; llama3_json; mistral "
                        "[TOOL_CALLS]); 'required' and named tool_choice need no parser")
    g.add_argument("--enable-request-timing", action="store_true",
                   help="each generation response carries its server-side timing in milliseconds (queue, prefill, "
                        "decode, detokenize, total): a Server-Timing header, and for streams a `timing` field on "
                        "the last chunk before [DONE]; `tokenmill router` adds its own time to the header")
    g.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own logging ('info' logs every request)")
    g.add_argument("--engine-start-timeout", type=float, default=900.0,
                   help="seconds to wait for the engine process to load the model")
    g.add_argument("--no-dashboard", action="store_true",
                   help="do not serve the live dashboard at /dashboard (nor record per-step stats for it)")
    g.add_argument("--install-default-model", action="store_true",
                   help="pip-install the built-in default model if it is missing")
    add_cors_args(p)
    lim, d = p.add_argument_group("request limits (each one exceeded is a 400 naming it)"), RequestLimits()
    lim.add_argument("--max-n", type=int, default=d.max_n,
                     help="largest n (and best_of) of one request; never more than --max-num-seqs")
    lim.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                     help="most prompts in one /v1/completions request (a list of strings or of token-id lists)")
    lim.add_argument("--max-sequences-per-request", type=int, default=d.max_sequences_per_request,
                     help="most sequences (prompts x n) in one request; each is an engine request")
    add_body_args(lim)
    lim.add_argument("--max-stop-strings", type=int, default=d.max_stop_strings,
                     help="most stop strings (and stop_token_ids) one request may list")
    lim.add_argument("--max-stop-string-length", type=int, default=d.max_stop_string_length,
                     help="longest stop string, in characters")
    lim.add_argument("--max-logit-bias", type=int, default=d.max_logit_bias, help="most logit_bias entries")
    lim.add_argument("--max-json-schema-bytes", type=int, default=d.max_json_schema_bytes,
                     help="largest JSON schema, regex or grammar for structured output")
    lim.add_argument("--max-json-schema-depth", type=int, default=d.max_json_schema_depth,
                     help="deepest nesting of a JSON schema for structured output (and of each tool's parameters)")
    lim.add_argument("--max-tools", type=int, default=d.max_tools,
                     help="most tools one chat request may list (OpenAI's bound)")
    lim.add_argument("--max-tools-schema-bytes", type=int, default=d.max_tools_schema_bytes,
                     help="largest total size of one request's tools as JSON (names, descriptions, parameter "
                          "schemas)")
    lim.add_argument("--max-chat-template-chars", type=int, default=d.max_chat_template_chars,
                     help="most characters one chat template render may output, or build in one string or list "
                          "(the sandbox also caps everything it builds at 8x this)")
    lim.add_argument("--chat-template-timeout", type=float, default=d.chat_template_timeout,
                     help="seconds one chat template render may take")


def add_body_args(group) -> None:
    """Request-body flags of `tokenmill serve` and `tokenmill router` (BodyLimitMiddleware)."""
    group.add_argument("--max-request-body-bytes", type=int, default=8 << 20,
                       help="largest request body; larger ones get 413")
    group.add_argument("--request-body-timeout", type=float, default=20.0,
                       help="seconds to wait for the next part of a request body; a client that stalls longer "
                            "gets 408 and its connection is closed (a slow upload that keeps sending is fine)")


def request_limits(args: argparse.Namespace) -> RequestLimits:
    return RequestLimits(max_n=min(args.max_n, args.max_num_seqs), max_stop_strings=args.max_stop_strings,
                         max_stop_string_length=args.max_stop_string_length, max_logit_bias=args.max_logit_bias,
                         max_json_schema_bytes=args.max_json_schema_bytes,
                         max_json_schema_depth=args.max_json_schema_depth, max_tools=args.max_tools,
                         max_tools_schema_bytes=args.max_tools_schema_bytes,
                         max_prompts_per_request=args.max_prompts_per_request,
                         max_sequences_per_request=args.max_sequences_per_request,
                         max_chat_template_chars=args.max_chat_template_chars,
                         chat_template_timeout=args.chat_template_timeout)


@dataclass
class ServerState:
    args: argparse.Namespace
    config: Any
    engine: Any                     # AsyncLLM
    tokenizer: Any
    metrics: Any                    # ServerMetrics
    model_name: str
    chat_template: Optional[str] = None
    limits: RequestLimits = field(default_factory=RequestLimits)
    tool_parser: Optional[str] = None  # --tool-call-parser when --enable-auto-tool-choice: tool_choice 'auto'
    ledger: Ledger = field(default_factory=Ledger)  # this server's start (/health?detail=1, /metrics)
    created: int = field(default_factory=lambda: int(time.time()))
    dashboard: Any = None           # serve.dashboard.DashboardStats, None with --no-dashboard
    drain: DrainState = field(default_factory=DrainState)  # POST /admin/drain
    admission: Admission = field(default_factory=Admission)  # sequences admitted, not yet sent to the engine

    def check_model(self, name: Optional[str]) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def check_task(self, task: str) -> None:
        """An embedding server (--task embed) does not generate and a generating one does not embed."""
        if self.config.model.task == task:
            return
        if task == "embed":
            raise bad_request(f"The model `{self.model_name}` is served with --task generate: /v1/embeddings is "
                              "not available; start the server with --task embed to embed with it", "model")
        raise bad_request(f"The model `{self.model_name}` is served with --task embed: it does not generate text; "
                          "use /v1/embeddings", "model")


# -- middleware and error handlers -----------------------------------------------------------------
# what --api-key guards: everything that touches the model, and the dashboard's data (its pages hold none)
PROTECTED = ("/v1", "/tokenize", "/detokenize", "/dashboard/api")


class APIKeyMiddleware:
    """Plain ASGI (no per-request task like BaseHTTPMiddleware, so streaming stays cheap)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROTECTED) and scope["method"] != "OPTIONS":
            auth = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(auth, self.expected):
                err = APIError(401, "Incorrect or missing API key; send 'Authorization: Bearer <key>'.",
                               code="invalid_api_key")
                await err.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """413 for a request body over --max-request-body-bytes, by its Content-Length or, for a chunked body, as
    soon as the bytes received pass the limit: the body is read here (never more than the limit) and handed
    on whole. 408, and the connection closed, when no part of the body arrives for --request-body-timeout
    seconds: a client that sends half a body and stalls would otherwise hold its connection (and this
    coroutine) for as long as it likes. A slow upload that keeps sending is never cut."""

    def __init__(self, app, limit: int, timeout: float = 20.0) -> None:
        self.app = app
        self.limit = limit
        self.timeout = timeout

    def _too_large(self) -> Response:
        return APIError(413, f"The request body is larger than this server's limit of {self.limit} bytes "
                             "(--max-request-body-bytes).", code="request_too_large").response()

    def _timed_out(self, received: int) -> Response:
        # Connection: close, as the rest of the body may still come and cannot be told from a next request
        return APIError(408, f"The request body stopped arriving: nothing for {self.timeout:g} s after {received} "
                             "bytes (--request-body-timeout).", code="request_timeout",
                        headers={"Connection": "close"}).response()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.limit:
            await self._too_large()(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), self.timeout)
            except asyncio.TimeoutError:
                logger.debug("%s %s: no body bytes for %g s after %d; answered 408", scope["method"],
                             scope["path"], self.timeout, size)
                await self._timed_out(size)(scope, receive, send)
                return
            if message["type"] != "http.request":  # client gone
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._too_large()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: only the disconnect notice

        await self.app(scope, replay, send)


def _validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        e = next(e for e in errors if e.get("type") == "json_invalid")
        return bad_request(f"The request body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}")
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # Union members add their type name to the location; keep the field path.
        loc = [x for x in loc if not x.startswith(("list[", "str", "int", "dict[", "function-"))]
        where = ".".join(loc)
        param = param or where or None
        msg = str(e.get("msg")).removeprefix("Value error, ")  # pydantic's prefix for a validator's ValueError
        parts.append(f"{where}: {msg}" if where else msg)
    return bad_request("; ".join(parts) or "invalid request", param)


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        ledger = state.ledger
        ledger.mark_since_last("server setup")  # app and uvicorn set-up (while the engine loads)
        await state.engine.start(timeout=state.args.engine_start_timeout)
        ready = state.engine.ready
        ledger.extend(ready.startup)
        with ledger.phase("serving start"):
            state.metrics.set_cache_config(ready.block_size, ready.num_blocks,
                                           state.config.cache.enable_prefix_caching)
            import anyio._backends._asyncio  # noqa: F401 - StreamingResponse's first use would import it mid-request
        state.metrics.set_startup(ledger.finish())
        logger.info("serving %s on http://%s:%d", state.model_name, state.args.host, state.args.port)
        try:
            yield
        finally:
            await state.engine.shutdown()

    app = FastAPI(title="tokenmill", version=tokenmill.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None)
    app.state.tokenmill = state

    install_error_handlers(app, "server")

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc).response()

    @app.get("/health")
    async def health(detail: bool = False) -> Response:
        """200 with an empty body (what load balancers poll); ?detail=1 adds a JSON body with the start-up
        ledger (startup.py)."""
        engine = state.engine
        if engine.dead is not None:
            return APIError(503, f"The engine is not available: {engine.dead}; it is being restarted",
                            code="engine_unavailable", headers={"Retry-After": "5"}).response()
        if state.drain.draining:
            return state.drain.refusal().response()
        if detail:
            from tokenmill.serve.serving import json_response

            return json_response({"status": "ok", "engine_restarts": engine.num_restarts,
                                  "num_requests_waiting": num_waiting(state), "startup": state.ledger.as_dict()})
        return Response(status_code=200)

    @app.api_route("/admin/drain", methods=["GET", "POST"])
    async def drain(raw: Request) -> Response:
        from tokenmill.serve.serving import json_response

        check_admin(raw, state.args.admin_key)
        if raw.method == "POST" and not state.drain.draining:
            logger.info("draining: no new requests; %d in flight", state.drain.in_flight)
            state.drain.draining = True
        return json_response(state.drain.status())

    @app.get("/version")
    async def version() -> Response:
        from tokenmill.serve.serving import json_response

        return json_response({"version": tokenmill.__version__,
                              "batch_invariant": bool(state.config.batch_invariant),
                              "kernels": state.engine.ready.kernels})

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> Response:
        from tokenmill.serve.serving import json_response

        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "tokenmill",
                "root": state.config.model.model or state.config.model.model_dir, "parent": None,
                "max_model_len": state.config.model.max_model_len, "permission": []}
        return json_response({"object": "list", "data": [card]})

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        from tokenmill.serve.completions import create_completion

        state.check_task("generate")
        await load_grammar_support(req)
        return await create_completion(state, req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        from tokenmill.serve.chat import create_chat_completion

        state.check_task("generate")
        await load_grammar_support(req)
        return await create_chat_completion(state, req, raw)

    @app.post("/v1/embeddings")
    async def embeddings(req: EmbeddingRequest, raw: Request) -> Response:
        from tokenmill.serve.embeddings import create_embedding

        state.check_task("embed")
        return await create_embedding(state, req, raw)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request) -> Response:
        from tokenmill.serve.responses import create_response

        state.check_task("generate")
        await load_grammar_support(req)
        return await create_response(state, req, raw)

    @app.api_route("/v1/responses/{response_id:path}", methods=["GET", "POST", "DELETE"])
    async def stored_response(response_id: str) -> Response:
        raise APIError(404, f"No response {response_id.split('/')[0]!r}: this server keeps no responses (it is "
                            "stateless; send the whole conversation as input).", param="response_id",
                       code="response_not_found")

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        from tokenmill.serve.chat import render_request_chat, template_tools
        from tokenmill.serve.serving import json_response, tokenize_text

        state.check_model(req.model)
        tok = state.tokenizer
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of prompt or messages", "prompt")
        if req.prompt is not None:
            ids = await tokenize_text(state, req.prompt, req.add_special_tokens)
        else:
            ids = (await render_request_chat(state, req, await template_tools(state, req.tools))).token_ids
        body = {"count": len(ids), "max_model_len": state.config.model.max_model_len, "tokens": ids,
                "token_strs": tok.convert_ids_to_tokens(ids) if req.return_token_strs else None}
        return json_response(body)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        from tokenmill.serve.serving import json_response, off_loop

        state.check_model(req.model)
        vocab = state.config.model.hf_config.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token id {bad[0]} is out of range for the vocabulary of {vocab}", "tokens")
        return json_response({"prompt": await off_loop(state.tokenizer.decode, req.tokens)})

    if state.dashboard is not None:
        from tokenmill.serve.dashboard_engine import mount_engine_dashboard

        mount_engine_dashboard(app, state, state.dashboard)
    if state.args.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.args.api_key)
    app.add_middleware(DrainMiddleware, drain=state.drain)
    app.add_middleware(BodyLimitMiddleware, limit=state.args.max_request_body_bytes,
                       timeout=state.args.request_body_timeout)
    add_cors(app, cors_config(state.args))  # outermost: first to run
    return app


# -- process entry -------------------------------------------------------------------------------------
class DrainingServer:
    """uvicorn.Server whose signal handling drains and then returns (uvicorn re-raises the signal after
    a graceful shutdown, which would make the exit status -SIGTERM instead of 0). `on_deadline` runs a
    second before the graceful period ends, so open streams can still end with an error event and [DONE]
    instead of being cut."""

    @staticmethod
    def make(config, on_deadline=None):
        import asyncio

        import uvicorn

        from tokenmill.serve.dashboard import end_streams as end_dashboard_streams

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                old = {s: signal.signal(s, self.handle_exit) for s in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for s, h in old.items():
                        signal.signal(s, h)

            def handle_exit(self, sig, frame) -> None:
                if not self.should_exit:
                    timeout = self.config.timeout_graceful_shutdown
                    logger.info("received %s: draining in-flight requests (up to %.0fs)",
                                signal.Signals(sig).name, timeout)
                    loop = asyncio.get_event_loop()
                    # the dashboard's streams never end by themselves: uvicorn would wait the whole timeout
                    loop.call_soon_threadsafe(end_dashboard_streams)
                    if on_deadline is not None and timeout is not None:
                        loop.call_soon_threadsafe(loop.call_later, max(timeout - 1.0, 0.0), on_deadline)
                super().handle_exit(sig, frame)

        return Server(config)


def bind_listening_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(False)
    return sock


SHIPPED_TEMPLATES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "chat_templates")


def _read_chat_template(value: Optional[str]) -> Optional[str]:
    """--chat-template: a file, the name of a template shipped in serve/chat_templates (hermes_tools), or
    the template itself."""
    if value is None:
        return None
    shipped = os.path.join(SHIPPED_TEMPLATES, f"{value}.jinja")
    for path in (value, shipped):
        if os.path.isfile(path):
            with open(path) as f:
                return f.read()
    if "{" not in value:
        names = sorted(n.removesuffix(".jinja") for n in os.listdir(SHIPPED_TEMPLATES))
        raise ValueError(f"--chat-template {value!r} is neither a file, a shipped template ({', '.join(names)}) "
                         "nor a Jinja template")
    return value


def run_server(args: argparse.Namespace, ledger=None, prestarted=None) -> NoReturn:
    """Serve until stopped, then end the process with its exit status (0 after a clean stop); start-up errors
    raise. ledger: the start-up ledger the CLI began at its entry (startup.py); a fresh one otherwise.
    prestarted: an engine process the CLI started first thing (engine/prestart.py)."""
    import uvicorn

    # No torch here (the engine process has it; models/resolution_cache.py keeps a warm start free of it)
    from tokenmill.config import EngineConfig
    from tokenmill.engine.async_llm import AsyncLLM
    from tokenmill.serve.metrics import ServerMetrics

    ledger = ledger or Ledger("api")
    ledger.mark_since_last("imports")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (how the model writes tool calls: "
                         "hermes, llama3_json or mistral)")
    cors_config(args)  # a malformed CORS flag fails before the model loads
    config = EngineConfig.from_cli_args(args)
    config.finalize(install_default=getattr(args, "install_default_model", False), ledger=ledger)
    chat_template = _read_chat_template(args.chat_template)
    sock = bind_listening_socket(args.host, args.port)  # fail fast on a busy port, before loading the model
    metrics = ServerMetrics(config.model.served_model_name)
    dashboard = stat_logger = None
    if config.step_records:
        from tokenmill.serve.dashboard import DashboardStats, StatFanout

        dashboard = DashboardStats()
        stat_logger = StatFanout(metrics, dashboard)
    try:
        engine = AsyncLLM(config, None, stat_logger or metrics,
                          log_level=logging.getLogger("tokenmill").getEffectiveLevel(), ledger=ledger,
                          prestarted=prestarted)
    except BaseException:
        sock.close()
        raise
    state = ServerState(args, config, engine, engine.tokenizer, metrics, config.model.served_model_name,
                        chat_template, request_limits(args),
                        args.tool_call_parser if args.enable_auto_tool_choice else None, ledger,
                        dashboard=dashboard)
    # Read when scraped: the engine's stats alone lag behind what was sent to it (serving.num_waiting)
    metrics.waiting.set_function(lambda: num_waiting(state))
    try:
        uv = uvicorn.Config(build_app(state), log_level=args.uvicorn_log_level, lifespan="on",
                            timeout_graceful_shutdown=args.shutdown_timeout, timeout_keep_alive=30)
        server = DrainingServer.make(uv, on_deadline=lambda: engine.fail_open_requests(
            "the server is shutting down (--shutdown-timeout passed)"))
        engine.on_fatal = lambda _: setattr(server, "should_exit", True)
        server.run(sockets=[sock])
        code = _exit_status(server, engine)
    finally:
        engine.shutdown_sync()  # no-op after a clean lifespan shutdown
        sock.close()
    _end_process(code)


def _exit_status(server, engine) -> int:
    if not server.started:
        logger.error("server failed to start (see above)")
        return 1
    if engine.fatal is not None:
        logger.error("server stopped: %s", engine.fatal)
        return 1
    logger.info("server stopped")
    return 0


def _end_process(code: int) -> NoReturn:
    """Exit now, skipping the interpreter's teardown: the engine process is joined, the sockets are closed and
    nothing is left to clean up, but the teardown's garbage collections and deallocations walk every object
    the server loaded (the tokenizer, and torch once a grammar request imported it), which kept a stopped
    server alive for 0.6-1.2 s after "server stopped" (4 s on a busy machine)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
