#!/usr/bin/env bash
# Integration test of cb-router with cb-blend workers (docs/router.md, docs/reliability.md), on
# random loopback ports with a temporary data dir; every wait is bounded:
#   - queries through the router (contexts, and retrieval) answer as a directly reached cb-blend and the
#     in-process engine do; a routed query is retrieved once (the router's search, carried to the worker);
#     ping/health/stats of the router work with cbctl (blend.endpoint = the router);
#   - a burst of queries reaches both workers; a worker started at run time joins and receives queries;
#   - kill -9 of a worker while a query waits before its first token: the query is retried on the other
#     worker and answered (counted in `retried`);
#   - kill -9 of a worker after the first token: the client gets a clear error within 5 s, no retry; the
#     same when the worker stops answering but keeps its connection (SIGSTOP: 3 missed heartbeats);
#   - with no worker: a clear `unavailable` error after router.queue_timeout_ms, health DOWN;
#   - CURVE on: clients and workers reach the router with blend's server key; a plaintext worker or
#     client is refused with the reason;
#   - the router exits 0 on SIGTERM.
export CB_COMMON_THREADS=${CB_COMMON_THREADS:-1}
. "$(dirname "$0")/lib/stack.bash"
stack_setup
svc_need build/bin/cb-router
export CB_ROUTER_ENDPOINT=$CB_BLEND_ENDPOINT          # clients reach the router as blend
export CB_ROUTER_WORKERS_ENDPOINT="tcp://127.0.0.1:$(svc_free_port)"
export CB_ROUTER_QUEUE_TIMEOUT_MS=2000
export CB_ROUTER_RETRIEVER_TIMEOUT_MS=5000            # a search is never late here: one search per query
DIRECT="tcp://127.0.0.1:$(svc_free_port)"             # a cb-blend of its own, for the reference answers
ROUTER=$CB_BLEND_ENDPOINT
export CB_BLEND_MAX_TOKENS=12

stack_launch retriever; stack_launch cacheindex; stack_launch precompute
for s in retriever cacheindex precompute; do stack_ready $s || svc_finish; done
cbctl ingest --wait data/sample 2>"$T/ingest.err"
check "ingest data/sample" "$?" 0
svc_stop precompute

# rstat FIELD: a field of the router's stats; wstat I FIELD: of its I-th worker (in worker_list)
rstat() { stack_stat blend "$1"; }
wcount() { jget "$(send "$ROUTER" '{"type":"stats"}' 2>/dev/null || echo '{}')" worker_list | jq 'length' 2>/dev/null; }
# wdispatched PID: the router's dispatch count to the worker with that pid (0 when unknown)
wdispatched() {
  send "$ROUTER" '{"type":"stats"}' 2>/dev/null | jq --arg p "$1" '[.worker_list[] | select(.pid == $p) | .dispatched] | add // 0'
}
# start_worker NAME [VAR=VALUE...]: a cb-blend worker of the router
start_worker() { local n=$1; shift; stack_launch worker "$n" "$@"; }
ready_workers() { [ "$(rstat workers_ready)" = "$1" ]; }

stack_launch router
start_worker w1 CB_BLEND_FAULT_STEP_DELAY_MS=40
start_worker w2 CB_BLEND_FAULT_STEP_DELAY_MS=40
stack_launch blend direct CB_BLEND_ENDPOINT="$DIRECT" CB_BLEND_ROUTER=
svc_wait_ping "$DIRECT" 30 || svc_finish
wait_until 30 ready_workers 2 || { echo "FAIL: 2 workers not ready within 30 s: $(send "$ROUTER" '{"type":"stats"}')"; svc_finish; }
echo "ok: the router has 2 ready workers"

# --- 1. answers through the router = direct cb-blend = in-process --------------------------------------
C1="The Kettleby Lighthouse stands on Harrow Island. It was designed by the engineer Miriam Ashcombe and first lit in 1871."
C2="Mount Oraka is a stratovolcano in the Lenmark Range. It last erupted in 1887."
Q="Who designed the Kettleby Lighthouse?"
out=$(cbctl query --context "$C1" --context "$C2" "$Q"); rc=$?
direct=$(CB_BLEND_ENDPOINT=$DIRECT cbctl query --context "$C1" --context "$C2" "$Q")
check "contexts: the router's answer = direct cb-blend's" "$rc/$out" "0/$direct"
check "contexts: = the in-process answer" "$out" "$(rag --context "$C1" --context "$C2" "$Q")"
for q in "Who designed the Kettleby Lighthouse?" "When did Mount Oraka last erupt?"; do
  out=$(cbctl query --json "$q"); rc=$?
  direct=$(CB_BLEND_ENDPOINT=$DIRECT cbctl query --json "$q")
  check "retrieval '$q': answer = direct cb-blend's" "$rc/$(printf '%s\n' "$out" | head -n -1)" "0/$(printf '%s\n' "$direct" | head -n -1)"
  check "retrieval '$q': same chunks" "$(printf '%s\n' "$out" | tail -n 1 | jq -c .chunk_ids)" \
    "$(printf '%s\n' "$direct" | tail -n 1 | jq -c .chunk_ids)"
done
[ "$(rstat searches)" -ge 2 ] && echo "ok: the cache policy looked the chunk ids up ($(rstat searches) searches)" \
  || { echo "FAIL: searches = $(rstat searches)"; FAILS=$((FAILS+1)); }
# retrieved once: the router's search goes to the worker with the query, which does not search again, so
# cb-retriever's request count moves as for a direct query (one search, and the stats request itself)
rreq() { stack_stat retriever requests; }
Q3="Where does the Kettleby Lighthouse stand?"
n0=$(rreq); direct=$(CB_BLEND_ENDPOINT=$DIRECT cbctl query --json "$Q3" | tail -n 1); n1=$(rreq)
carried0=$(rstat searches_carried)
out=$(cbctl query --json "$Q3" | tail -n 1); n2=$(rreq)
check "a direct query: one cb-retriever search" "$((n1 - n0))" 2
check "a routed query: one cb-retriever search (the router's)" "$((n2 - n1))" 2
check "... its chunks went to the worker with the query" "$(rstat searches_carried)" "$((carried0 + 1))"
check "... the same answer and chunks as the direct query" "$(jq -c '[.text, .chunk_ids, .metrics.n_chunks]' <<<"$out")" \
  "$(jq -c '[.text, .chunk_ids, .metrics.n_chunks]' <<<"$direct")"
jq -e '.metrics.retrieve_ms > 0' <<<"$out" >/dev/null && echo "ok: retrieve_ms is the router's ($(jget "$out" metrics.retrieve_ms) ms)" \
  || { echo "FAIL: retrieve_ms: $(jget "$out" metrics.retrieve_ms)"; FAILS=$((FAILS+1)); }
out=$(cbctl query "Who designed the Kettleby Lighthouse?" >/dev/null; send "$ROUTER" '{"type":"stats"}')
[ "$(jget "$out" routed_to_holder)" -ge 1 ] && echo "ok: a repeated retrieval went to the worker holding its chunks" \
  || { echo "FAIL: routed_to_holder = $(jget "$out" routed_to_holder) ($(jget "$out" worker_list))"; FAILS=$((FAILS+1)); }
"$CBCTL" health blend >"$T/health.out" 2>&1
check "cbctl health blend (the router) exits 0" "$?" 0
"$CBCTL" stats blend >"$T/stats.out" 2>&1
check "cbctl stats blend exits 0" "$?" 0
grep -q "role *router" "$T/stats.out" && grep -q "worker_list" "$T/stats.out" && echo "ok: stats shows the router and its workers" \
  || { echo "FAIL: stats: $(cat "$T/stats.out")"; FAILS=$((FAILS+1)); }
out=$(send "$ROUTER" '{"type":"cancel","id":"c1","query_id":"nope"}')
check "cancel of an unknown query: cancelled false" "$(jget "$out" ok)/$(jget "$out" cancelled)" "true/false"

# --- 2. a burst reaches both workers; a third joins at run time and gets queries ----------------------
# burst N: N queries with distinct contexts at once; all must answer
burst() {
  local n=$1 i pids=() bad=0
  for i in $(seq 1 "$n"); do
    "$CBCTL" query --context "Note $i: the harbour crane number $i was painted blue in 19$((10 + i))." \
      "What colour was crane $i painted?" >"$T/burst$i.out" 2>"$T/burst$i.err" &
    pids+=($!)
  done
  for i in "${pids[@]}"; do wait "$i" || bad=$((bad + 1)); done
  echo "$bad"
}
check "a burst of 6 queries: all answered" "$(burst 6)" 0
P1=${SVC_PID[w1]} P2=${SVC_PID[w2]}
d1=$(wdispatched "$P1") d2=$(wdispatched "$P2")
[ "$d1" -gt 0 ] && [ "$d2" -gt 0 ] && echo "ok: both workers got traffic ($d1, $d2)" \
  || { echo "FAIL: dispatched $d1 / $d2"; FAILS=$((FAILS+1)); }
start_worker w3 CB_BLEND_FAULT_STEP_DELAY_MS=40
wait_until 30 ready_workers 3 || { echo "FAIL: the third worker did not join"; FAILS=$((FAILS+1)); }
check "a burst of 9 with 3 workers: all answered" "$(burst 9)" 0
d3=$(wdispatched "${SVC_PID[w3]}")
[ "$d3" -gt 0 ] && echo "ok: the worker started at run time got $d3 queries" \
  || { echo "FAIL: the new worker got none"; FAILS=$((FAILS+1)); }

# --- 3. kill -9 before the first token: retried on another worker -------------------------------------
for w in w1 w2 w3; do svc_stop $w >/dev/null; done
wait_until 10 bash -c "[ \$('$SEND' '$ROUTER' '{\"type\":\"stats\"}' | jq .workers) = 0 ]" \
  || { echo "FAIL: stopped workers still listed"; FAILS=$((FAILS+1)); }
start_worker slow CB_BLEND_FAULT_STEP_DELAY_MS=15000     # its first step sleeps 15 s: no token before the kill
wait_until 30 ready_workers 1 || svc_finish
retried0=$(rstat retried)
t0=$(date +%s%N)
"$CBCTL" query --context "$C1" "$Q" >"$T/retry.out" 2>"$T/retry.err" &
CL=$!
wait_until 10 bash -c "[ \$('$SEND' '$ROUTER' '{\"type\":\"stats\"}' | jq .worker_list[0].inflight) = 1 ]" \
  || { echo "FAIL: the query did not reach the slow worker"; FAILS=$((FAILS+1)); }
start_worker w4
wait_until 30 ready_workers 2 || { echo "FAIL: w4 not ready"; FAILS=$((FAILS+1)); }
stack_kill9 slow
wait "$CL"; rc=$?
dt=$(( ($(date +%s%N) - t0) / 1000000 ))
check "kill -9 before the first token: the query is answered" "$rc/$(cat "$T/retry.out")" "0/$(rag --context "$C1" "$Q")"
check "kill -9 before the first token: retried once" "$(rstat retried)" "$((retried0 + 1))"
grep -q "retrying on another worker" "$T/router.log" && echo "ok: the retry is logged ($dt ms)" \
  || { echo "FAIL: no retry in the router log"; FAILS=$((FAILS+1)); }

# --- 4. kill -9 after the first token: a clear error within 5 s, no retry ------------------------------
start_worker dripping CB_BLEND_FAULT_STEP_DELAY_MS=400    # a token every ~0.4 s
svc_stop w4 >/dev/null
wait_until 30 bash -c "[ \$('$SEND' '$ROUTER' '{\"type\":\"stats\"}' | jq '.workers_ready == 1 and .workers == 1') = true ]" || svc_finish
retried0=$(rstat retried)
"$CBCTL" query --max-tokens 40 --context "$C1" "$Q" >"$T/mid.out" 2>"$T/mid.err" &
CL=$!
wait_until 30 test -s "$T/mid.out" || { echo "FAIL: no first token"; FAILS=$((FAILS+1)); }
t0=$(date +%s%N)
stack_kill9 dripping
wait "$CL"; rc=$?
dt=$(( ($(date +%s%N) - t0) / 1000000 ))
check "kill -9 after the first token: cbctl exits 3" "$rc" 3
[ "$dt" -le 5000 ] && echo "ok: the client had its error $dt ms after the kill" \
  || { echo "FAIL: the error took $dt ms"; FAILS=$((FAILS+1)); }
grep -q "unavailable.*after the answer had started" "$T/mid.err" && echo "ok: $(tail -n 1 "$T/mid.err")" \
  || { echo "FAIL: message: $(cat "$T/mid.err")"; FAILS=$((FAILS+1)); }
check "kill -9 after the first token: not retried" "$(rstat retried)" "$retried0"
check "failed_worker_lost counted" "$(rstat failed_worker_lost)" 1
# a worker that stops answering but keeps its connection (SIGSTOP): out after 3 missed heartbeats
start_worker frozen CB_BLEND_FAULT_STEP_DELAY_MS=400
wait_until 30 ready_workers 1 || svc_finish
"$CBCTL" query --max-tokens 40 --context "$C1" "$Q" >"$T/frozen.out" 2>"$T/frozen.err" &
CL=$!
wait_until 30 test -s "$T/frozen.out" || { echo "FAIL: no first token"; FAILS=$((FAILS+1)); }
t0=$(date +%s%N)
kill -STOP "${SVC_PID[frozen]}"
wait "$CL"; rc=$?
dt=$(( ($(date +%s%N) - t0) / 1000000 ))
check "SIGSTOP after the first token: cbctl exits 3" "$rc" 3
[ "$dt" -le 5000 ] && grep -q "silent for 3 heartbeats" "$T/frozen.err" && echo "ok: a silent worker is out, the client told, $dt ms after the stop" \
  || { echo "FAIL: SIGSTOP: $dt ms: $(cat "$T/frozen.err")"; FAILS=$((FAILS+1)); }
kill -KILL "${SVC_PID[frozen]}"; stack_kill9 frozen

# --- 5. no worker: a clear error after a bounded wait ------------------------------------------------
t0=$(date +%s%N)
"$CBCTL" query --context "$C1" "$Q" >"$T/none.out" 2>"$T/none.err"; rc=$?
dt=$(( ($(date +%s%N) - t0) / 1000000 ))
check "no worker: cbctl exits 3" "$rc" 3
grep -q "unavailable: no cb-blend worker" "$T/none.err" && [ "$dt" -lt 6000 ] && echo "ok: $(cat "$T/none.err") ($dt ms)" \
  || { echo "FAIL: no worker: $(cat "$T/none.err") ($dt ms)"; FAILS=$((FAILS+1)); }
"$CBCTL" health blend >"$T/health2.out" 2>&1
check "no worker: cbctl health blend exits 1 (the router answers: DOWN)" "$?" 1
grep -q "no cb-blend worker is ready" "$T/health2.out" && echo "ok: health says why" \
  || { echo "FAIL: health: $(cat "$T/health2.out")"; FAILS=$((FAILS+1)); }

# --- 6. CURVE: both router sockets are CURVE servers with blend's key; a plaintext worker stays out ----------
for s in router direct cacheindex; do svc_stop $s; done
cbctl keys init "$T/keys" >/dev/null
export CB_COMMON_CURVE=on CB_COMMON_KEYS_DIR="$T/keys"
export CB_CACHEINDEX_ENDPOINT="tcp://127.0.0.1:$(svc_free_port)" CB_BLEND_ENDPOINT="tcp://127.0.0.1:$(svc_free_port)"
export CB_ROUTER_ENDPOINT=$CB_BLEND_ENDPOINT CB_ROUTER_WORKERS_ENDPOINT="tcp://127.0.0.1:$(svc_free_port)"
ROUTER=$CB_BLEND_ENDPOINT
stack_launch cacheindex cacheindex2
stack_launch router router2
start_worker cw1
start_worker plain CB_COMMON_CURVE=off
wait_until 30 ready_workers 1 || { echo "FAIL: the CURVE worker did not join"; FAILS=$((FAILS+1)); }
out=$(cbctl query --context "$C1" "$Q"); rc=$?
check "CURVE: a query through the router is answered" "$rc/$out" "0/$(CB_COMMON_CURVE=off rag --context "$C1" "$Q")"
check "CURVE: the plaintext worker is not admitted" "$(rstat workers)" 1
grep -q "refused our handshake" "$T/plain.log" && echo "ok: the plaintext worker says why" \
  || { echo "FAIL: no refusal in the plaintext worker's log"; FAILS=$((FAILS+1)); }
out=$(CB_COMMON_CURVE=off "$CBCTL" query --context "$C1" "$Q" 2>&1); rc=$?
check "CURVE: a plaintext client is refused with the reason (exit 3)" "$rc/$(echo "$out" | grep -c 'requires CURVE')" "3/1"

for s in router2 cw1 plain cacheindex2 retriever; do svc_stop $s; done
svc_finish
