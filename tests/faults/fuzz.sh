#!/usr/bin/env bash
# tests/faults/fuzz.sh: fuzzing with committed corpora, bounded.
#   libFuzzer   fuzz_msg (cb_msg_decode_ex and every accessor), fuzz_kvfile (the KV file reader), fuzz_gguf (the
#               GGUF reader), fuzz_tokenizer (encode/decode round trips on the real vocabulary), fuzz_qa (the
#               MuSiQue parser), each for CB_FAULTS_FUZZ_S seconds (default 40) from a copy of its committed
#               seed corpus tests/fuzz/corpus_<name>/ (ASan + UBSan; any crash, leak, timeout or OOM is a
#               failure, its input kept under build/faults/fuzz-artifacts/<name>/). Skipped when clang cannot
#               build a libFuzzer target.
#   socket      every service's request handling, which only a running service reaches: cb-fuzzsock sends
#               CB_FAULTS_SOCK_N mutated copies (default 60) of every request type to each service (and of
#               `ingest` to cb-precompute's PULL socket); every message must get a well-formed reply (or be
#               dropped), no stream may hang, and the service must stay up.
#   CURVE       the same for a secured service: a cb-retriever of its own with common.curve = on and a key set
#               from `cbctl keys init` (the row is skipped when keys cannot be made), fuzzed by cb-fuzzsock with
#               --curve-client/--curve-server (CB_FAULTS_SOCK_N copies of each type, at most 300 s); a plaintext
#               cb-fuzzsock must be refused first.
. "$(dirname "$0")/lib/faults.bash"
faults_begin fuzz
FUZZ_S=${CB_FAULTS_FUZZ_S:-40}
SOCK_N=${CB_FAULTS_SOCK_N:-60}
[ "$FAULTS_QUICK" = 1 ] && FUZZ_S=5 SOCK_N=10
ART="$FAULTS_OUT/fuzz-artifacts"

# --- libFuzzer ----------------------------------------------------------------------------------------
have_fuzzer() {
  echo 'int LLVMFuzzerTestOneInput(const unsigned char *d, unsigned long n) { (void)d; (void)n; return 0; }' >"$T/probe.c"
  clang -fsanitize=fuzzer,address "$T/probe.c" -o "$T/probe" >/dev/null 2>&1
}
if have_fuzzer && make -s -j2 fuzz >"$T/fuzz-build.log" 2>&1; then
  for name in msg kvfile gguf tokenizer qa; do
    faults_row_begin "libFuzzer fuzz_$name"
    work="$T/corpus-$name"; mkdir -p "$work" "$ART/$name"
    find "tests/fuzz/corpus_$name" -maxdepth 1 -type f ! -name README.md -exec cp {} "$work/" \;
    seeds=$(ls "$work" | wc -l)
    case $name in kvfile|gguf) maxlen=65536 ;; *) maxlen=4097 ;; esac
    timeout $((FUZZ_S + 120)) "build/fuzz/fuzz_$name" -max_total_time="$FUZZ_S" -timeout=10 -rss_limit_mb=2048 \
      -max_len=$maxlen -print_final_stats=1 -artifact_prefix="$ART/$name/" "$work" >"$T/fuzz-$name.log" 2>&1
    rc=$?
    FZ_EXECS=$(awk '/stat::number_of_executed_units/ { print $2 }' "$T/fuzz-$name.log" | tail -1)
    FZ_EXECS=${FZ_EXECS:-0}
    found=$(find "$ART/$name" -type f \( -name 'crash-*' -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) -newer "$T/probe.c" | wc -l)
    FZ_CRASHES=$found
    [ "$rc" != 0 ] && [ "$found" = 0 ] && FZ_CRASHES=1
    if [ "$FZ_CRASHES" = 0 ]; then
      pass "fuzz_$name: $FZ_EXECS executions in $FUZZ_S s, no crash (corpus $seeds -> $(ls "$work" | wc -l) inputs)"
    else
      fail "fuzz_$name: exit $rc, $found crashing inputs under $ART/$name/"
      grep -m 3 -E "ERROR|SUMMARY|runtime error|fuzz_" "$T/fuzz-$name.log" | sed 's/^/    /'
      cp "$T/fuzz-$name.log" "$ART/$name/fuzzer.log"
    fi
    note "$(awk '/stat::peak_rss_mb/ { print "peak RSS " $2 " MB" }' "$T/fuzz-$name.log"); corpus $seeds -> $(ls "$work" | wc -l) inputs"
    faults_row_end
  done
else
  faults_row_begin "libFuzzer"
  ROW_STATUS=skip
  note "skipped: clang cannot build a libFuzzer target here ($(tail -1 "$T/fuzz-build.log" 2>/dev/null))"
  faults_row_end
fi

# --- over the socket ----------------------------------------------------------------------------------
svc_need build/bin/cb-fuzzsock
export CB_BLEND_CTX_SIZE=384 CB_BLEND_MAX_TOKENS=4   # a mutated max_tokens ends at the context, within seconds
stack_start_all || faults_finish
K=0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef
cat >"$T/t-retriever.jsonl" <<J
{"type":"ping"}
{"type":"stats"}
{"type":"index","chunk_id":"$K","doc_id":"doc-1","text":"The lighthouse keeper lit the lamp at dusk."}
{"type":"delete","chunk_id":"$K"}
{"type":"delete","doc_id":"doc-1"}
{"type":"search","query":"lighthouse lamp","k":5}
J
cat >"$T/t-cacheindex.jsonl" <<J
{"type":"ping"}
{"type":"stats"}
{"type":"put","key":"$K","path":"01/$K.kv","bytes":1024,"tokens":8,"fingerprint":"ab12"}
{"type":"lookup","keys":["$K","00112233445566778899aabbccddeeff"]}
{"type":"touch","keys":["$K"],"hit":true}
{"type":"gc"}
J
cat >"$T/t-precompute.jsonl" <<J
{"type":"ping"}
{"type":"stats"}
{"type":"ingest","doc_id":"fz-doc","text":"Short fuzz document about a quiet harbour.","meta":{"src":"fuzz","n":1}}
{"type":"status","job":"00112233445566778899aabbccddeeff"}
J
cat >"$T/t-blend.jsonl" <<J
{"type":"ping"}
{"type":"stats"}
{"type":"query","question":"Who lit the lamp?","contexts":["The keeper lit the lamp."],"mode":"full","max_tokens":2}
{"type":"query","question":"Who lit the lamp?","k":1,"mode":"blend","ratio":0.2,"max_tokens":2,"temperature":0.5,"top_p":0.9,"seed":3,"stop":["\n"],"frequency_penalty":0.1}
J
grep -h '"ingest"' "$T/t-precompute.jsonl" >"$T/t-pull.jsonl"
seed=$FAULTS_SEED
for svc in retriever cacheindex precompute blend pull; do
  faults_row_begin "socket cb-$svc"
  if [ "$svc" = pull ]; then
    ROW="socket cb-precompute (PULL)"
    p0=$(stack_stat precompute pulled); d0=$(stack_stat precompute pull_dropped)
    out=$(timeout 600 "$ROOT/build/bin/cb-fuzzsock" --seed "$seed" --n $((SOCK_N * 2)) --push --ping "$CB_PRECOMPUTE_ENDPOINT" --json \
          "$CB_PRECOMPUTE_PULL_ENDPOINT" "$T/t-pull.jsonl" 2>"$T/fz-$svc.err"); rc=$?
    sleep 1
    note "pulled $(( $(stack_stat precompute pulled) - p0 )), dropped as invalid $(( $(stack_stat precompute pull_dropped) - d0 ))"
  else
    out=$(timeout 900 "$ROOT/build/bin/cb-fuzzsock" --seed "$seed" --n "$SOCK_N" --timeout 3000 --stream-ms 15000 --json \
          "$(stack_endpoint "$svc")" "$T/t-$svc.jsonl" 2>"$T/fz-$svc.err"); rc=$?
  fi
  echo "cb-fuzzsock: $out"
  FZ_EXECS=$(jget "$out" sent); [ "$FZ_EXECS" = null ] && FZ_EXECS=0
  if [ "$rc" = 0 ] && [ "$(jget "$out" alive)" = true ]; then
    pass "$ROW: $FZ_EXECS messages, every reply well-formed, the service up"
  else
    [ "$(jget "$out" alive)" = true ] || FZ_CRASHES=1
    fail "$ROW: exit $rc: $out; $(head -3 "$T/fz-$svc.err" | tr '\n' ' ')"
  fi
  [ "$svc" != pull ] && note "replies: $(jget "$out" ok) ok, $(jget "$out" error_replies) errors $(jget "$out" codes | tr -d '{}"'), $(jget "$out" dropped) dropped, $(jget "$out" long_streams) long streams abandoned"
  crash_check
  FZ_CRASHES=$((FZ_CRASHES + CRASHES))
  faults_row_end
  seed=$((seed + 1))
done

# --- over the socket, CURVE -----------------------------------------------------------------------------
# A secured service: a cb-retriever of its own (port, data directory) with common.curve = on and a fresh key
# set (cbctl keys init); cb-fuzzsock connects as the cbctl identity with the service's public key. A plaintext
# cb-fuzzsock must be refused first, so the row cannot pass without the messages going through CURVE.
faults_row_begin "socket cb-retriever (CURVE)"
KEYS="$T/keys"
if ! "$CBCTL" keys init "$KEYS" >"$T/keys.log" 2>&1; then
  ROW_STATUS=skip
  note "skipped: CURVE keys could not be made ($(tail -1 "$T/keys.log"))"
else
  SEP="tcp://127.0.0.1:$(svc_free_port)"
  mkdir -p "$T/curve-data"
  svc_start retriever-curve build/bin/cb-retriever CB_COMMON_CURVE=on "CB_COMMON_KEYS_DIR=$KEYS" \
    "CB_RETRIEVER_ENDPOINT=$SEP" "CB_DATA_DIR=$T/curve-data"
  cpid=${SVC_PID[retriever-curve]}
  # cb-send (svc_wait_ping) speaks CURVE as the cbctl identity when the environment says so
  if CB_COMMON_CURVE=on CB_COMMON_KEYS_DIR="$KEYS" CB_RETRIEVER_ENDPOINT="$SEP" svc_wait_ping "$SEP" 20 "$cpid"; then
    timeout 60 "$ROOT/build/bin/cb-fuzzsock" --n 1 "$SEP" "$T/t-retriever.jsonl" >/dev/null 2>"$T/fz-plain.err"; rc=$?
    if [ "$rc" = 2 ] && grep -q "requires CURVE" "$T/fz-plain.err"; then
      pass "a plaintext cb-fuzzsock is refused by the secured cb-retriever (exit 2, the reason named)"
    else
      fail "a plaintext cb-fuzzsock was not refused: exit $rc; $(head -c 300 "$T/fz-plain.err")"
    fi
    out=$(timeout 300 "$ROOT/build/bin/cb-fuzzsock" --seed "$seed" --n "$SOCK_N" --timeout 3000 --json \
          --curve-client "$KEYS/client/cbctl.key_secret" --curve-server "$KEYS/public/retriever.key" \
          "$SEP" "$T/t-retriever.jsonl" 2>"$T/fz-curve.err"); rc=$?
    echo "cb-fuzzsock: $out"
    FZ_EXECS=$(jget "$out" sent); [ "$FZ_EXECS" = null ] && FZ_EXECS=0
    if [ "$rc" = 0 ] && [ "$(jget "$out" alive)" = true ] && [ "$(jget "$out" curve)" = true ] && [ "$(jget "$out" ok)" -gt 0 ]; then
      pass "$ROW: $FZ_EXECS messages through CURVE, every reply well-formed, the service up"
    else
      fail "$ROW: exit $rc: $out; $(head -3 "$T/fz-curve.err" | tr '\n' ' ')"
    fi
    note "replies: $(jget "$out" ok) ok, $(jget "$out" error_replies) errors $(jget "$out" codes | tr -d '{}"'), $(jget "$out" dropped) dropped"
  else
    fail "the CURVE cb-retriever did not answer ping: $(tail -3 "$T/retriever-curve.log" | tr '\n' ' ')"
  fi
  if kill -0 "$cpid" 2>/dev/null; then
    stack_stop retriever-curve
  else
    wait "$cpid" 2>/dev/null; rc=$?
    CRASHES=1 FZ_CRASHES=1
    fail "the CURVE cb-retriever died (exit $rc); last log lines: $(tail -5 "$T/retriever-curve.log" | tr '\n' ' ')"
  fi
  unset "SVC_PID[retriever-curve]"
fi
faults_row_end
faults_finish
