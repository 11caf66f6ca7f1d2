#!/usr/bin/env bash
# The one prepared script for a lent GPU (see the device tool): CUDA correctness first, then timings, then the
# CPU kernels' tests on that machine's CPU (often another CPU kind than the development machine's).
# Writes everything under $OUT (default /tmp/gpu_check). Usage: bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENMILL_CACHE_DIR=${TOKENMILL_CACHE_DIR:-/tmp/tokenmill-cache}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep -E "Model name|^CPU\(s\)|Flags";
  python -c "import torch, sys; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available(), \
'cpu capability', torch.backends.cpu.get_cpu_capability()); \
import importlib.util as u; print('triton', u.find_spec('triton') is not None)"; } > "$OUT/env.txt" 2>&1
# 1. correctness: gpu-marked tests (tests/test_cuda.py: the engine vs transformers and the CPU engine;
#    the Triton attention kernel and quantized linears vs the CPU/dense references)
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider --durations=8 tests/test_cuda.py tests/test_attention.py \
  tests/test_quantization.py > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" >> "$OUT/gpu_tests.txt"
[ "${SKIP_TIMINGS:-0}" = 1 ] || {
# 2. timings: the nano-vllm workload (256 seqs, U[100,1024] in/out, Qwen3-0.6B shape, bf16)
timeout 200 python benchmarks/nano_vllm_workload.py --device cuda --dtype bfloat16 > "$OUT/nano_vllm.txt" 2>&1
echo "nano-vllm rc=$?" >> "$OUT/nano_vllm.txt"; }
# 3. the C kernels built with -march=native for this CPU, on 2 pinned cores, against the torch references
#    (CUDA hidden: these tests mean the CPU device; the default model is not on a bare GPU machine)
CUDA_VISIBLE_DEVICES= timeout 110 taskset -c 0,1 python -m pytest -q -p no:cacheprovider tests/test_cpu_linear.py tests/test_cpu_fused.py \
  tests/test_cpu_stack.py tests/test_matmul_plan.py tests/test_attention.py tests/test_batch_invariant.py \
  -k "not default_model and not server and not interpreter" > "$OUT/cpu_kernels.txt" 2>&1
echo "cpu kernel tests rc=$?" >> "$OUT/cpu_kernels.txt"
tail -n 4 "$OUT"/*.txt
