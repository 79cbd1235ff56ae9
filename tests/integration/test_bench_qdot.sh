#!/usr/bin/env bash
# Integration test of `cb-bench --qdot` (the integer kernels timed alone, no model): it exits 0, reports the
# seven weight types, each with a positive rate for every kernel set this CPU runs (at least one), in text
# and in JSON; a bad --reps is exit 2.
set -u
cd "$(dirname "$0")/../.."
FAILS=0
check() {
  if [ "$2" = "$3" ]; then echo "ok: $1"; else echo "FAIL: $1: got '$2', expected '$3'"; FAILS=$((FAILS+1)); fi
}
B=build/bin/cb-bench
out=$(timeout 120 "$B" --qdot --reps 1 2>&1); rc=$?
check "text: exit status" "$rc" 0
check "text: one line per type" "$(echo "$out" | grep -cE '^  (Q4_0|Q4_1|Q5_0|Q8_0|Q4_K|Q5_K|Q6_K) ')" 7
json=$(timeout 120 "$B" --qdot --reps 1 --json 2>/dev/null); rc=$?
check "json: exit status" "$rc" 0
check "json: every type has a positive rate per set run" "$(echo "$json" | python3 -c '
import json, sys
q = json.load(sys.stdin)["qdot"]
ok = sorted(q) == sorted(["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
ok = ok and all(len(v) >= 1 and all(x > 0 for x in v.values()) for v in q.values())
print("yes" if ok else "no: %s" % q)')" yes
"$B" --qdot --reps 0 >/dev/null 2>&1; check "bad --reps: exit 2" "$?" 2
[ "$FAILS" -eq 0 ]
