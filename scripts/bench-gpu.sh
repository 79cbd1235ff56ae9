#!/usr/bin/env bash
# GPU benchmark, cb-bench-gpu: the device-resident reference on a synthetic llama3-8b built in
# device memory (full-prefill TFLOP/s vs the cuBLAS peak, decode vs the HBM bound, peak memory), then the one
# CacheBlend (libshared/blend) through an engine on the CUDA backend: engine full prefill vs blend TTFT at
# 4K/8K/32K and a 64K-token blend, on the llama3-8b geometry with 4 layers by default (--engine-layers).
# Builds build/bin/cb-bench-gpu (CB_CUDA=1) unless CB_GPU_BIN_DIR names a directory holding a prebuilt
# one (scripts/gpu-bundle.sh). Arguments are passed to cb-bench-gpu (see its --help). Without a GPU it
# says so and exits 0. The engine part writes a few GB model file to $TMPDIR (default /tmp), removed
# once loaded.
set -u
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "bench-gpu: skipped: no NVIDIA GPU found (nvidia-smi -L lists none)"
  exit 0
fi
if [ -n "${CB_GPU_BIN_DIR:-}" ]; then
  bin="$CB_GPU_BIN_DIR/cb-bench-gpu"
else
  if ! command -v "${NVCC:-nvcc}" >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  make -j"$(nproc 2>/dev/null || echo 2)" CB_CUDA=1 build/bin/cb-bench-gpu >&2 || { echo "bench-gpu: build failed"; exit 1; }
  bin=build/bin/cb-bench-gpu
fi
[ -x "$bin" ] || { echo "bench-gpu: $bin not found"; exit 1; }
exec "$bin" "$@"
