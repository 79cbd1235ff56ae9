#!/usr/bin/env bash
# Integration test of the whole stack (cb-retriever, cb-cacheindex, cb-precompute, cb-blend + cbctl) on
# random loopback ports with a temporary data dir:
#   - cbctl ingest --wait of data/sample: every document acknowledged and processed, each chunk indexed
#     once, one KV file and one cache-index entry per chunk; ingesting again changes nothing;
#   - queries with explicit contexts: the streamed answer equals the in-process answer (cb-rag, same
#     prompt, same mode, greedy) in full and blend mode; the second query on the same chunks hits the
#     cache (the query's metrics and the services' stats show it);
#   - a query without contexts retrieves the ingested chunks, finds their KV precomputed, and answers as
#     the in-process engine does with the same passages;
#   - a corrupted and a truncated KV file are misses: recomputed, rewritten, the answer unchanged;
#   - the PULL socket takes pipeline documents; garbage there is dropped;
#   - malformed msgpack, wrong field types, unknown types, oversized messages and deep nesting sent to
#     cb-blend and cb-precompute get an error reply or a dropped connection, and both keep answering;
#   - every service exits 0 on SIGTERM.
. "$(dirname "$0")/lib/stack.bash"
stack_setup
export CB_BLEND_HOT_CACHE_BYTES=0           # no memory tier: every hit reads its KV file
export CB_COMMON_MAX_MSG_BYTES=1048576      # oversized = over 1 MiB
export CB_PRECOMPUTE_MAX_DOC_BYTES=200000
stack_start_all || svc_finish
BLEND=$(stack_endpoint blend)
PRE=$(stack_endpoint precompute)
RET=$(stack_endpoint retriever)

# --- 1. ingest ---------------------------------------------------------------------------------------
cbctl ingest --wait data/sample 2>"$T/ingest.err"; rc=$?
check "cbctl ingest --wait data/sample exits 0" "$rc" 0
check "precompute: 4 jobs done, none failed" "$(stack_stat precompute jobs_done)/$(stack_stat precompute jobs_failed)" "4/0"
CHUNKS=$(stack_stat precompute chunks_done)
[ "$CHUNKS" -ge 4 ] && echo "ok: $CHUNKS chunks" || { echo "FAIL: chunks_done = $CHUNKS"; FAILS=$((FAILS+1)); }
check "retriever: 4 documents" "$(stack_stat retriever docs)" 4
check "retriever: each chunk indexed once" "$(stack_stat retriever chunks)" "$CHUNKS"
check "cacheindex: one entry per chunk" "$(stack_stat cacheindex entries)" "$CHUNKS"
check "one KV file per chunk" "$(find "$KV" -name '*.kv' | wc -l)" "$CHUNKS"
cbctl ingest --wait data/sample 2>"$T/ingest2.err"; rc=$?
check "ingesting again exits 0" "$rc" 0
check "ingesting again: still 4 jobs, nothing queued" \
  "$(stack_stat precompute jobs_done)/$(stack_stat precompute jobs_queued)/$(stack_stat precompute jobs_running)" "4/0/0"
check "ingesting again: retriever unchanged" "$(stack_stat retriever chunks)/$(stack_stat retriever docs)" "$CHUNKS/4"
out=$(send "$PRE" '{"type":"ingest","doc_id":"data/sample/oraka-volcano.txt","text":"other text"}')
JOB=$(jget "$out" job)
check "a new version of a document is a new job" "$(jget "$out" duplicate)" "false"
wait_until 60 bash -c "[ \"\$('$SEND' '$PRE' '{\"type\":\"status\",\"job\":\"$JOB\"}' | jq -r .state)\" = done ]" \
  && echo "ok: new version processed" || { echo "FAIL: new version not processed"; FAILS=$((FAILS+1)); }
out=$(send "$RET" '{"type":"search","query":"Oraka erupted 1887 Hask mudflow","k":5}')
check "the old version left the retriever" "$(echo "$out" | jq '[.hits[] | select(.doc_id == "data/sample/oraka-volcano.txt" and (.text | test("1887")))] | length')" 0
cbctl ingest --wait data/sample/oraka-volcano.txt 2>/dev/null
check "pushing the old version again brings it back" \
  "$(send "$RET" '{"type":"search","query":"Oraka erupted 1887 Hask mudflow","k":1}' | jq -r '.hits[0].doc_id')" \
  "data/sample/oraka-volcano.txt"

# --- 2. explicit contexts: stack answer = in-process answer; second query hits the cache -------------
C1="The Kettleby Lighthouse stands on Harrow Island. It was designed by the engineer Miriam Ashcombe and first lit in 1871."
C2="Mount Oraka is a stratovolcano in the Lenmark Range. It last erupted in 1887."
Q="Who designed the Kettleby Lighthouse?"
for mode in full blend reuse; do
  out=$(cbctl query --json --mode "$mode" --context "$C1" --context "$C2" "$Q"); rc=$?
  stream=$(printf '%s\n' "$out" | head -n -1)
  js=$(printf '%s\n' "$out" | tail -n 1)
  ref=$(rag --mode "$mode" --context "$C1" --context "$C2" "$Q")
  check "query $mode: exit 0" "$rc" 0
  check "query $mode: streamed answer = in-process answer" "$stream" "$ref"
  check "query $mode: done.text = the streamed text" "$(jget "$js" text)" "$stream"
  [ -n "$stream" ] && echo "ok: query $mode answered: $stream" || { echo "FAIL: empty answer"; FAILS=$((FAILS+1)); }
done
REF_BLEND=$(rag --mode blend --context "$C1" --context "$C2" "$Q")
h0=$(stack_stat blend cache_hits); c0=$(stack_stat cacheindex hits)
js=$(cbctl query --json --mode blend --context "$C1" --context "$C2" "$Q" | tail -n 1)
check "second query: both chunks hit, no miss" "$(jget "$js" metrics.cache_hits)/$(jget "$js" metrics.cache_misses)" "2/0"
check "second query: same answer" "$(jget "$js" text)" "$REF_BLEND"
check "cb-blend stats count the hits" "$(stack_stat blend cache_hits)" "$((h0 + 2))"
check "cb-cacheindex stats count the hits" "$(stack_stat cacheindex hits)" "$((c0 + 2))"
ID1=$(jget "$js" chunk_ids.0); ID2=$(jget "$js" chunk_ids.1)
[ "$(jget "$js" client.ttft_ms | cut -d. -f1)" -gt 0 ] && echo "ok: client ttft $(jget "$js" client.ttft_ms) ms"

# --- 3. retrieval: ingested chunks are found and their KV is precomputed ------------------------------
Q2="When did Mount Oraka last erupt?"
hits=$(send "$RET" "{\"type\":\"search\",\"query\":$(json_str "$Q2"),\"k\":3}")
args=(); for i in 0 1 2; do t=$(jget "$hits" "hits.$i.text"); [ "$t" != null ] && args+=(--context "$t"); done
js=$(cbctl query --json --mode blend "$Q2" | tail -n 1)
check "retrieval query: k=3 chunks, all precomputed" \
  "$(jget "$js" metrics.n_chunks)/$(jget "$js" metrics.cache_hits)/$(jget "$js" metrics.cache_misses)" "3/3/0"
check "retrieval query: answer = in-process answer with the same passages" "$(jget "$js" text)" \
  "$(rag --mode blend "${args[@]}" "$Q2")"
echo "ok: retrieval answer: $(jget "$js" text)"

# --- 4. corrupted and truncated KV files are misses: recomputed, rewritten, answer unchanged -----------
F1="$KV/${ID1:0:2}/$ID1.kv"; F2="$KV/${ID2:0:2}/$ID2.kv"
size=$(stat -c %s "$F1"); size2=$(stat -c %s "$F2")
printf '\xde\xad\xbe\xef\xde\xad\xbe\xef' | dd of="$F1" bs=1 seek=$((size / 2)) conv=notrunc status=none
truncate -s $(( $(stat -c %s "$F2") / 3 )) "$F2"
js=$(cbctl query --json --mode blend --context "$C1" --context "$C2" "$Q" | tail -n 1)
# the truncated file no longer has its recorded size: cb-cacheindex drops its row (an index miss); the
# flipped bytes pass the index's size check and fail the blend's checksum (cache_corrupt)
check "damaged files: both chunks recomputed" "$(jget "$js" metrics.cache_misses)/$(jget "$js" metrics.cache_corrupt)" "2/1"
check "damaged files: answer unchanged" "$(jget "$js" text)" "$REF_BLEND"
check "damaged files: rewritten whole" "$(stat -c %s "$F1")/$(stat -c %s "$F2")" "$size/$size2"
js=$(cbctl query --json --mode blend --context "$C1" --context "$C2" "$Q" | tail -n 1)
check "after the rewrite: hits again" "$(jget "$js" metrics.cache_hits)/$(jget "$js" metrics.cache_corrupt)" "2/0"
check "after the rewrite: answer unchanged" "$(jget "$js" text)" "$REF_BLEND"

# --- 5. PULL socket ---------------------------------------------------------------------------------
"$PUSH" "$CB_PRECOMPUTE_PULL_ENDPOINT" '{"type":"ingest","doc_id":"pushed-1","text":"The quokka is a small marsupial of Rottnest Island."}'
check "cb-push exit" "$?" 0
"$PUSH" --raw-hex 93010203 "$CB_PRECOMPUTE_PULL_ENDPOINT"
"$PUSH" "$CB_PRECOMPUTE_PULL_ENDPOINT" '{"type":"ingest","doc_id":"","text":"x"}' '{"type":"status","job":"x"}'
wait_until 60 bash -c "[ \"\$('$SEND' '$PRE' '{\"type\":\"stats\"}' | jq .jobs_done)\" = 6 ]" \
  && echo "ok: pushed document processed" || { echo "FAIL: pushed document not processed"; FAILS=$((FAILS+1)); }
check "pull: 4 messages taken, 3 dropped" "$(stack_stat precompute pulled)/$(stack_stat precompute pull_dropped)" "4/3"

# --- 6. hostile input to cb-blend and cb-precompute -----------------------------------------------------
for ep in "$BLEND" "$PRE"; do
  check_error "raw: not a map ($ep)" "$(send "$ep" '' --raw-hex 93010203)" bad_request
  check_error "raw: array32 claiming 2^32-1 elements" "$(send "$ep" '' --raw-hex 83a17601a474797065a470696e67a26964ddffffffff)" bad_request
  check_error "raw: huge map count" "$(send "$ep" '' --raw-hex dfffffffff)" bad_request
  check_error "raw: truncated" "$(send "$ep" '' --raw-hex 83a17601a474797065a470)" bad_request
  deep="84a17601a474797065a470696e67a26964a178a178$(printf '91%.0s' $(seq 1 40))01"
  check_error "raw: 41 levels of nesting" "$(send "$ep" '' --raw-hex "$deep")" bad_request
  check_error "unknown type" "$(send "$ep" '{"type":"frobnicate"}')" unknown_type
  check_error "protocol version 2" "$(send "$ep" '{"v":2,"type":"ping","id":"v2"}')" bad_request
  python3 -c "import json; print(json.dumps({'type':'ingest','doc_id':'big','question':'q','text':'x'*1200000}))" >"$T/big.json"
  send "$ep" - --timeout 1000 <"$T/big.json" >/dev/null 2>&1
  check "oversized message: connection dropped, no reply" "$?" 2
  check "still answering ping" "$(jget "$(send "$ep" '{"type":"ping"}')" ok)" true
done
check_error "query: question as a number" "$(send "$BLEND" '{"type":"query","question":42}')" bad_request
check_error "query: question missing" "$(send "$BLEND" '{"type":"query"}')" bad_request
check_error "query: empty question" "$(send "$BLEND" '{"type":"query","question":""}')" bad_request
check_error "query: contexts not an array" "$(send "$BLEND" '{"type":"query","question":"q","contexts":"c"}')" bad_request
check_error "query: a context not a string" "$(send "$BLEND" '{"type":"query","question":"q","contexts":["a",7]}')" bad_request
many=$(python3 -c "import json; print(json.dumps({'type':'query','question':'q','contexts':['c']*33}))")
check_error "query: 33 contexts" "$(send "$BLEND" "$many")" bad_request
check_error "query: unknown mode" "$(send "$BLEND" '{"type":"query","question":"q","mode":"turbo"}')" bad_request
check_error "query: ratio 2" "$(send "$BLEND" '{"type":"query","question":"q","ratio":2}')" bad_request
check_error "query: ratio as a string" "$(send "$BLEND" '{"type":"query","question":"q","ratio":"0.5"}')" bad_request
check_error "query: max_tokens 0" "$(send "$BLEND" '{"type":"query","question":"q","max_tokens":0}')" bad_request
check_error "query: k 1000" "$(send "$BLEND" '{"type":"query","question":"q","k":1000}')" bad_request
check_error "query: top_p 0" "$(send "$BLEND" '{"type":"query","question":"q","top_p":0}')" bad_request
check_error "query: seed negative" "$(send "$BLEND" '{"type":"query","question":"q","seed":-1}')" bad_request
long=$(python3 -c "print('word ' * 3000)")
out=$(send "$BLEND" "{\"type\":\"query\",\"question\":\"q\",\"max_tokens\":1,\"contexts\":[\"$long\"]}" --stream | tail -n 1)
check_error "query: prompt longer than ctx_size ends the stream with an error" "$out" too_large
check_error "ingest: text as a number" "$(send "$PRE" '{"type":"ingest","doc_id":"d","text":5}')" bad_request
check_error "ingest: empty doc_id" "$(send "$PRE" '{"type":"ingest","doc_id":"","text":"t"}')" bad_request
check_error "ingest: doc_id missing" "$(send "$PRE" '{"type":"ingest","text":"t"}')" bad_request
python3 -c "import json; print(json.dumps({'type':'ingest','doc_id':'d','text':'y'*300000}))" >"$T/doc.json"
check_error "ingest: text over max_doc_bytes" "$(send "$PRE" - <"$T/doc.json")" too_large
check_error "ingest: nested meta" "$(send "$PRE" '{"type":"ingest","doc_id":"d","text":"t","meta":{"a":{"b":1}}}')" bad_request
check_error "ingest: meta not a map" "$(send "$PRE" '{"type":"ingest","doc_id":"d","text":"t","meta":[1]}')" bad_request
check_error "status: unknown job" "$(send "$PRE" '{"type":"status","job":"nope"}')" not_found
check_error "status: job as a number" "$(send "$PRE" '{"type":"status","job":12}')" bad_request
out=$(cbctl query --mode blend --context "$C1" --context "$C2" "$Q"); rc=$?
check "cb-blend still answers queries after all that" "$rc/$out" "0/$REF_BLEND"
check "cb-precompute still processes documents" "$(stack_stat precompute jobs_failed)" 0

# --- 7. clean shutdown -----------------------------------------------------------------------------
for s in blend precompute cacheindex retriever; do svc_stop $s; done
svc_finish
