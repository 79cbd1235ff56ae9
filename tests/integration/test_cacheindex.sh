#!/usr/bin/env bash
# Integration test of cb-cacheindex: the real binary on a random loopback port with a temp data dir
# and small fake KV files. put / lookup (hits, misses, vanished files) / touch / LRU eviction under
# the byte budget (never the entry just put) / gc of rows without files, orphan files, temp files
# (young files spared, nothing outside kv_dir touched, symlinks never followed) / path validation /
# hostile input with the service still answering / persistence and gc at restart / clean SIGTERM exit.
. "$(dirname "$0")/lib/svc.bash"
svc_setup
svc_need build/bin/cb-cacheindex build/bin/cb-send

PORT=$(svc_free_port)
EP=tcp://127.0.0.1:$PORT
KV="$CB_DATA_DIR/kv"
ENV=(CB_CACHEINDEX_ENDPOINT=$EP CB_CACHEINDEX_BUDGET_BYTES=10000 CB_CACHEINDEX_GC_MIN_AGE_S=60
     CB_COMMON_MAX_MSG_BYTES=65536 CB_CACHEINDEX_MAX_KEYS=256)

key() { printf '%064x' "$1"; }
# mkkv N SIZE [AGE]: writes kv/<hex[0:2]>/<hex>.kv of SIZE bytes (mtime AGE ago, e.g. "2 hours"); prints the relative path
mkkv() {
  local k rel; k=$(key "$1"); rel="${k:0:2}/$k.kv"
  mkdir -p "$KV/${k:0:2}"; head -c "$2" /dev/zero >"$KV/$rel"
  [ -n "${3:-}" ] && touch -d "$3 ago" "$KV/$rel"
  echo "$rel"
}
put() { send "$EP" "{\"type\":\"put\",\"key\":\"$(key "$1")\",\"path\":\"$2\",\"bytes\":$3,\"tokens\":$4,\"fingerprint\":\"00ff\"}"; }

svc_start cacheindex build/bin/cb-cacheindex "${ENV[@]}"
svc_wait_ping "$EP" || svc_finish
out=$(send "$EP" '{"type":"stats"}')
check "empty at start" "$(jget "$out" entries)/$(jget "$out" bytes)/$(jget "$out" budget)" "0/0/10000"

# --- put and lookup
P1=$(mkkv 1 3000); P2=$(mkkv 2 3000); P3=$(mkkv 3 3000)
out=$(put 1 "$P1" 3000 100); check "put k1" "$(jget "$out" evicted)/$(jget "$out" bytes_total)" "0/3000"
out=$(put 2 "$P2" 3000 100); check "put k2" "$(jget "$out" bytes_total)" "6000"
out=$(put 3 "$P3" 3000 100); check "put k3" "$(jget "$out" bytes_total)" "9000"
out=$(put 3 "$P3" 3000 100); check "put is idempotent" "$(jget "$out" bytes_total)" "9000"
out=$(send "$EP" "{\"type\":\"lookup\",\"keys\":[\"$(key 1)\",\"$(key 2)\",\"$(key 3)\",\"$(key 99)\"]}")
check "lookup: 3 hits" "$(jget "$out" hits.0.key) $(jget "$out" hits.1.key) $(jget "$out" hits.2.key)" "$(key 1) $(key 2) $(key 3)"
check "lookup: hit fields" "$(jget "$out" hits.0.path)/$(jget "$out" hits.0.bytes)/$(jget "$out" hits.0.tokens)/$(jget "$out" hits.0.fingerprint)" "$P1/3000/100/00ff"
check "lookup: the miss" "$(jget "$out" misses)" "[\"$(key 99)\"]"

# --- LRU: touch k1, so k2 is now the least recently used; a put over budget evicts k2 only
out=$(send "$EP" "{\"type\":\"touch\",\"keys\":[\"$(key 1)\",\"$(key 98)\"]}")
check "touch counts existing keys" "$(jget "$out" touched)" "1"
P4=$(mkkv 4 3000)
out=$(put 4 "$P4" 3000 100)
check "put over budget evicts one" "$(jget "$out" evicted)/$(jget "$out" bytes_total)" "1/9000"
[ ! -e "$KV/$P2" ] && echo "ok: evicted file removed" || { echo "FAIL: k2's file still there"; FAILS=$((FAILS+1)); }
[ -e "$KV/$P1" ] && [ -e "$KV/$P3" ] && [ -e "$KV/$P4" ] && echo "ok: other files kept" || { echo "FAIL: files missing"; FAILS=$((FAILS+1)); }
out=$(send "$EP" "{\"type\":\"lookup\",\"keys\":[\"$(key 2)\"]}")
check "evicted key misses" "$(jget "$out" hits)/$(jget "$out" misses.0)" "[]/$(key 2)"

# --- a vanished file is a miss and its row goes
rm "$KV/$P3"
out=$(send "$EP" "{\"type\":\"lookup\",\"keys\":[\"$(key 3)\",\"$(key 1)\"]}")
check "vanished file: miss" "$(jget "$out" misses)" "[\"$(key 3)\"]"
check "vanished file: others still hit" "$(jget "$out" hits.0.key)" "$(key 1)"
out=$(send "$EP" '{"type":"stats"}')
check "row of vanished file removed" "$(jget "$out" entries)/$(jget "$out" bytes)" "2/6000"
check "stats counters" "$(jget "$out" hits)/$(jget "$out" misses)/$(jget "$out" evictions)" "4/3/1"

# --- path and field validation
mkdir -p "$KV/xx"; head -c 10 /dev/zero >"$KV/xx/f.txt"; head -c 10 /dev/zero >"$T/outside.kv"
ln -s "$T/outside.kv" "$KV/xx/link.kv"
mkdir -p "$T/elsewhere"; head -c 10 /dev/zero >"$T/elsewhere/g.kv"; ln -s "$T/elsewhere" "$KV/evil"
for p in "../outside.kv" "/etc/passwd" "$T/outside.kv" "xx/../xx/f.kv" "./a.kv" "xx//a.kv" "xx/f.txt" ".kv" "xx/" \
         "a b.kv" "xx/link.kv" "evil/g.kv"; do
  out=$(put 50 "$p" 10 1)
  [ "$(jget "$out" ok)" = "false" ] && [ "$(jget "$out" error.code)" = "bad_request" ] \
    || { echo "FAIL: path '$p' accepted or wrong error: $out"; FAILS=$((FAILS+1)); }
done
echo "ok: bad paths, symlinked files and symlinked directories refused"
check_error "missing file" "$(put 50 "ab/nothere.kv" 10 1)" not_found
P5=$(mkkv 5 100)
check_error "size mismatch" "$(put 5 "$P5" 99 1)" bad_request
check_error "path owned by another key" "$(put 6 "$P1" 3000 1)" bad_request
check_error "key not hex" "$(send "$EP" "{\"type\":\"put\",\"key\":\"xyz0000000000000\",\"path\":\"$P5\",\"bytes\":100,\"tokens\":1,\"fingerprint\":\"00\"}")" bad_request
check_error "bytes negative" "$(put 5 "$P5" -1 1)" bad_request
check_error "tokens as a string" "$(send "$EP" "{\"type\":\"put\",\"key\":\"$(key 5)\",\"path\":\"$P5\",\"bytes\":100,\"tokens\":\"1\",\"fingerprint\":\"00\"}")" bad_request
check_error "fingerprint missing" "$(send "$EP" "{\"type\":\"put\",\"key\":\"$(key 5)\",\"path\":\"$P5\",\"bytes\":100,\"tokens\":1}")" bad_request
check_error "lookup without keys" "$(send "$EP" '{"type":"lookup"}')" bad_request
check_error "lookup keys empty" "$(send "$EP" '{"type":"lookup","keys":[]}')" bad_request
check_error "lookup keys not an array" "$(send "$EP" "{\"type\":\"lookup\",\"keys\":\"$(key 1)\"}")" bad_request
check_error "lookup key not hex" "$(send "$EP" '{"type":"lookup","keys":["0123456789abcdefXX"]}')" bad_request
many=$(for i in $(seq 1 257); do printf '"%s",' "$(key "$i")"; done); many="[${many%,}]"
check_error "lookup of 257 keys" "$(send "$EP" "{\"type\":\"lookup\",\"keys\":$many}")" too_large
check_error "touch of a number" "$(send "$EP" '{"type":"touch","keys":[5]}')" bad_request
check_error "unknown type" "$(send "$EP" '{"type":"evict_everything"}')" unknown_type
check_error "raw garbage" "$(send "$EP" '' --raw-hex c1c1c1)" bad_request
check_error "raw: deep nesting" "$(send "$EP" '' --raw-hex "84a17601a474797065a470696e67a26964a178a178$(printf '81a161%.0s' $(seq 1 20))01")" bad_request
check_error "raw: map claiming 2^32-1 entries" "$(send "$EP" '' --raw-hex 84a17601a474797065a470696e67a26964a178a178dfffffffff)" bad_request
python3 -c "import json; print(json.dumps({'type':'lookup','keys':['ab'*32]*2000}))" >"$T/big.json"
send "$EP" - --timeout 500 <"$T/big.json" >/dev/null 2>&1; rc=$?
check "oversized message: connection dropped, no reply" "$rc" "2"
out=$(send "$EP" '{"type":"ping"}')
check "still answering" "$(jget "$out" ok)" "true"
[ -e "$T/outside.kv" ] && [ -e "$T/elsewhere/g.kv" ] && echo "ok: nothing outside kv_dir touched" || { echo "FAIL: outside file removed"; FAILS=$((FAILS+1)); }

# --- gc: rows without files, orphan *.kv files (old ones only), stray temp files; nothing else
out=$(put 5 "$P5" 100 1); check "put k5" "$(jget "$out" ok)" "true"
rm "$KV/$P5"                                                # row 5 loses its file
O1=$(mkkv 70 500 "2 hours")                                 # old orphan: removed
O2=$(mkkv 71 500)                                           # young orphan: maybe a write in progress, kept
K=$(key 72); mkdir -p "$KV/${K:0:2}"
head -c 50 /dev/zero >"$KV/${K:0:2}/$K.kv.tmp.123.0"; touch -d "2 hours ago" "$KV/${K:0:2}/$K.kv.tmp.123.0"   # old temp: removed
head -c 50 /dev/zero >"$KV/${K:0:2}/$K.kv.tmp.124.0"                                                           # young temp: kept
touch -d "2 hours ago" "$KV/xx/f.txt"                       # not a KV file: kept
ln -s "$T/outside.kv" "$KV/${K:0:2}/orphanlink.kv"          # a symlink: never followed nor removed
out=$(send "$EP" '{"type":"gc"}')
check "gc counts" "$(jget "$out" rows_removed)/$(jget "$out" files_removed)/$(jget "$out" tmp_removed)/$(jget "$out" bytes_freed)" "1/1/1/500"
[ ! -e "$KV/$O1" ] && echo "ok: old orphan removed" || { echo "FAIL: old orphan kept"; FAILS=$((FAILS+1)); }
[ -e "$KV/$O2" ] && echo "ok: young orphan kept" || { echo "FAIL: young orphan removed"; FAILS=$((FAILS+1)); }
[ ! -e "$KV/${K:0:2}/$K.kv.tmp.123.0" ] && [ -e "$KV/${K:0:2}/$K.kv.tmp.124.0" ] && echo "ok: old temp removed, young kept" \
  || { echo "FAIL: temp files"; FAILS=$((FAILS+1)); }
[ -e "$KV/xx/f.txt" ] && [ -L "$KV/${K:0:2}/orphanlink.kv" ] && [ -e "$T/outside.kv" ] && [ -e "$T/elsewhere/g.kv" ] \
  && echo "ok: non-KV files, symlinks and files outside kv_dir untouched" || { echo "FAIL: gc touched what it must not"; FAILS=$((FAILS+1)); }
[ -e "$KV/$P1" ] && [ -e "$KV/$P4" ] && echo "ok: indexed files kept" || { echo "FAIL: indexed file removed"; FAILS=$((FAILS+1)); }
out=$(send "$EP" '{"type":"stats"}')
check "after gc" "$(jget "$out" entries)/$(jget "$out" bytes)" "2/6000"

# --- an entry bigger than the whole budget evicts everything else but stays itself
P8=$(mkkv 8 12000)
out=$(put 8 "$P8" 12000 500)
check "oversize entry: others evicted, it stays" "$(jget "$out" evicted)/$(jget "$out" bytes_total)" "2/12000"
out=$(send "$EP" "{\"type\":\"lookup\",\"keys\":[\"$(key 8)\",\"$(key 1)\"]}")
check "just-put entry hits" "$(jget "$out" hits.0.key)/$(jget "$out" misses.0)" "$(key 8)/$(key 1)"

# --- restart: rows persist; gc at start enforces a smaller budget and removes old orphans
svc_stop cacheindex
touch -d "2 hours ago" "$KV/$O2"
P9=$(mkkv 9 100 "2 hours")                         # old orphan
svc_start cacheindex2 build/bin/cb-cacheindex "${ENV[@]}" CB_CACHEINDEX_BUDGET_BYTES=20000
svc_wait_ping "$EP" || svc_finish
out=$(send "$EP" '{"type":"stats"}')
check "persisted across restart" "$(jget "$out" entries)/$(jget "$out" bytes)/$(jget "$out" budget)" "1/12000/20000"
[ ! -e "$KV/$O2" ] && [ ! -e "$KV/$P9" ] && echo "ok: gc at start removed orphans" || { echo "FAIL: start gc"; FAILS=$((FAILS+1)); }
out=$(put 9 "$(mkkv 9 100)" 100 1); check "put after restart" "$(jget "$out" bytes_total)" "12100"
svc_stop cacheindex2
svc_start cacheindex3 build/bin/cb-cacheindex "${ENV[@]}" CB_CACHEINDEX_BUDGET_BYTES=5000
svc_wait_ping "$EP" || svc_finish
out=$(send "$EP" '{"type":"stats"}')
check "a smaller budget is enforced at start" "$(jget "$out" bytes)" "100"
grep -q "lookup ok" "$T/cacheindex.log" && echo "ok: request log lines" || { echo "FAIL: no request log lines"; FAILS=$((FAILS+1)); }
svc_stop cacheindex3
svc_finish
