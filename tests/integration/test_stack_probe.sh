#!/usr/bin/env bash
# What a probe of the stack found, run the way an attacker and an unlucky operator would, each fixed:
#   1. a FIFO (or a symbolic link to one) at a chunk's KV file path: cb-blend and cb-precompute answer in
#      bounded time by recomputing the chunk (the same answer), and the path holds a regular file again;
#   2. a directory at a KV path: an empty one is replaced by the file; a non-empty one is left alone, the
#      failed write is counted (kv_write_failed) and logged once, and no `put` is sent for it;
#   3. cbctl query has an overall deadline (cbctl.query_timeout_ms) even while cb-blend keeps sending
#      heartbeats (blend.fault_step_delay_ms): exit 3 with a clear message;
#   4. a document deleted from cb-retriever comes back when it is ingested again (restored: true);
#   5. a doc_id with a newline and an escape character leaves one log line, escaped;
#   6. fairness: client A's big document does not hold client B's small one back; a per-client cap on
#      queued documents answers `overloaded`;
#   7. health: cb-precompute's ping fails (cbctl health: DOWN) while its worker has work and makes no
#      progress for precompute.stuck_ms (precompute.fault_chunk_delay_ms), and recovers after.
. "$(dirname "$0")/lib/stack.bash"
stack_setup
export CB_BLEND_HOT_CACHE_BYTES=0           # no memory tier: every query reads the KV files
stack_start_all || svc_finish
BLEND=$(stack_endpoint blend)
PRE=$(stack_endpoint precompute)
RET=$(stack_endpoint retriever)

# the KV file of the only chunk of a document (its job's chunk key)
kv_of_job() { # JOB
  local key
  key=$(sqlite3 "$CB_DATA_DIR/precompute.db" "SELECT key FROM chunks WHERE job = '$1' ORDER BY idx LIMIT 1")
  echo "$KV/${key:0:2}/$key.kv"
}
# ingest DOC_ID TEXT [CLIENT]: the reply line of an acknowledged ingest
ingest() {
  local js
  js="{\"type\":\"ingest\",\"doc_id\":$(json_str "$1"),\"text\":$(json_str "$2")${3:+,\"client\":\"$3\"}}"
  send "$PRE" "$js"
}
job_state() { jget "$(send "$PRE" "{\"type\":\"status\",\"job\":\"$1\"}")" state; }
wait_done() { wait_until "${2:-60}" bash -c "[ \"\$('$SEND' '$PRE' '{\"type\":\"status\",\"job\":\"$1\"}' | jq -r .state)\" = done ]"; }
is_regular() { [ -f "$1" ] && [ ! -L "$1" ]; }

# --- 1. a FIFO or a symbolic link to one at a KV path -----------------------------------------------------
D1="The Pellham Observatory stands on Corran Hill. Its great refractor was built by the optician Tobias Wren in 1902."
Q1="Who built the great refractor of the Pellham Observatory?"
out=$(ingest probe/pellham "$D1"); J1=$(jget "$out" job)
wait_done "$J1" && echo "ok: document 1 processed" || { echo "FAIL: document 1 not processed"; FAILS=$((FAILS+1)); }
F1=$(kv_of_job "$J1")
is_regular "$F1" && echo "ok: its KV file is at $F1" || { echo "FAIL: no KV file at $F1"; FAILS=$((FAILS+1)); }
REF=$(cbctl query --mode blend "$Q1"); rc=$?
check "a normal query answers" "$rc" 0
for kind in fifo symlink; do
  rm -f "$F1" "$T/target.fifo"
  if [ $kind = fifo ]; then mkfifo "$F1"; else mkfifo "$T/target.fifo"; ln -s "$T/target.fifo" "$F1"; fi
  t0=$(date +%s%N)
  out=$(timeout 60 "$CBCTL" query --mode blend "$Q1" 2>"$T/q.err"); rc=$?
  dt=$(( ($(date +%s%N) - t0) / 1000000 ))
  check "cb-blend, $kind at the KV path: the query answers" "$rc" 0
  check "cb-blend, $kind at the KV path: the same answer (recomputed)" "$out" "$REF"
  [ "$dt" -lt 30000 ] && echo "ok: answered in $dt ms" || { echo "FAIL: took $dt ms"; FAILS=$((FAILS+1)); }
  is_regular "$F1" && echo "ok: cb-blend healed the path: a regular file again" \
    || { echo "FAIL: $kind: $(ls -l "$F1")"; FAILS=$((FAILS+1)); }
done
[ -p "$T/target.fifo" ] && echo "ok: the link's target was not written through" \
  || { echo "FAIL: the link's target changed"; FAILS=$((FAILS+1)); }
grep -q "not_regular" "$T/blend.log" && echo "ok: cb-blend logged the miss: $(grep -m1 -o 'not_regular.*' "$T/blend.log")" \
  || { echo "FAIL: no not_regular miss in cb-blend's log"; FAILS=$((FAILS+1)); }
check "cb-blend is healthy" "$(jget "$(send "$BLEND" '{"type":"ping"}')" ok)" true
# cb-precompute: a FIFO at the KV path of a done document, ingested again: restored, recomputed, healed
rm -f "$F1"; mkfifo "$F1"
out=$(ingest probe/pellham "$D1")
check "cb-precompute, FIFO at the KV path: the re-ingest is restored" "$(jget "$out" duplicate)/$(jget "$out" restored)" "false/true"
wait_done "$J1" 30 && echo "ok: cb-precompute recomputed the chunk in bounded time" \
  || { echo "FAIL: job $J1 is $(job_state "$J1")"; FAILS=$((FAILS+1)); }
is_regular "$F1" && echo "ok: cb-precompute healed the path" || { echo "FAIL: $(ls -l "$F1")"; FAILS=$((FAILS+1)); }
check "cb-precompute is healthy" "$(jget "$(send "$PRE" '{"type":"ping"}')" ok)" true

# --- 2. a directory at a KV path ------------------------------------------------------------------------------
rm -f "$F1"; mkdir "$F1"
out=$(cbctl query --mode blend "$Q1"); rc=$?
check "an empty directory at the KV path: the query answers the same" "$rc/$out" "0/$REF"
is_regular "$F1" && echo "ok: the empty directory was replaced by the file" || { echo "FAIL: $(ls -ld "$F1")"; FAILS=$((FAILS+1)); }
rm -f "$F1"; mkdir -p "$F1/keep"; echo x >"$F1/keep/file"
f0=$(stack_stat blend kv_write_failed)
for i in 1 2; do
  out=$(cbctl query --mode blend "$Q1"); rc=$?
  check "a non-empty directory at the KV path: query $i answers the same" "$rc/$out" "0/$REF"
done
[ -f "$F1/keep/file" ] && echo "ok: the directory was left alone" || { echo "FAIL: the directory was touched"; FAILS=$((FAILS+1)); }
check "cb-blend counts the failed writes" "$(stack_stat blend kv_write_failed)" "$((f0 + 2))"
n=$(grep -c "not written: .*not empty" "$T/blend.log")
check "cb-blend warns once per key (rate limited)" "$n" 1
sleep 0.5
grep -q "cache index put\|no KV file to register\|not a regular file at its KV path" "$T/blend.log" \
  && { echo "FAIL: a put was attempted for the unwritten file: $(grep -m1 'cache index put\|register' "$T/blend.log")"; FAILS=$((FAILS+1)); } \
  || echo "ok: no put was sent for the file that was not written"
# cb-precompute: the same obstacle fails the job clearly, counted, no put
out=$(ingest probe/pellham "$D1")
check "cb-precompute: the re-ingest is restored" "$(jget "$out" restored)" true
wait_until 30 bash -c "[ \"\$('$SEND' '$PRE' '{\"type\":\"status\",\"job\":\"$J1\"}' | jq -r .state)\" = failed ]" \
  && echo "ok: the job fails: $(send "$PRE" "{\"type\":\"status\",\"job\":\"$J1\"}" | jq -r .error)" \
  || { echo "FAIL: job $J1 is $(job_state "$J1")"; FAILS=$((FAILS+1)); }
check "cb-precompute counts the failed write" "$(stack_stat precompute kv_write_failed)" 1
check "cb-precompute sent no put for it" "$(grep -c "put refused\|writing the file again" "$T/precompute.log")" 0
rm -rf "$F1"
out=$(ingest probe/pellham "$D1")
check "once the directory is gone, a retry is queued" "$(jget "$out" duplicate)" false
wait_done "$J1" 30 && is_regular "$F1" && echo "ok: and it completes" || { echo "FAIL: retry: $(job_state "$J1")"; FAILS=$((FAILS+1)); }

# --- 4. a document deleted at cb-retriever comes back when ingested again -----------------------------------
D4="The Ashgrove Canal links the river Tamber to the port of Selby. It was dug by hand between 1791 and 1796."
out=$(ingest probe/ashgrove "$D4"); J4=$(jget "$out" job)
wait_done "$J4" || { echo "FAIL: document 4 not processed"; FAILS=$((FAILS+1)); }
hits() { send "$RET" '{"type":"search","query":"Ashgrove Canal Tamber Selby","k":5}' | jq '[.hits[] | select(.doc_id == "probe/ashgrove")] | length'; }
check "searchable after ingest" "$(hits)" 1
out=$(send "$RET" '{"type":"delete","doc_id":"probe/ashgrove"}')
check "deleted at cb-retriever" "$(jget "$out" deleted)/$(hits)" "1/0"
r0=$(stack_stat precompute restored)
out=$(ingest probe/ashgrove "$D4")
check "ingested again: not a duplicate, restored" "$(jget "$out" job)/$(jget "$out" duplicate)/$(jget "$out" restored)" "$J4/false/true"
wait_done "$J4" && check "searchable again" "$(hits)" 1 || { echo "FAIL: restore not processed"; FAILS=$((FAILS+1)); }
check "stats.restored" "$(stack_stat precompute restored)" "$((r0 + 1))"
out=$(ingest probe/ashgrove "$D4")
check "ingested once more, everything there: a duplicate" "$(jget "$out" duplicate)/$(jget "$out" restored)" "true/false"
grep -q "queued again (restored)" "$T/precompute.log" && echo "ok: the restore is logged" \
  || { echo "FAIL: no restore in the log"; FAILS=$((FAILS+1)); }

# --- 5. a doc_id with a newline and an escape character: one log line -----------------------------------------
FORGED='a\n2026-01-01T00:00:00.000Z info  cb-precompute forged\u001b[2J'
out=$(send "$PRE" "{\"type\":\"ingest\",\"doc_id\":\"$FORGED\",\"text\":\"A short note about nothing in particular.\"}")
J5=$(jget "$out" job)
wait_done "$J5" || { echo "FAIL: document 5 not processed"; FAILS=$((FAILS+1)); }
n=0; for f in "$T"/*.log; do n=$((n + $(grep -c '^2026-01-01T00:00:00.000Z' "$f"))); done
check "no forged log line in any service's log" "$n" 0
grep -q 'a\\n2026-01-01T00:00:00.000Z info  cb-precompute forged\\x1b\[2J' "$T/precompute.log" \
  && echo "ok: the doc_id is logged escaped: $(grep -m1 -o "doc 'a.*forged[^']*'" "$T/precompute.log")" \
  || { echo "FAIL: the escaped doc_id is not in cb-precompute's log"; FAILS=$((FAILS+1)); }
grep -q $'\x1b' "$T"/*.log && { echo "FAIL: an escape character reached a log"; FAILS=$((FAILS+1)); } || echo "ok: no escape character in the logs"

# --- 3. cbctl query: an overall deadline while cb-blend keeps sending heartbeats -----------------------------
svc_stop blend
CB_BLEND_FAULT_STEP_DELAY_MS=4000 stack_start blend blend2 || svc_finish
t0=$(date +%s%N)
CB_CBCTL_QUERY_TIMEOUT_MS=3000 "$CBCTL" query --mode full --max-tokens 64 --context "$D1" "$Q1" >/dev/null 2>"$T/q3.err"; rc=$?
dt=$(( ($(date +%s%N) - t0) / 1000000 ))
check "a query past cbctl.query_timeout_ms exits 3" "$rc" 3
[ "$dt" -ge 2900 ] && [ "$dt" -lt 6000 ] && echo "ok: it gave up after $dt ms (heartbeats kept coming)" \
  || { echo "FAIL: it gave up after $dt ms"; FAILS=$((FAILS+1)); }
grep -q "took longer than cbctl.query_timeout_ms" "$T/q3.err" && echo "ok: $(cat "$T/q3.err")" \
  || { echo "FAIL: message: $(cat "$T/q3.err")"; FAILS=$((FAILS+1)); }
grep -q "heartbeat\|query" "$T/blend2.log" || true
svc_stop blend2

# --- 6. fairness across clients; the per-client cap --------------------------------------------------------
svc_stop precompute
CB_PRECOMPUTE_MAX_QUEUED_JOBS_PER_CLIENT=1 stack_start precompute precompute2 || svc_finish
BIG=$(python3 -c '
for i in range(40):
    print(f"Paragraph {i} of the harbour report: the harbour of Veldmar number {i} has cranes, ferries and a fish market that opens at dawn. The log for {1900+i} lists {i*7} ships from the northern ports.\n")')
t0=$(date +%s%N)
out=$(ingest probe/big "$BIG" A); JA=$(jget "$out" job)
out=$(ingest probe/small "The Kettleby ferry leaves at nine." B); JB=$(jget "$out" job)
out=$(ingest probe/second "A second document of client A." A)
check_error "client A's second document while its first is queued: overloaded" "$out" overloaded
echo "ok: $(jget "$out" error.message)"
check "another client is not affected" "$(jget "$(ingest probe/other 'Client C writes too.' C)" ok)" true
wait_done "$JB" 60 || { echo "FAIL: B's document not done"; FAILS=$((FAILS+1)); }
tb=$(( ($(date +%s%N) - t0) / 1000000 ))
sa=$(send "$PRE" "{\"type\":\"status\",\"job\":\"$JA\"}")
echo "B's document was done after $tb ms; A's then: $(jget "$sa" state) $(jget "$sa" chunks_done)/$(jget "$sa" chunks_total) chunks"
[ "$(jget "$sa" state)" != done ] && [ "$(jget "$sa" chunks_done)" -lt $(( $(jget "$sa" chunks_total) / 2 )) ] \
  && echo "ok: B's small document was done long before A's big one" || { echo "FAIL: B waited for A"; FAILS=$((FAILS+1)); }
wait_done "$JA" 120 && echo "ok: A's document completes" || { echo "FAIL: A's document: $(job_state "$JA")"; FAILS=$((FAILS+1)); }
check "A may send again once its document is done" "$(jget "$(ingest probe/second 'A second document of client A.' A)" ok)" true

# --- 7. health: a stuck precompute worker ---------------------------------------------------------------------
svc_stop precompute2
CB_PRECOMPUTE_STUCK_MS=1000 CB_PRECOMPUTE_FAULT_CHUNK_DELAY_MS=6000 stack_start precompute precompute3 || svc_finish
out=$(ingest probe/stuck "A document whose chunk takes its time.")
J7=$(jget "$out" job)
sleep 2.5
out=$(send "$PRE" '{"type":"ping"}')
check_error "ping of a stuck cb-precompute" "$out" unavailable
echo "ok: $(jget "$out" error.message)"
cbctl health >"$T/health.out" 2>&1; rc=$?
[ "$rc" -ne 0 ] && grep -q "stuck" "$T/health.out" && echo "ok: cbctl health reports it (exit $rc)" \
  || { echo "FAIL: cbctl health exit $rc: $(cat "$T/health.out")"; FAILS=$((FAILS+1)); }
wait_done "$J7" 30 || { echo "FAIL: the stuck job never finished"; FAILS=$((FAILS+1)); }
check "healthy again once it made progress" "$(jget "$(send "$PRE" '{"type":"ping"}')" ok)" true

for s in precompute3 blend2 cacheindex retriever; do [ -n "${SVC_PID[$s]:-}" ] && svc_stop "$s"; done
svc_finish
