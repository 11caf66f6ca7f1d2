"""Builds tokenmill's small C kernels for CPU and loads them through ctypes.

Each library is compiled once per machine with the system C compiler (`-O3 -march=native -fopenmp`) into
`$TOKENMILL_CACHE_DIR/kernels/`, keyed by its sources, the flags and the CPU's feature flags, so a warm start
only loads the shared object (milliseconds). Libraries link libgomp by its soname, so inside a process that has
imported torch they share torch's OpenMP runtime and thread pool instead of starting a second one that would
spin against it. Without a compiler, or with TOKENMILL_CPU_KERNELS=0, `load_library` returns None (logged once)
and callers use their pure-torch path; `library_status` says which libraries loaded and why the others did not
(the engine's kernels report, worker/kernels_report.py).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from typing import Optional

from tokenmill.host import cache_root, cpu_flags

logger = logging.getLogger("tokenmill")

VEC_HEADER = os.path.join(os.path.dirname(__file__), "cpu_vec.h")  # shared by the kernels
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared", "-std=gnu11"]
_loaded: dict[str, Optional[ctypes.CDLL]] = {}
_status: dict[str, str] = {}  # name -> "loaded" or "unavailable: <one-line reason>"


def _build(name: str, sources: list[str]) -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    h = hashlib.sha256(" ".join([cc, *_FLAGS, *sorted(cpu_flags())]).encode())
    for src in sources:
        with open(src, "rb") as f:
            h.update(f.read())
    out_dir = os.path.join(cache_root(), "kernels")
    target = os.path.join(out_dir, f"{name}-{h.hexdigest()[:16]}.so")
    if os.path.exists(target):
        return target
    os.makedirs(out_dir, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out_dir)
    os.close(fd)
    try:
        compiled = [src for src in sources if not src.endswith(".h")]  # headers only count in the hash
        proc = subprocess.run([cc, *_FLAGS, "-o", tmp, *compiled, "-lm"], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:500]}")
        os.replace(tmp, target)  # atomic: concurrent builders never see a half-written library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def load_library(name: str, sources: list[str]) -> Optional[ctypes.CDLL]:
    """The compiled library `name` built from `sources` (absolute paths; list the headers they include too, so
    that a changed header rebuilds it), or None when it cannot be built."""
    if name in _loaded:
        return _loaded[name]
    lib = None
    if os.environ.get("TOKENMILL_CPU_KERNELS", "1") == "0":
        _status[name] = "unavailable: disabled by TOKENMILL_CPU_KERNELS=0"
    else:
        try:
            lib = ctypes.CDLL(_build(name, sources))
            _status[name] = "loaded"
        except Exception as e:  # noqa: BLE001 - any build/load failure means: use the torch path
            logger.warning("CPU kernel %s unavailable (%s); using the torch path", name, e)
            _status[name] = f"unavailable: {_one_line(str(e))}"
    _loaded[name] = lib
    return lib


def library_status() -> dict[str, str]:
    """Every library this process tried to load: name -> "loaded" or "unavailable: <reason>"."""
    return dict(_status)


def _one_line(message: str) -> str:
    """The telling line of a (compiler) error: its first line that names an error, else its first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()] or ["unknown error"]
    return next((line for line in lines if "error" in line.lower()), lines[0])[:300]
