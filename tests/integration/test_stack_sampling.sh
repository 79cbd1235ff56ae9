#!/usr/bin/env bash
# Sampling controls through the real stack (default model, greedy, data/sample ingested as the demo does:
# 512-token chunks, the question's top 3 passages as contexts):
#   1. the demo's repeating answer ("Who designed the Kettleby Lighthouse?", blend mode, 32 tokens) ends
#      with finish_reason "length" exactly when it has max_tokens tokens ("stop" otherwise); with a
#      frequency penalty it differs, its words repeat fewer times (occurrences beyond each word's first), it equals the in-process answer (cb-rag, same penalty), it is the same asked
#      twice and in one decode batch with the plain query (each query its own sampler); a presence penalty
#      changes it too; a short max_tokens is "length" as well;
#   2. stop sequences: a substring of the unconstrained answer gives exactly the text before it, with
#      finish_reason "stop", the streamed text equal to done.text (nothing of the stop sequence streamed);
#      the earliest of several wins; one at the very start gives an empty answer; one whose beginning
#      appears but that never completes (held back, then released) leaves the answer as it was; one
#      next to multi-byte characters cuts at the right byte; a raw query's token messages never carry it;
#   3. invalid values are bad_request (cb-send): a 300-byte stop sequence, 5 of them, an empty one, wrong
#      types, penalties 5 and -2.5; the limits themselves (-2, 2) are accepted; cbctl refuses bad values
#      with exit 2; cb-blend refuses to start with blend.frequency_penalty = 3.
. "$(dirname "$0")/lib/stack.bash"
stack_setup
export CB_PRECOMPUTE_CHUNK_TOKENS=512   # the shipped config's chunks: the documents whole, as in make demo
export CB_BLEND_MAX_TOKENS=32           # the demo's answers
stack_start_all || svc_finish
BL=$(stack_endpoint blend)
RET=$(stack_endpoint retriever)
cbctl ingest --wait data/sample >/dev/null 2>"$T/ingest.err" || { echo "FAIL: ingest"; FAILS=$((FAILS+1)); svc_finish; }

# contexts Q: the retriever's top 3 passages for Q, as --context arguments in CTX
contexts() {
  local hits i t
  hits=$(send "$RET" "{\"type\":\"search\",\"query\":$(json_str "$1"),\"k\":3}")
  CTX=()
  for i in 0 1 2; do t=$(jget "$hits" "hits.$i.text"); [ "$t" != null ] && CTX+=(--context "$t"); done
}
# ask NAME ARGS...: cbctl query --json; the streamed text in $T/NAME.stream, the done object in $T/NAME.json
ask() {
  local name=$1 out; shift
  out=$(cbctl query --json --mode blend "$@"); ASK_RC=$?
  printf '%s\n' "$out" | head -n -1 >"$T/$name.stream"
  printf '%s\n' "$out" | tail -n 1 >"$T/$name.json"
}
js() { jget "$(cat "$T/$1.json")" "$2"; }
# most_repeated TEXT: how often the most frequent word occurs
most_repeated() {
  python3 -c 'import collections, re, sys
w = re.findall(r"\w+", sys.argv[1].lower())
print(max(collections.Counter(w).values()) if w else 0)' "$1"
}
# repeats TEXT: occurrences of words beyond each word's first
repeats() {
  python3 -c 'import collections, re, sys
w = re.findall(r"\w+", sys.argv[1].lower())
print(sum(c - 1 for c in collections.Counter(w).values()))' "$1"
}
# check_stream NAME: the streamed text is done.text
check_stream() { check "$1: streamed text = done.text" "$(cat "$T/$1.stream")" "$(js "$1" text)"; }

# --- 1. penalties on the repeating answer -------------------------------------------------------------
Q="Who designed the Kettleby Lighthouse?"
contexts "$Q"
ask plain "${CTX[@]}" "$Q"
PLAIN=$(js plain text)
echo "plain: $PLAIN"
check "plain: exit 0" "$ASK_RC" 0
PLAIN_FIN=$( [ "$(js plain metrics.n_generated)" -eq 32 ] && echo length || echo stop )
check "plain: finish_reason length at 32 tokens, stop before ($(js plain metrics.n_generated) tokens)" \
  "$(js plain finish_reason)" "$PLAIN_FIN"
check_stream plain
check "plain: = the in-process answer" "$PLAIN" "$(rag --mode blend "${CTX[@]}" "$Q")"
R0=$(most_repeated "$PLAIN")
[ "$R0" -ge 3 ] && echo "ok: the plain answer repeats itself (a word $R0 times)" \
  || { echo "FAIL: the plain answer does not repeat (most repeated word: $R0 times); pick another question"; FAILS=$((FAILS+1)); }

ask freq --frequency-penalty 1.0 "${CTX[@]}" "$Q"
FREQ=$(js freq text)
echo "frequency_penalty 1: $FREQ"
check "frequency penalty: exit 0" "$ASK_RC" 0
[ "$FREQ" != "$PLAIN" ] && echo "ok: frequency penalty: a different answer" \
  || { echo "FAIL: frequency penalty: the same answer"; FAILS=$((FAILS+1)); }
P0=$(repeats "$PLAIN") P1=$(repeats "$FREQ")
[ "$P1" -lt "$P0" ] && echo "ok: frequency penalty: $P1 repeated words (was $P0)" \
  || { echo "FAIL: frequency penalty: $P1 repeated words, not fewer than $P0"; FAILS=$((FAILS+1)); }
check "frequency penalty: it ends at an end-of-turn token: finish_reason stop" "$(js freq finish_reason)" stop
check_stream freq
check "frequency penalty: = the in-process answer with the same penalty" "$FREQ" \
  "$(rag --mode blend --frequency_penalty 1.0 "${CTX[@]}" "$Q")"
ask freq2 --frequency-penalty 1.0 "${CTX[@]}" "$Q"
check "frequency penalty: the same answer asked again" "$(js freq2 text)" "$FREQ"

# the plain and the penalised query in one decode batch: each keeps its own counts
"$CBCTL" query --mode blend "${CTX[@]}" "$Q" >"$T/par.plain" & p1=$!
"$CBCTL" query --mode blend --frequency-penalty 1.0 "${CTX[@]}" "$Q" >"$T/par.freq" & p2=$!
wait $p1; wait $p2
check "together: the plain answer unchanged" "$(cat "$T/par.plain")" "$PLAIN"
check "together: the penalised answer unchanged" "$(cat "$T/par.freq")" "$FREQ"

ask pres --presence-penalty 1.0 "${CTX[@]}" "$Q"
echo "presence_penalty 1: $(js pres text)"
[ "$(js pres text)" != "$PLAIN" ] && echo "ok: presence penalty: a different answer" \
  || { echo "FAIL: presence penalty: the same answer"; FAILS=$((FAILS+1)); }
ask zero --frequency-penalty 0 --presence-penalty 0 "${CTX[@]}" "$Q"
check "penalties 0: the plain answer" "$(js zero text)" "$PLAIN"
ask short --max-tokens 3 "${CTX[@]}" "$Q"
check "max_tokens 3: finish_reason length, 3 tokens" "$(js short finish_reason)/$(js short metrics.n_generated)" "length/3"

# --- 2. stop sequences ----------------------------------------------------------------------------------
# PLAIN = "The Kettleby Lighthouse was designed by the engineer Miriam Ashcombe and was designed by ..."
before() { python3 -c 'import sys; t, s = sys.argv[1], sys.argv[2]; i = t.find(s); print(t[:i] if i >= 0 else "NOT FOUND")' "$1" "$2"; }
S="Miriam"
ask stop1 --stop "$S" "${CTX[@]}" "$Q"
check "stop '$S': the text before it" "$(js stop1 text)" "$(before "$PLAIN" "$S")"
check "stop '$S': finish_reason stop" "$(js stop1 finish_reason)" stop
check_stream stop1
S2=" and was designed"
ask stop2 --stop "xyz" --stop "$S2" --stop "Lighthouse was" "${CTX[@]}" "$Q"
check "three stop sequences: cut at the earliest ('Lighthouse was')" "$(js stop2 text)" "$(before "$PLAIN" "Lighthouse was")"
check_stream stop2
ask stop3 --stop "$S2" "${CTX[@]}" "$Q"
check "stop '$S2' (several tokens long): the text before its first occurrence" "$(js stop3 text)" "$(before "$PLAIN" "$S2")"
check "stop '$S2': finish_reason stop, fewer tokens" "$(js stop3 finish_reason)/$([ "$(js stop3 metrics.n_generated)" -lt 32 ] && echo fewer)" "stop/fewer"
check_stream stop3
ask stop4 --stop "The" "${CTX[@]}" "$Q"
check "a stop sequence at the very start: an empty answer, finish_reason stop" "$(js stop4 text)/$(js stop4 finish_reason)" "/stop"
check "  and nothing streamed" "$(cat "$T/stop4.stream")" ""
# "Ashcombe and" appears; "Ashcombe was" never does: the tail "Ashcombe " is held back, then released
ask stop5 --stop "Ashcombe was" --stop "engineer Miriam Ashcombe is" "${CTX[@]}" "$Q"
check "stop sequences that start to appear but never complete: the answer unchanged" "$(js stop5 text)" "$PLAIN"
check "  finish_reason as the plain answer's" "$(js stop5 finish_reason)" "$PLAIN_FIN"
check_stream stop5
# multi-byte characters: "Hélène" (é and è are two bytes each)
QU="Who founded the Quillon Chamber Orchestra?"
contexts "$QU"
ask uplain "${CTX[@]}" "$QU"
UPLAIN=$(js uplain text)
echo "plain: $UPLAIN"
ask ustop --stop "ène" "${CTX[@]}" "$QU"
check "stop 'ène': the text before it (cut after 'Hél')" "$(js ustop text)" "$(before "$UPLAIN" "ène")"
check_stream ustop
ask ustop2 --stop "é" "${CTX[@]}" "$QU"
check "stop 'é': the text before it" "$(js ustop2 text)" "$(before "$UPLAIN" "é")"
check_stream ustop2
# a raw query with stop as one string: no token message carries any of it
contexts "$Q"
ctx_json=$(python3 -c 'import json, sys; print(json.dumps(sys.argv[2::2]))' "${CTX[@]}") # the texts of --context T ...
raw=$(send "$BL" "{\"type\":\"query\",\"question\":$(json_str "$Q"),\"mode\":\"blend\",\"contexts\":$ctx_json,\"stop\":\"the engineer\"}" --stream)
done_line=$(printf '%s\n' "$raw" | tail -n 1)
streamed=$(printf '%s\n' "$raw" | head -n -1 | jq -j 'select(.text != null) | .text')
check "raw stop 'the engineer': done.text = the text before it" "$(jget "$done_line" text)" "$(before "$PLAIN" "the engineer")"
check "raw stop: the token messages together = done.text" "$streamed" "$(jget "$done_line" text)"
check "raw stop: finish_reason stop" "$(jget "$done_line" finish_reason)" stop
n_bad=$(printf '%s\n' "$raw" | head -n -1 | jq -r '.text' | grep -c "engineer")
check "raw stop: no token message carries it" "$n_bad" 0

# --- 3. invalid values ----------------------------------------------------------------------------------
long=$(python3 -c "print('x' * 300)")
check_error "stop of 300 bytes" "$(send "$BL" "{\"type\":\"query\",\"question\":\"q\",\"stop\":\"$long\"}")" bad_request
check_error "stop array with a 300-byte element" "$(send "$BL" "{\"type\":\"query\",\"question\":\"q\",\"stop\":[\"a\",\"$long\"]}")" bad_request
check_error "5 stop sequences" "$(send "$BL" '{"type":"query","question":"q","stop":["a","b","c","d","e"]}')" bad_request
check_error "empty stop sequence" "$(send "$BL" '{"type":"query","question":"q","stop":""}')" bad_request
check_error "empty stop sequence in an array" "$(send "$BL" '{"type":"query","question":"q","stop":["a",""]}')" bad_request
check_error "stop as a number" "$(send "$BL" '{"type":"query","question":"q","stop":5}')" bad_request
check_error "stop array with a number" "$(send "$BL" '{"type":"query","question":"q","stop":["a",5]}')" bad_request
check_error "frequency_penalty 5" "$(send "$BL" '{"type":"query","question":"q","frequency_penalty":5}')" bad_request
check_error "presence_penalty -2.5" "$(send "$BL" '{"type":"query","question":"q","presence_penalty":-2.5}')" bad_request
check_error "frequency_penalty as a string" "$(send "$BL" '{"type":"query","question":"q","frequency_penalty":"1"}')" bad_request
msg=$(jget "$(send "$BL" '{"type":"query","question":"q","frequency_penalty":5}')" error.message)
echo "$msg" | grep -q "frequency_penalty" && echo "ok: the error names the field: $msg" \
  || { echo "FAIL: the error does not name the field: $msg"; FAILS=$((FAILS+1)); }
ctx1=$(json_str "$(jget "$(send "$RET" '{"type":"search","query":"Kettleby","k":1}')" hits.0.text)")
lim=$(send "$BL" "{\"type\":\"query\",\"question\":\"q\",\"max_tokens\":2,\"contexts\":[$ctx1],\"frequency_penalty\":2,\"presence_penalty\":-2,\"stop\":[]}" --stream | tail -n 1)
check "penalties at the limits (2, -2) and an empty stop array: answered" "$(jget "$lim" type)/$(jget "$lim" ok)" "done/true"
cbctl query --frequency-penalty 5 q >/dev/null 2>&1; check "cbctl --frequency-penalty 5: exit 2" "$?" 2
cbctl query --presence-penalty nan q >/dev/null 2>&1; check "cbctl --presence-penalty nan: exit 2" "$?" 2
cbctl query --stop "" q >/dev/null 2>&1; check "cbctl --stop '': exit 2" "$?" 2
cbctl query --stop "$long" q >/dev/null 2>&1; check "cbctl --stop of 300 bytes: exit 2" "$?" 2
cbctl query --stop a --stop b --stop c --stop d --stop e q >/dev/null 2>&1; check "cbctl: 5 --stop: exit 2" "$?" 2
CB_BLEND_ENDPOINT="tcp://127.0.0.1:$(svc_free_port)" timeout 20 build/bin/cb-blend --blend.frequency_penalty=3 \
  >"$T/badcfg.log" 2>&1
check "cb-blend with blend.frequency_penalty = 3: exit 1" "$?" 1
grep -q "frequency_penalty" "$T/badcfg.log" && echo "ok: it says why: $(grep frequency_penalty "$T/badcfg.log" | head -1)" \
  || { echo "FAIL: no reason in: $(cat "$T/badcfg.log")"; FAILS=$((FAILS+1)); }

check "the service keeps answering" "$(jget "$(send "$BL" '{"type":"ping"}')" ok)" true
for s in blend precompute cacheindex retriever; do svc_stop $s; done
svc_finish
