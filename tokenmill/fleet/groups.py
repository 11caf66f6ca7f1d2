"""Replica groups (`--group NAME=SPEC[:PCT%]`): a canary beside the stable replicas, with its share of traffic.

SPEC is either comma-separated replica URLs (`canary=http://10.0.0.3:8000:5%`) or a `tokenmill serve ...`
command the router launches one replica of and keeps alive (`canary=tokenmill serve new-model:5%`). The
--replica / --launch replicas form the group `default`. Groups with a percentage get it; the others share
what is left equally. Per request the router draws a group by weight among those with a healthy replica,
then its policy picks a replica inside the group (router/forward.py), and /metrics labels latency and errors by group.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from tokenmill.fleet.launchers import parse_launch


@dataclass
class GroupSpec:
    name: str
    urls: list[str] = field(default_factory=list)
    launch: Optional[list[str]] = None   # serve argv of a launched group
    percent: Optional[float] = None


def parse_group(value: str) -> GroupSpec:
    m = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)\s*=\s*(.+?)(?::\s*([0-9.]+)\s*%)?\s*", value, re.S)
    if not m:
        raise ValueError(f"--group {value!r}: expected NAME=URL[,URL...][:PCT%] or NAME=tokenmill serve ...[:PCT%]")
    name, spec, pct = m[1], m[2].strip(), m[3]
    percent = None
    if pct is not None:
        try:
            percent = float(pct)
        except ValueError:
            raise ValueError(f"--group {value!r}: {pct!r} is not a percentage") from None
        if not 0 <= percent <= 100:
            raise ValueError(f"--group {value!r}: the share must be between 0% and 100%")
    if spec.startswith("tokenmill "):
        return GroupSpec(name, launch=parse_launch(spec, f"--group {name}"), percent=percent)
    urls = [u.strip().rstrip("/") for u in spec.split(",") if u.strip()]
    for url in urls:
        if not re.fullmatch(r"https?://[^/\s,]+", url):
            raise ValueError(f"--group {name}: {url!r} is not a base URL such as http://127.0.0.1:8001 (nor a "
                             "`tokenmill serve ...` command)")
    return GroupSpec(name, urls=urls, percent=percent)


def group_weights(groups: list[GroupSpec], default_present: bool) -> dict[str, float]:
    """group -> share of requests (0..1): explicit percentages, the rest split among the unweighted groups
    (`default` among them when --replica or --launch gave it replicas)."""
    names = [g.name for g in groups]
    if len(set(names)) != len(names) or (default_present and "default" in names):
        dup = next(n for n in names if names.count(n) > 1 or (default_present and n == "default"))
        raise ValueError(f"--group {dup} is given twice (`default` is the --replica / --launch group)")
    explicit = {g.name: g.percent / 100 for g in groups if g.percent is not None}
    rest = [g.name for g in groups if g.percent is None] + (["default"] if default_present else [])
    total = sum(explicit.values())
    if total > 1 + 1e-9:
        raise ValueError(f"--group shares add up to {total * 100:g}%, more than 100%")
    if rest and total >= 1 - 1e-9:
        raise ValueError(f"--group shares take 100%, leaving nothing for {', '.join(rest)}")
    return {**explicit, **{name: (1 - total) / len(rest) for name in rest}}
