#!/usr/bin/env bash
# The accelerator check: on a machine with one NVIDIA GPU, install the `cuda` extra, list the GPU, check parity
# on 2 logical GPUs split from it, and print Single images/s (batch 64 and 1,024; float32 and mixed_bfloat16)
# and DataParallel(2) images/s. Bounded to 8 minutes. Without a GPU it says so and checks the CPU path only.
#
# Run from the repository root: bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
    nvidia-smi -L
    pip install -q -e ".[cuda]"
else
    echo "gpu_check: no NVIDIA GPU here (nvidia-smi finds none); the GPU part is skipped, the CPU path runs."
    pip install -q -e .
fi
timeout 480 python benchmarks/gpu_check.py
