#!/usr/bin/env bash
# Runs the GPU tests (tests/gpu/test_*.c), the `make test-gpu` target. When `nvidia-smi -L` lists no GPU
# it prints why and exits 0 (skipped). Otherwise it builds the CUDA library and the test programs
# (mk/cuda.mk), runs them, prints their ok/FAIL/skip lines and "N passed, N failed", and exits 1 on any
# failure. Logs: build/test-logs/gpu-<test>.err. CB_GPU_BIN_DIR=dir runs prebuilt test programs from dir
# instead of building (scripts/gpu-bundle.sh makes them for a GPU machine that cannot build the tree).
set -u
cd "$(dirname "$0")/.."
if ! command -v nvidia-smi >/dev/null 2>&1; then
  echo "test-gpu: skipped: nvidia-smi not found (no NVIDIA driver on this machine)"
  exit 0
fi
if ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  echo "test-gpu: skipped: nvidia-smi -L lists no GPU"
  exit 0
fi
dir=build/gpu
if [ -n "${CB_GPU_BIN_DIR:-}" ]; then
  dir=$CB_GPU_BIN_DIR
else
  NVCC=${NVCC:-nvcc}
  if ! command -v "$NVCC" >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    export PATH="/usr/local/cuda/bin:$PATH"
  fi
  if ! command -v "$NVCC" >/dev/null 2>&1; then
    echo "test-gpu: FAIL: a GPU is present but nvcc (the CUDA toolkit) is not on PATH"
    exit 1
  fi
  jobs=$(nproc 2>/dev/null || echo 2)
  make -j"$jobs" -f Makefile -f mk/cuda.mk CB_CUDA=1 gpu-tests || { echo "test-gpu: FAIL: build"; exit 1; }
fi
mkdir -p build/test-logs
pass=0; fail=0; skip=0
for t in "$dir"/test_*; do
  [ -x "$t" ] || continue
  name=$(basename "$t")
  out=$(timeout 900 "$t" 2>"build/test-logs/gpu-$name.err"); rc=$?
  echo "$out" | sed "s/^/[$name] /"
  p=$(echo "$out" | grep -c '^ok ' || true)
  f=$(echo "$out" | grep -c '^FAIL ' || true)
  s=$(echo "$out" | grep -c '^skip ' || true)
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; echo "[$name] FAIL (exit $rc)"; fi
  if [ "$f" -gt 0 ]; then tail -40 "build/test-logs/gpu-$name.err" | sed 's/^/    /'; fi
  pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
done
echo "test-gpu: $pass passed, $fail failed ($skip skipped)"
[ "$fail" -eq 0 ]
