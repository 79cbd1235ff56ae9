#!/usr/bin/env bash
# Integration test of cb-retriever: the real binary on a random loopback port with a temp data dir.
# index / idempotent re-index / search (BM25 order, FTS5 syntax in user text is inert) / delete by
# chunk and by document / stats / hostile input (malformed msgpack, wrong types, unknown types,
# oversized messages, deep nesting, huge counts) with the service still answering / persistence across
# a restart / clean exit (0) on SIGTERM.
. "$(dirname "$0")/lib/svc.bash"
svc_setup
svc_need build/bin/cb-retriever build/bin/cb-send

PORT=$(svc_free_port)
EP=tcp://127.0.0.1:$PORT
ENV=(CB_RETRIEVER_ENDPOINT=$EP CB_COMMON_MAX_MSG_BYTES=65536 CB_RETRIEVER_MAX_TEXT_BYTES=20000)
svc_start retriever build/bin/cb-retriever "${ENV[@]}"
svc_wait_ping "$EP" || svc_finish

# --- a small corpus whose query words are rare (BM25 needs that to rank)
subjects=(
  "Hamlet is a tragedy written by William Shakespeare about a Danish prince."
  "The Eiffel Tower is a wrought-iron lattice tower in Paris, France."
  "Photosynthesis converts light energy into chemical energy in plants."
  "The Amazon river flows through Brazil into the Atlantic Ocean."
  "Mount Kilimanjaro is a dormant volcano in Tanzania."
  "The violin is a string instrument played with a bow."
  "Marie Curie researched radioactivity and won two Nobel prizes."
  "Basalt is an igneous rock formed from rapidly cooling lava."
  "The Great Wall of China stretches across northern China."
  "Penguins are flightless birds living in the Southern Hemisphere."
  "Espresso is coffee brewed by forcing hot water through ground beans."
  "Saturn has prominent rings made mostly of ice particles."
)
for i in "${!subjects[@]}"; do
  cid=$(printf 'c%039d' "$i" | tr 'c' 'a')
  out=$(send "$EP" "{\"type\":\"index\",\"chunk_id\":\"$cid\",\"doc_id\":\"doc$i\",\"text\":\"${subjects[$i]}\"}")
  [ "$(jget "$out" created)" = "true" ] || { echo "FAIL: index $i: $out"; FAILS=$((FAILS+1)); }
done
HAMLET=$(printf 'c%039d' 0 | tr 'c' 'a')
CURIE=$(printf 'c%039d' 6 | tr 'c' 'a')

out=$(send "$EP" "{\"type\":\"index\",\"chunk_id\":\"$HAMLET\",\"doc_id\":\"doc0\",\"text\":\"${subjects[0]}\"}")
check "re-index is idempotent" "$(jget "$out" created)" "false"
out=$(send "$EP" '{"type":"stats"}')
check "stats: chunks" "$(jget "$out" chunks)" "12"
check "stats: docs" "$(jget "$out" docs)" "12"
[ "$(jget "$out" db_bytes)" -gt 0 ] && echo "ok: stats: db_bytes > 0" || { echo "FAIL: db_bytes"; FAILS=$((FAILS+1)); }

# count {doc_id}: the chunks a document holds (cb-precompute's re-ingest check)
out=$(send "$EP" "{\"type\":\"index\",\"chunk_id\":\"$(printf 'b%039d' 1 | tr 'b' 'b')\",\"doc_id\":\"doc0\",\"text\":\"Hamlet's second chunk.\"}")
check "count: a document's chunks" "$(jget "$(send "$EP" '{"type":"count","doc_id":"doc0"}')" chunks)" 2
check "count: an unknown document has 0" "$(jget "$(send "$EP" '{"type":"count","doc_id":"nope"}')" chunks)" 0
check_error "count: empty doc_id" "$(send "$EP" '{"type":"count","doc_id":""}')" bad_request
check_error "count: no doc_id" "$(send "$EP" '{"type":"count"}')" bad_request
out=$(send "$EP" "{\"type\":\"delete\",\"chunk_id\":\"$(printf 'b%039d' 1)\"}")
check "count: after a delete" "$(jget "$(send "$EP" '{"type":"count","doc_id":"doc0"}')" chunks)" 1

out=$(send "$EP" '{"type":"search","query":"Who wrote Hamlet, the Danish tragedy?","k":3}')
check "search: best hit" "$(jget "$out" hits.0.chunk_id)" "$HAMLET"
check "search: doc_id" "$(jget "$out" hits.0.doc_id)" "doc0"
check "search: text" "$(jget "$out" hits.0.text)" "${subjects[0]}"
python3 -c 'import json,sys; h=json.loads(sys.argv[1])["hits"]; assert h[0]["score"]>0 and len(h)<=3 and all(h[i]["score"]>=h[i+1]["score"] for i in range(len(h)-1))' "$out" \
  && echo "ok: scores positive, sorted, at most k" || { echo "FAIL: scores: $out"; FAILS=$((FAILS+1)); }
out=$(send "$EP" '{"type":"search","query":"radioactivity Nobel"}')
check "search: default k, other doc" "$(jget "$out" hits.0.chunk_id)" "$CURIE"

# FTS5 syntax in user text is plain text: never an error, never a crash
for q in 'AND' 'OR NOT' '"unbalanced' 'NEAR(a b' 'text:Hamlet' 'Hamlet*' '^Hamlet' '-Hamlet' '(((' ')' \
         'a AND OR NOT b' '""' "'" '\\' 'Hamlet + tragedy' '{text} : x' 'é ü 中文 Hamlet'; do
  out=$(send "$EP" "{\"type\":\"search\",\"query\":$(json_str "$q"),\"k\":2}")
  [ "$(jget "$out" ok)" = "true" ] || { echo "FAIL: query '$q': $out"; FAILS=$((FAILS+1)); }
done
echo "ok: FTS5 operator characters in queries are inert"
out=$(send "$EP" '{"type":"search","query":"Hamlet* text:prince","k":2}')
check "search with operators still finds words" "$(jget "$out" hits.0.chunk_id)" "$HAMLET"
out=$(send "$EP" '{"type":"search","query":"?!.,;:()","k":2}')
check "punctuation-only query: no hits" "$(jget "$out" hits)" "[]"

# --- delete: a chunk shared by two documents survives the first document's deletion
out=$(send "$EP" "{\"type\":\"index\",\"chunk_id\":\"$CURIE\",\"doc_id\":\"docX\",\"text\":\"${subjects[6]}\"}")
check "shared chunk linked to a second doc" "$(jget "$out" created)" "false"
out=$(send "$EP" '{"type":"delete","doc_id":"doc6"}')
check "delete doc6: shared chunk kept" "$(jget "$out" deleted)" "0"
out=$(send "$EP" '{"type":"search","query":"radioactivity","k":1}')
check "shared chunk still found, now via docX" "$(jget "$out" hits.0.doc_id)" "docX"
out=$(send "$EP" '{"type":"delete","doc_id":"docX"}')
check "delete docX: chunk removed" "$(jget "$out" deleted)" "1"
out=$(send "$EP" '{"type":"search","query":"radioactivity","k":1}')
check "deleted chunk not found" "$(jget "$out" hits)" "[]"
out=$(send "$EP" "{\"type\":\"delete\",\"chunk_id\":\"$HAMLET\"}")
check "delete by chunk_id" "$(jget "$out" deleted)" "1"
out=$(send "$EP" "{\"type\":\"delete\",\"chunk_id\":\"$HAMLET\"}")
check "delete again: nothing" "$(jget "$out" deleted)" "0"
out=$(send "$EP" '{"type":"search","query":"Hamlet","k":1}')
check "deleted chunk gone from search" "$(jget "$out" hits)" "[]"
out=$(send "$EP" '{"type":"stats"}')
check "stats after deletes" "$(jget "$out" chunks)/$(jget "$out" docs)" "10/10"

# --- bad requests: error replies, and the service keeps answering
check_error "delete needs one key" "$(send "$EP" '{"type":"delete"}')" bad_request
check_error "delete with both keys" "$(send "$EP" "{\"type\":\"delete\",\"doc_id\":\"a\",\"chunk_id\":\"$HAMLET\"}")" bad_request
check_error "k as a string" "$(send "$EP" '{"type":"search","query":"x","k":"5"}')" bad_request
check_error "k out of range" "$(send "$EP" '{"type":"search","query":"x","k":100000}')" bad_request
check_error "k negative" "$(send "$EP" '{"type":"search","query":"x","k":-1}')" bad_request
check_error "query missing" "$(send "$EP" '{"type":"search","k":1}')" bad_request
check_error "query empty" "$(send "$EP" '{"type":"search","query":""}')" bad_request
check_error "query as a number" "$(send "$EP" '{"type":"search","query":42}')" bad_request
check_error "chunk_id not hex" "$(send "$EP" '{"type":"index","chunk_id":"zz112233445566778899","doc_id":"d","text":"t"}')" bad_request
check_error "chunk_id too short" "$(send "$EP" '{"type":"index","chunk_id":"abcd","doc_id":"d","text":"t"}')" bad_request
check_error "text missing" "$(send "$EP" "{\"type\":\"index\",\"chunk_id\":\"$HAMLET\",\"doc_id\":\"d\"}")" bad_request
check_error "doc_id empty" "$(send "$EP" "{\"type\":\"index\",\"chunk_id\":\"$HAMLET\",\"doc_id\":\"\",\"text\":\"t\"}")" bad_request
check_error "text with NUL" "$(send "$EP" "{\"type\":\"index\",\"chunk_id\":\"$HAMLET\",\"doc_id\":\"d\",\"text\":\"a\\u0000b\"}")" bad_request
big=$(python3 -c "print('word ' * 5000)")
check_error "text over max_text_bytes" "$(send "$EP" "{\"type\":\"index\",\"chunk_id\":\"$HAMLET\",\"doc_id\":\"d\",\"text\":\"$big\"}")" too_large
check_error "unknown type" "$(send "$EP" '{"type":"frobnicate"}')" unknown_type
check_error "protocol version 2" "$(send "$EP" '{"v":2,"type":"ping","id":"v2"}')" bad_request
check_error "type not a string" "$(send "$EP" '{"v":1,"type":7,"id":"t7"}')" bad_request
out=$(send "$EP" '{"v":1,"type":"ping","id":"x","ok":true}'); check_error "request carrying ok" "$out" bad_request
check_error "raw: not a map" "$(send "$EP" '' --raw-hex 93010203)" bad_request
check_error "raw: array32 claiming 2^32-1 elements" "$(send "$EP" '' --raw-hex 83a17601a474797065a470696e67a26964ddffffffff)" bad_request
check_error "raw: huge map count" "$(send "$EP" '' --raw-hex dfffffffff)" bad_request
check_error "raw: str32 longer than the frame" "$(send "$EP" '' --raw-hex 84a17601a474797065a470696e67a26964a178a178db7fffffff41)" bad_request
check_error "raw: truncated" "$(send "$EP" '' --raw-hex 83a17601a474797065a470)" bad_request
check_error "raw: trailing bytes" "$(send "$EP" '' --raw-hex 83a17601a474797065a470696e67a26964a178c0)" bad_request
check_error "raw: ext type" "$(send "$EP" '' --raw-hex 84a17601a474797065a470696e67a26964a178a178d40100)" bad_request
deep="84a17601a474797065a470696e67a26964a178a178$(printf '91%.0s' $(seq 1 40))01"
out=$(send "$EP" '' --raw-hex "$deep"); check_error "raw: 41 levels of nesting" "$out" bad_request
check "nesting error names the cause" "$(jget "$out" error.message | grep -c nesting)" "1"
check_error "raw: empty frame" "$(send "$EP" '' --raw-hex '')" bad_request
# oversized (> CB_COMMON_MAX_MSG_BYTES=65536): libzmq drops the connection, no reply
python3 -c "import json; print(json.dumps({'type':'index','chunk_id':'$HAMLET','doc_id':'d','text':'x'*100000}))" >"$T/big.json"
send "$EP" - --timeout 500 <"$T/big.json" >/dev/null 2>&1; rc=$?
check "oversized message: no reply (connection dropped)" "$rc" "2"
out=$(send "$EP" '{"type":"ping"}')
check "still answering after all that" "$(jget "$out" ok)" "true"
out=$(send "$EP" '{"type":"search","query":"Saturn rings ice","k":1}')
check "search still works" "$(jget "$out" hits.0.doc_id)" "doc11"

# --- clean exit on SIGTERM, persistence across a restart
svc_stop retriever
svc_start retriever2 build/bin/cb-retriever "${ENV[@]}"
svc_wait_ping "$EP" || svc_finish
out=$(send "$EP" '{"type":"search","query":"Saturn rings ice","k":1}')
check "index persisted across restart" "$(jget "$out" hits.0.doc_id)" "doc11"
out=$(send "$EP" '{"type":"stats"}')
check "stats after restart" "$(jget "$out" chunks)" "10"
grep -q "search ok" "$T/retriever.log" && echo "ok: one log line per request" || { echo "FAIL: no request log lines"; FAILS=$((FAILS+1)); }
grep -q "\[$(jget "$out" id)\] stats ok" "$T/retriever2.log" && echo "ok: log lines carry the request id" \
  || { echo "FAIL: request id not in log"; FAILS=$((FAILS+1)); }
svc_stop retriever2
svc_finish
