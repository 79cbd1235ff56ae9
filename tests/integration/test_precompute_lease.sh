#!/usr/bin/env bash
# Remote precompute workers leasing jobs from one master (docs/leases.md):
#   - a master cb-precompute with no worker thread of its own (precompute.workers = 0) holds the job table;
#   - two remote workers (precompute.lease_from = the master), each on its own "host": its own data dir,
#     kv_dir and cb-cacheindex, one cb-retriever for all (the one the configuration names);
#   - N documents are ingested with acknowledgement; both workers take jobs;
#   - kill -9 of one worker in the middle of a job (precompute.fault_chunk_delay_ms slows every chunk):
#     after precompute.lease_ms its job is leased again to the other worker, which completes it;
#   - every document is done once, its chunks are in the retriever exactly once (count = its plan), every
#     KV file is on one of the hosts; the dead worker's token is refused (stale); the master's stats count
#     the grants, the expiry and the refusal;
#   - the remote worker reports its role and master link, refuses ingest, rides out a master restart;
#   - a query over the stack (cb-blend) answers.
# Every wait is bounded; exit 77 without the model.
. "$(dirname "$0")/lib/stack.bash"
stack_setup
export CB_PRECOMPUTE_CHUNK_TOKENS=40 CB_COMMON_THREADS=1
LEASE_MS=3000
N=6
MASTER=$(stack_endpoint precompute)
RET=$(stack_endpoint retriever)
HA="$T/hostA" HB="$T/hostB"
mkdir -p "$HA" "$HB"
CIA=$(stack_endpoint cacheindex)
CIB="tcp://127.0.0.1:$(svc_free_port)"
WA="tcp://127.0.0.1:$(svc_free_port)"
WB="tcp://127.0.0.1:$(svc_free_port)"
DB="$CB_DATA_DIR/precompute.db"

stat_of() { jget "$("$SEND" --timeout 2000 "$1" '{"type":"stats"}' 2>/dev/null || echo '{}')" "$2"; }
q() { sqlite3 "$DB" "$1"; }

# --- the stack: retriever, a cache index per host, the master (no worker), two remote workers ----------
stack_launch retriever
svc_start cacheindexA build/bin/cb-cacheindex CB_DATA_DIR="$HA"
svc_start cacheindexB build/bin/cb-cacheindex CB_DATA_DIR="$HB" CB_CACHEINDEX_ENDPOINT="$CIB"
svc_start master build/bin/cb-precompute CB_PRECOMPUTE_WORKERS=0 CB_PRECOMPUTE_LEASE_MS=$LEASE_MS
for ep in "$RET" "$CIA" "$CIB" "$MASTER"; do svc_wait_ping "$ep" 20 || svc_finish; done
check "master: role" "$(stat_of "$MASTER" role)/$(stat_of "$MASTER" workers)" "master/0"
# workers: their own endpoint (ping/stats), data dir, kv_dir and cache index; the shared retriever
start_worker() { # NAME ENDPOINT DATA_DIR CACHEINDEX
  svc_start "$1" build/bin/cb-precompute CB_PRECOMPUTE_LEASE_FROM="$MASTER" CB_PRECOMPUTE_WORKER_NAME="$1" \
    CB_PRECOMPUTE_ENDPOINT="$2" CB_PRECOMPUTE_PULL_ENDPOINT= CB_DATA_DIR="$3" CB_CACHEINDEX_ENDPOINT="$4" \
    CB_PRECOMPUTE_FAULT_CHUNK_DELAY_MS=700
}
start_worker wA "$WA" "$HA" "$CIA"
start_worker wB "$WB" "$HB" "$CIB"
for ep in "$WA" "$WB"; do
  svc_wait_ping "$ep" 20 || svc_finish
  wait_until 60 bash -c "[ \"\$('$SEND' --timeout 1000 '$ep' '{\"type\":\"stats\"}' | jq -r .worker_ready)\" = true ]" \
    || { echo "FAIL: worker at $ep not ready"; FAILS=$((FAILS+1)); svc_finish; }
done
check "worker: role and master link" "$(stat_of "$WB" role)/$(stat_of "$WB" master)/$(stat_of "$WB" master_up)" \
  "remote/$MASTER/true"
out=$(send "$WB" '{"type":"ingest","id":"i1","doc_id":"x","text":"y"}')
check_error "a remote worker refuses ingest (documents go to the master)" "$out" bad_request

# --- N documents, acknowledged ---------------------------------------------------------------------------
mkdir -p "$T/docs"
for i in $(seq 1 $N); do
  {
    echo "Report $i concerns the harbour town of Velmar$i, where the fishing fleet number $i is moored beside the old customs house."
    echo "The harbour master keeps a logbook of every boat that has entered since the year 18$((20 + i))."
    echo
    echo "Velmar$i exports smoked herring and salted cod to the inland cities, carried by carts along the Ostrey$i road."
    echo "A lighthouse painted with red band number $i stands on the breakwater and is lit every evening at dusk."
    echo
    echo "Storms from the west close the harbour of Velmar$i for about $((10 + i)) days each winter, and the boats stay in."
  } >"$T/docs/report$i.txt"
done
cbctl ingest "$T/docs" 2>"$T/ingest.err"
check "$N documents acknowledged" "$?" 0
check "$N jobs in the master's table" "$(q 'SELECT count(*) FROM jobs')" "$N"

# --- both workers take jobs; kill -9 one of them in the middle of its job --------------------------------
wait_until 60 bash -c "[ \$(sqlite3 '$DB' \"SELECT count(DISTINCT lease_owner) FROM jobs WHERE lease_owner LIKE 'r:%'\") -ge 2 ]" \
  && echo "ok: both workers hold leases" || { echo "FAIL: the two workers did not both lease jobs"; FAILS=$((FAILS+1)); }
# wA's job with a plan and at least one chunk done, not finished
wait_until 60 bash -c "[ -n \"\$(sqlite3 '$DB' \"SELECT job FROM jobs WHERE lease_owner = 'r:wA' AND state = 1 AND chunks_done >= 1 AND chunks_done < chunks_total\")\" ]" \
  || { echo "FAIL: wA never got into the middle of a job"; FAILS=$((FAILS+1)); }
stack_kill9 wA
KJ=$(q "SELECT job FROM jobs WHERE lease_owner = 'r:wA' AND state = 1 LIMIT 1")
KT=$(q "SELECT lease_token FROM jobs WHERE job = '$KJ'")
echo "killed wA in the middle of job $KJ ($(q "SELECT chunks_done || ' of ' || chunks_total FROM jobs WHERE job = '$KJ'") chunks done)"
[ -n "$KJ" ] && check "the killed worker's job is still running in the table" "$(q "SELECT state FROM jobs WHERE job = '$KJ'")" 1
# re-leased to wB after the lease times out
wait_until $((LEASE_MS / 1000 + 90)) bash -c "[ \"\$(sqlite3 '$DB' \"SELECT lease_owner FROM jobs WHERE job = '$KJ'\")\" = r:wB ]" \
  && echo "ok: job $KJ leased again to wB after the lease expired" \
  || { echo "FAIL: job $KJ not leased again: $(q "SELECT lease_owner, state FROM jobs WHERE job = '$KJ'")"; FAILS=$((FAILS+1)); }
out=$(send "$MASTER" "{\"type\":\"renew\",\"id\":\"r1\",\"job\":\"$KJ\",\"token\":\"$KT\"}")
check_error "the dead worker's token is refused (lease gone)" "$out" not_found
wait_until 180 bash -c "[ \$(sqlite3 '$DB' 'SELECT count(*) FROM jobs WHERE state = 2') -eq $N ]" \
  || { echo "FAIL: not every job done: $(q 'SELECT state, count(*) FROM jobs GROUP BY state')"; FAILS=$((FAILS+1)); }

# --- exactly once ----------------------------------------------------------------------------------------
check "every job done, once" "$(q 'SELECT count(*), count(DISTINCT doc_id), sum(state = 2) FROM jobs')" "$N|$N|$N"
check "the killed job completed on wB" "$(q "SELECT state, lease_owner FROM jobs WHERE job = '$KJ'")" "2|r:wB"
check "each job finished once (master log)" "$(grep -c 'done by a remote worker' "$T/master.log")" "$N"
check "chunks_done = chunks_total, no chunk left" \
  "$(q 'SELECT sum(chunks_done) = sum(chunks_total) FROM jobs')/$(q 'SELECT count(*) FROM chunks WHERE done = 0')" "1/0"
bad=0
for doc in $(q 'SELECT doc_id FROM jobs'); do
  plan=$(q "SELECT count(DISTINCT c.key) FROM chunks c JOIN jobs j ON j.job = c.job WHERE j.doc_id = '$doc'")
  have=$(jget "$(send "$RET" "{\"type\":\"count\",\"id\":\"c\",\"doc_id\":\"$doc\"}")" chunks)
  [ "$plan" -ge 2 ] && [ "$have" = "$plan" ] || { echo "FAIL: doc $doc: $have chunks in the retriever, plan $plan"; bad=1; }
done
[ $bad -eq 0 ] && echo "ok: every document's chunks are in the retriever exactly once (count = plan)" || FAILS=$((FAILS+1))
NCH=$(q 'SELECT count(DISTINCT key) FROM chunks')
check "retriever: each chunk once" "$(stat_of "$RET" chunks)/$(stat_of "$RET" docs)" "$NCH/$N"
missing=0
for k in $(q 'SELECT DISTINCT key FROM chunks'); do
  [ -n "$(find "$HA/kv" "$HB/kv" -name "$k*.kv" 2>/dev/null | head -1)" ] || missing=$((missing+1))
done
check "every chunk's KV file is on a worker's host" "$missing" 0
[ "$(find "$HA/kv" -name '*.kv' | wc -l)" -ge 1 ] && [ "$(find "$HB/kv" -name '*.kv' | wc -l)" -ge 1 ] \
  && echo "ok: both hosts computed KV files" || { echo "FAIL: a host has no KV files"; FAILS=$((FAILS+1)); }
check "master stats: expired and stale counted" \
  "$([ "$(stat_of "$MASTER" leases_expired)" -ge 1 ] && [ "$(stat_of "$MASTER" leases_stale)" -ge 1 ] && echo yes)" yes
[ "$(stat_of "$MASTER" leases_granted)" -ge $((N + 1)) ] && echo "ok: leases_granted = $(stat_of "$MASTER" leases_granted)" \
  || { echo "FAIL: leases_granted = $(stat_of "$MASTER" leases_granted)"; FAILS=$((FAILS+1)); }
check "wB: no lease held now, none lost" "$(stat_of "$WB" leases_held)/$(stat_of "$WB" leases_lost)" "0/0"
# the same documents again: done, indexed (their KV files are on the workers' hosts): duplicates, not restored
cbctl ingest --wait "$T/docs" 2>"$T/ingest2.err"
check "ingest again: exits 0, nothing restored" "$?/$(stat_of "$MASTER" restored)/$(q 'SELECT sum(state = 2) FROM jobs')" "0/0/$N"

# --- the master down and back: the worker backs off and reports the link --------------------------------
svc_stop master
wait_until 30 bash -c "[ \"\$('$SEND' --timeout 1000 '$WB' '{\"type\":\"stats\"}' | jq -r .master_up)\" = false ]" \
  && echo "ok: wB reports the master down" || { echo "FAIL: wB did not notice the master down"; FAILS=$((FAILS+1)); }
svc_start master2 build/bin/cb-precompute CB_PRECOMPUTE_WORKERS=0 CB_PRECOMPUTE_LEASE_MS=$LEASE_MS
svc_wait_ping "$MASTER" 20 || svc_finish
wait_until 60 bash -c "[ \"\$('$SEND' --timeout 1000 '$WB' '{\"type\":\"stats\"}' | jq -r .master_up)\" = true ]" \
  && echo "ok: wB reconnects to the restarted master" || { echo "FAIL: wB did not reconnect"; FAILS=$((FAILS+1)); }
logs=$(grep -c "job source" "$T/wB.log")
[ "$logs" -le 12 ] && echo "ok: the outage was logged $logs times (bounded)" \
  || { echo "FAIL: $logs log lines for one outage"; FAILS=$((FAILS+1)); }

# --- a query over the stack (host A's cache index and KV files) ------------------------------------------
svc_start blend build/bin/cb-blend CB_DATA_DIR="$HA"
stack_ready blend || svc_finish
out=$(cbctl query "Which town has a lighthouse with red band number 3?" 2>"$T/query.err"); rc=$?
check "a query over the stack answers" "$rc/$([ -n "$out" ] && echo answered)" "0/answered"
echo "answer: $out"

# --- SIGTERM of a worker in the middle of a job: it gives the lease back (grantable at once) ------------
mkdir -p "$T/late"
for i in 1 2 3; do echo "A late report, part $i, about the quays of Velmar and the tides that rise there each spring."; echo; done \
  >"$T/late/late.txt"
cbctl ingest "$T/late" 2>"$T/ingest3.err"
wait_until 30 bash -c "[ \"\$('$SEND' --timeout 1000 '$WB' '{\"type\":\"stats\"}' | jq -r .leases_held)\" = 1 ]" \
  || { echo "FAIL: wB did not lease the late document"; FAILS=$((FAILS+1)); }
svc_stop blend; svc_stop wB
check "SIGTERM mid-job: the lease was given back" \
  "$(q "SELECT state, lease_until FROM jobs WHERE doc_id LIKE '%late.txt'")/$(grep -c 'lease given back by its worker' "$T/master2.log")" \
  "1|0/1"
svc_stop master2
for s in cacheindexA cacheindexB retriever; do svc_stop $s; done
svc_finish
