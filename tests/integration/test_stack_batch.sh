#!/usr/bin/env bash
# Continuous batching in cb-blend, through the real stack:
#   1. 8 concurrent `cbctl query` clients (4 questions over ingested documents, each in blend and in full
#      mode) get the answers 8 sequential ones got, and they really ran together (stats: batch_peak > 1,
#      tokens per step > 1);
#   2. one client killed mid-stream: its query is cancelled, its blocks go back to the pool, the others
#      finish with their answers;
#   3. pool exhaustion under load (a KV pool that holds two of these prompts but not their answers):
#      the newest running query ends `overloaded` (cbctl exit 3), the others are answered, no block
#      leaks, and the service keeps answering with the answer it gave alone;
#   4. health: ping answers with the step loop's age, and fails while the loop is stuck (fault injection:
#      blend.fault_step_delay_ms); a stopped cb-retriever holds only the queries that need it (the fetch
#      thread), not the step loop; stats shows running/waiting and the step counters.
. "$(dirname "$0")/lib/stack.bash"
stack_setup
export CB_BLEND_MAX_SEQS=8 CB_BLEND_MAX_QUEUE=16
stack_start_all || svc_finish
BL=$(stack_endpoint blend)
cbctl ingest --wait data/sample >/dev/null || { echo "FAIL: ingest"; FAILS=$((FAILS+1)); svc_finish; }
mapfile -t QS < data/sample/questions.lst
MODES=(blend full)
TOK=24

# 1. sequential, then 8 at once
i=0
for m in "${MODES[@]}"; do for q in "${QS[@]}"; do
  cbctl query --mode "$m" --max-tokens $TOK "$q" >"$T/seq.$i" 2>"$T/seq.$i.err" || { echo "FAIL: sequential $i"; FAILS=$((FAILS+1)); }
  i=$((i+1))
done; done
base_used=$(stack_stat blend pool_blocks_used)
pids=(); i=0
for m in "${MODES[@]}"; do for q in "${QS[@]}"; do
  cbctl query --mode "$m" --max-tokens $TOK "$q" >"$T/par.$i" 2>"$T/par.$i.err" & pids+=($!)
  i=$((i+1))
done; done
for j in "${!pids[@]}"; do wait "${pids[$j]}" || { echo "FAIL: concurrent $j exited $?"; FAILS=$((FAILS+1)); }; done
same=0
for j in $(seq 0 7); do
  if cmp -s "$T/seq.$j" "$T/par.$j"; then same=$((same+1)); else
    echo "differs $j: sequential '$(cat "$T/seq.$j")' concurrent '$(cat "$T/par.$j")'"; fi
done
check "8 concurrent answers = 8 sequential ones" "$same" 8
peak=$(stack_stat blend batch_peak)
tps=$(stack_stat blend tokens_per_step)
echo "decode batch peak $peak, tokens per step $tps"
check "the queries ran in one batch (batch_peak > 1)" "$([ "$peak" -gt 1 ] && echo yes)" yes
check "tokens per step > 1" "$(python3 -c "print('yes' if $tps > 1 else 'no')")" yes
check "no block leaked" "$(stack_stat blend pool_blocks_used)" "$base_used"

# 2. one client killed mid-stream
cancelled0=$(stack_stat blend queries_cancelled)
pids=()
for j in 0 1 2 3; do # the binary itself (not the cbctl function's subshell), so that the kill reaches it
  "$CBCTL" query --mode blend --max-tokens 48 "${QS[$j]}" >"$T/k.$j" 2>"$T/k.$j.err" & pids+=($!)
done
# kill client 1 once its first token has arrived
wait_until 60 test -s "$T/k.1" || { echo "FAIL: no token for client 1"; FAILS=$((FAILS+1)); }
kill -KILL "${pids[1]}"; wait "${pids[1]}" 2>/dev/null
cancelled_now() { [ "$(stack_stat blend queries_cancelled)" = $((cancelled0 + 1)) ]; }
wait_until 30 cancelled_now \
  && echo "ok: the killed client's query was cancelled" \
  || { echo "FAIL: not cancelled"; FAILS=$((FAILS+1)); grep -E "cancel|client" "$T/blend.log" | tail -5; }
for j in 0 2 3; do wait "${pids[$j]}" || { echo "FAIL: client $j exited $?"; FAILS=$((FAILS+1)); }; done
for j in 0 2 3; do
  cbctl query --mode blend --max-tokens 48 "${QS[$j]}" >"$T/k.$j.alone" 2>/dev/null
  check "client $j's answer beside the killed one = alone" "$(cat "$T/k.$j")" "$(cat "$T/k.$j.alone")"
done
check "the killed client's blocks went back" "$(stack_stat blend pool_blocks_used)" "$base_used"

# 4. health and stats
ping=$(send "$BL" '{"type":"ping"}')
check "ping ok, step loop age reported" "$(jget "$ping" ok)/$(jget "$ping" step_age_ms)" "true/0"
check "stats: nothing running or waiting" "$(stack_stat blend running)/$(stack_stat blend waiting)" "0/0"
cbctl stats blend >"$T/stats.txt"
grep -q "step loop" "$T/stats.txt" && echo "ok: cbctl stats shows the step loop: $(grep 'step loop' "$T/stats.txt")" \
  || { echo "FAIL: no step loop line in cbctl stats"; FAILS=$((FAILS+1)); }
svc_stop blend

# 4b. retrieval off the step loop: with cb-retriever stopped, a query that needs it waits in the fetch
# thread while a query with its own context is answered and ping stays healthy; once cb-retriever goes on,
# the first is answered too
kill -STOP "${SVC_PID[retriever]}"
# a long retriever timeout: on a loaded machine the context query below may take longer than the default
# 5 s, and the stalled retrieval must wait it out, not time out
CB_BLEND_RETRIEVER_TIMEOUT_MS=120000 stack_start blend blend1 || svc_finish
"$CBCTL" query --mode blend --max-tokens $TOK "${QS[0]}" >"$T/r.out" 2>"$T/r.err" & rp=$!
C1="The Quillon Chamber Orchestra was founded in 1978 by the cellist Helene Marchetti."
out=$(cbctl query --mode blend --max-tokens 12 --context "$C1" "Who founded the Quillon Chamber Orchestra?"); rc=$?
check "a query with contexts beside a stalled retrieval: answered" "$rc/$([ -n "$out" ] && echo text)" "0/text"
ping=$(send "$BL" '{"type":"ping"}')
check "ping healthy meanwhile" "$(jget "$ping" ok)" true
kill -CONT "${SVC_PID[retriever]}"
wait $rp; check "the retrieval query, once cb-retriever goes on" "$?/$(cat "$T/r.out")" "0/$(cat "$T/seq.0")"
svc_stop blend1
# 4c. a stuck step loop (fault injection: every busy step sleeps 1.5 s): ping says so while a query runs
export CB_BLEND_FAULT_STEP_DELAY_MS=1500 CB_BLEND_STUCK_MS=500
stack_start blend blend4 || svc_finish
"$CBCTL" query --mode blend --max-tokens 2 --context "$C1" "Who founded the Quillon Chamber Orchestra?" >/dev/null 2>&1 & sp=$!
sleep 1
ping=$(send "$BL" '{"type":"ping"}')
check "ping while the step loop is stuck: unavailable" "$(jget "$ping" ok)/$(jget "$ping" error.code)" "false/unavailable"
echo "ping said: $(jget "$ping" error.message)"
wait $sp
pingok() { [ "$(jget "$(send "$BL" '{"type":"ping"}')" ok)" = true ]; }
wait_until 20 pingok && echo "ok: ping is healthy again when idle" || { echo "FAIL: ping still failing"; FAILS=$((FAILS+1)); }
svc_stop blend4
unset CB_BLEND_FAULT_STEP_DELAY_MS CB_BLEND_STUCK_MS

# 3. a pool that holds two prompts, not their answers: after one query of 1 token, pool_blocks_peak - the
# context's blocks = the blocks a prompt owns (OWN); a pool of context + 2 OWN admits two such queries and
# has no block for either's growth: the first to need one (the oldest, once its partial last block is
# full) makes the newest give way; the third waits for blocks, then runs
LONG="$(cat data/sample/kettleby-lighthouse.md)"
Q="Describe the Kettleby Lighthouse in detail: who designed it, when, and everything else you know."
export CB_BLEND_HOT_CACHE_BYTES=0 CB_BLEND_MAX_TOKENS=400 CB_BLEND_KV_POOL_BYTES=0
stack_start blend blend2 || svc_finish
ctx=$(stack_stat blend pool_blocks_used); bt=$(stack_stat blend pool_block_tokens)
cbctl query --mode blend --max-tokens 1 --context "$LONG" "$Q" >/dev/null 2>&1
OWN=$(( $(stack_stat blend pool_blocks_peak) - ctx ))
cbctl query --json --mode blend --max-tokens 400 --context "$LONG" "$Q" >"$T/solo.json" 2>/dev/null
SOLO=$(tail -1 "$T/solo.json")
N=$(jget "$SOLO" metrics.n_prompt_tokens); G=$(jget "$SOLO" metrics.n_generated)
echo "prompt $N tokens ($OWN blocks of its own), $G generated alone; the context holds $ctx blocks of $bt"
check "the answer outgrows the prompt's last block" "$([ $(( (N % bt) + G )) -gt "$bt" ] && echo yes)" yes
svc_stop blend2
# SmolLM2: K + V of 30 layers x 16 positions x 192 values of 2 bytes (engine.kv_dtype f16, the default) or 4 (f32)
vb=2; [ "${CB_ENGINE_KV_DTYPE:-f16}" = f32 ] && vb=4
block_bytes=$((2 * 30 * 16 * 192 * vb))
export CB_BLEND_KV_POOL_BYTES=$(( (ctx + 2 * OWN) * block_bytes ))
# every step 40 ms slower: the oldest needs its growth block only ~0.5 s after its first token (the prompt's
# last block has room for 16 - N % 16 tokens), so the second query is in before it; one that arrived later,
# on a loaded machine, found the oldest grown, waited, and the third became the newest running
export CB_BLEND_FAULT_STEP_DELAY_MS=40
stack_start blend blend3 || svc_finish
cbctl query --mode blend --max-tokens 24 --context "$LONG" "$Q" >"$T/before" 2>/dev/null
used=$(stack_stat blend pool_blocks_used)
# the queries arrive in order: each client starts once the service has seen the one before (in flight, or
# already ended), not after a fixed pause that a slow process start on a loaded machine can outlast
ended() { local st; st=$(stack_stats blend); echo $(( $(jget "$st" queries_done) + $(jget "$st" queries_failed) )); }
seen() { # at least $1 of the load queries in flight or ended
  local st; st=$(stack_stats blend)
  [ $(( $(jget "$st" running) + $(jget "$st" waiting) + $(jget "$st" queries_done) + $(jget "$st" queries_failed) )) \
    -ge $(( base + $1 )) ]
}
base=$(ended)
pids=()
for j in 0 1 2; do
  cbctl query --mode blend --max-tokens 400 --context "$LONG" "$Q" >"$T/ex.$j" 2>"$T/ex.$j.err" & pids+=($!)
  wait_until 20 seen $((j + 1)) || echo "note: query $j not seen by the service within 20 s"
done
ok=0; over=0; rcs=""
for j in 0 1 2; do
  wait "${pids[$j]}"; rc=$?; rcs="$rcs$rc"
  if [ $rc -eq 0 ]; then ok=$((ok+1)); elif [ $rc -eq 3 ] && grep -q overloaded "$T/ex.$j.err"; then over=$((over+1));
  else echo "FAIL: client $j exited $rc: $(head -c 300 "$T/ex.$j.err")"; FAILS=$((FAILS+1)); fi
done
echo "under load: $ok answered, $over overloaded: $(head -c 300 "$T/ex.1.err")"
check "the oldest and the third answered, the second (the newest running) overloaded" "$rcs" "030"
check "stats: one preempted, one overloaded" "$(stack_stat blend queries_preempted)/$(stack_stat blend queries_overloaded)" "1/1"
check "the answers under load = alone" "$(cat "$T/ex.0")|$(cat "$T/ex.2")" "$(head -n -1 "$T/solo.json")|$(head -n -1 "$T/solo.json")"
check "no block leaked" "$(stack_stat blend pool_blocks_used)" "$used"
cbctl query --mode blend --max-tokens 24 --context "$LONG" "$Q" >"$T/after" 2>/dev/null
check "the service keeps answering, with the same answer" "$(cat "$T/after")" "$(cat "$T/before")"

unset CB_BLEND_FAULT_STEP_DELAY_MS
for s in blend3 precompute cacheindex retriever; do svc_stop $s; done
svc_finish
