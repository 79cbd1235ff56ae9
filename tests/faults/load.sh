#!/usr/bin/env bash
# tests/faults/load.sh: bounded load. 32 concurrent clients (cb-load, one DEALER each) send a mix of queries
# for CB_FAULTS_LOAD_S seconds (default 150; count-bounded too): blend and full, with explicit contexts and
# with retrieval over ingested documents (data/sample and the passages of 2 MuSiQue examples). cb-blend runs
# with its default queue (16 waiting) and batch (16 running), so a part of the 32 is refused `overloaded`;
# those are counted apart. Checks: every query answered or ended with an error reply or a bounded timeout
# (cb-load --timeout 30 s of silence); cb-load itself finishes within its bound (no hang); no service dies;
# every service answers afterwards; RSS of each service before, half-way and after (a plateau, not a climb).
# Clients wait 200 ms after an `overloaded` reply (cb-load --backoff), as a polite client would.
. "$(dirname "$0")/lib/faults.bash"
faults_begin load
svc_need build/bin/cb-load
LOAD_S=${CB_FAULTS_LOAD_S:-150}
[ "$FAULTS_QUICK" = 1 ] && LOAD_S=20
CLIENTS=32
export CB_BLEND_MAX_TOKENS=16
stack_start_all || faults_finish
head -n 2 data/musique_dev.jsonl >"$T/musique.jsonl"
t0=$(now_ms)
cbctl ingest --wait data/sample "$T/musique.jsonl" >/dev/null 2>"$T/ingest.err" || fail "ingest: $(tail -2 "$T/ingest.err")"
note "ingested data/sample and 2 MuSiQue examples ($(stack_stat retriever docs) documents, $(stack_stat retriever chunks) chunks) in $(( ($(now_ms) - t0) / 1000 )) s"
# the query mix: MuSiQue and sample questions by retrieval (blend, full), sample questions with contexts
{
  jq -c '{question: .question, mode: "blend"}, {question: .question, mode: "full"}' "$T/musique.jsonl"
  while read -r q; do
    jq -cn --arg q "$q" '{question: $q, mode: "blend"}, {question: $q, mode: "full"}'
  done <data/sample/questions.lst
  for f in data/sample/*.md data/sample/*.txt; do
    jq -cn --arg c "$(head -c 1500 "$f")" --arg q "What is this passage about?" \
      '{question: $q, contexts: [$c], mode: "blend"}, {question: $q, contexts: [$c], mode: "full"}'
  done
} >"$T/mix.jsonl"
note "$(wc -l <"$T/mix.jsonl") distinct queries in the mix"

ref_queries_define
unset "QARGS[rag-blend]" "QARGS[ctx-blend]"
ref_queries_record

faults_row_begin "${CLIENTS} clients x ${LOAD_S} s"
declare -A RSS0=()
for s in $ALL_SVCS; do RSS0[$s]=$(rss_mb "$s"); done
( sleep $((LOAD_S / 2)); for s in $ALL_SVCS; do echo "$s $(rss_mb "$s")"; done >"$T/rss-mid.txt" ) &
timeout $((LOAD_S + 120)) "$ROOT/build/bin/cb-load" --clients "$CLIENTS" --queries 1000000 --duration "$LOAD_S" \
  --backoff 200 --timeout 30000 --json "$(stack_endpoint blend)" "$T/mix.jsonl" >"$T/load.json" 2>"$T/load.err"
rc=$?
res=$(cat "$T/load.json")
echo "cb-load: $res"
if [ "$rc" = 124 ] || [ "$rc" = 137 ] || [ -z "$res" ]; then
  fail "cb-load did not finish within $((LOAD_S + 120)) s (exit $rc)"; Q_HUNG=1
else
  ok=$(jget "$res" ok) errors=$(jget "$res" errors) over=$(jget "$res" overloaded) noreply=$(jget "$res" no_reply)
  Q_OK=$ok Q_OVER=$over Q_ERR=$((errors - over))
  pass "cb-load: $ok answered, $over overloaded, $((errors - over)) other errors ($noreply without a reply in 30 s) in $(printf %.0f "$(jget "$res" wall_s)") s"
  note "$(printf '%.2f' "$(jget "$res" qps)") answers/s; TTFT p50 $(printf %.0f "$(jget "$res" ttft_ms.p50)") ms, p99 $(printf %.0f "$(jget "$res" ttft_ms.p99)") ms; total p99 $(printf %.0f "$(jget "$res" total_ms.p99)") ms"
  # every error is explained: an error reply with a code, or a timeout
  codes=$(sed -n 's/^cb-load: query [0-9]*: \([a-z_]*\): .*/\1/p' "$T/load.err" | sort | uniq -c | awk '{ printf "%s %s, ", $2, $1 }')
  [ -n "$codes" ] && note "error replies by code: ${codes%, }"
  [ "$noreply" -gt 0 ] && note "$noreply queries got no message for 30 s (cb-load's bound; reported as timeouts, not hangs)"
  unexplained=$(grep -c "^cb-load: query" "$T/load.err" || true)
  [ "$unexplained" -ge "$errors" ] && pass "every failed query has its reason in cb-load's log ($unexplained lines)" \
    || fail "$errors failed queries but only $unexplained reasons"
fi
crash_check
health_all && pass "after the load every service answers" || fail "after the load a service does not answer"
rss=""
for s in $ALL_SVCS; do rss="${rss}cb-$s ${RSS0[$s]} -> $(awk -v s="$s" '$1 == s { print $2 }' "$T/rss-mid.txt" 2>/dev/null) -> $(rss_mb "$s") MB, "; done
note "RSS before -> half-way -> after: ${rss%, }"
note "cb-blend: $(stack_stat blend queries_done) done, $(stack_stat blend rejected) refused (queue full), $(stack_stat blend queries_overloaded) overloaded (KV pool), $(stack_stat blend queries_cancelled) cancelled, batch peak $(stack_stat blend batch_peak)"
# the answers did not change under load
for l in "${!QARGS[@]}"; do
  a=$(query_run "$l" 60)
  check "after the load, query $l answers as before" "${a%% *}/$(cat "$T/q.out")" "0/${REF[$l]}"
done
faults_row_end
db_checks
faults_finish
