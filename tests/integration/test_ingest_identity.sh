#!/usr/bin/env bash
# Who the ingest client is (docs/protocol.md section 6, "Who the client is"): cb-precompute limits and
# takes turns per authenticated CURVE key, not per declared `client`.
#   A. plaintext (nothing authenticated: the declared field counts): 20 ingests with 20 declared clients
#      are all accepted, and a victim's one-chunk document waits behind all of them (printed);
#   B. CURVE on: the same 20 from one key are limited as one client (the reply's client is the key; the
#      worker drains meanwhile, so the exact count is C's), and a second key's one-chunk document is not held
#      behind them (its wait printed); `on_behalf_of` from a key that is not a trusted forwarder is refused;
#   C. CURVE on, no worker (nothing drains, the counts are exact): the 20 from one key: 6 accepted, 14
#      overloaded; 20 documents through cb-gateway with one API key are one client too (6 accepted, 14 503
#      overloaded), counted under the hashed key (the key itself in no log); the global cap
#      (precompute.max_queued_jobs = 13) then answers `overloaded` to a third key's second document.
# The floods are sent at once (20 cb-send in parallel); every chunk waits precompute.fault_chunk_delay_ms =
# 400 (so a turn is measurable).
. "$(dirname "$0")/lib/stack.bash"
stack_setup
svc_need build/bin/cb-gateway
command -v curl >/dev/null || { echo "skip: no curl"; exit 77; }
command -v sqlite3 >/dev/null || { echo "skip: no sqlite3"; exit 77; }

ms_now() { date +%s%3N; }
PRE=$(stack_endpoint precompute)
KEYS="$T/keys"
cbctl keys init "$KEYS" >/dev/null || { echo "FAIL: keys init"; exit 1; }
cbctl keys init "$T/keys2" >/dev/null                    # another client key set: the victim's
cp "$T/keys2/allowed/cbctl.key" "$KEYS/allowed/victim.key"   # admitted by the services
cp "$KEYS"/public/*.key "$T/keys2/public/"                   # and it knows their keys
export CB_PRECOMPUTE_MAX_QUEUED_JOBS_PER_CLIENT=6 CB_PRECOMPUTE_FAULT_CHUNK_DELAY_MS=400

# flood PREFIX: 20 ingests with 20 declared clients, sent at once (cb-send, as cbctl); prints "ACCEPTED
# OVERLOADED CLIENTS" (CLIENTS: the distinct `client` of the accepted replies).
flood() {
  local i out acc=0 over=0
  : >"$T/clients"
  for i in $(seq -w 0 19); do
    send "$PRE" "{\"type\":\"ingest\",\"doc_id\":\"$1-$i\",\"text\":\"Flood document $i of $1: one short chunk about nothing.\",\"client\":\"flood-$i\"}" \
      >"$T/flood.$i" 2>/dev/null &
  done
  wait
  for i in $(seq -w 0 19); do
    out=$(cat "$T/flood.$i")
    if [ "$(jget "$out" ok)" = true ]; then acc=$((acc + 1)); jget "$out" client >>"$T/clients"
    elif [ "$(jget "$out" error.code)" = overloaded ]; then over=$((over + 1)); echo "$out" >"$T/last_overloaded"; fi
  done
  echo "$acc $over $(sort -u "$T/clients" | wc -l)"
}
# victim_wait DOC [VAR=VALUE...]: ingests a one-chunk document (cb-send in that environment) and prints the
# milliseconds from its acknowledgement until its job is done (-1: not done within 60 s).
victim_wait() {
  local doc=$1 out job t0 st; shift
  out=$(env "$@" "$SEND" --timeout 3000 "$PRE" "{\"type\":\"ingest\",\"doc_id\":\"$doc\",\"text\":\"The victim's short note: the ferry leaves at nine.\",\"client\":\"victim\"}")
  job=$(jget "$out" job); t0=$(ms_now)
  echo "$out" >"$T/victim.reply"
  for _ in $(seq 1 1200); do
    st=$(jget "$(send "$PRE" "{\"type\":\"status\",\"job\":\"$job\"}")" state)
    [ "$st" = done ] && { echo $(( $(ms_now) - t0 )); return; }
    sleep 0.05
  done
  echo -1
}
start3() { local s; for s in retriever cacheindex precompute; do stack_launch $s; done
           for s in retriever cacheindex precompute; do stack_ready $s || svc_finish; done; }
stop3() { local s; for s in precompute cacheindex retriever; do svc_stop $s >/dev/null; done; }

# --- A. plaintext: the declared client is all there is ----------------------------------------------------
start3
read -r acc over _ <<<"$(flood a)"
check "plaintext: 20 declared clients, all accepted" "$acc/$over" "20/0"
before=$(victim_wait a-victim)
echo "plaintext: the victim's one-chunk document waited $before ms behind 20 declared clients"
[ "$before" -gt 4000 ] && echo "ok: without CURVE the declared clients are trusted (the victim waits their turns)" \
  || { echo "FAIL: expected a long wait without CURVE, got $before ms"; FAILS=$((FAILS+1)); }
stop3

# --- B. CURVE: one key is one client --------------------------------------------------------------------
export CB_COMMON_CURVE=on CB_COMMON_KEYS_DIR="$KEYS" CB_DATA_DIR="$T/data2"
mkdir -p "$CB_DATA_DIR"
start3
grep -q "ingest clients are their CURVE keys; 1 trusted forwarder" "$T/precompute.log" \
  && echo "ok: cb-precompute counts CURVE keys, trusts the gateway" || { echo "FAIL: no CURVE identity line"; FAILS=$((FAILS+1)); }
read -r acc over nclients <<<"$(flood b)"
echo "CURVE: 20 ingests of one key, 20 declared clients, the worker draining: $acc accepted, $over overloaded"
[ $((acc + over)) -eq 20 ] && [ "$over" -ge 10 ] && echo "ok: limited as one client" \
  || { echo "FAIL: $acc accepted, $over overloaded"; FAILS=$((FAILS+1)); }
CBCTL_KEY=$(sed -n 's/^ *public-key = "\(.*\)"$/\1/p' "$KEYS/allowed/cbctl.key")
check "CURVE: every accepted one counted as the key" "$nclients/$(cat "$T/clients" | sort -u)" "1/k:$CBCTL_KEY"
grep -q "precompute.max_queued_jobs_per_client = 6" "$T/last_overloaded" && echo "ok: $(jget "$(cat "$T/last_overloaded")" error.message)" \
  || { echo "FAIL: overloaded reason: $(cat "$T/last_overloaded")"; FAILS=$((FAILS+1)); }
after=$(victim_wait b-victim CB_COMMON_KEYS_DIR="$T/keys2")
VICTIM_KEY=$(sed -n 's/^ *public-key = "\(.*\)"$/\1/p' "$KEYS/allowed/victim.key")
check "CURVE: the victim is its own key" "$(jget "$(cat "$T/victim.reply")" client)" "k:$VICTIM_KEY"
echo "CURVE: the victim's one-chunk document waited $after ms behind the other key's queue (plaintext: $before ms)"
[ "$after" -ge 0 ] && [ "$after" -lt 3000 ] && [ "$after" -lt $((before / 3)) ] \
  && echo "ok: a second key's document is not held behind the first key's queue" \
  || { echo "FAIL: the victim waited $after ms"; FAILS=$((FAILS+1)); }
out=$(send "$PRE" '{"type":"ingest","doc_id":"forged","text":"x","on_behalf_of":"key:0123"}')
check_error "CURVE: on_behalf_of from a key that is not a trusted forwarder" "$out" bad_request
svc_stop precompute >/dev/null

# --- C. exact counts (no worker), through the gateway (one API key), and the global cap ---------------------
API_KEY="sk-identity-test-7f3a9c"
CB_PRECOMPUTE_WORKERS=0 CB_PRECOMPUTE_MAX_QUEUED_JOBS=13 CB_PRECOMPUTE_DB="$T/data3/precompute.db" \
  stack_start precompute precompute || svc_finish
read -r acc over nclients <<<"$(flood c)"
check "CURVE: 20 ingests of one key with 20 declared clients: limited as one client" "$acc/$over/$nclients" "6/14/1"
grep -q "precompute.max_queued_jobs_per_client = 6" "$T/last_overloaded" || { echo "FAIL: $(cat "$T/last_overloaded")"; FAILS=$((FAILS+1)); }
CB_GATEWAY_API_KEY="$API_KEY" stack_start_gateway || svc_finish
ok=0; refused=0
for i in $(seq -w 0 19); do
  code=$(curl -s -o "$T/gw.json" -w '%{http_code}' --max-time 10 -H "Authorization: Bearer $API_KEY" \
    -H 'Content-Type: application/json' -d "{\"documents\":[{\"id\":\"gw-$i\",\"text\":\"Gateway document $i.\"}]}" "$GW/v1/documents")
  [ "$code" = 200 ] && ok=$((ok + 1))
  [ "$code" = 503 ] && grep -q overloaded "$T/gw.json" && refused=$((refused + 1))
done
check "gateway: 20 documents with one API key: limited as one client (200 / 503 overloaded)" "$ok/$refused" "6/14"
HASH=$(sqlite3 "$T/data3/precompute.db" "SELECT DISTINCT client FROM jobs WHERE doc_id LIKE 'gw-%'")
[[ "$HASH" =~ ^gateway:key:[0-9a-f]{24}$ ]] && echo "ok: counted as the gateway's hashed key: $HASH" \
  || { echo "FAIL: gateway documents counted as '$HASH'"; FAILS=$((FAILS+1)); }
n=$(cat "$T"/*.log | grep -c -- "$API_KEY")
check "the API key is in no log" "$n" 0
out=$(CB_COMMON_KEYS_DIR="$T/keys2" "$SEND" --timeout 3000 "$PRE" '{"type":"ingest","doc_id":"c-third","text":"A third key."}')
check "global cap: 12 queued, a third key's first document fits" "$(jget "$out" ok)" true
out=$(CB_COMMON_KEYS_DIR="$T/keys2" "$SEND" --timeout 3000 "$PRE" '{"type":"ingest","doc_id":"c-third-2","text":"A full queue."}')
check_error "global cap: its second one is refused" "$out" overloaded
grep -q "the ingest queue is full: 13 documents queued (precompute.max_queued_jobs = 13)" <<<"$out" \
  && echo "ok: $(jget "$out" error.message)" || { echo "FAIL: $out"; FAILS=$((FAILS+1)); }
check "stats: clients waiting (cbctl's key, the gateway's API key, the third key)" "$(stack_stat precompute clients_waiting)" 3

svc_stop gateway >/dev/null
svc_stop precompute >/dev/null
for s in cacheindex retriever; do svc_stop $s >/dev/null; done
svc_finish
