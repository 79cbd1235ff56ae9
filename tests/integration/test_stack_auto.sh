#!/usr/bin/env bash
# ratio = auto through the stack: `ratio: "auto"` in a query (cbctl --ratio auto) makes cb-blend
# choose the recompute ratio per request (blend.auto_target / auto_floor / auto_ceil); the done metrics
# report it (ratio_auto, ratio = ratio_chosen, n_candidates) within the floor and the ceiling; the answer
# equals the in-process one (cb-rag with blend.ratio = auto) and is the same asked twice; blend.ratio = auto
# in the config makes it the default, a number in the query still wins; a bad value is bad_request.
. "$(dirname "$0")/lib/stack.bash"
stack_setup
export CB_BLEND_AUTO_FLOOR=0.05 CB_BLEND_AUTO_CEIL=0.5
stack_start_all || svc_finish
C1=$(head -c 1500 data/sample/kettleby-lighthouse.md)
C2=$(head -c 1500 data/sample/oraka-volcano.txt)
Q="Who designed the Kettleby Lighthouse?"
q_auto() { cbctl query --json --ratio auto --context "$C1" --context "$C2" "$@" "$Q" | tail -n 1; }
a=$(q_auto); b=$(q_auto)
check "auto: ratio_auto in the done metrics" "$(jget "$a" metrics.ratio_auto)" "true"
r=$(jget "$a" metrics.ratio); n=$(jget "$a" metrics.n_candidates)
python3 -c "import sys; r, n = float(sys.argv[1]), int(sys.argv[2]); import math
lo, hi = math.floor(0.05 * n + 1e-9) / n, math.ceil(0.5 * n - 1e-9) / n
sys.exit(0 if n > 0 and lo - 1e-6 <= r <= hi + 1e-6 else 1)  # r is a float32" "$r" "$n" \
  && echo "ok: auto chose ratio $r of $n candidates, within [0.05, 0.5]" || { echo "FAIL: ratio $r of $n outside the bounds"; FAILS=$((FAILS+1)); }
check "auto: the same query twice, the same ratio and answer" "$(jget "$b" metrics.ratio)/$(jget "$b" text)" "$r/$(jget "$a" text)"
check "auto: the stack's answer = the in-process answer" "$(jget "$a" text)" \
  "$(CB_BLEND_RATIO=auto rag --mode blend --context "$C1" --context "$C2" "$Q")"
out=$(send "$(stack_endpoint blend)" '{"type":"query","question":"x","ratio":"fast","contexts":["y"]}')
check_error "ratio 'fast': bad_request" "$out" bad_request
# blend.ratio = auto as the default; a number in the query still wins
svc_stop blend >/dev/null
CB_BLEND_RATIO=auto stack_start blend || svc_finish
d=$(cbctl query --json --context "$C1" --context "$C2" "$Q" | tail -n 1)
check "blend.ratio = auto: the default query is auto" "$(jget "$d" metrics.ratio_auto)/$(jget "$d" metrics.ratio)" "true/$r"
f=$(cbctl query --json --ratio 0.15 --context "$C1" --context "$C2" "$Q" | tail -n 1)
check "... a number in the query wins" "$(jget "$f" metrics.ratio_auto)/$(jget "$f" metrics.ratio)" "false/0.15"
svc_stop blend
svc_finish
