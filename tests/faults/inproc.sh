#!/usr/bin/env bash
# tests/faults/inproc.sh: every failing call inside the process, one at a time.
#   build/fault/cb-faultpaths (tests/faults/inproc/cb-faultpaths.c; the fault build: -DCB_FAULT_INJECT, ASan +
#   UBSan) runs each main path (config, msg, tokenize, model, kvfile, ingest, query) once per failure point:
#   the Nth allocation (base/alloc.h, SQLite's and jansson's allocators), or the Nth read, write, fsync, rename
#   or map of the KV files, the config and the job database (base/sysio.h, a test VFS under SQLite) fails with
#   ENOSPC or EIO, for N = 1, 2, ... until the path needs fewer calls. Each point must give a clean error (or
#   the same result), leave no torn file under a final name, succeed with the same result when run again
#   without the fault, and leak nothing. One row per path; the full table is build/faults/inproc.md.
#   CB_FAULTS_QUICK=1 runs at most 200 points per path and kind.
. "$(dirname "$0")/lib/faults.bash"
faults_begin inproc
BIN=build/fault/cb-faultpaths
if ! make -s -j2 "$BIN" >"$T/build.log" 2>&1; then
  faults_row_begin "cb-faultpaths"
  fail "cannot build $BIN: $(tail -3 "$T/build.log" | tr '\n' ' ')"
  faults_row_end
  faults_finish
fi
if [ ! -f models/vocab/smollm2.gguf ] || [ ! -f models/vocab/gemma3.gguf ]; then
  echo "skip: no vocabularies under models/vocab (scripts/fetch-model.sh --vocab-only all)"
  exit 77
fi
max=()
[ "$FAULTS_QUICK" = 1 ] && max=(--max 200)
# the work directories on tmpfs when there is one: thousands of SQLite and KV-file fsyncs
work="$T/fp"
[ -d /dev/shm ] && [ -w /dev/shm ] && work=$(mktemp -d /dev/shm/cb-faultpaths.XXXXXX) && stack_at_exit 'rm -rf "$work"'
CB_LOG_LEVEL=warn "$BIN" --vocab-dir models/vocab --corpus tests/fuzz/corpus_msg --work "$work" "${max[@]}" \
  >"$FAULTS_OUT/inproc.md" 2>"$T/faultpaths.err"
rc=$?
grep -E '^  [a-z]+/[a-z]+ N=' "$T/faultpaths.err" | head -40
for path in config msg tokenize model kvfile ingest query; do
  faults_row_begin "$path"
  rows=$(grep -E "^\| $path \| " "$FAULTS_OUT/inproc.md")
  if [ -z "$rows" ]; then
    fail "$path: no result (cb-faultpaths exit $rc: $(grep -m1 -E 'fails without|setup' "$T/faultpaths.err"))"
    faults_row_end
    continue
  fi
  summary=""
  while IFS='|' read -r _ _ kind points clean absorbed wrong torn norec leaks crashes _; do
    kind=$(echo $kind); points=$(echo $points); clean=$(echo $clean); absorbed=$(echo $absorbed)
    wrong=$(echo $wrong); torn=$(echo $torn); norec=$(echo $norec); leaks=$(echo $leaks); crashes=$(echo $crashes)
    CRASHES=$((CRASHES + crashes))
    summary="${summary:+$summary, }$kind $points ($clean clean, $absorbed absorbed)"
    if [ $((wrong + torn + norec + leaks + crashes)) -gt 0 ]; then
      fail "$path/$kind: $wrong wrong results, $torn torn files, $norec without recovery, $leaks leaking, $crashes crashes"
    else
      pass "$path/$kind: $points failure points, each a clean error or the same result"
    fi
  done <<<"$rows"
  note "failure points: $summary"
  faults_row_end
done
faults_finish
