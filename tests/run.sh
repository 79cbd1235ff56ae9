#!/usr/bin/env bash
# Runs every unit test (normal and ASan/UBSan builds) and every integration test, then prints
# "N passed, N failed". Unit tests print "ok"/"FAIL"/"skip" lines; an integration test script
# passes when it exits 0 (exit 77 = skipped).
#
# Usage: tests/run.sh [--unit] [FILTER]
#   --unit   only the plain unit binaries, build/tests/test_*, CB_TEST_JOBS (default: the CPU count) at a
#            time (`make check`: the fast tier, about a minute)
#   FILTER   only the tests whose path contains FILTER
set -u
cd "$(dirname "$0")/.."
pass=0; fail=0; skip=0; failed=()
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export CB_LOG_LEVEL=${CB_LOG_LEVEL:-warn}
unit_only=0
if [ "${1:-}" = "--unit" ]; then unit_only=1; shift; fi
filter=${1:-}

run_unit() { # $1 = binary, $2 = label
  local bin=$1 label=$2 out rc
  out=$(timeout 600 "$bin" 2>"build/test-logs/$label.err"); rc=$?
  count_unit "$label" "$out" "$rc"
}
count_unit() { # $1 = label, $2 = its stdout, $3 = its exit status
  local label=$1 out=$2 rc=$3
  echo "$out" | sed "s/^/[$label] /"
  local p f s
  p=$(echo "$out" | grep -c '^ok ' || true)
  f=$(echo "$out" | grep -c '^FAIL ' || true)
  s=$(echo "$out" | grep -c '^skip ' || true)
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then f=1; echo "[$label] FAIL (exit $rc, see build/test-logs/$label.err)"; fi
  if [ "$f" -gt 0 ]; then failed+=("$label"); tail -20 "build/test-logs/$label.err" | sed "s/^/    /"; fi
  pass=$((pass + p)); fail=$((fail + f)); skip=$((skip + s))
}

mkdir -p build/test-logs
if [ "$unit_only" -eq 1 ]; then
  # The plain unit binaries, CB_TEST_JOBS at a time (default: one per CPU), the longest sources first;
  # their output is printed per binary, in that order, once all have run.
  units=()
  for src in $(ls -S tests/unit/test_*.c); do
    t=build/tests/$(basename "$src" .c)
    [ -x "$t" ] || continue
    [ -n "$filter" ] && [[ "$t" != *"$filter"* ]] && continue
    units+=("$t")
  done
  [ ${#units[@]} -gt 0 ] && printf '%s\0' "${units[@]}" |
    xargs -0 -P "${CB_TEST_JOBS:-$(nproc 2>/dev/null || echo 2)}" -I{} bash -c \
      'l=build/test-logs/$(basename "$1"); timeout 600 "$1" >"$l.out" 2>"$l.err"; echo $? >"$l.rc"' _ {}
  for t in "${units[@]}"; do
    l=build/test-logs/$(basename "$t")
    count_unit "$(basename "$t")" "$(cat "$l.out" 2>/dev/null)" "$(cat "$l.rc" 2>/dev/null || echo 1)"
  done
  [ ${#failed[@]} -gt 0 ] && echo "failed: ${failed[*]}"
  echo "$pass passed, $fail failed ($skip skipped)"
  [ "$fail" -eq 0 ]; exit
fi
for t in build/tests/test_*; do
  [ -x "$t" ] || continue
  [ -n "$filter" ] && [[ "$t" != *"$filter"* ]] && continue
  run_unit "$t" "$(basename "$t")"
done
for t in build/asan/tests/test_*; do
  [ -x "$t" ] || continue
  [ -n "$filter" ] && [[ "$t" != *"$filter"* ]] && continue
  run_unit "$t" "asan-$(basename "$t")"
done
# test_blend once more on its synthetic model (what runs where the real model is absent)
for t in build/tests/test_blend build/asan/tests/test_blend; do
  [ -x "$t" ] || continue
  [ -n "$filter" ] && [[ "$t" != *"$filter"* ]] && continue
  label="synth-$(basename "$t")"; [[ "$t" == build/asan/* ]] && label="synth-asan-$(basename "$t")"
  CB_TEST_SYNTH=1 run_unit "$t" "$label"
done
# and on the other architectures' synthetic layers (biases, NEOX RoPE, Q/K norms, rope_freqs, a SentencePiece
# vocabulary, gemma3's post-norms, GELU and sliding windows), normal build only
for arch in llama3 qwen2 qwen3 mistral gemma3; do
  t=build/tests/test_blend
  [ -x "$t" ] || continue
  [ -n "$filter" ] && [[ "$t" != *"$filter"* ]] && continue
  CB_TEST_SYNTH=1 CB_TEST_ARCH=$arch run_unit "$t" "synth-$arch-test_blend"
done
for t in tests/integration/*.sh; do
  [ -f "$t" ] || continue
  [ -n "$filter" ] && [[ "$t" != *"$filter"* ]] && continue
  label="it-$(basename "$t" .sh)"
  timeout 900 bash "$t" >"build/test-logs/$label.log" 2>&1; rc=$?
  if [ $rc -eq 0 ]; then echo "ok $label"; pass=$((pass+1))
  elif [ $rc -eq 77 ]; then echo "skip $label"; skip=$((skip+1))
  else echo "FAIL $label (exit $rc)"; tail -30 "build/test-logs/$label.log" | sed 's/^/    /'; fail=$((fail+1)); failed+=("$label"); fi
done
[ ${#failed[@]} -gt 0 ] && echo "failed: ${failed[*]}"
echo "$pass passed, $fail failed ($skip skipped)"
[ "$fail" -eq 0 ]
