#!/usr/bin/env bash
# CURVE and ZAP on every link of the stack (docs/protocol.md section 1.1):
#   1. cbctl keys init makes the key set (secrets 0600), a second init changes nothing, keys list checks it;
#   2. the whole stack with CB_COMMON_CURVE=on: every service a CURVE server with a ZAP allow-list;
#      cbctl health, ingest of data/sample (cb-precompute -> retriever/cacheindex through CURVE), a query
#      (cb-blend -> retriever/cacheindex), cb-send and cb-push as the cbctl identity;
#   3. refused, with the reason, before any timeout: a cbctl whose key is not in the allow-list (ZAP), a
#      cbctl with another key set altogether (wrong server keys), a plaintext cbctl and cb-push; the
#      service logs the refusal;
#   4. a service with curve on and no keys stops at start with a clear error; a plaintext service bound to
#      a non-loopback address warns;
#   5. cb-gateway through CURVE: /health 200 and a chat completion; with an unlisted key, /health 503
#      naming the refusal.
. "$(dirname "$0")/lib/stack.bash"
stack_setup
svc_need build/bin/cb-gateway
command -v curl >/dev/null || { echo "skip: no curl"; exit 77; }

ms_now() { date +%s%3N; }

# --- 1. keys -----------------------------------------------------------------------------------------
KEYS="$T/keys"
out=$(cbctl keys init "$KEYS"); rc=$?
check "cbctl keys init exits 0" "$rc" 0
check "init says what it made" "$(echo "$out" | grep -c 'made CURVE keys')" 1
check "a server secret is 0600" "$(stat -c %a "$KEYS/server/blend.key_secret")" 600
check "a client secret is 0600" "$(stat -c %a "$KEYS/client/cbctl.key_secret")" 600
check "server/ is 0700" "$(stat -c %a "$KEYS/server")" 700
check "allowed/ holds the six client identities" "$(ls "$KEYS/allowed" | sort | tr '\n' ' ')" \
      "blend.key cacheindex.key cbctl.key gateway.key precompute.key retriever.key "
check "public/ holds the four services" "$(ls "$KEYS/public" | sort | tr '\n' ' ')" \
      "blend.key cacheindex.key precompute.key retriever.key "
before=$(md5sum "$KEYS"/server/* "$KEYS"/client/* | md5sum)
out=$(cbctl keys init "$KEYS"); rc=$?
check "a second init exits 0" "$rc" 0
check "a second init changes nothing" "$(md5sum "$KEYS"/server/* "$KEYS"/client/* | md5sum)" "$before"
check "a second init says so" "$(echo "$out" | grep -c 'nothing changed')" 1
out=$(cbctl keys list "$KEYS"); rc=$?
check "cbctl keys list exits 0" "$rc" 0
check "keys list: every pair fine" "$(echo "$out" | tail -n 1)" "ok; 6 client keys allowed"

# --- 2. the stack with CURVE on ----------------------------------------------------------------------
export CB_COMMON_CURVE=on CB_COMMON_KEYS_DIR="$KEYS"
stack_start_all || svc_finish
for s in retriever cacheindex precompute blend; do
  check "cb-$s is a CURVE server" "$(grep -c 'is a CURVE server' "$T/$s.log" | awk '{print ($1 > 0)}')" 1
  check "cb-$s admits the allowed keys" "$(grep -c 'ZAP handler admits the 6 client keys' "$T/$s.log")" 1
done
check "cb-precompute's PULL socket is a CURVE server too" \
      "$(grep 'is a CURVE server' "$T/precompute.log" | grep -c "$CB_PRECOMPUTE_PULL_ENDPOINT")" 1
out=$(cbctl health); rc=$?
check "cbctl health through CURVE exits 0" "$rc" 0
check "cbctl health: all four answer" "$(echo "$out" | tail -n 1)" "4 of 4 services answer"
cbctl ingest --wait data/sample 2>"$T/ingest.err"; rc=$?
check "cbctl ingest --wait data/sample through CURVE exits 0" "$rc" 0
check "the chunks reached cb-retriever" "$(stack_stat retriever chunks | awk '{print ($1 > 0)}')" 1
mapfile -t QS < data/sample/questions.lst
ans=$(cbctl query "${QS[0]}"); rc=$?
check "cbctl query through CURVE exits 0" "$rc" 0
check "the query is answered" "$([ -n "$ans" ] && echo yes)" yes
js=$(cbctl query --json "${QS[0]}" | tail -n 1)
check "the query used the precomputed chunks (cache hits)" "$(jget "$js" metrics.cache_hits | awk '{print ($1 > 0)}')" 1
check "cb-send as cbctl through CURVE" "$(jget "$(send "$(stack_endpoint blend)" '{"type":"ping"}')" ok)" true
"$PUSH" --timeout 3000 "$CB_PRECOMPUTE_PULL_ENDPOINT" '{"type":"ingest","doc_id":"pushed-doc","text":"A pushed document about teal herons."}'
check "cb-push through CURVE exits 0" "$?" 0
retriever_docs() { [ "$(stack_stat retriever docs)" = 5 ]; }   # data/sample's 4, and the pushed one
wait_until 30 retriever_docs
check "the pushed document was processed (PUSH -> PULL through CURVE)" "$?" 0

# --- 3. refused clients -------------------------------------------------------------------------------
# keys2: its own client keys, the real services' public keys: only the allow-list can refuse it
cbctl keys init "$T/keys2" >/dev/null
cp "$KEYS"/public/*.key "$T/keys2/public/"
export CB_CBCTL_SEND_TIMEOUT_MS=4000 CB_CBCTL_REQUEST_TIMEOUT_MS=4000   # refusals must not wait for these
t0=$(ms_now)
out=$(CB_COMMON_KEYS_DIR="$T/keys2" cbctl health 2>&1); rc=$?
check "an unlisted cbctl: health exits 3" "$rc" 3
check "an unlisted cbctl is told why (ZAP), for every service" \
      "$(echo "$out" | grep -c "our CURVE key is not in the server's allowed clients (ZAP")" 4
t0=$(ms_now)
out=$(CB_COMMON_KEYS_DIR="$T/keys2" cbctl query "${QS[0]}" 2>&1); rc=$?; t1=$(ms_now)
check "an unlisted cbctl: query exits 3" "$rc" 3
check "an unlisted cbctl: query says why" \
      "$(echo "$out" | grep -c "refused by $(stack_endpoint blend): our CURVE key is not in the server's allowed clients (ZAP")" 1
check "the refusal comes before the 4 s send timeout" "$(( t1 - t0 < 3000 ))" 1
out=$(CB_COMMON_KEYS_DIR="$T/keys2" cbctl stats retriever 2>&1); rc=$?
check "an unlisted cbctl: stats exits 3 with the reason" "$rc/$(echo "$out" | grep -c 'allowed clients (ZAP')" "3/1"
check "cb-retriever logs the refused client" "$(grep -c 'refused a client on .*not in .*allowed' "$T/retriever.log" | awk '{print ($1 > 0)}')" 1
# keys3: another key set altogether (the servers' keys do not match)
cbctl keys init "$T/keys3" >/dev/null
t0=$(ms_now)
out=$(CB_COMMON_KEYS_DIR="$T/keys3" cbctl query "${QS[0]}" 2>&1); rc=$?; t1=$(ms_now)
check "another key set: query exits 3" "$rc" 3
check "another key set: told the server key is not the one it has" "$(echo "$out" | grep -c 'probably not its key')" 1
check "that refusal comes before the send timeout too" "$(( t1 - t0 < 3000 ))" 1
# plaintext clients
t0=$(ms_now)
out=$(CB_COMMON_CURVE=off cbctl health 2>&1); rc=$?; t1=$(ms_now)
check "a plaintext cbctl: health exits 3" "$rc" 3
check "a plaintext cbctl is told the services require CURVE" \
      "$(echo "$out" | grep -c 'requires CURVE.*set common.curve = on')" 4
check "in bounded time" "$(( t1 - t0 < 3000 ))" 1
out=$(CB_COMMON_CURVE=off cbctl query "${QS[0]}" 2>&1); rc=$?
check "a plaintext cbctl: query exits 3 with the reason" "$rc/$(echo "$out" | grep -c 'requires CURVE')" "3/1"
out=$(CB_COMMON_CURVE=off "$PUSH" --timeout 4000 "$CB_PRECOMPUTE_PULL_ENDPOINT" '{"type":"ingest","doc_id":"x","text":"y"}' 2>&1); rc=$?
check "a plaintext cb-push exits 2 with the reason" "$rc/$(echo "$out" | grep -c 'requires CURVE')" "2/1"
out=$(CB_COMMON_CURVE=off "$SEND" --timeout 4000 "$(stack_endpoint retriever)" '{"type":"ping"}' 2>&1); rc=$?
check "a plaintext cb-send exits 2 with the reason" "$rc/$(echo "$out" | grep -c 'requires CURVE')" "2/1"
# the side that sees the mismatch first hangs up: the service logs the mismatch, or a dropped handshake
check "cb-retriever logs the plaintext clients" \
      "$(grep -c 'connects in plaintext and this service requires CURVE\|dropped its handshake' "$T/retriever.log" | awk '{print ($1 > 0)}')" 1
unset CB_CBCTL_SEND_TIMEOUT_MS CB_CBCTL_REQUEST_TIMEOUT_MS
check "the stack still serves the listed cbctl" "$(cbctl -q health; echo $?)" 0

# --- 4. startup errors and the bind warning -----------------------------------------------------------
p=$(svc_free_port)
timeout 10 env CB_COMMON_KEYS_DIR="$T/no-keys" CB_RETRIEVER_ENDPOINT="tcp://127.0.0.1:$p" CB_DATA_DIR="$T/data-nokeys" \
  build/bin/cb-retriever >"$T/nokeys.log" 2>&1; rc=$?
check "a service with curve on and no keys exits 1" "$rc" 1
check "... naming the missing file and the fix" \
      "$(grep -c "cannot read $T/no-keys/client/retriever.key_secret.*cbctl keys init" "$T/nokeys.log")" 1
p=$(svc_free_port)
svc_start wide build/bin/cb-retriever CB_COMMON_CURVE=off CB_RETRIEVER_BIND="tcp://0.0.0.0:$p" \
  CB_RETRIEVER_ENDPOINT="tcp://127.0.0.1:$p" CB_DATA_DIR="$T/data-wide"
wait_until 10 grep -q "non-loopback address without CURVE" "$T/wide.log"
check "a plaintext service bound to 0.0.0.0 warns" "$?" 0
svc_stop wide

# --- 5. the gateway through CURVE ---------------------------------------------------------------------
stack_start_gateway || svc_finish
check "gateway /health through CURVE: 200" "$(curl -s -o "$T/health.json" -w '%{http_code}' --max-time 10 "$GW/health")" 200
check "gateway /health: every service ok" "$(jget "$(cat "$T/health.json")" status)" ok
body=$(printf '{"model":"m","max_tokens":8,"messages":[{"role":"user","content":%s}]}' "$(json_str "${QS[1]}")")
code=$(curl -s -o "$T/chat.json" -w '%{http_code}' --max-time 60 -H 'Content-Type: application/json' -d "$body" "$GW/v1/chat/completions")
check "gateway chat completion through CURVE: 200" "$code" 200
check "gateway chat completion: an answer" "$(jget "$(cat "$T/chat.json")" choices.0.message.role)" assistant
svc_stop gateway
CB_COMMON_KEYS_DIR="$T/keys2" stack_start_gateway || svc_finish   # the gateway with an unlisted key
code=$(curl -s -o "$T/health2.json" -w '%{http_code}' --max-time 10 "$GW/health")
check "an unlisted gateway: /health 503" "$code" 503
check "an unlisted gateway: /health says why" \
      "$(grep -o "not in the server's allowed clients (ZAP" "$T/health2.json" | wc -l)" 4
svc_stop gateway

svc_finish
