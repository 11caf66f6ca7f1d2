"""Cold and warm start of `tokenmill serve` on the default model: process spawn to /health 200, with the
server's own start-up ledger per phase. A thin wrapper of `tokenmill bench startup` (tokenmill/bench/startup.py),
which is the one place this is measured.

    python benchmarks/start_time.py [-n 3] [--serve-args '...']
"""
from __future__ import annotations

import os
import sys

from tokenmill.cli import main

if __name__ == "__main__":
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")  # no figure from a slow path (kernels_report.py)
    sys.exit(main(["bench", "startup", *sys.argv[1:]]))
