#!/usr/bin/env bash
# The cache budget under ingest: with cacheindex.budget_bytes far below the corpus' KV size, ingesting
# data/sample keeps the KV files on disk (and the index's total) within the budget by LRU eviction; a query
# whose chunk was evicted recomputes it (a miss), answers as the in-process engine does, and stores it
# again (the next query hits).
. "$(dirname "$0")/lib/stack.bash"
stack_setup
export CB_CACHEINDEX_BUDGET_BYTES=3000000   # about two 64-token chunks
export CB_BLEND_HOT_CACHE_BYTES=0
stack_start_all || svc_finish
RET=$(stack_endpoint retriever)

kv_bytes() { find "$KV" -name '*.kv' -printf '%s\n' | awk '{s+=$1} END{print s+0}'; }

cbctl ingest --wait data/sample 2>"$T/ingest.err"
check "ingest --wait exits 0" "$?" 0
CHUNKS=$(stack_stat precompute chunks_done)
check "every chunk indexed for retrieval" "$(stack_stat retriever chunks)" "$CHUNKS"
total=$(kv_bytes); idx=$(stack_stat cacheindex bytes); ev=$(stack_stat cacheindex evictions)
echo "corpus: $CHUNKS chunks; on disk $total bytes, index $idx bytes, budget $CB_CACHEINDEX_BUDGET_BYTES, $ev evictions"
[ "$total" -le "$CB_CACHEINDEX_BUDGET_BYTES" ] && echo "ok: KV files on disk within the budget" \
  || { echo "FAIL: $total bytes on disk > budget"; FAILS=$((FAILS+1)); }
[ "$idx" -le "$CB_CACHEINDEX_BUDGET_BYTES" ] && echo "ok: index total within the budget" \
  || { echo "FAIL: index total $idx > budget"; FAILS=$((FAILS+1)); }
[ "$ev" -gt 0 ] && echo "ok: $ev evictions" || { echo "FAIL: no eviction"; FAILS=$((FAILS+1)); }
check "index entries = files on disk" "$(stack_stat cacheindex entries)" "$(find "$KV" -name '*.kv' | wc -l)"

# an evicted chunk: in the retriever, no KV file any more
hits=$(send "$RET" '{"type":"search","query":"the a of in and is was","k":50}')
n=$(echo "$hits" | jq '.hits | length')
evicted=""
for i in $(seq 0 $((n - 1))); do
  id=$(echo "$hits" | jq -r ".hits[$i].chunk_id")
  if [ ! -f "$KV/${id:0:2}/$id.kv" ]; then evicted=$i; break; fi
done
if [ -z "$evicted" ]; then echo "FAIL: no evicted chunk found among $n"; FAILS=$((FAILS+1)); svc_finish; fi
ID=$(echo "$hits" | jq -r ".hits[$evicted].chunk_id")
TEXT=$(echo "$hits" | jq -r ".hits[$evicted].text")
Q="What is this passage about?"
js=$(cbctl query --json --mode blend --context "$TEXT" "$Q" | tail -n 1)
check "evicted chunk: same key as at ingest" "$(jget "$js" chunk_ids.0)" "$ID"
check "evicted chunk: a miss, recomputed" "$(jget "$js" metrics.cache_misses)" 1
REF=$(rag --mode blend --context "$TEXT" "$Q")
check "evicted chunk: answer = in-process answer" "$(jget "$js" text)" "$REF"
[ -f "$KV/${ID:0:2}/$ID.kv" ] && echo "ok: its KV file is back" || { echo "FAIL: no KV file after the miss"; FAILS=$((FAILS+1)); }
js=$(cbctl query --json --mode blend --context "$TEXT" "$Q" | tail -n 1)
check "asked again: a hit" "$(jget "$js" metrics.cache_hits)/$(jget "$js" metrics.cache_misses)" "1/0"
check "asked again: same answer" "$(jget "$js" text)" "$REF"
total=$(kv_bytes)
[ "$total" -le "$CB_CACHEINDEX_BUDGET_BYTES" ] && echo "ok: still within the budget ($total bytes)" \
  || { echo "FAIL: $total bytes on disk > budget"; FAILS=$((FAILS+1)); }

for s in blend precompute cacheindex retriever; do svc_stop $s; done
svc_finish
