"""docs/architecture.md lists every source file of tokenmill/ (issue 31): each `.py`, `.c` and `.h` file's path
relative to tokenmill/ heads a table row in backticks (section 5, one row per file), and no table row names a path that no longer exists."""
from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent
PKG = ROOT / "tokenmill"
DOC = ROOT / "docs" / "architecture.md"
SUFFIXES = {".py", ".c", ".h"}


def source_files() -> set[str]:
    return {p.relative_to(PKG).as_posix() for p in PKG.rglob("*")
            if p.suffix in SUFFIXES and p.is_file() and "__pycache__" not in p.parts}


def table_paths(text: str) -> set[str]:
    """Paths in the first cell of each table row (`| `engine/scheduler.py` | ... |`)."""
    paths = set()
    for line in text.splitlines():
        m = re.match(r"\s*\|\s*`([^`]+)`\s*\|", line)
        if m and pathlib.PurePosixPath(m.group(1)).suffix in SUFFIXES:
            paths.add(m.group(1))
    return paths


def test_every_source_file_is_in_the_doc():
    missing = sorted(source_files() - table_paths(DOC.read_text()))
    assert not missing, f"{len(missing)} file(s) under tokenmill/ missing from docs/architecture.md: {missing}"


def test_no_stale_rows():
    stale = sorted(table_paths(DOC.read_text()) - source_files())
    assert not stale, f"docs/architecture.md has rows for files that no longer exist under tokenmill/: {stale}"
