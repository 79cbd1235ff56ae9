#!/usr/bin/env bash
# tests/faults/flood.sh: slow and hostile HTTP clients against cb-gateway (docs/gateway.md, "Connections and
# limits"), with tests/faults/lib/flood.py. Loopback only (source addresses 127.0.0.1-4), bounded in count
# and time (~90 s with the stack's start). Two gateways on the same stack:
#   A  no cap per address, request_timeout_s 60: every slow connection gets in;
#   B  max_connections_per_ip 32, request_timeout_s 5, an API key with auth_fail_limit 5.
# Rows:
#   slowloris   A: 260 connections from 127.0.0.2 send one byte every 2 s for 20 s (half trickle the request
#               line itself, half a header after a good request line) while a client on 127.0.0.1 asks
#               /health, a chat completion and the same streamed every 2 s: each must answer within 2 s,
#               all 260 must be open at once (the gauge), and the gateway must not grow a thread per
#               connection;
#   per-ip      B: the same flood: 32 get in, the other 228 get 429 at once, the 32 are cut with 408 at
#               ~5 s (the deadline does not restart with each byte); the other client is answered as above;
#   garbage     B: request lines that cannot be HTTP (no spaces, a TLS hello, text without a line end,
#               binary, ...): 400 within 1 s each;
#   api-key     B: 20 wrong keys from 127.0.0.3: 401 for the first 5, then 429 (Retry-After), the right key
#               from 127.0.0.3 too while locked out; the right key from 127.0.0.1: 200 within 2 s.
# CB_FLOOD_GATEWAY=PATH runs the rows against another cb-gateway binary (e.g. an older build, to compare).
. "$(dirname "$0")/lib/faults.bash"
faults_begin flood
GW_BIN=${CB_FLOOD_GATEWAY:-$ROOT/build/bin/cb-gateway}
svc_need build/bin/cb-gateway
python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.2", 0))' 2>/dev/null \
  || { echo "skip: cannot bind 127.0.0.2 (loopback addresses other than 127.0.0.1)"; exit 77; }
FLOOD="python3 $ROOT/tests/faults/lib/flood.py"
KEY=flood-test-key
BOUND_MS=2000
stack_start_all || faults_finish

# start_gw NAME VAR=VALUE...: a gateway on a free port; sets GWPORT.
start_gw() {
  local name=$1; shift
  GWPORT=$(svc_free_port)
  svc_start "$name" "$GW_BIN" CB_GATEWAY_LISTEN="127.0.0.1:$GWPORT" "$@"
  svc_wait_http "$name" "http://127.0.0.1:$GWPORT/metrics" 10 || { fail "cb-gateway ($name) did not start"; return 1; }
}
start_gw gwa CB_GATEWAY_MAX_CONNECTIONS_PER_IP=0 CB_GATEWAY_REQUEST_TIMEOUT_S=60 || faults_finish
PA=$GWPORT
start_gw gwb CB_GATEWAY_MAX_CONNECTIONS_PER_IP=32 CB_GATEWAY_REQUEST_TIMEOUT_S=5 CB_GATEWAY_API_KEY=$KEY \
  CB_GATEWAY_AUTH_FAIL_LIMIT=5 CB_GATEWAY_AUTH_FAIL_WINDOW_S=60 CB_GATEWAY_AUTH_LOCKOUT_S=30 || faults_finish
PB=$GWPORT
CHAT=$(jq -cn --arg c "$C_QO" '{messages: [{role: "user", content: "Who founded the Quillon Chamber Orchestra?"}],
                                documents: [$c], max_tokens: 8, cacheblend: {mode: "full"}}')
# pid_stat PID FIELD: a field of /proc/PID/status (Threads, VmRSS), the number only
pid_stat() { awk -v f="$2:" '$1 == f { print $2 }' "/proc/$1/status" 2>/dev/null || echo 0; }
le() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a + 0 <= b + 0) }'; }

# check_probes JSON: the other client's rounds during a flood, each within BOUND_MS
check_probes() {
  local res=$1 what n ok mx failed
  for what in health chat stream; do
    n=$(jget "$res" "probe.$what.n"); ok=$(jget "$res" "probe.$what.ok"); mx=$(jget "$res" "probe.$what.ms.max")
    failed=$(jget "$res" "probe.$what.failed")
    [ "$what" != health ] && { Q_OK=$((Q_OK + ok)); Q_ERR=$((Q_ERR + n - ok)); }
    if [ "$n" -gt 0 ] && [ "$ok" = "$n" ] && le "$mx" "$BOUND_MS"; then
      pass "the other client's $what: $ok/$n answered 200, p50 $(jget "$res" "probe.$what.ms.p50") ms, max $mx ms"
    else fail "the other client's $what: $ok/$n answered 200 (max ${mx} ms; bound $BOUND_MS ms); failures: $failed"; fi
    note "$what $ok/$n ok, max ${mx} ms"
  done
}

# the other client's latencies with no flood, for reference
base=$($FLOOD slow "$PA" --conns 0 --duration 4 --probe-src 127.0.0.1 --chat "$CHAT")
echo "baseline (no flood): $(jget "$base" probe)"

# --- slowloris: every slow connection admitted, nobody else waits ---------------------------------------
faults_row_begin "slowloris (no per-address cap)"
pid=${SVC_PID[gwa]}
th0=$(pid_stat "$pid" Threads); rss0=$(pid_stat "$pid" VmRSS)
timeout 60 $FLOOD slow "$PA" --conns 260 --src 127.0.0.2 --interval 2 --duration 20 --probe-src 127.0.0.1 \
  --chat "$CHAT" >"$T/slowloris.json" &
fp=$!
sleep 10
th1=$(pid_stat "$pid" Threads); rss1=$(pid_stat "$pid" VmRSS)
wait "$fp"
res=$(cat "$T/slowloris.json")
echo "result: $res"
check_probes "$res"
open=$(jget "$res" probe.open_connections_max)
still=$(jget "$res" still_open)
[ "$open" -ge 260 ] 2>/dev/null && pass "all 260 slow connections open at once (gauge peak $open)" \
  || fail "the gateway held at most $open connections of the 260 (refused: $(jget "$res" refused))"
[ "$still" = 260 ] && pass "none of the 260 was cut before request_timeout_s (60 s)" \
  || fail "$still of 260 still open after 20 s (refused $(jget "$res" refused), cut $(jget "$res" cut))"
note "260 slow connections: gauge peak $open, $still open after 20 s"
note "cb-gateway threads $th0 -> $th1 during the flood, RSS $((rss0 / 1024)) -> $((rss1 / 1024)) MB"
[ "${th1:-0}" -lt $((th0 + 40)) ] && pass "threads $th0 -> $th1: none per slow connection" \
  || fail "threads $th0 -> $th1 during the flood: a thread per connection?"
crash_check
faults_row_end

# --- per-ip: the cap and the deadline -------------------------------------------------------------------
faults_row_begin "per-ip 32, request deadline 5 s"
res=$(timeout 60 $FLOOD slow "$PB" --conns 260 --src 127.0.0.2 --interval 2 --duration 20 --probe-src 127.0.0.1 \
        --key "$KEY" --chat "$CHAT")
echo "result: $res"
check_probes "$res"
r429=$(echo "$res" | jq '.refused["429"] // 0'); c408=$(echo "$res" | jq '.cut["408"] // 0'); still=$(jget "$res" still_open)
cl=$(jget "$res" cut_after_s.line); ch=$(jget "$res" cut_after_s.headers)
[ "$r429" = 228 ] && pass "228 connections over the cap of 32 got 429 at once" \
  || fail "over the per-address cap: $r429 got 429, expected 228 (refused $(jget "$res" refused))"
[ "$c408" = 32 ] && [ "$still" = 0 ] && pass "the 32 admitted were cut with 408 (line: $cl; headers: $ch s after connect)" \
  || fail "of the 32 admitted: $c408 cut with 408, $still still open (cut $(jget "$res" cut))"
for k in line headers; do
  mx=$(jget "$res" "cut_after_s.$k.max"); mn=$(jget "$res" "cut_after_s.$k.min")
  if le 4.5 "$mn" && le "$mx" 7; then pass "trickling the $k: cut after $mn..$mx s (request_timeout_s 5)"
  else fail "trickling the $k: cut after $mn..$mx s, expected 5 to 7 s"; fi
done
note "260 from one address: $r429 refused (429), $c408 cut (408) after $(jget "$res" cut_after_s.headers.p50) s, $still left"
crash_check
faults_row_end

# --- garbage request lines -----------------------------------------------------------------------------
faults_row_begin "garbage request lines"
res=$(timeout 60 $FLOOD garbage "$PB" --src 127.0.0.4)
echo "result: $res"
n=$(echo "$res" | jq '.cases | length')
for i in $(seq 0 $((n - 1))); do
  c=$(echo "$res" | jq -r ".cases[$i].case"); st=$(echo "$res" | jq -r ".cases[$i].status"); ms=$(echo "$res" | jq -r ".cases[$i].ms")
  if [ "$st" = 400 ] && le "$ms" 1000; then pass "$c: 400 in $ms ms"; else fail "$c: status $st after $ms ms (expected 400 within 1 s)"; fi
done
note "$(echo "$res" | jq -r '[.cases[] | "\(.case) \(.status) \(.ms) ms"] | join(", ")')"
faults_row_end

# --- wrong API keys ------------------------------------------------------------------------------------
faults_row_begin "wrong API keys"
res=$(timeout 60 $FLOOD keys "$PB" --bad-src 127.0.0.3 --good-src 127.0.0.1 --key "$KEY" --n 20)
echo "result: $res"
check "20 wrong keys from one address: 5 x 401 then 15 x 429" "$(echo "$res" | jq -r '"\(.counts["401"] // 0)/\(.counts["429"] // 0)"')" "5/15"
check "the first 429 is the 6th try" "$(jget "$res" first_429)" 6
[ "$(jget "$res" retry_after)" != null ] && pass "429 carries Retry-After: $(jget "$res" retry_after) s" || fail "429 without Retry-After"
check "the right key from the locked-out address: 429" "$(jget "$res" right_key_from_locked)" 429
gms=$(jget "$res" good_ms)
if [ "$(jget "$res" good)" = 200 ] && le "$gms" "$BOUND_MS"; then pass "the right key from another address: 200 in $gms ms"
else fail "the right key from another address: $(jget "$res" good) after $gms ms ($(jget "$res" good_error))"; fi
note "statuses $(jget "$res" statuses); other address $(jget "$res" good) in $gms ms"
Q_OK=$((Q_OK + 1))
crash_check
faults_row_end

# both gateways still answer, and their counters say what happened
for g in gwa:$PA gwb:$PB; do
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://127.0.0.1:${g#*:}/health")
  check "${g%%:*}: /health after the floods" "$code" 200
  echo "${g%%:*} counters: $(curl -s --max-time 5 "http://127.0.0.1:${g#*:}/metrics" | grep -E '^cacheblend_gateway_(refused_total|connections|requests_active)' | sed 's/cacheblend_gateway_//' | tr '\n' ' ')"
done
faults_finish
