"""CORS for browsers calling `tokenmill serve` or `tokenmill router` from another origin (vLLM's flags).

With no --allowed-origins (the default) no CORS headers are sent, so browsers refuse cross-origin calls.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Optional


def parse_list(value: str, flag: str) -> list[str]:
    """A JSON list ('["https://a.example", "https://b.example"]') or a comma list ('https://a.example,*')."""
    text = value.strip()
    if text.startswith("["):
        try:
            items = json.loads(text)
        except ValueError as e:
            raise ValueError(f"{flag}: {value!r} is not a JSON list: {e}") from None
        if not isinstance(items, list) or not all(isinstance(x, str) for x in items):
            raise ValueError(f"{flag} must be a JSON list of strings or a comma-separated list, got {value!r}")
        return items
    return [x.strip() for x in text.split(",") if x.strip()]


def add_cors_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("CORS (browsers on other origins)")
    g.add_argument("--allowed-origins", default=None,
                   help="origins allowed to call this server from a browser: a JSON list or comma list "
                        "(e.g. 'https://app.example,http://localhost:3000' or '*'); default: none")
    g.add_argument("--allowed-methods", default="*", help="HTTP methods allowed cross-origin (JSON or comma list)")
    g.add_argument("--allowed-headers", default="*", help="request headers allowed cross-origin (JSON or comma list)")
    g.add_argument("--allow-credentials", action="store_true", help="allow cookies and credentials cross-origin")


@dataclass(frozen=True)
class CorsConfig:
    origins: list[str]
    methods: list[str]
    headers: list[str]
    credentials: bool = False


def cors_config(args: argparse.Namespace) -> Optional[CorsConfig]:
    """The CORS settings of parsed flags (None without --allowed-origins); a malformed list is a ValueError."""
    if getattr(args, "allowed_origins", None) is None:
        return None
    return CorsConfig(parse_list(args.allowed_origins, "--allowed-origins"),
                      parse_list(args.allowed_methods, "--allowed-methods"),
                      parse_list(args.allowed_headers, "--allowed-headers"), args.allow_credentials)


def add_cors(app, config: Optional[CorsConfig]) -> None:
    """Add CORS to a FastAPI app; call it after its other middleware so it runs first (a preflight OPTIONS is
    answered before the API-key check, and error responses carry the headers too)."""
    if config is None:
        return
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(CORSMiddleware, allow_origins=config.origins, allow_methods=config.methods,
                       allow_headers=config.headers, allow_credentials=config.credentials)
