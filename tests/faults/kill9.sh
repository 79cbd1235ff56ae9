#!/usr/bin/env bash
# tests/faults/kill9.sh: kill -9 of every service (cb-retriever, cb-cacheindex, cb-precompute, cb-blend,
# cb-gateway) at seeded random points of an ingest and of a series of queries, CB_FAULTS_ROUNDS rounds each
# (default 3). After each kill the service is started again (same endpoint, same data dir) and:
#   - every acknowledged document ends up processed exactly once (job done, one job per document, each chunk
#     once in a search for the document's marker word and once in the retriever's document links);
#   - every query sent during the fault was answered (with the answer the healthy stack gave) or ended with a
#     clear error within its bound (30 s); none hung;
#   - after recovery the reference queries give the answers they gave before the faults;
#   - no other service died.
# Documents go to cb-precompute with cb-send (Lazy Pirate, 2 s x 3), or through the gateway's
# POST /v1/documents when the gateway is the one killed; queries use cbctl query (or the gateway's chat
# completions). One row per service in build/faults/rows.jsonl.
. "$(dirname "$0")/lib/faults.bash"
faults_begin kill9
ROUNDS=${CB_FAULTS_ROUNDS:-3}
[ "$FAULTS_QUICK" = 1 ] && ROUNDS=1
DOCS_PER_ROUND=5
QUERIES_PER_ROUND=4
stack_start_all || faults_finish
stack_start_gateway || faults_finish
cbctl ingest --wait data/sample >/dev/null 2>&1 || fail "ingest of data/sample"
ref_queries_define
ref_queries_record
http_ref_record

next=1
for svc in retriever cacheindex precompute blend gateway; do
  faults_row_begin "$svc"
  points=""
  via=zmq; [ "$svc" = gateway ] && via=http
  for r in $(seq 1 "$ROUNDS"); do
    # --- during an ingest: 5 documents sent one by one, the kill somewhere in the sending or the processing
    ingest_docs "$T/ack-$svc.txt" "$next" "$DOCS_PER_ROUND" "$via" &
    drv=$!
    d=$(rand_between 50 1500)
    ms_sleep "$d"
    kill9 "$svc"
    points="${points}i$d "
    sleep 0.3
    svc_restart "$svc"
    wait "$drv"
    next=$((next + DOCS_PER_ROUND))
    # --- during queries: 4 one after the other, each bounded by 30 s
    if [ "$svc" = gateway ]; then http_query_driver "$T/q-$svc-$r" "$QUERIES_PER_ROUND" 30 &
    else query_driver "$T/q-$svc-$r" "$QUERIES_PER_ROUND" 30 & fi
    drv=$!
    d=$(rand_between 50 1500)
    ms_sleep "$d"
    kill9 "$svc"
    points="${points}q$d "
    sleep 0.3
    svc_restart "$svc"
    wait "$drv"
    classify_dir "$T/q-$svc-$r"
    # --- after recovery: the reference answers
    ref_queries_check
    if [ "$svc" = gateway ]; then http_query_driver "$T/qr-$svc-$r" 1 30; classify_dir "$T/qr-$svc-$r"; fi
    crash_check
  done
  verify_docs "$T/ack-$svc.txt" 90
  nak=0; [ -f "$T/ack-$svc.txt.nak" ] && nak=$(wc -l <"$T/ack-$svc.txt.nak")
  note "kill points (ms after the start; i: ingest, q: queries): ${points% }"
  note "$nak of $((ROUNDS * DOCS_PER_ROUND)) documents not acknowledged (refused or unanswered while the service was down)"
  faults_row_end
done
db_checks
faults_finish
