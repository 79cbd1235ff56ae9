#!/usr/bin/env bash
# tests/faults/run.sh: the fault and load suite (`make test-faults`; docs/reliability.md).
#
#   tests/faults/run.sh [SCENARIO...]     default: inproc kill9 diskfull sigstop slow load fuzz flood
#
# Each scenario is a script next to this one; it prints ok:/FAIL: lines (shown here as they come, prefixed
# with the scenario) and writes one row per service or sub-case to build/faults/rows.jsonl. At the end this
# runner writes build/faults/summary.json and build/faults/summary.md (the table of docs/reliability.md) and
# prints the table. The services' logs of every scenario are kept under build/faults/logs/<scenario>/, each
# scenario's full output in build/faults/<scenario>.log, fuzzer crash inputs under build/faults/fuzz-artifacts/.
#
# Environment: CB_FAULTS_SEED (default 1: the kill points, stop lengths and mutations; the same seed repeats
# them), CB_FAULTS_ROUNDS (kill -9 rounds per service, 3), CB_FAULTS_ROUNDS_STOP (SIGSTOP rounds, 2),
# CB_FAULTS_LOAD_S (150), CB_FAULTS_FUZZ_S (40 per fuzzer), CB_FAULTS_SOCK_N (60 per request type),
# CB_FAULTS_QUICK=1 (one round, 20 s of load, 5 s per fuzzer: a smoke run of a few minutes),
# CB_FAULTS_STRICT=1 (a skipped scenario counts as a failure).
# Exit: 0 when no row and no scenario failed (skips allowed unless strict), 1 otherwise.
set -u
cd "$(dirname "$0")/../.."
ROOT=$(pwd)
OUT=$ROOT/build/faults
export FAULTS_OUT=$OUT
SEED=${CB_FAULTS_SEED:-1}
export CB_FAULTS_SEED=$SEED
mkdir -p "$OUT"
rm -rf "$OUT/rows.jsonl" "$OUT/scenarios.jsonl" "$OUT/logs" "$OUT/fuzz-artifacts"
scenarios=("$@")
[ ${#scenarios[@]} -eq 0 ] && scenarios=(inproc kill9 diskfull sigstop slow load fuzz flood)
command="make test-faults"
[ $# -gt 0 ] && command="tests/faults/run.sh $*"
[ "${CB_FAULTS_QUICK:-0}" = 1 ] && command="CB_FAULTS_QUICK=1 $command"
started=$(date -u +%Y-%m-%dT%H:%M:%SZ)
t0=$(date +%s)
failed=0

for s in "${scenarios[@]}"; do
  script=tests/faults/$s.sh
  if [ ! -f "$script" ]; then echo "FAIL: no scenario $s ($script)"; failed=1; continue; fi
  echo "=== $s"
  st=$(date +%s)
  rows0=$( [ -f "$OUT/rows.jsonl" ] && wc -l <"$OUT/rows.jsonl" || echo 0)
  timeout 1800 bash "$script" 2>&1 | tee "$OUT/$s.log" | grep --line-buffered -E '^(ok|FAIL|skip|row)[: ]' | sed -u "s/^/[$s] /"
  rc=${PIPESTATUS[0]}
  secs=$(( $(date +%s) - st ))
  case $rc in
    0) status=ok ;;
    77) status=skip ;;
    124|137) status=FAIL; echo "[$s] FAIL: the scenario did not finish within 1800 s" ;;
    *) status=FAIL ;;
  esac
  rows1=$( [ -f "$OUT/rows.jsonl" ] && wc -l <"$OUT/rows.jsonl" || echo 0)
  if [ "$rows1" = "$rows0" ]; then   # nothing written: a skip, or a death before the first row
    reason=$(grep -m 1 -E '^(skip|FAIL)' "$OUT/$s.log" || echo "exit $rc")
    jq -cn --arg s "$s" --arg st "$status" --arg n "$reason" --argjson secs "$secs" --argjson seed "$SEED" \
      '{scenario: $s, target: "-", status: $st, seed: $seed, seconds: $secs, docs_acked: 0, docs_lost: 0,
        docs_duplicated: 0, queries_answered: 0, queries_errored: 0, queries_overloaded: 0, queries_hung: 0,
        crashes: 0, fuzz_execs: 0, fuzz_crashes: 0, note: $n}' >>"$OUT/rows.jsonl"
  fi
  jq -cn --arg s "$s" --arg st "$status" --argjson rc "$rc" --argjson secs "$secs" \
    '{scenario: $s, status: $st, exit: $rc, seconds: $secs}' >>"$OUT/scenarios.jsonl"
  echo "=== $s: $status in ${secs} s"
  if [ "$status" = FAIL ] || { [ "$status" = skip ] && [ "${CB_FAULTS_STRICT:-0}" = 1 ]; }; then failed=1; fi
done

duration=$(( $(date +%s) - t0 ))
host="$(nproc) CPUs, $(awk '/MemTotal/ { printf "%.0f GiB", $2 / 1048576 }' /proc/meminfo), Linux $(uname -r)"
jq -s --slurpfile sc "$OUT/scenarios.jsonl" --arg cmd "$command" --arg started "$started" --arg host "$host" \
  --argjson dur "$duration" --argjson seed "$SEED" \
  '{command: $cmd, started: $started, host: $host, seed: $seed, duration_s: $dur, scenarios: $sc, rows: .,
    totals: {docs_acked: (map(.docs_acked) | add), docs_lost: (map(.docs_lost) | add),
             docs_duplicated: (map(.docs_duplicated) | add), queries_answered: (map(.queries_answered) | add),
             queries_errored: (map(.queries_errored) | add), queries_overloaded: (map(.queries_overloaded) | add),
             queries_hung: (map(.queries_hung) | add), crashes: (map(.crashes) | add),
             fuzz_execs: (map(.fuzz_execs) | add), fuzz_crashes: (map(.fuzz_crashes) | add),
             rows_failed: (map(select(.status == "FAIL")) | length)}}' "$OUT/rows.jsonl" >"$OUT/summary.json"

jq -r '
  def n: if . == 0 then "0" else tostring end;
  "`\(.command)` — \(.started), \(.host), seed \(.seed), \(.duration_s / 60 | floor) min \(.duration_s % 60) s\n",
  "| scenario | target | status | docs acked | lost | dup | queries answered | errored | overloaded | hung | crashes | fuzz execs | fuzz crashes | s |",
  "|---|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
  (.rows[] | "| \(.scenario) | \(.target) | \(if .status == "FAIL" then "**FAIL**" else .status end) | \(.docs_acked) | \(.docs_lost) | \(.docs_duplicated) | \(.queries_answered) | \(.queries_errored) | \(.queries_overloaded) | \(.queries_hung) | \(.crashes) | \(.fuzz_execs) | \(.fuzz_crashes) | \(.seconds | floor) |"),
  (.totals | "| **total** | | \(.rows_failed) failed | \(.docs_acked) | \(.docs_lost) | \(.docs_duplicated) | \(.queries_answered) | \(.queries_errored) | \(.queries_overloaded) | \(.queries_hung) | \(.crashes) | \(.fuzz_execs) | \(.fuzz_crashes) | |"),
  "",
  "Notes:\n",
  (.rows[] | select(.note != "") | "- **\(.scenario) / \(.target)**: \(.note)"),
  "",
  "Scenarios: " + ([.scenarios[] | "\(.scenario) \(.status) (\(.seconds) s)"] | join(", "))
' "$OUT/summary.json" >"$OUT/summary.md"

echo
jq -r '
  (["scenario", "target", "status", "acked", "lost", "dup", "answered", "errored", "overld", "hung", "crash", "fuzz execs", "fz crash"] | @tsv),
  (.rows[] | [.scenario, .target, .status, .docs_acked, .docs_lost, .docs_duplicated, .queries_answered, .queries_errored,
              .queries_overloaded, .queries_hung, .crashes, .fuzz_execs, .fuzz_crashes] | @tsv),
  (.totals | ["total", "", "\(.rows_failed) failed", .docs_acked, .docs_lost, .docs_duplicated, .queries_answered,
              .queries_errored, .queries_overloaded, .queries_hung, .crashes, .fuzz_execs, .fuzz_crashes] | @tsv)
' "$OUT/summary.json" | column -t -s $'\t'
echo
echo "summary: $OUT/summary.md, $OUT/summary.json ($(( duration / 60 )) min $(( duration % 60 )) s)"
if [ "$failed" -ne 0 ] || [ "$(jq '.totals.rows_failed' "$OUT/summary.json")" -gt 0 ]; then
  echo "FAIL: the fault suite found failures (rows marked FAIL above; details in $OUT/<scenario>.log)"
  exit 1
fi
echo "ok: the fault suite passed"
