"""`tokenmill router`: its flags (the router's, router/app.py, with the fleet's and the groups' between them),
the router over --replica / --group / --prefill --decode URLs, the fleets it launches itself (--launch and
launched --group entries: fleet.py) and running it all with the /admin endpoints (admin.py)."""
from __future__ import annotations

import argparse
import logging
import os

from tokenmill.fleet.admin import admin_mount
from tokenmill.fleet.autoscale import Autoscaler, parse_targets
from tokenmill.fleet.fleet import Fleet
from tokenmill.fleet.groups import GroupSpec, group_weights, parse_group
from tokenmill.fleet.launchers import cpu_count, make_launcher, parse_launch
from tokenmill.http.auth import ADMIN_KEY_HELP
from tokenmill.http.cors import cors_config
from tokenmill.http.server import bind_listening_socket
from tokenmill.router.app import add_replica_args, add_routing_args, make_router, router_config, serve_router
from tokenmill.router.forward import Router

logger = logging.getLogger("tokenmill")


def add_router_args(p: argparse.ArgumentParser) -> None:
    add_replica_args(p)
    p.add_argument("--group", action="append", default=[], metavar="NAME=SPEC[:PCT%]",
                   help="a replica group with its share of requests: SPEC is URL[,URL...] or a 'tokenmill serve "
                        "...' command (one launched replica), e.g. canary=http://10.0.0.3:8000:5%%; groups "
                        "without a share split what is left with the --replica/--launch group 'default'")
    p.add_argument("--admin-key", default=os.environ.get("TOKENMILL_ADMIN_KEY"), help=ADMIN_KEY_HELP)
    add_fleet_args(p)
    add_routing_args(p)


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


def router_from_args(args: argparse.Namespace, groups: list[GroupSpec]) -> Router:
    """The router of `tokenmill router`'s flags: over --replica URLs and `groups` (the default group's replicas
    and the launched groups' join as they start), or the disaggregated one over --prefill and --decode."""
    if args.prefill or args.decode:
        if args.launch or groups:
            raise ValueError("--launch and --group work with --replica routers, not disaggregated ones")
        return make_router(args, args.replica, args.prefill, args.decode)
    if not groups:
        return make_router(args, args.replica, require_replicas=not args.launch)
    weights = group_weights(groups, bool(args.replica or args.launch))
    url_groups = {url: g.name for g in groups for url in g.urls}
    every = [*args.replica, *url_groups]
    return Router(router_config(args, every, not (args.launch or any(g.launch for g in groups))),
                  groups=url_groups, weights=weights)


def make_fleets(args: argparse.Namespace, router: Router, groups: list[GroupSpec]) -> list[Fleet]:
    """The fleets of --launch (group `default`, autoscaled between --min/--max-replicas) and of launched
    --group entries (one replica each)."""
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


def run_router(args: argparse.Namespace) -> int:
    groups = [parse_group(v) for v in args.group]
    if not (args.replica or args.prefill or args.decode or args.launch or groups):
        raise ValueError("the router needs --replica URLs, or --prefill and --decode URLs (or --launch "
                         "'tokenmill serve ...' to run its own replicas)")
    router = router_from_args(args, groups)
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
                            not args.no_dashboard, cors, args.max_request_body_bytes, args.request_body_timeout,
                            mounts=[admin_mount(router, fleets, args.admin_key, args.drain_timeout)],
                            services=fleets)
    finally:
        sock.close()
