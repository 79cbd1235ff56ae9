#!/usr/bin/env bash
# Runs every unit test (normal and ASan/UBSan builds) and every integration test, then prints
# "N passed, N failed". Unit tests print "ok"/"FAIL"/"skip" lines; an integration test script
# passes when it exits 0 (exit 77 = skipped).
set -u
cd "$(dirname "$0")/.."
pass=0; fail=0; skip=0; failed=()
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=0}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export CB_LOG_LEVEL=${CB_LOG_LEVEL:-warn}
filter=${1:-}

run_unit() { # $1 = binary, $2 = label
  local bin=$1 label=$2 out rc
  out=$(timeout 600 "$bin" 2>"build/test-logs/$label.err"); rc=$?
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
