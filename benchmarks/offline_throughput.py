"""Offline throughput: tokenmill vs transformers `generate` on the same random workload, in one run.

The measurement lives in tokenmill/bench/offline.py (also `tokenmill bench offline MODEL`); this script
compares against transformers by default (--skip-transformers to leave it out).
Prints a JSON result and one summary line.
"""
from __future__ import annotations

import argparse
import json
import os

from tokenmill.bench.offline import add_offline_args, run_offline, summary_line


def main() -> None:
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")  # no figure from a slow path (kernels_report.py)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="HF dir or .gguf (default: built-in default model)")
    add_offline_args(ap, compare_transformers=True)
    args = ap.parse_args()
    result = run_offline(args.model, args)
    print(json.dumps(result, indent=2))
    if args.save_result:
        with open(args.save_result, "w") as f:
            json.dump(result, f, indent=2)
    print(summary_line(result))


if __name__ == "__main__":
    main()
