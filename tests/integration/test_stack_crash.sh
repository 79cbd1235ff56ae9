#!/usr/bin/env bash
# Fault tests of the stack (docs/reliability.md):
#   - kill -9 of cb-precompute while it processes acknowledged documents, then a restart: every document is
#     processed exactly once (one job per document, all done; each chunk once in the retriever and the
#     cache index; the worker resumes where it stopped);
#   - kill -9 of cb-precompute while cbctl ingest is sending: cbctl fails clearly; after a restart the same
#     ingest completes, with no document lost or doubled;
#   - kill -9 (and SIGSTOP) of cb-blend during a query: the client gets a timeout error within the heartbeat
#     window, not a hang; after a restart queries work and answer as the in-process engine does;
#   - a client that goes away mid-query does not stall the service; queries are queued FIFO and a full
#     queue answers `overloaded`; concurrent answers are not mixed.
. "$(dirname "$0")/lib/stack.bash"
stack_setup
export CB_PRECOMPUTE_CHUNK_TOKENS=40
export CB_BLEND_MAX_QUEUE=1 CB_BLEND_MAX_SEQS=1 CB_BLEND_CTX_SIZE=2048 # one runs, one waits, one is refused (section 4)
stack_launch retriever; stack_launch cacheindex; stack_launch precompute
for s in retriever cacheindex precompute; do stack_ready $s || svc_finish; done
PRE=$(stack_endpoint precompute)
DB="$CB_DATA_DIR/precompute.db"

# --- 1. kill -9 of cb-precompute in the middle of processing ------------------------------------------
mkdir -p "$T/docs1"
for i in $(seq 1 8); do
  {
    echo "Document $i is about the village of Hollin$i, which lies beside the river Asket$i in the northern hills."
    echo "The village has a stone bridge built in 17$((10 + i)) and a market held every Thursday since then."
    echo
    echo "Its main industry is the weaving of wool blankets dyed with madder$i and woad, sold in towns along the coast."
    echo "A small museum keeps looms, dye vats and the account books of the weavers' guild number $i."
    echo
    echo "In winter the river Asket$i often floods the lower meadows, and the villagers move their sheep uphill."
  } >"$T/docs1/doc$i.txt"
done
cbctl ingest "$T/docs1" 2>"$T/ingest1.err"
check "8 documents acknowledged" "$?" 0
wait_until 120 bash -c "[ \$('$SEND' '$PRE' '{\"type\":\"stats\"}' | jq .chunks_done) -ge 3 ]" \
  || { echo "FAIL: no progress before the kill"; FAILS=$((FAILS+1)); }
stack_kill9 precompute
done_at_kill=$(sqlite3 "$DB" "SELECT count(*) FROM jobs WHERE state = 2")
chunks_at_kill=$(sqlite3 "$DB" "SELECT count(*) FROM chunks WHERE done = 1")
echo "killed cb-precompute with $done_at_kill of 8 documents and $chunks_at_kill chunks done"
[ "$done_at_kill" -lt 8 ] && echo "ok: killed in the middle" || echo "note: all documents were done before the kill"
check "acknowledged documents are in the job table" "$(sqlite3 "$DB" "SELECT count(*) FROM jobs")" 8
stack_start precompute precompute2 || svc_finish
cbctl ingest --wait "$T/docs1" 2>"$T/ingest1b.err"
check "after the restart, ingest --wait of the same documents exits 0" "$?" 0
check "one job per document, all done" \
  "$(sqlite3 "$DB" "SELECT count(*), count(DISTINCT doc_id), sum(state = 2) FROM jobs")" "8|8|8"
NCH=$(sqlite3 "$DB" "SELECT count(DISTINCT key) FROM chunks")
check "every planned chunk done" "$(sqlite3 "$DB" "SELECT count(*) FROM chunks WHERE done = 0")" 0
check "chunks_done = chunks_total" "$(sqlite3 "$DB" "SELECT sum(chunks_done) = sum(chunks_total) FROM jobs")" 1
check "retriever: 8 documents" "$(stack_stat retriever docs)" 8
check "retriever: each chunk once" "$(stack_stat retriever chunks)" "$NCH"
check "cacheindex: each chunk once" "$(stack_stat cacheindex entries)" "$NCH"
check "one KV file per chunk" "$(find "$KV" -name '*.kv' | wc -l)" "$NCH"
if [ "$done_at_kill" -lt 8 ]; then
  grep -q "resumed\|doc '" "$T/precompute2.log" && echo "ok: the restarted worker picked the jobs up" \
    || { echo "FAIL: no resume in the log"; FAILS=$((FAILS+1)); }
fi

# --- 2. kill -9 of cb-precompute while cbctl ingest is sending ------------------------------------------
mkdir -p "$T/docs2"
for i in $(seq 1 600); do printf '{"id":"m%d","text":"A shared note about the Asket valley weather station."}\n' "$i"; done >"$T/docs2/many.jsonl"
cbctl ingest "$T/docs2" 2>"$T/ingest2.err" &
CL=$!
for _ in $(seq 1 3000); do [ "$(sqlite3 "$DB" 'SELECT count(*) FROM jobs')" -ge 40 ] && break; done
stack_kill9 precompute2
wait "$CL"; rc=$?
jobs_at_kill=$(sqlite3 "$DB" "SELECT count(*) FROM jobs")
echo "killed cb-precompute with $((jobs_at_kill - 8)) of 600 documents acknowledged (cbctl exit $rc)"
if [ "$jobs_at_kill" -lt 608 ]; then
  check "cbctl ingest reports the dead service (exit 3)" "$rc" 3
  grep -q "precompute" "$T/ingest2.err" && echo "ok: cbctl says which service: $(tail -n 2 "$T/ingest2.err" | head -n 1)"
fi
stack_start precompute precompute3 || svc_finish
cbctl ingest --wait "$T/docs2" 2>"$T/ingest2b.err"
check "after the restart, ingest --wait exits 0" "$?" 0
check "608 jobs, one per document, all done" \
  "$(sqlite3 "$DB" "SELECT count(*), count(DISTINCT doc_id), sum(state = 2) FROM jobs")" "608|608|608"
check "retriever: 608 documents" "$(stack_stat retriever docs)" 608
check "retriever: the shared chunk once" "$(stack_stat retriever chunks)" "$((NCH + 1))"
check "cacheindex: the shared chunk once" "$(stack_stat cacheindex entries)" "$((NCH + 1))"

# --- 3. kill -9 / SIGSTOP of cb-blend during a query -----------------------------------------------------
svc_stop precompute3
stack_start blend || svc_finish
# every sample document twice (~1,400 tokens): the full prefill outlasts the 1.2 s before the signal
ctx=(); for f in data/sample/*.md data/sample/*.txt data/sample/*.md data/sample/*.txt; do ctx+=(--context "$(cat "$f")"); done
Q="Who designed the Kettleby Lighthouse?"
# for the signals, ~1,700 tokens (what this stack's ctx_size of 2048 allows): with bf16 attention on AMX
# their prefill takes about a second at 2 threads, so the signal goes 0.5 s after the query (it arrives
# within milliseconds): mid-prefill on any machine this runs on
ctx_sig=("${ctx[@]}" --context "$(cat data/sample/brisket-station.txt)" --context "$(cat data/sample/kettleby-lighthouse.md)")
for sig in KILL STOP; do
  t0=$(date +%s%N)
  cbctl query --mode full --max-tokens 64 "${ctx_sig[@]}" "$Q" >"$T/q.out" 2>"$T/q.err" &
  CL=$!
  sleep 0.5
  kill -$sig "${SVC_PID[blend]}"
  wait "$CL"; rc=$?
  dt=$(( ($(date +%s%N) - t0) / 1000000 ))
  check "SIG$sig of cb-blend mid-query: cbctl exits 3" "$rc" 3
  [ "$dt" -lt 10000 ] && echo "ok: SIG$sig: the client gave up after $dt ms" \
    || { echo "FAIL: SIG$sig: the client took $dt ms"; FAILS=$((FAILS+1)); }
  grep -q "no answer from cb-blend" "$T/q.err" && echo "ok: SIG$sig: $(cat "$T/q.err")" \
    || { echo "FAIL: SIG$sig: message: $(cat "$T/q.err")"; FAILS=$((FAILS+1)); }
  if [ $sig = STOP ]; then kill -KILL "${SVC_PID[blend]}"; fi
  stack_kill9 blend
  stack_start blend || svc_finish
done
C1="The Quillon Chamber Orchestra was founded in 1978 by the cellist Helene Marchetti."
out=$(cbctl query --mode blend --context "$C1" "Who founded the Quillon Chamber Orchestra?"); rc=$?
check "after the restart, queries work" "$rc/$out" "0/$(rag --mode blend --context "$C1" "Who founded the Quillon Chamber Orchestra?")"

# --- 4. a client that goes away does not stall the service; FIFO queue; overloaded ---------------------
"$CBCTL" query --mode full --max-tokens 64 "${ctx[@]}" "$Q" >/dev/null 2>&1 &
CL=$!
sleep 0.8
kill -KILL "$CL"; wait "$CL" 2>/dev/null
t0=$(date +%s%N)
out=$(cbctl query --mode blend --context "$C1" "Who founded the Quillon Chamber Orchestra?"); rc=$?
dt=$(( ($(date +%s%N) - t0) / 1000000 ))
check "the next query is answered after a client vanished" "$rc" 0
wait_until 10 bash -c "[ \$('$SEND' '$(stack_endpoint blend)' '{\"type\":\"stats\"}' | jq .queries_cancelled) -ge 1 ]" \
  && echo "ok: the vanished client's query was cancelled (next query took $dt ms)" \
  || { echo "FAIL: queries_cancelled = $(stack_stat blend queries_cancelled)"; FAILS=$((FAILS+1)); }
# three at once with max_queue 1: one runs, one waits, one is refused
C2="Brisket Station is a research base on the Tamsen Ice Shelf, opened in 2003."
Q2="When was Brisket Station opened?"
cbctl query --mode full --max-tokens 64 "${ctx[@]}" "$Q" >"$T/a.out" 2>"$T/a.err" &
A=$!
sleep 0.5
cbctl query --mode blend --context "$C2" "$Q2" >"$T/b.out" 2>"$T/b.err" &
B=$!
sleep 0.3
cbctl query --mode blend --context "$C1" "Who founded the Quillon Chamber Orchestra?" >"$T/c.out" 2>"$T/c.err"; rc_c=$?
wait "$A"; rc_a=$?; wait "$B"; rc_b=$?
check "queue: the running query and the waiting one are answered" "$rc_a/$rc_b" "0/0"
check "queue: the third is refused (overloaded, exit 3)" "$rc_c/$(grep -c overloaded "$T/c.err")" "3/1"
check "queue: the waiting query got its own answer" "$(cat "$T/b.out")" "$(rag --mode blend --context "$C2" "$Q2")"
check "queue: the first query got its own answer" "$(cat "$T/a.out")" "$(rag --mode full --max-tokens 64 "${ctx[@]}" "$Q")"
check "stats: one rejected" "$(stack_stat blend rejected)" 1

for s in blend cacheindex retriever; do svc_stop $s; done
svc_finish
