#!/usr/bin/env bash
# The portable build: the CPU kernels compiled for plain x86-64 (no -march=native, so no AVX at compile time)
# still carry every intrinsic path (target attributes) and pick one at run time. Builds test_qmatmul and
# test_engine that way into a temporary directory and runs them on the path this CPU picks and on the scalar
# path (CB_CPU_ISA=scalar); test_engine's cpu_ops kernels then run their scalar code too.
set -u
cd "$(dirname "$0")/../.."
command -v gcc >/dev/null || { echo "skip: no gcc"; exit 77; }
[ "$(uname -m)" = x86_64 ] || { echo "skip: not x86-64"; exit 77; }
T=$(mktemp -d /tmp/cb_portable.XXXXXX)
trap 'rm -rf "$T"' EXIT
PKGS="openblas libsodium libxxhash"
SRC="kernels/cpu/*.c libshared/format/*.c libshared/model/model.c libshared/base/*.c libshared/engine/*.c"
CFLAGS="-std=c11 -D_GNU_SOURCE -Wall -Wextra -Werror -O2 -march=x86-64 -fopenmp -Ilibshared -Ikernels -Itests"
fail=0
for t in test_qmatmul test_engine; do
  # shellcheck disable=SC2086
  if ! gcc $CFLAGS $(pkg-config --cflags $PKGS) tests/unit/$t.c $SRC $(pkg-config --libs $PKGS) -lm -lpthread \
       -o "$T/$t" 2>"$T/$t.log"; then
    echo "FAIL: $t does not build for x86-64"; cat "$T/$t.log"; exit 1
  fi
  for isa in "" scalar; do
    out=$(CB_CPU_ISA=$isa CB_LOG_LEVEL=warn "$T/$t" 2>"$T/$t.err")
    f=$(echo "$out" | grep -c '^FAIL '); o=$(echo "$out" | grep -c '^ok ')
    echo "$t (x86-64 build, path ${isa:-auto}): $o ok, $f failed"
    if [ "$f" -ne 0 ] || [ "$o" -eq 0 ]; then echo "$out" | grep '^FAIL'; tail -20 "$T/$t.err"; fail=1; fi
  done
done
exit $fail
