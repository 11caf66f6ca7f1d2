"""`tokenmill plan`: memory and roofline arithmetic for a model on a piece of hardware.

    tokenmill plan Llama-3.1-8B --hardware h100 --batch-size 32 --input-len 2048 --output-len 256 --json
    tokenmill plan Llama-3.1-70B --hardware h100 --num-nodes 2 --devices-per-node 8     # the rules' split
    tokenmill plan Qwen3-235B-A22B --hardware h200 -tp 8 --enable-expert-parallel       # per device, comm
    tokenmill plan Llama-3.1-70B --hardware h100 --disaggregate 2P2D --request-rate 4   # colocated vs xPyD
    tokenmill plan --trace load.jsonl --replica-bench replica.json --plot replicas.png  # autoscaled replay
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Optional

from tokenmill.host import cpu_has_avx512_bf16
from tokenmill.models.shape import gguf_weight_dtype, load_model_shape
from tokenmill.perf.hardware import (CATALOG, INTERCONNECTS, Hardware, get_hardware, get_interconnect,
                                     hardware_names, measure_local_cpu)
from tokenmill.perf.memory import GGUF, PRESETS, ModelShape, memory_plan, normalize_dtype
from tokenmill.perf.parallel import Split, check_split, choose_split
from tokenmill.perf.roofline import default_compute_dtype, format_plan, make_plan
from tokenmill.plan.trace_report import add_trace_args, run_trace

__all__ = ["CATALOG", "INTERCONNECTS", "Hardware", "ModelShape", "PRESETS", "Split", "add_plan_args",
           "choose_split", "format_plan", "get_hardware", "get_interconnect", "load_model_shape", "make_plan",
           "measure_local_cpu", "memory_plan", "run_plan"]


def add_plan_args(p: argparse.ArgumentParser) -> None:
    _add_model_args(p)
    _add_workload_args(p)
    _add_disagg_args(p)
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--list", action="store_true", help="list the model presets and hardware, then exit")
    add_trace_args(p)
    p.set_defaults(func=run_plan)


def _add_model_args(p: argparse.ArgumentParser) -> None:
    """The model, the hardware and the dtypes."""
    p.add_argument("model", nargs="?", default=None,
                   help=f"local HF directory (config.json alone suffices), a config.json, a .gguf file, or a "
                        f"preset: {', '.join(PRESETS)} (default: the built-in default model, SmolLM2-135M's "
                        f"Q4_1 GGUF)")
    p.add_argument("--model", dest="model_flag", default=None, help=argparse.SUPPRESS)
    p.add_argument("--hardware", default="local-cpu",
                   help=f"one of {', '.join(hardware_names())} (local-cpu is measured now; default)")
    p.add_argument("--weight-dtype", default="auto",
                   help="fp32, bf16, fp16, fp8, int8, int4 (Q4_1 blocks, 5 bits), fp4, gguf (a .gguf model's own "
                        "blocks: each tensor's real bytes) or gguf:<bits per weight> (any model at that average, "
                        "e.g. gguf:4.85 for Q4_K_M). Default auto: gguf for a quantized GGUF served natively "
                        "(--gguf-weights); else bf16, on local-cpu what the engine picks, bf16 with AVX512-BF16, "
                        "else fp32")
    p.add_argument("--gguf-weights", default="auto", choices=["auto", "native", "dequantize"],
                   help="as serve's flag: a GGUF's weights native (its own block types, counted at their real "
                        "bytes) or dequantize (float at the serving dtype); auto = native for a quantized GGUF")
    p.add_argument("--kv-dtype", default="auto",
                   help="KV cache dtype (default: bf16, fp32 for fp32 weights; for a GGUF's blocks the engine's "
                        "float dtype)")
    p.add_argument("--compute-dtype", default=None,
                   help="dtype of the matmuls (default: from the weights; 4-bit weight-only and GGUF blocks run "
                        "in bf16, or on local-cpu without AVX512-BF16 in fp32)")


def _add_workload_args(p: argparse.ArgumentParser) -> None:
    """The batch, the lengths, the split over devices and the memory budget."""
    p.add_argument("--batch-size", type=int, default=1, help="concurrent sequences")
    p.add_argument("--input-len", type=int, default=2048, help="prompt tokens per sequence")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per sequence")
    p.add_argument("--tensor-parallel-size", "-tp", "--tp", dest="tp", type=int, default=None,
                   help="devices each layer is split over (tensor parallel; default 1, or the rules' pick with "
                        "--num-nodes/--devices-per-node)")
    p.add_argument("--pipeline-parallel-size", "-pp", "--pp", dest="pp", type=int, default=None,
                   help="consecutive stages the layers are split into (pipeline parallel; default 1)")
    p.add_argument("--enable-expert-parallel", action="store_true",
                   help="MoE: whole experts spread over the tensor-parallel ranks instead of a slice of each")
    p.add_argument("--num-nodes", type=int, default=None,
                   help="machines available: with it (or --devices-per-node) the plan says which split the rules "
                        "pick, and plans that split unless -tp/-pp are given")
    p.add_argument("--devices-per-node", type=int, default=None,
                   help="devices per machine (default 8; on local-cpu the ranks are processes of this machine)")
    p.add_argument("--interconnect", default=None,
                   help=f"link between the devices of a node: {', '.join(i.name for i in INTERCONNECTS.values())} "
                        "(default: the hardware's NVLink generation, PCIe otherwise; loopback on local-cpu)")
    p.add_argument("--network", default=None, help="link between nodes (default InfiniBand-NDR)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="tokens of the largest step, for the activation estimate (the engine's default 2048)")
    p.add_argument("--memory-utilization", type=float, default=0.9,
                   help="fraction of memory for weights + KV (like --gpu-memory-utilization)")


def _add_disagg_args(p: argparse.ArgumentParser) -> None:
    """--disaggregate and its traffic."""
    p.add_argument("--disaggregate", default=None, metavar="xPyD",
                   help="compare x prefill + y decode instances (e.g. 1P1D, 2P2D) with the same x + y instances "
                        "colocated: TTFT, ITL P50/P99, pool utilisation, break-even traffic and a verdict "
                        "(docs/plan.md); each instance is -tp devices (default: the fewest that hold the weights "
                        "with KV headroom); the KV goes over --network")
    p.add_argument("--request-rate", type=float, default=1.0,
                   help="with --disaggregate: requests/s arriving (Poisson), all instances together (default 1)")
    p.add_argument("--long-fraction", type=float, default=0.0,
                   help="with --disaggregate: share of requests whose prompt is --long-input-len tokens instead "
                        "of --input-len (chat plus periodic long prompts; default 0)")
    p.add_argument("--long-input-len", type=int, default=None,
                   help="with --disaggregate: the long prompts' tokens; given alone, the plan also says from which "
                        "share of such prompts xPyD pays")


def run_plan(args: argparse.Namespace) -> int:
    if args.list:
        print("models:   " + ", ".join(PRESETS))
        print("hardware: " + ", ".join(hardware_names()))
        print("links:    " + ", ".join(f"{i.name} ({i.bandwidth / 1e9:g} GB/s, {i.latency * 1e6:g} us, nominal)"
                                       for i in INTERCONNECTS.values()))
        return 0
    if args.trace or args.make_trace:
        return run_trace(args)
    if not 0 < args.memory_utilization <= 1:
        raise ValueError(f"--memory-utilization must be in (0, 1], got {args.memory_utilization}")
    shape = load_model_shape(args.model_flag or args.model)
    if args.disaggregate is not None:
        return run_disagg(args, shape)
    local = args.hardware.lower() in ("local-cpu", "local", "cpu")
    weight_dtype, kv_dtype, compute = _dtypes(args, local)
    hw = get_hardware(args.hardware, measure_dtypes=(compute,))
    choice, (tp, pp, ep) = resolve_split(args, shape, hw, weight_dtype)
    links = {k: get_interconnect(v) for k, v in (("node_link", args.interconnect), ("net_link", args.network)) if v}
    plan = make_plan(shape, hw, weight_dtype, kv_dtype, args.batch_size, args.input_len, args.output_len,
                     tp, compute, args.memory_utilization, pp, ep, devices_per_node=args.devices_per_node,
                     max_batched_tokens=args.max_num_batched_tokens, **links)
    if choice is not None:
        plan["rules_pick"] = {**choice, "split": str(choice["split"]) if choice["split"] else None}
    if args.json:
        json.dump(plan, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_plan(plan))
    return 0


def _dtypes(args: argparse.Namespace, local: bool) -> tuple[str, str, str]:
    """(weights, KV, matmuls). Weights: --weight-dtype; auto is gguf where the engine serves a GGUF in its own
    blocks (--gguf-weights), else the engine's float dtype: bf16, on local-cpu bf16 with AVX512-BF16, else fp32.
    Beside GGUF blocks, the KV cache and the matmuls (dequantized tiles) are in that float dtype too."""
    float_dtype = "fp32" if local and not cpu_has_avx512_bf16() else "bf16"
    weight = args.weight_dtype
    if weight == "auto":
        weight = gguf_weight_dtype(args.model_flag or args.model, args.gguf_weights) or float_dtype
    weight = normalize_dtype(weight)
    gguf = weight == GGUF
    kv = normalize_dtype(args.kv_dtype) if args.kv_dtype != "auto" else \
        (float_dtype if gguf else "fp32" if weight == "fp32" else "bf16")
    compute = normalize_dtype(args.compute_dtype) if args.compute_dtype else \
        (float_dtype if gguf else default_compute_dtype(weight))
    return weight, kv, compute


def resolve_split(args: argparse.Namespace, shape: ModelShape, hw: Hardware,
                  weight_dtype: str) -> tuple[Optional[dict], tuple[int, int, bool]]:
    """(the rules' pick when a device count is given, else None; the (tp, pp, ep) to plan): the user's flags,
    or the pick when -tp/-pp are not given."""
    for flag, value in (("--num-nodes", args.num_nodes), ("--devices-per-node", args.devices_per_node),
                        ("--max-num-batched-tokens", args.max_num_batched_tokens)):
        if value is not None and value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    split = (1 if args.tp is None else args.tp, 1 if args.pp is None else args.pp, args.enable_expert_parallel)
    check_split(shape, Split(*split))
    if args.num_nodes is None and args.devices_per_node is None:
        return None, split
    nodes, per_node = args.num_nodes or 1, args.devices_per_node or 8
    if split[0] * split[1] > nodes * per_node:
        raise ValueError(f"TP {split[0]} x PP {split[1]} needs {split[0] * split[1]} devices; "
                         f"{nodes} node(s) x {per_node} have {nodes * per_node}")
    choice = choose_split(shape, hw, weight_dtype, nodes, per_node)
    if args.tp is None and args.pp is None and choice["split"] is not None:
        pick = choice["split"]
        split = (pick.tp, pick.pp, pick.ep or args.enable_expert_parallel)
    return choice, split


def run_disagg(args: argparse.Namespace, shape: ModelShape) -> int:
    from tokenmill.plan.disagg import Traffic, disagg_plan, format_disagg, parse_xpyd  # ~7 ms: only --disaggregate

    x, y = parse_xpyd(args.disaggregate)
    if args.pp not in (None, 1) or args.num_nodes is not None or args.devices_per_node is not None \
            or args.enable_expert_parallel:
        raise ValueError("--disaggregate plans instances of -tp devices each; it does not take -pp, --num-nodes, "
                         "--devices-per-node or --enable-expert-parallel")
    if args.tp is not None:
        check_split(shape, Split(args.tp))
    local = args.hardware.lower() in ("local-cpu", "local", "cpu")
    weight_dtype, kv_dtype, compute = _dtypes(args, local)
    hw = get_hardware(args.hardware, measure_dtypes=(compute,))
    traffic = Traffic(args.request_rate, args.input_len, args.output_len, args.long_fraction, args.long_input_len)
    plan = disagg_plan(shape, hw, x, y, traffic, args.tp, weight_dtype, kv_dtype, compute,
                       args.max_num_batched_tokens, args.memory_utilization,
                       get_interconnect(args.network) if args.network else None,
                       get_interconnect(args.interconnect) if args.interconnect else None)
    if args.json:
        json.dump(plan, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(format_disagg(plan))
    return 0
