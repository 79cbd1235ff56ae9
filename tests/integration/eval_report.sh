#!/usr/bin/env bash
# eval_report: scripts/eval-report over several results files (synthetic rows written to a temporary
# directory and removed again; the numbers mean nothing): two runs of one mode stay apart (MODE#2) and pair,
# each row's TTFT ratio is against its own file's full, two halves of one run merge, and a full whose first
# token differs between files stops the report.
# Exit 0 pass, 77 skip (no python3).
set -u
cd "$(dirname "$0")/../.."
command -v python3 >/dev/null || exit 77
d=$(mktemp -d /tmp/eval_report.XXXXXX)
trap 'rm -rf "$d"' EXIT
row() { # id mode ttft_ms kl first_token
  printf '{"id":"%s","mode":"%s","answer":"x","f1":0,"agree_f1":1,"first_token_match":true,"ttft_ms":%s,"ttft_cpu_ms":%s,"first_token":%s,"kl_first":%s,"ratio_chosen":0.15}\n' \
    "$1" "$2" "$3" "$3" "$5" "$4"
}
printf '{"id":"a","answers":["x"]}\n{"id":"b","answers":["x"]}\n' > "$d/data.jsonl"
{ row a full 100 0 5; row a blend 25 0.03 5; row b full 100 0 7; row b blend 25 0.05 7; } > "$d/run1.jsonl"
# the second run is under twice the load: its full took 200 ms, and its blend 40 ms (0.2 of its own full)
{ row a full 200 0 5; row a blend 40 0.02 5; row b full 200 0 7; row b blend 40 0.04 7; } > "$d/run2.jsonl"
python3 scripts/eval-report --data "$d/data.jsonl" --pair blend "$d/run1.jsonl" "$d/run2.jsonl" > "$d/out.txt" || { cat "$d/out.txt"; exit 1; }
grep -q '^| blend | 2 .*| 0.0400 (0.0100) | 0.250 | 0.250 |' "$d/out.txt" || { echo "run 1's blend:"; cat "$d/out.txt"; exit 1; }
grep -q '^| blend#2 | 2 .*| 0.0300 (0.0100) | 0.200 | 0.200 |' "$d/out.txt" || { echo "run 2's blend:"; cat "$d/out.txt"; exit 1; }
grep -q '^| blend#2 | 2 | -0.0100 (0.0000) | -0.050 (0.000) |' "$d/out.txt" || { echo "the pairing:"; cat "$d/out.txt"; exit 1; }
# two halves of one run: one mode, no suffix
head -2 "$d/run1.jsonl" > "$d/h1.jsonl"
tail -2 "$d/run1.jsonl" > "$d/h2.jsonl"
python3 scripts/eval-report --data "$d/data.jsonl" "$d/h1.jsonl" "$d/h2.jsonl" > "$d/halves.txt" || exit 1
grep -q '^| blend | 2 ' "$d/halves.txt" && ! grep -q 'blend#' "$d/halves.txt" || { cat "$d/halves.txt"; exit 1; }
# a full with another first token: the KLs of the two files do not pair
{ row a full 100 0 6; row a blend 25 0.03 6; } > "$d/other.jsonl"
if python3 scripts/eval-report --data "$d/data.jsonl" "$d/run1.jsonl" "$d/other.jsonl" > /dev/null 2> "$d/err.txt"; then
  echo "a full with another first token was accepted"
  exit 1
fi
grep -q 'another first token' "$d/err.txt" || { cat "$d/err.txt"; exit 1; }
echo "eval-report ok"
