#!/usr/bin/env bash
# One GPU run, sized for a short lease: it covers the cross-backend tests and the GPU benchmark.
# Builds (make cuda, then the GPU test program), runs make test-gpu's tests (kernels vs CPU references,
# causal limit, deterministic top-k and attention mass, OOM, pools, graphs; the backend table op by op, CUDA
# vs the CPU reference, KV pool through shuffled block tables; whole forwards vs the CPU engine; and the one
# CacheBlend in every mode on a CPU and a CUDA engine, comparing selected rows, logits and greedy tokens)
# and the benchmark (scripts/bench-gpu.sh: device-resident prefill vs cuBLAS and decode vs HBM; blend vs
# full TTFT at 4K/8K/32K and a 64K blend through the CUDA engine); then the host CPU's integer kernel sets
# (the GPU hosts have AVX-512 VNNI and AMX, which the build machines may not): test_qdot (every set's bits are
# the scalar set's) and cb-bench --qdot (each set's speed per weight type). Writes into RESULTS_DIR (default
# build/gpu-check):
#   env.txt (nvidia-smi, toolkit, the CPU), build.log, test-gpu.log, gpu-test_gpu.err (the test's details),
#   bench.log, cpu.log, summary.txt (status lines, the cross-backend lines, the benchmark tables and the
#   targets, the kernel sets' table).
# If the tree cannot be built there (the GPU image lacks this project's libraries) and build/gpu-bundle
# was carried along (scripts/gpu-bundle.sh, built where the dependencies are), its binaries are used.
# Extra arguments after RESULTS_DIR go to the benchmark. Exit 0 when everything ran and passed.
# Time: every step is capped (build 180 s + 40 s, tests 140 s, benchmark 160 s, CPU kernels 30 + 30 + 20 s)
# so the whole check stays under 10 minutes; expect about 4. At most 7 files are written (a device run
# returns up to 8).
set -u
cd "$(dirname "$0")/.."
R=${1:-build/gpu-check}
[ $# -gt 0 ] && shift
mkdir -p "$R"
R=$(cd "$R" && pwd)
: > "$R/summary.txt"
t0=$(date +%s)
say() { echo "[gpu-check +$(( $(date +%s) - t0 ))s] $*" | tee -a "$R/summary.txt"; }
{ date -u; uname -a; nvidia-smi 2>&1; command -v nvcc && nvcc --version; grep -m1 'model name' /proc/cpuinfo
  echo "cpu flags: $(grep -m1 -o -w -E 'avx2|avx512f|avx512_vnni|amx_tile|amx_int8|amx_bf16' /proc/cpuinfo | sort -u | tr '\n' ' ')"
} > "$R/env.txt" 2>&1
if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then
  say "no NVIDIA GPU here (nvidia-smi -L lists none): nothing to check"
  exit 0
fi
say "gpu: $(nvidia-smi -L | head -1)"
if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then export PATH="/usr/local/cuda/bin:$PATH"; fi
jobs=$(nproc 2>/dev/null || echo 4)
status=0

# 1. build
if timeout 180 make -j"$jobs" cuda > "$R/build.log" 2>&1 && \
   timeout 40 make -j"$jobs" -f Makefile -f mk/cuda.mk CB_CUDA=1 gpu-tests >> "$R/build.log" 2>&1; then
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
timeout 140 tests/run-gpu.sh > "$R/test-gpu.log" 2>&1; rc=$?
cp build/test-logs/gpu-*.err "$R/" 2>/dev/null
say "tests: $(grep 'test-gpu:' "$R/test-gpu.log" | tail -1) (exit $rc)"
grep -E '^\[test_.*FAIL' "$R/test-gpu.log" | sed 's/^/  /' | tee -a "$R/summary.txt"
# the cross-backend blend: one line per mode; and the backend-table and forward comparisons
grep -hE 'selected overlap|backend kv:|forward vs CPU:|tie between' "$R"/gpu-*.err 2>/dev/null | sed 's/^ */  /' >> "$R/summary.txt"
[ $rc -eq 0 ] || status=1

# 3. benchmark
timeout 160 scripts/bench-gpu.sh "$@" > "$R/bench.log" 2>&1; rc=$?
say "benchmark: exit $rc"
grep -E '^(\||cb-bench-gpu|device-resident|CacheBlend|  cuBLAS|  device|  host|  best|  engine|  precomputed|targets|  blend|  prefill|  decode|  [0-9]+-token|  .* failed)' "$R/bench.log" >> "$R/summary.txt"
[ $rc -eq 0 ] || status=1

# 4. the host CPU's integer kernel sets
say "cpu: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//'); $(grep 'cpu flags' "$R/env.txt")"
if timeout 30 make -j"$jobs" build/tests/test_qdot build/bin/cb-bench > "$R/cpu.log" 2>&1; then
  timeout 30 build/tests/test_qdot >> "$R/cpu.log" 2>&1; rc=$?
  say "cpu kernels: test_qdot exit $rc; $(grep -m1 'AMX kernel sets run' "$R/cpu.log" | sed 's/^ *//')"
  [ $rc -eq 0 ] || status=1
  timeout 20 build/bin/cb-bench --qdot >> "$R/cpu.log" 2>&1 || status=1
  grep -A7 '^G multiply-adds' "$R/cpu.log" >> "$R/summary.txt"
else
  say "cpu kernels: not built here (see cpu.log); skipped"
fi
say "done in $(( $(date +%s) - t0 ))s; logs in $R"
exit $status
