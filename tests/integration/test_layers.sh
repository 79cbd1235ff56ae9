#!/usr/bin/env bash
# Integration test of scripts/check-layers: the real tree passes it; copies of libshared/ and kernels/
# with one planted violation each fail it with a message naming the file: an upward include (format ->
# blend, rag -> wire, wire -> svc), wire including a layer other than base (kv), a direct kernel call in
# blend.c and in model.c, an include without a layer folder, a kernel header included from rag/ and from
# model.c (only the backend registry names a backend), kernels files including engine.h and model.h (above
# the floor they implement, tensor/), tensor/ including model/, and raw allocations (malloc in a service,
# in a tool and in a test tool, strdup in libshared) outside the allocation seam. A planted call in a
# comment or a string is not a call. Needs
# only python3 (exit 77 without it).
set -u
cd "$(dirname "$0")/../.."
command -v python3 >/dev/null || { echo "skip: no python3"; exit 77; }
FAILS=0
check() {
  if [ "$2" = "$3" ]; then echo "ok: $1"; else echo "FAIL: $1: got '$2', expected '$3'"; FAILS=$((FAILS+1)); fi
}
T=$(mktemp -d /tmp/cb-layers.XXXXXX)
trap 'rm -rf "$T"' EXIT

# --- the real tree
out=$(scripts/check-layers 2>&1); rc=$?
check "the real tree follows the layers" "$rc" "0"
[ "$rc" -eq 0 ] || echo "$out" | sed 's/^/    /'

# fresh copy of the libraries (and the script) in $T/tree
fresh() {
  rm -rf "$T/tree"
  mkdir -p "$T/tree/scripts" "$T/tree/tests"
  cp -r libshared kernels services tools "$T/tree/"
  cp -r tests/tools "$T/tree/tests/"
  cp scripts/check-layers "$T/tree/scripts/"
}
# expect_violation DESCRIPTION PATTERN: check-layers on the copy fails, a line matches PATTERN
expect_violation() {
  local out rc
  out=$("$T/tree/scripts/check-layers" "$T/tree" 2>&1); rc=$?
  check "$1: exit 1" "$rc" "1"
  check "$1: reported" "$(echo "$out" | grep -c -E "$2")" "1"
}

fresh
out=$("$T/tree/scripts/check-layers" "$T/tree" 2>&1); rc=$?
check "the copy checks like the real tree" "$rc" "$(scripts/check-layers >/dev/null 2>&1; echo $?)"

fresh
printf '#include "wire/msg.h"\n' >>"$T/tree/libshared/rag/qa.c"
expect_violation "rag includes wire" '^libshared/rag/qa\.c:[0-9]+: rag includes wire \(wire/msg\.h\)$'

fresh
printf '#include "svc/session.h"\n' >>"$T/tree/libshared/wire/msg.c"
expect_violation "wire includes svc" '^libshared/wire/msg\.c:[0-9]+: wire includes svc \(svc/session\.h\)$'

fresh
printf '#include "kv/kvremote.h"\n' >>"$T/tree/libshared/wire/config.c"
expect_violation "wire includes kv" '^libshared/wire/config\.c:[0-9]+: wire includes kv \(kv/kvremote\.h\): wire/ includes only base/$'

fresh
printf '#include "blend/blend.h"\n' >>"$T/tree/libshared/format/quant.c"
expect_violation "format includes blend" '^libshared/format/quant\.c:[0-9]+: format includes blend \(blend/blend\.h\)$'

fresh
printf 'static void x(void){cb_cpu_add(0,0,0);}\n' >>"$T/tree/libshared/blend/blend.c"
expect_violation "a kernel call in blend.c" \
  '^libshared/blend/blend\.c:[0-9]+: blend calls a kernel outside the backend table \(cb_cpu_add\)$'

fresh
printf '#include "engine.h"\n' >>"$T/tree/libshared/kv/kvmem.c"
expect_violation "an include without a layer folder" '^libshared/kv/kvmem\.c:[0-9]+: kv includes a header without a layer folder \(engine\.h\)$'

fresh
printf '#include "cpu/cpu_ops.h"\n' >>"$T/tree/libshared/rag/qa.c"
expect_violation "a kernel header in rag" '^libshared/rag/qa\.c:[0-9]+: rag includes kernels \(cpu/cpu_ops\.h\)'

fresh
printf '#include "cpu/cpu_quant.h"\n' >>"$T/tree/libshared/model/model.c"
expect_violation "a kernel header in model.c" \
  '^libshared/model/model\.c:[0-9]+: model includes kernels \(cpu/cpu_quant\.h\): only the backend registry'

fresh
printf 'static void x(void){cb_cpu_x8_pack(0,0);}\n' >>"$T/tree/libshared/model/model.c"
expect_violation "a kernel call in model.c" \
  '^libshared/model/model\.c:[0-9]+: model calls a kernel outside the backend table \(cb_cpu_x8_pack\)$'

fresh
printf '#include "engine/engine.h"\n' >>"$T/tree/kernels/cpu/cpu_pool.c"
expect_violation "kernels include engine.h" '^kernels/cpu/cpu_pool\.c:[0-9]+: kernels includes engine \(engine/engine\.h\)'

fresh
printf '#include "model/model.h"\n' >>"$T/tree/kernels/cpu/cpu_quant.c"
expect_violation "a kernel includes model.h" '^kernels/cpu/cpu_quant\.c:[0-9]+: kernels includes model \(model/model\.h\)'

fresh
printf '#include "engine/backend.h"\n' >>"$T/tree/kernels/cuda/cb_cuda_backend.cu"
expect_violation "a CUDA kernel includes backend.h" \
  '^kernels/cuda/cb_cuda_backend\.cu:[0-9]+: kernels includes engine \(engine/backend\.h\)'

fresh
printf '#include "model/model.h"\n' >>"$T/tree/libshared/tensor/tensor.h"
expect_violation "tensor includes model" '^libshared/tensor/tensor\.h:[0-9]+: tensor includes model \(model/model\.h\)$'

fresh
printf '/* cb_cpu_add(0, 0, 0) */\nstatic const char *x_ = "cb_cuda_free(p)"; // cb_pool_run(p)\n' >>"$T/tree/libshared/kv/kvmem.c"
out=$("$T/tree/scripts/check-layers" "$T/tree" 2>&1)
check "calls in comments and strings are not calls" "$(echo "$out" | grep -c '^libshared/kv/kvmem\.c')" "0"

fresh
printf 'static void *x_(void){return malloc(4);}\n' >>"$T/tree/services/precompute/jobs.c"
expect_violation "a raw malloc in a service" \
  '^services/precompute/jobs\.c:[0-9]+: calls malloc outside the allocation seam \(base/alloc\.h: cb_malloc\)$'

fresh
printf 'static void *x_(void){return calloc(1, 4);}\n' >>"$T/tree/tools/common/args.c"
expect_violation "a raw calloc in a tool" \
  '^tools/common/args\.c:[0-9]+: calls calloc outside the allocation seam \(base/alloc\.h: cb_calloc\)$'

fresh
printf 'static void *x_(void *p){return realloc(p, 4);}\n' >>"$T/tree/tests/tools/cb-slow.c"
expect_violation "a raw realloc in a test tool" \
  '^tests/tools/cb-slow\.c:[0-9]+: calls realloc outside the allocation seam \(base/alloc\.h: cb_realloc\)$'

fresh
printf 'static char *y_(const char *s){return strdup(s);}\n' >>"$T/tree/libshared/rag/qa.c"
expect_violation "a raw strdup in libshared" '^libshared/rag/qa\.c:[0-9]+: calls strdup outside the allocation seam'

fresh
printf '/* malloc(4) */\nstatic const char *z_ = "calloc(1, 2)";\n' >>"$T/tree/services/precompute/jobs.c"
out=$("$T/tree/scripts/check-layers" "$T/tree" 2>&1)
check "allocations in comments and strings are not calls" "$(echo "$out" | grep -c '^services/precompute/jobs\.c')" "0"

if [ "$FAILS" -gt 0 ]; then echo "$FAILS check(s) failed"; exit 1; fi
echo "all checks passed"
