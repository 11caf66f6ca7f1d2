"""The router's app: an OpenAI-compatible front that forwards each request to one of several replicas.

Endpoints of its own: /health (200 while any replica is healthy), /metrics (`tokenmill:router_*`), whatever
its caller mounts (`tokenmill router` mounts /admin/*: fleet/admin.py) and /dashboard. Everything else
(/v1/models, /v1/completions, /v1/chat/completions and /v1/responses with SSE, /v1/embeddings, /tokenize, ...)
is forwarded. Its caller may also give it services that run beside it for its lifetime (`tokenmill router
--launch` gives it its fleets: fleet/fleet.py); the command itself, flags and all, is fleet/router_command.py.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from typing import Callable, Optional, Protocol, Sequence

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.config import ROUTER_POLICIES, RouterConfig
from tokenmill.http.auth import APIKeyMiddleware
from tokenmill.http.body_limit import BodyLimitMiddleware, add_body_args
from tokenmill.http.cors import CorsConfig, add_cors, add_cors_args
from tokenmill.http.disconnect import until_disconnected
from tokenmill.http.errors import install_error_handlers
from tokenmill.http.server import DrainingServer
from tokenmill.router.dashboard import mount_router_dashboard
from tokenmill.router.disagg import DisaggRouter
from tokenmill.router.forward import Router
from tokenmill.serve.dashboard import end_streams as end_dashboard_streams

logger = logging.getLogger("tokenmill")

# Adds routes to the router's app; called after /health and /metrics, before /dashboard and the catch-all
# forward (`tokenmill router`'s /admin/*: fleet/admin.py).
Mount = Callable[[FastAPI], None]


class Service(Protocol):
    """Work that runs beside the router while it serves (`tokenmill router --launch`'s fleets): run() is
    started once the replicas were first probed and cancelled at shutdown, then close() is awaited."""

    async def run(self) -> None: ...

    async def close(self) -> None: ...


def add_router_policy_args(p: argparse.ArgumentParser, policy_flag: str = "--policy") -> None:
    """Flags shared by `tokenmill router` and `tokenmill serve --data-parallel-size N`."""
    p.add_argument(policy_flag, dest="router_policy", default="prefix_aware", choices=list(ROUTER_POLICIES),
                   help="prefix_aware: send a request where its prompt prefix is likely cached, traded off "
                        "against load; least_load: fewest running + waiting requests; round_robin")
    p.add_argument("--router-load-weight", type=float, default=0.2,
                   help="prefix_aware: score = cached prefix fraction - weight * (load - least load) / "
                        "(least load + 1) - uncached fraction * cache fullness")
    p.add_argument("--router-prefix-chunk-chars", type=int, default=64,
                   help="prefix_aware: characters per chunk of the router's prefix index")
    p.add_argument("--health-check-interval", type=float, default=1.0, help="seconds between replica probes")
    p.add_argument("--health-check-timeout", type=float, default=5.0, help="seconds before a probe counts as failed")
    p.add_argument("--prefill-timeout", type=float, default=300.0,
                   help="disaggregated: seconds a prefill instance may go silent before the request is retried "
                        "on another one")


def add_replica_args(p: argparse.ArgumentParser) -> None:
    """`tokenmill router`'s first flag; fleet/router_command.py adds its own after it."""
    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="base URL of a `tokenmill serve` replica (repeat the flag for each)")


def add_routing_args(p: argparse.ArgumentParser) -> None:
    """The rest of `tokenmill router`'s flags: disaggregated instances, policy, listening, HTTP."""
    d = p.add_argument_group("disaggregated prefill/decode (instead of --replica)")
    d.add_argument("--prefill", action="append", default=[], metavar="URL",
                   help="base URL of a prefill instance (kv_role kv_producer; repeat for each)")
    d.add_argument("--decode", action="append", default=[], metavar="URL",
                   help="base URL of a decode instance (kv_role kv_consumer; repeat for each)")
    add_router_policy_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on")
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (forwarded to the replicas as sent)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds to let in-flight requests finish")
    p.add_argument("--no-dashboard", action="store_true", help="do not serve the router's dashboard at /dashboard")
    p.add_argument("--uvicorn-log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own logging ('info' logs every request)")
    add_body_args(p)
    add_cors_args(p)


def router_config(args: argparse.Namespace, replicas: list[str], require_replicas: bool = True) -> RouterConfig:
    return RouterConfig(replicas=replicas, policy=args.router_policy, load_weight=args.router_load_weight,
                        prefix_chunk_chars=args.router_prefix_chunk_chars,
                        health_check_interval=args.health_check_interval,
                        health_check_timeout=args.health_check_timeout).validate(require_replicas)


def make_router(args: argparse.Namespace, replicas: list[str], prefill: list[str] = (),
                decode: list[str] = (), require_replicas: bool = True) -> Router:
    """The plain router over `replicas`, or the disaggregated one over `prefill` and `decode`. (Replica groups
    and launched replicas: fleet/router_command.py.)"""
    if not (prefill or decode):
        return Router(router_config(args, replicas, require_replicas))
    if replicas:
        raise ValueError("use either --replica or --prefill/--decode, not both")
    if not prefill or not decode:
        raise ValueError("a disaggregated router needs at least one --prefill and one --decode URL")
    if args.prefill_timeout <= 0:
        raise ValueError(f"--prefill-timeout must be positive, got {args.prefill_timeout}")
    return DisaggRouter(router_config(args, [*prefill, *decode]), prefill, decode, args.prefill_timeout)


def _lifespan(router: Router, services: Sequence[Service]):
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.pool.probe_all()
        tasks = [asyncio.ensure_future(router.pool.run()), *(asyncio.ensure_future(s.run()) for s in services)]
        healthy = len(router.pool.healthy())
        logger.info("router (%s) up with %d/%d healthy replicas%s", router.policy.name, healthy,
                    len(router.pool.replicas), f"; launching {len(services)} group(s)" if services else "")
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*(s.close() for s in services))
            await router.aclose()

    return lifespan


def build_router_app(router: Router, api_key: Optional[str] = None, dashboard: bool = True,
                     cors: Optional[CorsConfig] = None, max_body_bytes: int = 8 << 20, body_timeout: float = 20.0,
                     *, mounts: Sequence[Mount] = (), services: Sequence[Service] = ()) -> FastAPI:
    """max_body_bytes, body_timeout: --max-request-body-bytes and --request-body-timeout (BodyLimitMiddleware),
    so that a huge or stalled body is refused here, before the router holds it or forwards it. mounts add
    routes after /health and /metrics, in order, before /dashboard and the catch-all forward; services run
    for the app's lifetime (see Service)."""
    app = FastAPI(title="tokenmill router", lifespan=_lifespan(router, services), docs_url=None, redoc_url=None,
                  openapi_url=None)

    install_error_handlers(app, "router")

    @app.get("/health")
    async def health() -> Response:
        if not router.ready():
            return router.unavailable([], "").response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def metrics() -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        for r in router.pool.replicas:  # in-flight counts move between probes
            router.metrics.on_replica(r.url, r.healthy, r.load, r.in_flight)
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    for mount in mounts:  # before the catch-all forward
        mount(app)

    if dashboard:  # before the catch-all forward
        mount_router_dashboard(app, router)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE"])
    async def forward(path: str, raw: Request) -> Response:
        body = await raw.body()
        work = router.forward(raw.method, "/" + path, raw.url.query, body, raw.headers)
        response = await until_disconnected(raw, work)
        return response if response is not None else Response(status_code=499)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes, timeout=body_timeout)
    add_cors(app, cors)  # outermost: a preflight is answered here, not forwarded
    return app


def serve_router(router: Router, sock: socket.socket, api_key: Optional[str], shutdown_timeout: float,
                 uvicorn_log_level: str = "warning", dashboard: bool = True, cors: Optional[CorsConfig] = None,
                 max_body_bytes: int = 8 << 20, body_timeout: float = 20.0, *, mounts: Sequence[Mount] = (),
                 services: Sequence[Service] = ()) -> int:
    """Run the router on an already bound socket until SIGINT/SIGTERM (then drain, return 0)."""
    import uvicorn

    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every forwarded request and probe at INFO
    app = build_router_app(router, api_key, dashboard, cors, max_body_bytes, body_timeout, mounts=mounts,
                           services=services)
    uv = uvicorn.Config(app, log_level=uvicorn_log_level, lifespan="on",
                        timeout_graceful_shutdown=shutdown_timeout, timeout_keep_alive=30)
    server = DrainingServer.make(uv, on_signal=end_dashboard_streams)
    server.run(sockets=[sock])
    if not server.started:
        logger.error("router failed to start (see above)")
        return 1
    logger.info("router stopped")
    return 0
