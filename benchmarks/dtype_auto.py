"""`--dtype auto` on first starts, quiet and beside a busy neighbour: do they all pick the same dtype?

Each start is a fresh process resolving the default model's dtype the way `tokenmill serve` does
(ModelConfig.finalize on the CPU) with an empty $TOKENMILL_CACHE_DIR: no matmul plans, no resolution record,
so every start measures from nothing. Quiet and busy starts alternate (quiet, busy, quiet, ...) so that drift
in the machine's other load hits both alike; a busy start has a process spinning on one core beside it. Prints
one line per start (the dtype and the log line with both dtypes' timings) and a summary.

By default the converted GGUF and the compiled kernels are copied into each fresh cache (they take ~15 s to
rebuild and decide nothing about the dtype); --really-empty rebuilds them too.

    python benchmarks/dtype_auto.py            # 5 quiet + 5 busy
    python benchmarks/dtype_auto.py --starts 3 --really-empty
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import tempfile

from tokenmill.bench.startup import busy_neighbour

_CHILD = r"""
import json, logging
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("--dtype auto"):
            lines.append(record.getMessage())
logging.getLogger("tokenmill").addHandler(Keep())
logging.getLogger("tokenmill").setLevel(logging.INFO)
from tokenmill.config import ModelConfig
from tokenmill.models.resolution import Resolver
mc = ModelConfig()
mc.finalize("cpu", Resolver())
print(json.dumps({"dtype": mc.dtype_name, "log": lines[-1] if lines else "(no --dtype auto line)"}))
"""


def warm_parts(really_empty: bool) -> str | None:
    """A cache holding only the converted default model and the compiled kernels (None: --really-empty)."""
    if really_empty:
        return None
    from tokenmill.config import ModelConfig
    from tokenmill.host import cache_root
    from tokenmill.models.resolution import Resolver

    ModelConfig().finalize("cpu", Resolver())  # converts the GGUF and builds the kernels once, into the user's cache
    parts = tempfile.mkdtemp(prefix="dtype-auto-parts-")
    for name in ("gguf", "kernels"):
        if os.path.isdir(os.path.join(cache_root(), name)):
            shutil.copytree(os.path.join(cache_root(), name), os.path.join(parts, name), symlinks=True)
    return parts


def first_start(parts: str | None, busy: bool) -> dict:
    cache = tempfile.mkdtemp(prefix="dtype-auto-")
    try:
        if parts is not None:
            shutil.copytree(parts, cache, dirs_exist_ok=True, symlinks=True)
        env = dict(os.environ, TOKENMILL_CACHE_DIR=cache)
        env.pop("TOKENMILL_MATMUL", None)
        with busy_neighbour(busy):
            out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                                 timeout=900)
        if out.returncode != 0:
            raise RuntimeError(f"the start failed:\n{out.stderr[-2000:]}")
        return dict(json.loads(out.stdout.strip().splitlines()[-1]), busy=busy)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--starts", type=int, default=5, help="first starts of each kind (quiet, busy)")
    p.add_argument("--really-empty", action="store_true", help="also rebuild the converted model and kernels")
    args = p.parse_args()
    parts = warm_parts(args.really_empty)
    runs = []
    try:
        for i in range(2 * args.starts):
            run = first_start(parts, busy=i % 2 == 1)
            runs.append(run)
            print(f"{'busy ' if run['busy'] else 'quiet'} {run['dtype']:<9} {run['log']}", flush=True)
    finally:
        if parts is not None:
            shutil.rmtree(parts, ignore_errors=True)
    counts = collections.Counter((r["busy"], r["dtype"]) for r in runs)
    picked = {r["dtype"] for r in runs}
    print(f"quiet: {dict((d, n) for (b, d), n in counts.items() if not b)}; "
          f"busy: {dict((d, n) for (b, d), n in counts.items() if b)}; load average {os.getloadavg()[0]:.1f}; "
          + ("all picked " + picked.pop() if len(picked) == 1 else "DIFFERENT dtypes picked"))
    return 0 if len(picked) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
