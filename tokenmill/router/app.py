"""`tokenmill router`: an OpenAI-compatible front that forwards each request to one of several replicas.

Endpoints of its own: /health (200 while any replica is healthy), /metrics (`tokenmill:router_*`) and
/admin/* (admin.py). With --launch it runs its replicas itself (fleet.py: healing, autoscaling, upgrades).
Everything else (/v1/models, /v1/completions, /v1/chat/completions and /v1/responses with SSE,
/v1/embeddings, /tokenize, ...) is forwarded.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from typing import Optional

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.config import ROUTER_POLICIES, RouterConfig
from tokenmill.http.auth import APIKeyMiddleware
from tokenmill.http.body_limit import BodyLimitMiddleware, add_body_args
from tokenmill.http.cors import CorsConfig, add_cors, add_cors_args, cors_config
from tokenmill.http.disconnect import until_disconnected
from tokenmill.http.errors import install_error_handlers
from tokenmill.router.forward import Router

logger = logging.getLogger("tokenmill")


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


def add_router_args(p: argparse.ArgumentParser) -> None:
    from tokenmill.http.auth import ADMIN_KEY_HELP

    p.add_argument("--replica", action="append", default=[], metavar="URL",
                   help="base URL of a `tokenmill serve` replica (repeat the flag for each)")
    p.add_argument("--group", action="append", default=[], metavar="NAME=SPEC[:PCT%]",
                   help="a replica group with its share of requests: SPEC is URL[,URL...] or a 'tokenmill serve "
                        "...' command (one launched replica), e.g. canary=http://10.0.0.3:8000:5%%; groups "
                        "without a share split what is left with the --replica/--launch group 'default'")
    p.add_argument("--admin-key", default=os.environ.get("TOKENMILL_ADMIN_KEY"), help=ADMIN_KEY_HELP)
    add_fleet_args(p)
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


def add_fleet_args(p: argparse.ArgumentParser) -> None:
    f = p.add_argument_group("fleet: replicas the router launches, heals, scales and upgrades itself")
    f.add_argument("--launch", default=None, metavar="'tokenmill serve MODEL ...'",
                   help="start replicas with this command (each on a free port; --host/--port are the launcher's)")
    f.add_argument("--min-replicas", type=int, default=1, help="with --launch: fewest replicas")
    f.add_argument("--max-replicas", type=int, default=None,
                   help="with --launch: most replicas; above --min-replicas the autoscaler sizes the fleet "
                        "(default: --min-replicas, a fixed size)")
    f.add_argument("--target", action="append", default=[], metavar="NAME=VALUE",
                   help="autoscaling target (repeatable): ttft_p90=2s, queue=4 (running + waiting requests per "
                        "replica; the default), kv_usage=0.8; scale up at 80%% of a target")
    f.add_argument("--scale-down-delay", type=float, default=60.0,
                   help="seconds of low load (under 50%% of every target) before each scale-down")
    f.add_argument("--launcher", default="local", choices=["local", "ray"],
                   help="local: subprocesses on this machine; ray: Ray actors on a Ray cluster's nodes")
    f.add_argument("--ray-address", default=None, help="--launcher ray: the cluster (default: start a local one)")
    f.add_argument("--ray-num-gpus", type=float, default=0,
                   help="--launcher ray: GPUs per replica's actor (Ray places it on a node with them and sets its "
                        "CUDA_VISIBLE_DEVICES)")
    f.add_argument("--replica-threads", type=int, default=None,
                   help="CPU threads per launched replica (default: this machine's cores / most replicas)")
    f.add_argument("--health-check-failures", type=int, default=3,
                   help="a launched replica failing this many health checks in a row is replaced")
    f.add_argument("--replica-start-timeout", type=float, default=600.0,
                   help="seconds a launched replica may take to become healthy")
    f.add_argument("--drain-timeout", type=float, default=300.0,
                   help="seconds a drained replica's in-flight requests may take before it is stopped anyway")


def router_config(args: argparse.Namespace, replicas: list[str], require_replicas: bool = True) -> RouterConfig:
    return RouterConfig(replicas=replicas, policy=args.router_policy, load_weight=args.router_load_weight,
                        prefix_chunk_chars=args.router_prefix_chunk_chars,
                        health_check_interval=args.health_check_interval,
                        health_check_timeout=args.health_check_timeout).validate(require_replicas)


def make_router(args: argparse.Namespace, replicas: list[str], prefill: list[str] = (),
                decode: list[str] = (), groups: Optional[list] = None) -> Router:
    """The plain router over `replicas` (and `groups`: groups.GroupSpec), or the disaggregated one over
    `prefill` and `decode`."""
    if not (prefill or decode):
        if not groups:
            return Router(router_config(args, replicas, not getattr(args, "launch", None)))
        from tokenmill.router.groups import group_weights

        weights = group_weights(groups, bool(replicas or args.launch))
        url_groups = {url: g.name for g in groups for url in g.urls}
        every = [*replicas, *url_groups]
        return Router(router_config(args, every, not (args.launch or any(g.launch for g in groups))),
                      groups=url_groups, weights=weights)
    if getattr(args, "launch", None) or groups:
        raise ValueError("--launch and --group work with --replica routers, not disaggregated ones")
    if replicas:
        raise ValueError("use either --replica or --prefill/--decode, not both")
    if not prefill or not decode:
        raise ValueError("a disaggregated router needs at least one --prefill and one --decode URL")
    if args.prefill_timeout <= 0:
        raise ValueError(f"--prefill-timeout must be positive, got {args.prefill_timeout}")
    from tokenmill.router.disagg import DisaggRouter

    return DisaggRouter(router_config(args, [*prefill, *decode]), prefill, decode, args.prefill_timeout)


def make_fleets(args: argparse.Namespace, router: Router, groups: list) -> list:
    """The fleets of --launch (group `default`, autoscaled between --min/--max-replicas) and of launched
    --group entries (one replica each)."""
    from tokenmill.router.autoscale import Autoscaler, parse_targets
    from tokenmill.router.fleet import Fleet
    from tokenmill.router.launchers import cpu_count, make_launcher, parse_launch

    launched = [("default", parse_launch(args.launch))] if args.launch else []
    launched += [(g.name, g.launch) for g in groups if g.launch]
    if not launched:
        if args.max_replicas is not None or args.target or args.launcher != "local" or args.ray_address:
            raise ValueError("--max-replicas, --target, --launcher and --ray-address need --launch (or a --group "
                             "with a `tokenmill serve` command)")
        return []
    high = max(args.min_replicas, args.max_replicas or args.min_replicas)
    autoscaler = None
    if high > args.min_replicas or args.target:
        autoscaler = Autoscaler(parse_targets(args.target), args.min_replicas, high, args.scale_down_delay)
    elif args.min_replicas < 1:
        raise ValueError(f"--min-replicas must be at least 1, got {args.min_replicas}")
    threads = args.replica_threads or max(1, cpu_count() // (high + len(launched) - 1))
    launcher = make_launcher(args.launcher, args.ray_address, threads, args.log_level, args.ray_num_gpus)
    return [Fleet(router, launcher, argv, name, args.min_replicas if name == "default" else 1,
                  autoscaler if name == "default" else None, args.health_check_failures,
                  args.replica_start_timeout, args.drain_timeout, args.health_check_interval)
            for name, argv in launched]


def build_router_app(router: Router, api_key: Optional[str] = None, dashboard: bool = True,
                     cors: Optional[CorsConfig] = None, fleets: list = (), admin_key: Optional[str] = None,
                     drain_timeout: float = 300.0, max_body_bytes: int = 8 << 20,
                     body_timeout: float = 20.0) -> FastAPI:
    """max_body_bytes, body_timeout: --max-request-body-bytes and --request-body-timeout (BodyLimitMiddleware),
    so that a huge or stalled body is refused here, before the router holds it or forwards it."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.pool.probe_all()
        tasks = [asyncio.ensure_future(router.pool.run()), *(asyncio.ensure_future(f.run()) for f in fleets)]
        healthy = len(router.pool.healthy())
        logger.info("router (%s) up with %d/%d healthy replicas%s", router.policy.name, healthy,
                    len(router.pool.replicas), f"; launching {len(fleets)} group(s)" if fleets else "")
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*(f.close() for f in fleets))
            await router.aclose()

    app = FastAPI(title="tokenmill router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

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

    from tokenmill.router.admin import mount_router_admin

    mount_router_admin(app, router, list(fleets), admin_key, drain_timeout)

    if dashboard:  # before the catch-all forward
        from tokenmill.router.dashboard import mount_router_dashboard

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
                 uvicorn_log_level: str = "warning", dashboard: bool = True,
                 cors: Optional[CorsConfig] = None, fleets: list = (), admin_key: Optional[str] = None,
                 drain_timeout: float = 300.0, max_body_bytes: int = 8 << 20, body_timeout: float = 20.0) -> int:
    """Run the router on an already bound socket until SIGINT/SIGTERM (then drain, return 0)."""
    import uvicorn

    from tokenmill.http.server import DrainingServer
    from tokenmill.serve.dashboard import end_streams as end_dashboard_streams

    logging.getLogger("httpx").setLevel(logging.WARNING)  # it logs every forwarded request and probe at INFO
    app = build_router_app(router, api_key, dashboard, cors, fleets, admin_key, drain_timeout, max_body_bytes,
                           body_timeout)
    uv = uvicorn.Config(app, log_level=uvicorn_log_level, lifespan="on",
                        timeout_graceful_shutdown=shutdown_timeout, timeout_keep_alive=30)
    server = DrainingServer.make(uv, on_signal=end_dashboard_streams)
    server.run(sockets=[sock])
    if not server.started:
        logger.error("router failed to start (see above)")
        return 1
    logger.info("router stopped")
    return 0


def run_router(args: argparse.Namespace) -> int:
    from tokenmill.router.groups import parse_group
    from tokenmill.http.server import bind_listening_socket

    groups = [parse_group(v) for v in args.group]
    if not (args.replica or args.prefill or args.decode or args.launch or groups):
        raise ValueError("the router needs --replica URLs, or --prefill and --decode URLs (or --launch "
                         "'tokenmill serve ...' to run its own replicas)")
    router = make_router(args, args.replica, args.prefill, args.decode, groups)
    fleets = make_fleets(args, router, groups)
    cors = cors_config(args)
    sock = bind_listening_socket(args.host, args.port)
    if args.prefill:
        logger.info("routing http://%s:%d disaggregated: prefill on %s (%s), decode on %s (least load)",
                    args.host, args.port, ", ".join(args.prefill), router.config.policy, ", ".join(args.decode))
    else:
        logger.info("routing http://%s:%d to %s (%s)", args.host, args.port,
                    ", ".join(router.config.replicas + [f"launched {f.group}" for f in fleets]),
                    router.config.policy)
    try:
        return serve_router(router, sock, args.api_key, args.shutdown_timeout, args.uvicorn_log_level,
                            not args.no_dashboard, cors, fleets, args.admin_key, args.drain_timeout,
                            args.max_request_body_bytes, args.request_body_timeout)
    finally:
        sock.close()
