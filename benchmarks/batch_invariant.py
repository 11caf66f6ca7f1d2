"""Cost of --batch-invariant: offline throughput and single-stream decode, default vs batch-invariant, in one
run on the default model (target: batch-invariant >= 0.8x default on both).

    python benchmarks/batch_invariant.py [--num-requests 64] [--dtype auto]
"""
from __future__ import annotations

import argparse
import json
import os

from tokenmill import LLM
from tokenmill.bench.offline import load_average, random_workload, run_single_stream, run_tokenmill


def measure(batch_invariant: bool, args, workload) -> dict:
    llm = LLM(args.model, dtype=args.dtype, batch_invariant=batch_invariant, max_num_seqs=256)
    llm.generate([{"prompt_token_ids": workload[0][0]}], use_tqdm=False)  # warm-up
    res = {"offline": run_tokenmill(llm, workload), "single_stream": run_single_stream(llm, 128, 128)}
    res["dtype"] = str(llm.config.model.torch_dtype).removeprefix("torch.")
    del llm
    return res


def main() -> None:
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")  # no figure from a slow path (kernels_report.py)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    workload = random_workload(args.num_requests, 49152, seed=args.seed)
    load = [load_average()]
    default = measure(False, args, workload)
    invariant = measure(True, args, workload)
    load.append(load_average())
    off = invariant["offline"]["output_tok_s"] / default["offline"]["output_tok_s"]
    single = invariant["single_stream"]["decode_tok_s"] / default["single_stream"]["decode_tok_s"]
    result = {"default": default, "batch_invariant": invariant, "offline_ratio": off, "single_stream_ratio": single,
              "num_requests": args.num_requests, "load_average": load}
    print(json.dumps(result, indent=2))
    print(f"batch-invariant vs default ({default['dtype']}): offline {invariant['offline']['output_tok_s']:.1f} vs "
          f"{default['offline']['output_tok_s']:.1f} out tok/s = {off:.2f}x; single stream "
          f"{invariant['single_stream']['decode_tok_s']:.1f} vs {default['single_stream']['decode_tok_s']:.1f} "
          f"tok/s = {single:.2f}x; load {load[0]:.1f} -> {load[1]:.1f}")


if __name__ == "__main__":
    main()
