#!/usr/bin/env bash
# Integration test of the shared KV tier on Redis (docs/kvremote.md) with the whole stack on random
# loopback ports, a temporary data dir and a redis-server of its own (Unix socket, persistence off):
#   - ingest: cb-precompute puts every chunk it computes in Redis (one key per chunk);
#   - a new host: cb-blend and cb-cacheindex restarted with their local state gone (KV files and the
#     cache-index db deleted): a query finds every chunk in Redis (kv_remote_hits), computes none, gives
#     the same answer, writes the local files again and registers them with cb-cacheindex; the next query
#     reads the local files;
#   - Redis killed: queries still answer (computed), kv_remote_errors counted, kv_remote_up 0, the log says
#     the tier is down (once); Redis restarted: after the recovery interval the tier is back (logged),
#     computed chunks are put again; cb-gateway's /metrics exports cacheblend_kv_remote_*;
#   - every service exits 0 on SIGTERM.
# Exit 77 (skip) when redis-server or the model is absent. Every wait is bounded.
. "$(dirname "$0")/lib/stack.bash"
command -v redis-server >/dev/null 2>&1 || { echo "skip: redis-server is not installed"; exit 77; }
stack_setup
SOCK="$T/redis.sock"
STACK_REDIS_SOCK=$SOCK
redis_up() { stack_start redis; }        # the launcher's redis-server (log $T/redis.log), PING waited for
redis_down() { stack_kill9 redis; }
rcli() { redis-cli -s "$SOCK" "$@"; }
redis_up || exit 1

export CB_COMMON_KV_REMOTE="unix://$SOCK"
export CB_COMMON_KV_REMOTE_TIMEOUT_MS=500
export CB_COMMON_KV_REMOTE_RECOVERY_MS=1000
export CB_COMMON_KV_REMOTE_PREFIX=it
export CB_BLEND_HOT_CACHE_BYTES=0          # no memory tier: every chunk comes from a file, Redis, or compute
stack_start_all || svc_finish
grep -q "kvremote: connected to unix://$SOCK" "$T/blend.log" && echo "ok: cb-blend connected to Redis" \
  || { echo "FAIL: no 'connected' line in the blend log"; FAILS=$((FAILS+1)); }

# --- 1. ingest: every computed chunk is put in Redis --------------------------------------------------
cbctl ingest --wait data/sample 2>"$T/ingest.err"; rc=$?
check "cbctl ingest --wait data/sample exits 0" "$rc" 0
CHUNKS=$(stack_stat precompute chunks_done)
check "precompute: every chunk put in Redis" "$(stack_stat precompute kv_remote_puts)" "$CHUNKS"
check "precompute: the tier is up, no errors" "$(stack_stat precompute kv_remote_up)/$(stack_stat precompute kv_remote_errors)" "1/0"
check "Redis holds one key per chunk" "$(rcli --scan --pattern 'it:*' | wc -l)" "$CHUNKS"

Q="When did Mount Oraka last erupt?"
js=$(cbctl query --json --mode blend "$Q" | tail -n 1)
check "first host: 3 chunks from its files" "$(jget "$js" metrics.cache_hits)/$(jget "$js" metrics.cache_misses)" "3/0"
A1=$(jget "$js" text)
check "first host: Redis not needed" "$(stack_stat blend kv_remote_hits)" 0

# --- 2. a new host: local state gone, Redis has it all ---------------------------------------------------
svc_stop blend; svc_stop cacheindex
rm -rf "$KV" "$CB_DATA_DIR/cacheindex.db"*
mkdir -p "$KV"
stack_start cacheindex && stack_start blend || svc_finish
js=$(cbctl query --json --mode blend "$Q" | tail -n 1)
check "new host: 3 chunks, none computed" "$(jget "$js" metrics.cache_hits)/$(jget "$js" metrics.cache_misses)" "3/0"
check "new host: the same answer" "$(jget "$js" text)" "$A1"
check "new host: 3 remote hits, nothing corrupt" "$(stack_stat blend kv_remote_hits)/$(stack_stat blend kv_remote_corrupt)" "3/0"
[ "$(stack_stat blend kv_remote_bytes_read)" -gt 0 ] && echo "ok: kv_remote_bytes_read $(stack_stat blend kv_remote_bytes_read)" \
  || { echo "FAIL: kv_remote_bytes_read"; FAILS=$((FAILS+1)); }
check "new host: the local KV files written again" "$(find "$KV" -name '*.kv' | wc -l)" 3
wait_until 10 bash -c "[ \"\$('$SEND' '$(stack_endpoint cacheindex)' '{\"type\":\"stats\"}' | jq .entries)\" = 3 ]" \
  && echo "ok: cb-cacheindex registered the 3 local copies" || { echo "FAIL: cacheindex entries $(stack_stat cacheindex entries)"; FAILS=$((FAILS+1)); }
js=$(cbctl query --json --mode blend "$Q" | tail -n 1)
check "new host, again: from the local files (no new remote hit)" \
  "$(jget "$js" metrics.cache_hits)/$(stack_stat blend kv_remote_hits)" "3/3"

# --- 3. Redis down: queries still answer; back after a restart ------------------------------------------
redis_down
C1="The Brindle Canal was dug in 1791 to carry coal from the Hobson pits to the river port of Calder."
Q1="What did the Brindle Canal carry?"
t0=$(date +%s%N)
out=$(cbctl query --mode blend --context "$C1" "$Q1"); rc=$?
dt=$(( ($(date +%s%N) - t0) / 1000000 ))
check "Redis down: the query answers" "$rc/$out" "0/$(rag --mode blend --context "$C1" "$Q1")"
check "Redis down: the tier is down, the error counted" \
  "$(stack_stat blend kv_remote_up)/$([ "$(stack_stat blend kv_remote_errors)" -ge 1 ] && echo yes)" "0/yes"
check "Redis down: one 'is down' line in the log" "$(grep -c "kvremote: unix://$SOCK is down" "$T/blend.log")" 1
echo "ok: query with Redis down took $dt ms"
C2="Ferrow Abbey was founded in 1132 by monks from Cluny and dissolved in 1539."
js=$(cbctl query --json --mode blend --context "$C2" "Who founded Ferrow Abbey?" | tail -n 1)
check "Redis still down: answered, computed" "$([ -n "$(jget "$js" text)" ] && echo yes)/$(jget "$js" metrics.cache_misses)" "yes/1"
[ "$(stack_stat blend kv_remote_skipped)" -ge 0 ] && echo "ok: kv_remote_skipped $(stack_stat blend kv_remote_skipped)"
redis_up || svc_finish
sleep 1.2   # kv_remote_recovery_ms
p0=$(stack_stat blend kv_remote_puts)
C3="The Tolland viaduct has nineteen arches and was finished in 1849."
out=$(cbctl query --mode blend --context "$C3" "How many arches has the Tolland viaduct?"); rc=$?
check "Redis back: the query answers" "$rc" 0
check "Redis back: the tier is up" "$(stack_stat blend kv_remote_up)" 1
check "Redis back: the computed chunk is put" "$(stack_stat blend kv_remote_puts)" "$((p0 + 1))"
grep -q "kvremote: unix://$SOCK is back" "$T/blend.log" && echo "ok: the log says the tier is back" \
  || { echo "FAIL: no 'is back' line in the blend log"; FAILS=$((FAILS+1)); }

# --- 4. /metrics --------------------------------------------------------------------------------------
if stack_start_gateway; then
  m=$(curl -s --max-time 5 "$GW/metrics")
  check "metrics: remote hits of cb-blend" "$(echo "$m" | grep '^cacheblend_kv_remote_hits_total{service="blend"}' | awk '{print $2}')" 3
  check "metrics: the tier is up (cb-blend)" "$(echo "$m" | grep '^cacheblend_kv_remote_up{service="blend"}' | awk '{print $2}')" 1
  check "metrics: puts of cb-precompute" "$(echo "$m" | grep '^cacheblend_kv_remote_puts_total{service="precompute"}' | awk '{print $2}')" "$CHUNKS"
  svc_stop gateway
else
  FAILS=$((FAILS+1))
fi

# --- 5. clean shutdown -----------------------------------------------------------------------------
for s in blend precompute cacheindex retriever; do svc_stop $s; done
svc_finish
