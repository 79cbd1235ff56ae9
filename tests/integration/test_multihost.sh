#!/usr/bin/env bash
# The stack across three hosts (docs/scaleout.md): network namespaces joined by veth pairs on a bridge of
# their own (tests/integration/lib/netns.bash), every link CURVE-encrypted, every wait bounded:
#   host 1: redis-server (the shared KV tier, password), cb-retriever, cb-cacheindex, the cb-precompute
#           master (the job table; no worker thread of its own), cb-router (the front of the blend workers);
#           the clients (cbctl, cb-send) run here
#   host 2, host 3: each a cb-blend worker of the router, a cb-precompute worker leasing jobs from the
#           master, and its own cb-cacheindex and KV directory
# It ingests documents (both precompute workers take jobs), queries through the router (both blend workers
# answer; chunks computed on the other host come from Redis, none is recomputed; every answer equals the
# single-host answer: cb-rag in-process with the same passages, which test_stack shows equal to the
# single-host stack's), then, one at a time, and brings each back:
#   1. kill -9 of a blend worker while a query waits before its first token: the query is answered by the
#      other worker;
#   2. kill -9 of a precompute worker in the middle of a job: the job is leased again and completes;
#   3. Redis stopped: queries still answer (recompute), Redis restarted;
#   4. host 3 partitioned (its link down): queries answer through host 2, host 3 rejoins when healed.
# Every acknowledged document is indexed exactly once (its chunks in cb-retriever = its plan), every query
# answers or gets a clear error in bounded time. Exit 77 without root (namespaces), redis-server or the model.
. "$(dirname "$0")/lib/stack.bash"
command -v redis-server >/dev/null 2>&1 || { echo "skip: redis-server is not installed"; exit 77; }
command -v sqlite3 >/dev/null 2>&1 || { echo "skip: no sqlite3"; exit 77; }
stack_setup
svc_need build/bin/cb-router
. "$(dirname "$0")/lib/netns.bash"
netns_setup 3 || { echo "FAIL: could not make the hosts"; exit 1; }
H1=$(netns_addr 1) H2=$(netns_addr 2) H3=$(netns_addr 3)
echo "ok: three hosts $H1 $H2 $H3"

# --- configuration: the same on every host but for each host's own addresses and data dir --------------
cbctl keys init "$T/keys" >/dev/null || { echo "FAIL: cbctl keys init"; exit 1; }
export CB_COMMON_CURVE=on CB_COMMON_KEYS_DIR="$T/keys"
export CB_COMMON_THREADS=1 CB_PRECOMPUTE_CHUNK_TOKENS=48 CB_BLEND_MAX_TOKENS=12
export CB_RETRIEVER_ENDPOINT="tcp://$H1:5551"
export CB_PRECOMPUTE_ENDPOINT="tcp://$H1:5553" CB_PRECOMPUTE_PULL_ENDPOINT="tcp://$H1:5554"
export CB_ROUTER_ENDPOINT="tcp://$H1:5556" CB_ROUTER_WORKERS_ENDPOINT="tcp://$H1:5557"
export CB_BLEND_ENDPOINT="$CB_ROUTER_ENDPOINT"          # clients reach the blend workers through the router
export CB_ROUTER_QUEUE_TIMEOUT_MS=4000
REDIS_PASS="multihost-$$-$RANDOM"
export CB_COMMON_KV_REMOTE="redis://$H1:6379" CB_COMMON_KV_REMOTE_PASSWORD="$REDIS_PASS"
export CB_COMMON_KV_REMOTE_TIMEOUT_MS=500 CB_COMMON_KV_REMOTE_RECOVERY_MS=1000
export CB_PRECOMPUTE_LEASE_MS=3000
CI1="tcp://$H1:5552"
MASTER_DB="$T/h1/precompute.db"
mkdir -p "$T/h1" "$T/h2" "$T/h3"

# on HOST: a command in that host with its own data dir and cache index
on() { local h=$1; shift; netns_exec "$h" env CB_DATA_DIR="$T/h$h" CB_CACHEINDEX_ENDPOINT="tcp://$(netns_addr "$h"):5552" "$@"; }
hsend() { local h=$1; shift; on "$h" "$SEND" --timeout 2000 "$@"; }
hstat() { jget "$(hsend "$1" "$2" '{"type":"stats"}' 2>/dev/null || echo '{}')" "$3"; }
hping() { # HOST ENDPOINT SECONDS: until it answers ping
  local i
  for i in $(seq 1 $(($3 * 5))); do hsend "$1" "$2" '{"type":"ping"}' >/dev/null 2>&1 && return 0; sleep 0.2; done
  echo "FAIL: $2 did not answer ping from host $1 within $3 s"; FAILS=$((FAILS + 1)); return 1
}
rstat() { hstat 1 "$CB_ROUTER_ENDPOINT" "$1"; }
hcbctl() { on 1 "$CBCTL" "$@"; }
rcli() { on 1 redis-cli -h "$H1" -p 6379 -a "$REDIS_PASS" --no-auth-warning "$@"; }
q() { sqlite3 "$MASTER_DB" "$1"; }

redis_start() {
  netns_start 1 redis -- redis-server --bind "$H1" --port 6379 --requirepass "$REDIS_PASS" --save '' \
    --appendonly no --dir "$T" --maxmemory 256mb --maxmemory-policy allkeys-lru
  wait_until 10 bash -c "[ \"\$(ip netns exec $(netns_name 1) redis-cli -h $H1 -a '$REDIS_PASS' --no-auth-warning ping 2>/dev/null)\" = PONG ]" \
    || { echo "FAIL: redis-server did not start"; FAILS=$((FAILS + 1)); return 1; }
}
# host_start HOST NAME BINARY [VAR=VALUE...]: a service of that host (its data dir, its cache index)
host_start() {
  local h=$1 name=$2 bin=$3; shift 3
  netns_start "$h" "$name" CB_DATA_DIR="$T/h$h" CB_CACHEINDEX_ENDPOINT="tcp://$(netns_addr "$h"):5552" "$@" -- "$bin"
}
start_blend() { host_start "$1" "$2" build/bin/cb-blend CB_BLEND_ROUTER="$CB_ROUTER_WORKERS_ENDPOINT" "${@:3}"; }
start_pworker() { # HOST NAME [VAR=VALUE...]: a precompute worker leasing jobs from the master
  host_start "$1" "$2" build/bin/cb-precompute CB_PRECOMPUTE_LEASE_FROM="$CB_PRECOMPUTE_ENDPOINT" \
    CB_PRECOMPUTE_WORKER_NAME="$2" CB_PRECOMPUTE_ENDPOINT="tcp://$(netns_addr "$1"):5553" CB_PRECOMPUTE_PULL_ENDPOINT= \
    "${@:3}"
}
ready_workers() { [ "$(rstat workers_ready)" = "$1" ]; }
# pstat HOST FIELD: a field of the stats of host HOST's precompute worker (its endpoint is the one the
# CURVE keys are looked up for)
pstat() {
  local ep="tcp://$(netns_addr "$1"):5553"
  jget "$(on "$1" env CB_PRECOMPUTE_ENDPOINT="$ep" "$SEND" --timeout 2000 "$ep" '{"type":"stats"}' 2>/dev/null || echo '{}')" "$2"
}
pworker_ready() { [ "$(pstat "$1" worker_ready)" = true ]; }

# --- start: host 1, then the workers on hosts 2 and 3 ---------------------------------------------------
redis_start || svc_finish
host_start 1 retriever build/bin/cb-retriever
host_start 1 cacheindex1 build/bin/cb-cacheindex
host_start 1 master build/bin/cb-precompute CB_PRECOMPUTE_WORKERS=0
host_start 1 router build/bin/cb-router
for h in 2 3; do host_start $h cacheindex$h build/bin/cb-cacheindex; done
for ep in "$CB_RETRIEVER_ENDPOINT" "$CI1" "$CB_PRECOMPUTE_ENDPOINT"; do hping 1 "$ep" 20 || svc_finish; done
# the router answers ping only with a ready worker: its stats say it is up
wait_until 20 bash -c "[ \"\$(ip netns exec $(netns_name 1) '$SEND' --timeout 1000 '$CB_ROUTER_ENDPOINT' '{\"type\":\"stats\"}' | jq -r .role)\" = router ]" \
  || { echo "FAIL: cb-router does not answer stats"; FAILS=$((FAILS + 1)); svc_finish; }
for h in 2 3; do hping $h "tcp://$(netns_addr $h):5552" 20 || svc_finish; done
start_pworker 2 pw2 CB_PRECOMPUTE_FAULT_CHUNK_DELAY_MS=300
start_pworker 3 pw3 CB_PRECOMPUTE_FAULT_CHUNK_DELAY_MS=300
start_blend 2 blend2
start_blend 3 blend3
wait_until 90 ready_workers 2 || { echo "FAIL: the router has not 2 ready workers: $(hsend 1 "$CB_ROUTER_ENDPOINT" '{"type":"stats"}')"; FAILS=$((FAILS + 1)); svc_finish; }
for h in 2 3; do wait_until 90 pworker_ready $h || { echo "FAIL: precompute worker on host $h not ready"; FAILS=$((FAILS + 1)); svc_finish; }; done
echo "ok: router with 2 blend workers, 2 precompute workers leasing from the master"
grep -q "is a CURVE server" "$T/router.log" && grep -q "is a CURVE server" "$T/master.log" \
  && echo "ok: the router and the master are CURVE servers" || { echo "FAIL: CURVE is not on"; FAILS=$((FAILS + 1)); }
out=$(hcbctl health); rc=$?
check "cbctl health on host 1 (retriever, cacheindex, master, router)" "$rc" 0

# --- ingest: both precompute workers take jobs; every document once --------------------------------------
mkdir -p "$T/docs"
cp data/sample/*.txt data/sample/*.md "$T/docs/"
for i in 1 2 3 4; do
  {
    echo "Report $i concerns the harbour town of Velmar$i, where the fishing fleet number $i is moored beside the old customs house."
    echo "The harbour master keeps a logbook of every boat that has entered since the year 18$((20 + i))."
    echo
    echo "Velmar$i exports smoked herring and salted cod to the inland cities, carried by carts along the Ostrey$i road."
  } >"$T/docs/report$i.txt"
done
NDOCS=$(ls "$T/docs" | wc -l)
hcbctl ingest --wait "$T/docs" 2>"$T/ingest.err"
check "cbctl ingest --wait of $NDOCS documents (through the master, computed on hosts 2 and 3)" "$?" 0
t2=$(pstat 2 leases_taken) t3=$(pstat 3 leases_taken)
[ "${t2:-0}" -gt 0 ] && [ "${t3:-0}" -gt 0 ] && echo "ok: both precompute workers took jobs ($t2, $t3)" \
  || { echo "FAIL: leases taken: host 2 $t2, host 3 $t3"; FAILS=$((FAILS + 1)); }
n2=$(find "$T/h2/kv" -name '*.kv' 2>/dev/null | wc -l) n3=$(find "$T/h3/kv" -name '*.kv' 2>/dev/null | wc -l)
[ "$n2" -gt 0 ] && [ "$n3" -gt 0 ] && echo "ok: KV files on both hosts ($n2, $n3)" || { echo "FAIL: KV files $n2 / $n3"; FAILS=$((FAILS + 1)); }
keys=$(rcli --scan --pattern 'cb:*' | wc -l)
check "Redis holds every chunk once (host 2's and host 3's)" "$keys" "$(q 'SELECT sum(chunks_total) FROM jobs')"

# exactly_once: every document's chunks in cb-retriever = its plan, every job done once
exactly_once() {
  local bad=0 doc plan got
  while IFS='|' read -r doc plan; do
    got=$(jget "$(hsend 1 "$CB_RETRIEVER_ENDPOINT" "{\"type\":\"count\",\"doc_id\":\"$doc\"}")" chunks)
    [ "$got" = "$plan" ] || { echo "  doc $doc: $got chunks in the retriever, plan $plan"; bad=$((bad + 1)); }
  done < <(q "SELECT doc_id, chunks_total FROM jobs WHERE state = 2")
  check "$1: every document's chunks in the retriever exactly once" "$bad" 0
  check "$1: every job done" "$(q 'SELECT count(*) FROM jobs WHERE state != 2')" 0
}
exactly_once "after ingest"

# --- queries through the router: both workers, chunks from Redis, answers = single-host ------------------
mapfile -t QS < data/sample/questions.lst
# ask Q: the answer through the router equals cb-rag's with the passages the retriever gives
ask() {
  local label=$1 qq=$2 js hits args=() i t ref
  js=$(hcbctl query --json "$qq" | tail -n 1)
  hits=$(hsend 1 "$CB_RETRIEVER_ENDPOINT" "{\"type\":\"search\",\"query\":$(json_str "$qq"),\"k\":3}")
  for i in 0 1 2; do t=$(jget "$hits" "hits.$i.text"); [ "$t" != null ] && args+=(--context "$t"); done
  ref=$(env -u CB_COMMON_KV_REMOTE CB_COMMON_CURVE=off CB_DATA_DIR="$T/ref" "$RAG" --hot_cache_bytes 256M "${args[@]}" "$qq")
  check "$label '$qq': answer = the single-host answer" "$(jget "$js" text)" "$ref"
  LAST_JS=$js
}
mkdir -p "$T/ref"
r0=$(rcli info stats | grep -o 'keyspace_hits:[0-9]*' | cut -d: -f2)
misses=0
for qq in "${QS[@]}" "${QS[@]}"; do
  ask "router" "$qq"
  misses=$((misses + $(jget "$LAST_JS" metrics.cache_misses)))
done
check "no chunk recomputed by a query (every one from a file or Redis)" "$misses" 0
r1=$(rcli info stats | grep -o 'keyspace_hits:[0-9]*' | cut -d: -f2)
[ "$r1" -gt "$r0" ] && echo "ok: blend workers read chunks made on the other host from Redis ($((r1 - r0)) hits)" \
  || { echo "FAIL: no Redis hits from the blend workers"; FAILS=$((FAILS + 1)); }
wd() { hsend 1 "$CB_ROUTER_ENDPOINT" '{"type":"stats"}' | jq --arg p "$1" '[.worker_list[] | select(.pid == $p) | .dispatched] | add // 0'; }
# The sequential questions go where the rendezvous hash of their first chunk points (then to the holder),
# which for 4 questions is one worker for all of them 1 time in 8; a burst of new passages at once spreads
# over both (the load bound), so both must have answered after it.
# burst N TAG: N queries at once, each with a passage no earlier query had (TAG makes it new); sets
# BURST_BAD to how many failed
burst() {
  local pids=() i p
  BURST_BAD=0
  for i in $(seq 1 "$1"); do
    hcbctl query --context "Note $2 $i: the harbour crane number $i was painted blue in 19$((10 + i))." \
      "What colour was crane $i painted?" >"$T/$2$i.out" 2>"$T/$2$i.err" &
    pids+=($!)
  done
  for p in "${pids[@]}"; do wait "$p" || BURST_BAD=$((BURST_BAD + 1)); done
}
burst 4 spread
check "a burst of 4 queries with new passages, all answered" "$BURST_BAD" 0
d2=$(wd "$(netns_pid blend2)") d3=$(wd "$(netns_pid blend3)")
[ "$d2" -gt 0 ] && [ "$d3" -gt 0 ] && echo "ok: both blend workers answered queries ($d2, $d3)" \
  || { echo "FAIL: dispatched $d2 / $d3"; FAILS=$((FAILS + 1)); }

# --- 1. kill -9 of a blend worker before its first token: the other answers -------------------------------
C1="The Kettleby Lighthouse stands on Harrow Island. It was designed by the engineer Miriam Ashcombe and first lit in 1871."
QK="Who designed the Kettleby Lighthouse?"
REF_C1=$(env -u CB_COMMON_KV_REMOTE CB_COMMON_CURVE=off CB_DATA_DIR="$T/ref" "$RAG" --hot_cache_bytes 256M --context "$C1" "$QK")
netns_stop blend3
wait_until 10 ready_workers 1 || { echo "FAIL: blend3 still listed"; FAILS=$((FAILS + 1)); }
netns_stop blend2
start_blend 2 slow2 CB_BLEND_FAULT_STEP_DELAY_MS=15000   # its first step sleeps 15 s: no token before the kill
wait_until 60 ready_workers 1 || svc_finish
hcbctl query --context "$C1" "$QK" >"$T/retry.out" 2>"$T/retry.err" &
CL=$!
wait_until 10 bash -c "[ \"\$(ip netns exec $(netns_name 1) '$SEND' --timeout 1000 '$CB_ROUTER_ENDPOINT' '{\"type\":\"stats\"}' | jq .worker_list[0].inflight)\" = 1 ]" \
  || { echo "FAIL: the query did not reach the slow worker"; FAILS=$((FAILS + 1)); }
start_blend 3 blend3
wait_until 60 ready_workers 2 || { echo "FAIL: blend3 did not come back"; FAILS=$((FAILS + 1)); }
t0=$(date +%s%N)
netns_kill9 slow2
wait "$CL"; rc=$?
dt=$(( ($(date +%s%N) - t0) / 1000000 ))
check "1. blend worker on host 2 killed before the first token: answered by host 3" "$rc/$(cat "$T/retry.out")" "0/$REF_C1"
echo "ok: answered $dt ms after the kill (retried: $(rstat retried))"
start_blend 2 blend2
wait_until 60 ready_workers 2 || { echo "FAIL: blend2 did not come back"; FAILS=$((FAILS + 1)); }
ask "1. after host 2's worker is back:" "${QS[0]}"

# --- 2. kill -9 of a precompute worker mid-job: re-leased, completed, exactly once ---------------------
mkdir -p "$T/more"
for i in 5 6 7 8; do
  {
    echo "Report $i concerns the river town of Ardel$i, where the ferry number $i crosses to the east bank every hour."
    echo "The ferry master keeps a ledger of every crossing since the year 19$((20 + i))."
    echo
    echo "Ardel$i sends wool and cheese to the coast, carried by barges along the Tessa$i canal."
    echo "A bridge with $i arches was planned in Ardel$i but never built, for lack of stone."
  } >"$T/more/report$i.txt"
done
hcbctl ingest "$T/more" 2>"$T/ingest2.err"
check "2. four more documents acknowledged" "$?" 0
wait_until 60 bash -c "[ -n \"\$(sqlite3 '$MASTER_DB' \"SELECT job FROM jobs WHERE lease_owner = 'r:pw2' AND state = 1 AND chunks_done >= 1 AND chunks_done < chunks_total\")\" ]" \
  || { echo "FAIL: pw2 never got into the middle of a job"; FAILS=$((FAILS + 1)); }
netns_kill9 pw2
echo "ok: precompute worker on host 2 killed mid-job"
wait_until 120 bash -c "[ \"\$(sqlite3 '$MASTER_DB' 'SELECT count(*) FROM jobs WHERE state != 2')\" = 0 ]" \
  || { echo "FAIL: not every job finished after the kill"; FAILS=$((FAILS + 1)); }
exactly_once "2. after the kill"
[ "$(hstat 1 "$CB_PRECOMPUTE_ENDPOINT" leases_expired)" -ge 1 ] && echo "ok: the master counted the expired lease" \
  || { echo "FAIL: leases_expired = $(hstat 1 "$CB_PRECOMPUTE_ENDPOINT" leases_expired)"; FAILS=$((FAILS + 1)); }
start_pworker 2 pw2
wait_until 90 pworker_ready 2 || { echo "FAIL: pw2 did not come back"; FAILS=$((FAILS + 1)); }
ask "2. after the kill:" "When did the ferry number 6 start its ledger in Ardel6?"

# --- 3. Redis stopped: queries still answer; restarted -------------------------------------------------
netns_kill9 redis
C2="The Brindle Canal was dug in 1791 to carry coal from the Hobson pits to the river port of Calder."
Q2="What did the Brindle Canal carry?"
REF_C2=$(env -u CB_COMMON_KV_REMOTE CB_COMMON_CURVE=off CB_DATA_DIR="$T/ref" "$RAG" --hot_cache_bytes 256M --context "$C2" "$Q2")
t0=$(date +%s%N)
out=$(hcbctl query --context "$C2" "$Q2"); rc=$?
dt=$(( ($(date +%s%N) - t0) / 1000000 ))
check "3. Redis down: a query with a new passage answers (computed)" "$rc/$out" "0/$REF_C2"
echo "ok: in $dt ms"
ask "3. Redis down:" "${QS[1]}"
grep -q "down" "$T/blend2.log" "$T/blend3.log" && echo "ok: a blend worker logged the tier down" \
  || { echo "FAIL: no 'down' line in the blend workers' logs"; FAILS=$((FAILS + 1)); }
redis_start || svc_finish
sleep 1.5
out=$(hcbctl query --context "$C2 Again." "$Q2"); rc=$?
check "3. Redis back: a query answers" "$rc" 0

# --- 4. host 3 partitioned: host 2 answers; host 3 rejoins -----------------------------------------------
netns_partition 3
wait_until 15 ready_workers 1 || { echo "FAIL: the router still counts host 3's worker after 15 s"; FAILS=$((FAILS + 1)); }
echo "ok: host 3 partitioned, the router took its worker out"
for qq in "${QS[@]}"; do
  t0=$(date +%s%N)
  ask "4. partition:" "$qq"
  dt=$(( ($(date +%s%N) - t0) / 1000000 ))
  [ "$dt" -lt 30000 ] || { echo "FAIL: a query took $dt ms during the partition"; FAILS=$((FAILS + 1)); }
done
netns_heal 3
wait_until 40 ready_workers 2 || { echo "FAIL: host 3's worker did not rejoin within 40 s"; FAILS=$((FAILS + 1)); }
echo "ok: host 3 healed, its worker is back"
for qq in "${QS[@]}"; do ask "4. healed:" "$qq"; done
# the retrieval queries above go to the worker that holds their chunks (host 2's, which served alone);
# a burst of new passages at once spreads over both
burst 6 burst
check "4. healed: a burst of 6 queries, all answered" "$BURST_BAD" 0
d3b=$(wd "$(netns_pid blend3)")
[ "$d3b" -gt 0 ] && echo "ok: host 3's worker answers again ($d3b)" || { echo "FAIL: host 3's worker got nothing after the heal"; FAILS=$((FAILS + 1)); }
exactly_once "at the end"
svc_finish
