#!/usr/bin/env bash
# One GPU run for ISSUE 5, sized for a short lease (a few minutes): builds (make cuda), runs make test-gpu
# (kernels vs CPU references, causal limit, top-k determinism, OOM, pool, graphs, whole forwards vs the CPU
# engine) and the benchmark (scripts/bench-gpu.sh), and writes into RESULTS_DIR (default build/gpu-check):
#   env.txt (nvidia-smi, toolkit), build.log, test-gpu.log, bench.log, summary.txt (status lines, the
#   benchmark table and the targets).
# If the tree cannot be built there (the GPU image lacks this project's libraries) and build/gpu-bundle
# was carried along (scripts/gpu-bundle.sh, built where the dependencies are), its binaries are used.
# Extra arguments after RESULTS_DIR go to the benchmark. Exit 0 when everything ran and passed.
# Time: steps are capped (build 200 s, tests 150 s, benchmark 210 s) so the whole check fits one 600 s
# device command; expect about 3 minutes. At most 6 files are written (a device run returns up to 8).
set -u
cd "$(dirname "$0")/.."
R=${1:-build/gpu-check}
[ $# -gt 0 ] && shift
mkdir -p "$R"
R=$(cd "$R" && pwd)
: > "$R/summary.txt"
t0=$(date +%s)
say() { echo "[gpu-check +$(( $(date +%s) - t0 ))s] $*" | tee -a "$R/summary.txt"; }
{ date -u; uname -a; nvidia-smi 2>&1; command -v nvcc && nvcc --version; } > "$R/env.txt" 2>&1
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  say "no NVIDIA GPU here (nvidia-smi -L lists none): nothing to check"
  exit 0
fi
say "gpu: $(nvidia-smi -L | head -1)"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
jobs=$(nproc 2>/dev/null || echo 4)
status=0

# 1. build
if timeout 200 make -j"$jobs" cuda > "$R/build.log" 2>&1 && \
   timeout 60 make -j"$jobs" -f Makefile -f mk/cuda.mk CB_CUDA=1 gpu-tests >> "$R/build.log" 2>&1; then
  say "build: ok (make cuda)"
  unset CB_GPU_BIN_DIR
elif [ -x build/gpu-bundle/bin/test_gpu ] && [ -x build/gpu-bundle/bin/cb-bench-gpu ]; then
  export CB_GPU_BIN_DIR="$PWD/build/gpu-bundle/bin"
  say "build: make cuda FAILED here ($(grep -m1 -E 'error|Error' "$R/build.log" | cut -c1-160)); using the carried build/gpu-bundle"
else
  say "build: FAILED (see build.log: $(grep -m1 -E 'error|Error' "$R/build.log" | cut -c1-160))"
  exit 1
fi

# 2. tests
# what `make test-gpu` runs (without rebuilding `all`); with CB_GPU_BIN_DIR set it runs the bundle
timeout 150 tests/run-gpu.sh > "$R/test-gpu.log" 2>&1; rc=$?
cp build/test-logs/gpu-*.err "$R/" 2>/dev/null
say "tests: $(grep 'test-gpu:' "$R/test-gpu.log" | tail -1) (exit $rc)"
grep -E '^\[test_.*FAIL' "$R/test-gpu.log" | sed 's/^/  /' | tee -a "$R/summary.txt"
[ $rc -eq 0 ] || status=1

# 3. benchmark
timeout 210 scripts/bench-gpu.sh "$@" > "$R/bench.log" 2>&1; rc=$?
say "benchmark: exit $rc"
grep -E '^(\||  cuBLAS|  device|  host|  best|  precomputed|targets|  blend|  prefill|  decode|  [0-9]+-token)' "$R/bench.log" >> "$R/summary.txt"
[ $rc -eq 0 ] || status=1
say "done in $(( $(date +%s) - t0 ))s; logs in $R"
exit $status
