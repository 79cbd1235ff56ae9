#!/usr/bin/env bash
# cbctl ingest --wait rides out a restart of cb-precompute:
#   1. four documents are acknowledged, then, while cbctl polls their jobs (every chunk slowed by
#      precompute.fault_chunk_delay_ms), cb-precompute is stopped, kept down 3 s and started again on the same
#      endpoint and data: the failed status polls are retried (cbctl says so once, and again when it answers
#      again), cbctl exits 0 ("acknowledged and processed") and every job is done;
#   2. the deadline: a document acknowledged (its chunk held back for a minute), cb-precompute stopped for good: cbctl ingest --wait --timeout
#      4000 gives up after about 4 s with exit 3, naming the last error and the --timeout deadline.
# cbctl's own request timeout is 1 s x 2 attempts here, shorter than the outage: one poll alone cannot
# bridge it (a cbctl that gave up on the first failed poll fails part 1).
. "$(dirname "$0")/lib/stack.bash"
stack_setup
export CB_PRECOMPUTE_FAULT_CHUNK_DELAY_MS=700
export CB_CBCTL_REQUEST_TIMEOUT_MS=1000 CB_CBCTL_REQUEST_RETRIES=1
for s in retriever cacheindex precompute; do stack_start $s || svc_finish; done
DB="$CB_DATA_DIR/precompute.db"

# stop_precompute: SIGTERM, up to 10 s for it to exit (then SIGKILL), forgotten.
stop_precompute() { stack_stop precompute 10; }
jobs_of() { sqlite3 "$DB" "SELECT count(*) FROM jobs WHERE doc_id LIKE '$1%'" 2>/dev/null || echo 0; }
jobs_done() { sqlite3 "$DB" "SELECT count(*) FROM jobs WHERE doc_id LIKE '$1%' AND state = 2" 2>/dev/null || echo 0; }
has_jobs() { [ "$(jobs_of "$1")" -ge "$2" ]; }

# --- 1. a restart while cbctl waits ------------------------------------------------------------------------
mkdir -p "$T/docs"
words=(harbour lantern meadow orchard quarry ridge saddle thicket valley willow anchor beacon cistern dune
       estuary fjord glacier heath inlet jetty)
for d in 1 2 3 4; do
  for p in 1 2 3; do
    printf 'Record %d part %d.' "$d" "$p"
    for w in $(seq 1 45); do printf ' %s' "${words[$(( (d * 11 + p * 7 + w * 3) % ${#words[@]} ))]}"; done
    printf '.\n\n'
  done >"$T/docs/restart-$d.txt"
done
"$CBCTL" ingest --wait --timeout 180000 --prefix rs/ "$T/docs" >"$T/ingest1.out" 2>"$T/ingest1.err" &
CPID=$!
wait_until 30 has_jobs rs/ 4 && echo "ok: the four documents were acknowledged" \
  || { echo "FAIL: $(jobs_of rs/) of 4 jobs recorded"; FAILS=$((FAILS+1)); }
sleep 1   # cbctl is polling now (the first chunk alone takes 0.7 s)
check "processing is under way when cb-precompute stops" "$(( $(jobs_done rs/) < 4 ))" 1
stop_precompute
echo "cb-precompute stopped ($(jobs_done rs/) of 4 jobs done); restarting in 3 s"
sleep 3
kill -0 "$CPID" 2>/dev/null && echo "ok: cbctl still waits while cb-precompute is down" \
  || { echo "FAIL: cbctl gave up while cb-precompute was down: $(cat "$T/ingest1.err")"; FAILS=$((FAILS+1)); }
stack_start precompute || svc_finish
for i in $(seq 1 900); do kill -0 "$CPID" 2>/dev/null || break; sleep 0.2; done
kill -0 "$CPID" 2>/dev/null && { echo "FAIL: cbctl still running after 180 s"; kill "$CPID"; FAILS=$((FAILS+1)); }
wait "$CPID"; rc=$?
echo "cbctl said:"; sed 's/^/    /' "$T/ingest1.err"
check "cbctl ingest --wait across the restart exits 0" "$rc" 0
check "cbctl said the polls failed, once" "$(grep -c 'retrying status polls' "$T/ingest1.err")" 1
check "cbctl said when cb-precompute answered again" "$(grep -c 'precompute answers again' "$T/ingest1.err")" 1
check "cbctl's summary" "$(tail -n 1 "$T/ingest1.err")" "4 documents acknowledged and processed, 0 errors"
check "every job is done" "$(jobs_done rs/)" 4

# --- 2. cb-precompute gone for good: the --timeout deadline ---------------------------------------------------
stop_precompute
export CB_PRECOMPUTE_FAULT_CHUNK_DELAY_MS=60000   # the document stays unprocessed until cb-precompute is gone
stack_start precompute || svc_finish
printf 'A lone record about a tidal causeway and its keeper.\n' >"$T/lone.txt"
t0=$(date +%s%3N)
"$CBCTL" ingest --wait --timeout 4000 --prefix gone/ "$T/lone.txt" >/dev/null 2>"$T/ingest2.err" &
CPID=$!
wait_until 20 has_jobs gone/ 1 || { echo "FAIL: the document was not acknowledged"; FAILS=$((FAILS+1)); }
stack_kill9 precompute
wait "$CPID"; rc=$?
dt=$(( $(date +%s%3N) - t0 ))
echo "cbctl said:"; sed 's/^/    /' "$T/ingest2.err"
check "cb-precompute gone: exit 3" "$rc" 3
[ "$dt" -lt 15000 ] && echo "ok: gave up in $dt ms (--timeout 4000)" || { echo "FAIL: took $dt ms"; FAILS=$((FAILS+1)); }
check "the last error is reported with the deadline" \
      "$(grep -c 'status polls failed for .*: gave up at the --timeout deadline' "$T/ingest2.err")" 1
svc_finish
