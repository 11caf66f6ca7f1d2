"""The router's /admin endpoints (--admin-key): see its replicas and fleets, drain one, upgrade a fleet.

- `GET /admin/replicas`: every replica (group, health, draining, in flight, load, KV usage) and each fleet's
  members and retired replicas (what each reported once drained: in flight, running, KV usage).
- `POST /admin/drain?replica=URL`: no new requests go there; the call returns once those in flight are done.
  A launched replica is then stopped (and its fleet starts a fresh one if it is below size); a --replica one
  stays out of rotation (removed from the pool).
- `POST /admin/upgrade` with `{"launch": "tokenmill serve ...", "group": "default"}`: a rolling upgrade of
  that fleet (fleet.py); answers when it is done, with the old and new URLs.
"""
from __future__ import annotations

import asyncio
import functools
import json
from dataclasses import asdict
from typing import Callable, Optional

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import Response

from tokenmill.fleet.fleet import Fleet
from tokenmill.fleet.launchers import parse_launch
from tokenmill.http.auth import check_admin
from tokenmill.http.errors import APIError, bad_request
from tokenmill.router.forward import Router


def _json(body: dict) -> Response:
    return Response(json.dumps(body), media_type="application/json")


def _fleet_of(fleets: list[Fleet], url: str):
    for fleet in fleets:
        for member in fleet.members:
            if member.handle.url == url:
                return fleet, member
    return None, None


async def drain_replica(router: Router, fleets: list[Fleet], url: str, timeout: float) -> dict:
    replica = router.pool.get(url)
    if replica is None:
        raise APIError(404, f"No replica {url!r} in this router (GET /admin/replicas lists them).",
                       param="replica", code="replica_not_found")
    fleet, member = _fleet_of(fleets, replica.url)
    if fleet is not None:
        await fleet.retire(member)
        return {"replica": replica.url, "drained": True, "stopped": True}
    replica.draining = True
    deadline = asyncio.get_running_loop().time() + timeout
    while replica.in_flight > 0 and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.1)
    router.remove_replica(replica)
    return {"replica": replica.url, "drained": replica.in_flight == 0, "stopped": False}


def mount_router_admin(app: FastAPI, router: Router, fleets: list[Fleet], admin_key: Optional[str],
                       drain_timeout: float) -> None:
    @app.get("/admin/replicas")
    async def replicas(raw: Request) -> Response:
        check_admin(raw, admin_key)
        pool = [asdict(r) | {"load": r.load} for r in router.pool.replicas]
        return _json({"replicas": pool, "fleets": [f.describe() for f in fleets]})

    @app.post("/admin/drain")
    async def drain(raw: Request) -> Response:
        check_admin(raw, admin_key)
        url = raw.query_params.get("replica")
        if not url:
            raise bad_request("give the replica to drain: POST /admin/drain?replica=URL", "replica")
        return _json(await drain_replica(router, fleets, url, drain_timeout))

    @app.post("/admin/upgrade")
    async def upgrade(raw: Request) -> Response:
        check_admin(raw, admin_key)
        try:
            body = json.loads(await raw.body())
            command, group = body["launch"], body.get("group", "default")
        except (ValueError, KeyError, TypeError):
            raise bad_request('expected a JSON body {"launch": "tokenmill serve ...", "group": "default"}',
                              "launch") from None
        fleet = next((f for f in fleets if f.group == group), None)
        if fleet is None:
            raise bad_request(f"no launched group {group!r}; launched: {', '.join(f.group for f in fleets) or 'none'}",
                              "group")
        try:
            argv = parse_launch(command, "launch")
            return _json(await fleet.upgrade(argv))
        except ValueError as e:
            raise bad_request(str(e), "launch") from None
        except RuntimeError as e:
            raise APIError(500, str(e), code="upgrade_failed") from None


def admin_mount(router: Router, fleets: list[Fleet], admin_key: Optional[str],
                drain_timeout: float) -> Callable[[FastAPI], None]:
    """The /admin endpoints as a mount for router/app.py's build_router_app (its `mounts`)."""
    return functools.partial(mount_router_admin, router=router, fleets=fleets, admin_key=admin_key,
                             drain_timeout=drain_timeout)


def add_upgrade_args(p) -> None:
    p.add_argument("--router", required=True, help="the router's base URL, e.g. http://127.0.0.1:9000")
    p.add_argument("--launch", required=True, help="the new replicas' command: 'tokenmill serve MODEL ...'")
    p.add_argument("--group", default="default", help="the launched group to upgrade")
    p.add_argument("--admin-key", default=None, help="the router's --admin-key (default: $TOKENMILL_ADMIN_KEY)")


def run_upgrade(args) -> list[str]:
    """`tokenmill upgrade`: ask a router for a rolling upgrade of one launched group and wait for it (one
    replica at a time: the new one healthy, then the old one drained and stopped). Returns the report's lines
    (the CLI prints them); raises RuntimeError with a one-line reason when the router refuses or is away."""
    import os

    import httpx

    key = args.admin_key or os.environ.get("TOKENMILL_ADMIN_KEY")
    parse_launch(args.launch, "--launch")  # a bad command is refused here, before the router is asked
    try:
        r = httpx.post(args.router.rstrip("/") + "/admin/upgrade", json={"launch": args.launch, "group": args.group},
                       headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=None, trust_env=False)
    except httpx.HTTPError as e:
        raise RuntimeError(f"could not reach the router at {args.router}: {e}") from None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = r.text
        raise RuntimeError(f"upgrade refused (HTTP {r.status_code}): {message}")
    replaced = r.json()["replaced"]
    return [f"{step['old']} -> {step['new']}" for step in replaced] + \
        [f"group {args.group}: {len(replaced)} replicas upgraded"]
