#!/usr/bin/env bash
# The one prepared script for a lent GPU (see the device tool): CUDA correctness first, then timings.
# Writes everything under $OUT (default /tmp/gpu_check). Usage: bash benchmarks/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export TOKENMILL_CACHE_DIR=${TOKENMILL_CACHE_DIR:-/tmp/tokenmill-cache}
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; python -c "import torch, sys; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'available', torch.cuda.is_available()); \
import importlib.util as u; print('triton', u.find_spec('triton') is not None)"; } > "$OUT/env.txt" 2>&1
pip install -q --no-deps -e . > /dev/null 2>&1 || true
# 1. correctness: gpu-marked tests (CUDA backend vs CPU backend and the dense reference)
timeout 240 python -m pytest -q -m gpu -p no:cacheprovider tests/ > "$OUT/gpu_tests.txt" 2>&1
echo "gpu tests rc=$?" >> "$OUT/gpu_tests.txt"
# 2. timings: the nano-vllm workload (256 seqs, U[100,1024] in/out, Qwen3-0.6B shape, bf16)
timeout 300 python benchmarks/nano_vllm_workload.py --device cuda --dtype bfloat16 > "$OUT/nano_vllm.txt" 2>&1
echo "nano-vllm rc=$?" >> "$OUT/nano_vllm.txt"
tail -n 3 "$OUT"/*.txt
