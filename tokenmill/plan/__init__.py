"""`tokenmill plan`: memory and roofline arithmetic for a model on a piece of hardware.

    tokenmill plan Llama-3.1-8B --hardware h100 --batch-size 32 --input-len 2048 --output-len 256 --json
"""
from __future__ import annotations

import argparse
import json
import sys

from tokenmill.plan.hardware import CATALOG, Hardware, get_hardware, hardware_names, measure_local_cpu
from tokenmill.plan.memory import PRESETS, ModelShape, load_model_shape, memory_plan, normalize_dtype
from tokenmill.plan.roofline import StepStatsLogger, default_compute_dtype, format_plan, make_plan

__all__ = ["CATALOG", "Hardware", "ModelShape", "PRESETS", "StepStatsLogger", "add_plan_args", "format_plan",
           "get_hardware", "load_model_shape", "make_plan", "measure_local_cpu", "memory_plan", "run_plan"]


def add_plan_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None,
                   help=f"local HF directory (config.json alone suffices), a config.json, or a preset: "
                        f"{', '.join(PRESETS)} (default: SmolLM2-135M, the built-in default model)")
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hardware", default="local-cpu",
                   help=f"one of {', '.join(hardware_names())} (local-cpu is measured now; default)")
    p.add_argument("--weight-dtype", default="auto",
                   help="fp32, bf16, fp16, fp8, int8, int4, fp4 (default auto: bf16; on local-cpu what the engine "
                        "picks, bf16 with AVX512-BF16, else fp32)")
    p.add_argument("--kv-dtype", default="auto", help="KV cache dtype (default: bf16, fp32 for fp32 weights)")
    p.add_argument("--compute-dtype", default=None,
                   help="dtype of the matmuls (default: from the weights; 4-bit weight-only runs in bf16)")
    p.add_argument("--batch-size", type=int, default=1, help="concurrent sequences")
    p.add_argument("--input-len", type=int, default=2048, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per sequence")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="devices the model is split over (tensor parallel)")
    p.add_argument("--memory-utilization", type=float, default=0.9,
                   help="fraction of memory for weights + KV (like --gpu-memory-utilization)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--list", action="store_true", help="list the model presets and hardware, then exit")
    p.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    if args.list:
        print("models:   " + ", ".join(PRESETS))
        print("hardware: " + ", ".join(hardware_names()))
        return 0
    if not 0 < args.memory_utilization <= 1:
        raise ValueError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization}")
    shape = load_model_shape(args.model_flag or args.model)
    local = args.hardware.lower() in ("local-cpu", "local", "cpu")
    weight_dtype = args.weight_dtype
    if weight_dtype == "auto":
        from tokenmill.config import cpu_has_avx512_bf16

        weight_dtype = "fp32" if local and not cpu_has_avx512_bf16() else "bf16"
    compute = normalize_dtype(args.compute_dtype) if args.compute_dtype else default_compute_dtype(weight_dtype)
    hw = get_hardware(args.hardware, measure_dtypes=(compute,))
    plan = make_plan(shape, hw, weight_dtype, args.kv_dtype, args.batch_size, args.input_len, args.output_len,
                     args.tp, compute, args.memory_utilization)
    if args.json:
        json.dump(plan, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_plan(plan))
    return 0
