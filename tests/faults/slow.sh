#!/usr/bin/env bash
# tests/faults/slow.sh: clients that never read their stream (docs/reliability.md).
#   zmq   3 raw DEALERs (build/bin/cb-slow: receive HWM 1, a 1 KB socket buffer) send a query with a large
#         max_tokens at temperature 5 (no early end of generation) and never receive;
#   http  2 HTTP clients (tests/faults/lib/slowhttp.py) POST a streamed chat completion through cb-gateway and
#         never read.
# Meanwhile other clients query (cb-load, 2 clients): their time to first token must stay within 3 s of the
# same load's before; the slow ones must be dropped (cb-blend: a send finds the pipe full after its send
# timeout and cancels the query; cb-gateway: the connection times out) while they still hold their sockets,
# and the services' memory must not grow with what the slow clients do not read (RSS before/after).
#
# The scenario runs in its own network namespace (unshare -n) with small TCP buffers (tcp_wmem/tcp_rmem max
# 4 KB): with the kernel's defaults (up to 4 MB per socket on loopback) a whole 4096-token answer (~250 KB
# of ZeroMQ messages, ~1 MB of SSE) fits in the socket buffers, so the slow client's query simply runs to its
# end and no drop can be seen in a bounded time. Without unshare it runs in the normal namespace and only
# checks that the slow queries end (at max_tokens) and the others are served.
if [ -z "${FAULTS_NETNS:-}" ] && [ "$(id -u)" = 0 ] && unshare -n true 2>/dev/null; then
  exec unshare -n env FAULTS_NETNS=1 bash -c 'ip link set lo up && sysctl -qw net.ipv4.tcp_wmem="4096 4096 4096" net.ipv4.tcp_rmem="4096 4096 4096" && exec bash "$0"' "$0"
fi
. "$(dirname "$0")/lib/faults.bash"
faults_begin slow
svc_need build/bin/cb-slow build/bin/cb-load build/bin/cb-gateway
SMALL_BUFFERS=${FAULTS_NETNS:+1}
export CB_BLEND_CTX_SIZE=2560 CB_BLEND_SNDHWM=5 CB_GATEWAY_IDLE_TIMEOUT_S=5
MAXT=2000 HOLD=60   # the drop needs ~50-170 tokens to pile up: 22 s on an AVX-512 host, 36 s on a loaded AVX2 one
stack_start_all || faults_finish
stack_start_gateway || faults_finish
SLOW="$ROOT/build/bin/cb-slow"
LOAD="$ROOT/build/bin/cb-load"
B=$(stack_endpoint blend)
# the probe load: short contexts, both modes
for i in $(seq 1 8); do
  m=blend; [ $((i % 2)) = 0 ] && m=full
  jq -cn --arg m "$m" --arg c "Station $i of the Orlen line opened in $((1900 + i * 7)) beside the river." \
    --arg q "When did station $i open?" '{question: $q, contexts: [$c], mode: $m}'
done >"$T/probe.jsonl"
probe() { "$LOAD" --clients 2 --per-client "$1" --max-tokens 12 --timeout 20000 --json "$B" "$T/probe.jsonl" 2>>"$T/load.err"; }
base=$(probe 4)
BASE_P99=$(jget "$base" ttft_ms.p99)
echo "baseline: $base"
STORY='{"type":"query","question":"Write a very long story about a dragon and a lighthouse keeper.","contexts":["A dragon lived near the Kettleby Lighthouse."],"mode":"full","temperature":5,"max_tokens":'$MAXT'}'

# slow_row KIND N: N slow clients of KIND while the probe load runs.
slow_row() {
  local kind=$1 n=$2 k pids=() c0 t0 gone=-1 during p99 st running cancelled0 res dropped=0 finished=0
  faults_row_begin "$kind${3:+ ($3)}"
  local rb rg
  rb=$(rss_mb blend); rg=$(rss_mb gateway)
  cancelled0=$(stack_stat blend queries_cancelled)
  t0=$(now_ms)
  for k in $(seq 1 "$n"); do
    if [ "$kind" = zmq ]; then
      "$SLOW" --hold $((HOLD * 1000)) --drain 1000 "$B" "$STORY" >"$T/slow-$kind-$k.json" 2>"$T/slow-$kind-$k.err" &
    else
      python3 "$ROOT/tests/faults/lib/slowhttp.py" "${GW#http://}" "$HOLD" \
        "$(jq -cn --argjson n "$MAXT" '{messages: [{role: "user", content: "Write a very long story about a dragon."}],
             documents: ["A dragon lived near the Kettleby Lighthouse."], max_tokens: $n, temperature: 2, stream: true,
             cacheblend: {mode: "full"}}')" >"$T/slow-$kind-$k.json" 2>"$T/slow-$kind-$k.err" &
    fi
    pids+=($!)
  done
  sleep 3
  during=$(probe 6)
  p99=$(jget "$during" ttft_ms.p99)
  Q_OK=$((Q_OK + $(jget "$during" ok))); Q_ERR=$((Q_ERR + $(jget "$during" errors) - $(jget "$during" overloaded)))
  Q_OVER=$((Q_OVER + $(jget "$during" overloaded)))
  echo "during: $during"
  if awk -v a="$p99" -v b="$BASE_P99" 'BEGIN { exit !(a <= b + 3000) }'; then
    pass "$kind: the other clients' TTFT p99 $(printf %.0f "$p99") ms (before: $(printf %.0f "$BASE_P99") ms)"
  else fail "$kind: the other clients' TTFT p99 $(printf %.0f "$p99") ms, more than 3 s over the $(printf %.0f "$BASE_P99") ms before"; fi
  note "other clients' TTFT p99 $(printf %.0f "$p99") ms (before: $(printf %.0f "$BASE_P99") ms)"
  # the slow queries leave cb-blend while their clients still hold the sockets
  for k in $(seq 1 $((HOLD * 2))); do
    running=$(stack_stat blend running)
    [ "$running" = 0 ] && { gone=$(( $(now_ms) - t0 )); break; }
    sleep 0.5
  done
  for k in "${pids[@]}"; do wait "$k"; done
  for k in $(seq 1 "$n"); do
    res=$(cat "$T/slow-$kind-$k.json")
    if [ "$(jget "$res" done)" = true ]; then finished=$((finished + 1)); else dropped=$((dropped + 1)); fi
  done
  local cancelled=$(( $(stack_stat blend queries_cancelled) - cancelled0 ))
  note "$n slow clients: $dropped dropped, $finished answered in full into the buffers; cb-blend cancelled $cancelled"
  if [ "$gone" -ge 0 ]; then note "the slow queries left cb-blend after $((gone / 1000)) s (the clients held $HOLD s)"
  else note "the slow queries still ran when the clients closed after $HOLD s"; fi
  if [ -n "$SMALL_BUFFERS" ]; then
    [ "$gone" -ge 0 ] && [ "$gone" -lt $((HOLD * 1000)) ] && pass "$kind: the slow queries were dropped while their clients held on" \
      || fail "$kind: the slow queries were not dropped within $HOLD s"
  fi
  [ "$kind" = http ] && note "HTTP clients after the hold: $(for k in $(seq 1 "$n"); do jq -c . "$T/slow-$kind-$k.json"; done | tr '\n' ' ')"
  [ "$kind" = zmq ] && note "tokens piled up per DEALER: $(for k in $(seq 1 "$n"); do jget "$(cat "$T/slow-$kind-$k.json")" tokens; done | tr '\n' ' ')"
  note "RSS cb-blend $rb -> $(rss_mb blend) MB, cb-gateway $rg -> $(rss_mb gateway) MB"
  crash_check
  health_all && pass "$kind: every service answers" || fail "$kind: a service does not answer"
  curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$GW/health" | grep -q 200 && pass "$kind: the gateway's /health is 200" \
    || fail "$kind: the gateway's /health is not 200"
  faults_row_end
}
slow_row zmq 3
slow_row http 2
# memory after both rows and a second round of the same: no growth beyond the first round's
r1=$(rss_mb blend); g1=$(rss_mb gateway)
slow_row zmq 3 again
r2=$(rss_mb blend); g2=$(rss_mb gateway)
if [ $((r2 - r1)) -le 64 ] && [ $((g2 - g1)) -le 16 ]; then pass "a second round of slow clients: RSS cb-blend $r1 -> $r2 MB, cb-gateway $g1 -> $g2 MB"
else fail "RSS grows with every round of slow clients: cb-blend $r1 -> $r2 MB, cb-gateway $g1 -> $g2 MB"; fi
faults_finish
