# tests/faults/lib/faults.bash: helpers for the fault and load suite (tests/faults/run.sh, docs/reliability.md).
# Source it from a scenario script; it sources tests/integration/lib/stack.bash (stack_setup, stack_start,
# cb-send, jget, check ...). A scenario is a series of rows (one per service or sub-case); each row counts
#
#   ACKED LOST DUP      documents acknowledged by cb-precompute (an ok `ingest` reply, or a 200 from the
#                       gateway), of those the ones not fully processed and searchable once the fault is over,
#                       and the ones found more than once (a second job, a chunk twice in the search hits or
#                       the retriever's document links)
#   Q_OK Q_ERR Q_OVER Q_HUNG   queries answered (and equal to the answer before the fault), ended with a clear
#                       error (non-zero exit and a message), refused as overloaded, and not finished within
#                       the client-side bound (a hang: always a failure)
#   CRASHES             services that died without being killed by the test
#   FZ_EXECS FZ_CRASHES fuzzing runs
#
# and faults_row_end writes it to $FAULTS_OUT/rows.jsonl, which tests/faults/run.sh turns into the summary
# table. Randomness (kill delays, stop lengths) comes from bash's RANDOM seeded with CB_FAULTS_SEED and the
# scenario name, so a run can be repeated with the same points (timings still vary with the machine's load).

. "$(dirname "${BASH_SOURCE[0]}")/../../integration/lib/stack.bash"

FAULTS_OUT=${FAULTS_OUT:-$ROOT/build/faults}
FAULTS_SEED=${CB_FAULTS_SEED:-1}
FAULTS_QUICK=${CB_FAULTS_QUICK:-0}
SCEN=""
ROW=""
ROW_T0=0
ROW_NOTE=""
ACKED=0 LOST=0 DUP=0 Q_OK=0 Q_ERR=0 Q_OVER=0 Q_HUNG=0 CRASHES=0 FZ_EXECS=0 FZ_CRASHES=0
Q_MAXMS=0   # the longest query of the row (ms): the bound a client actually waited
ROW_FAILS0=0
declare -A FAULTS_EXPECT_DEAD=()   # services the test killed or stopped on purpose (not crashes)
declare -A REF=()                  # reference answers, by query label
declare -A QARGS=()                # cbctl query arguments, by label (one string, eval'd)

FAULTS_MOUNTS=()

# faults_at_exit: run by the launcher's exit trap once every started service is stopped (SIGCONT, SIGTERM,
# SIGKILL after a bound: scripts/lib/stack.bash), before the temp dir goes: the services' logs are kept and
# every tmpfs this scenario mounted is unmounted.
faults_at_exit() {
  local m
  if [ -n "$T" ] && [ -n "$SCEN" ]; then   # the services' logs outlive the run (build/faults/logs/SCENARIO/)
    rm -rf "$FAULTS_OUT/logs/$SCEN"; mkdir -p "$FAULTS_OUT/logs/$SCEN"
    cp "$T"/*.log "$FAULTS_OUT/logs/$SCEN/" 2>/dev/null
  fi
  for m in "${FAULTS_MOUNTS[@]}"; do umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null; done
  return 0
}

# faults_mount_tmpfs DIR SIZE: a tmpfs of SIZE (e.g. 48m) on DIR, unmounted at exit; false when not allowed.
faults_mount_tmpfs() {
  mkdir -p "$1"
  mount -t tmpfs -o "size=$2" tmpfs "$1" 2>/dev/null || return 1
  FAULTS_MOUNTS+=("$1")
}

# faults_begin NAME: the scenario's name, seed, temp dir and stack settings.
faults_begin() {
  SCEN=$1
  mkdir -p "$FAULTS_OUT"
  local h
  h=$(printf '%s' "$SCEN" | cksum | cut -d' ' -f1)
  RANDOM=$(( (FAULTS_SEED * 7919 + h) % 32768 ))
  stack_setup
  stack_at_exit faults_at_exit
  export CB_CBCTL_REQUEST_TIMEOUT_MS=3000 CB_CBCTL_REQUEST_RETRIES=1
  echo "scenario $SCEN (seed $FAULTS_SEED, dir $T)"
}

# rand_between LO HI: a seeded integer in [LO, HI].
rand_between() { echo $(( $1 + RANDOM % ($2 - $1 + 1) )); }

# ms_sleep MS
ms_sleep() { sleep "$(awk -v m="$1" 'BEGIN { printf "%.3f", m / 1000 }')"; }

now_ms() { echo $(( $(date +%s%N) / 1000000 )); }

ROW_STATUS=""   # set to "skip" for a row that could not run

faults_row_begin() {
  ROW=$1; ROW_NOTE=""; ROW_T0=$(now_ms); ROW_FAILS0=$FAILS; ROW_STATUS=""
  ACKED=0 LOST=0 DUP=0 Q_OK=0 Q_ERR=0 Q_OVER=0 Q_HUNG=0 CRASHES=0 FZ_EXECS=0 FZ_CRASHES=0 Q_MAXMS=0
  echo "--- $SCEN / $ROW"
}

# note TEXT: appended to the row's note column (RSS, TTFT, what happened).
note() { ROW_NOTE="${ROW_NOTE:+$ROW_NOTE; }$*"; echo "note: $*"; }

fail() { echo "FAIL: $*"; FAILS=$((FAILS + 1)); }
pass() { echo "ok: $*"; }

faults_row_end() {
  local status=ok ms
  [ "$Q_MAXMS" -gt 0 ] && note "longest query $(awk -v m="$Q_MAXMS" 'BEGIN { printf "%.1f", m / 1000 }') s"
  [ "$FAILS" -gt "$ROW_FAILS0" ] && status=FAIL
  [ -n "$ROW_STATUS" ] && [ "$status" = ok ] && status=$ROW_STATUS
  ms=$(( $(now_ms) - ROW_T0 ))
  jq -cn --arg s "$SCEN" --arg r "$ROW" --arg st "$status" --arg note "$ROW_NOTE" --argjson seed "$FAULTS_SEED" \
    --argjson ms "$ms" --argjson a "$ACKED" --argjson l "$LOST" --argjson d "$DUP" --argjson qo "$Q_OK" \
    --argjson qe "$Q_ERR" --argjson qv "$Q_OVER" --argjson qh "$Q_HUNG" --argjson c "$CRASHES" \
    --argjson fe "$FZ_EXECS" --argjson fc "$FZ_CRASHES" \
    '{scenario: $s, target: $r, status: $st, seed: $seed, seconds: ($ms / 1000), docs_acked: $a, docs_lost: $l,
      docs_duplicated: $d, queries_answered: $qo, queries_errored: $qe, queries_overloaded: $qv, queries_hung: $qh,
      crashes: $c, fuzz_execs: $fe, fuzz_crashes: $fc, note: $note}' >>"$FAULTS_OUT/rows.jsonl"
  echo "row $SCEN/$ROW: $status (acked $ACKED lost $LOST dup $DUP; queries $Q_OK ok $Q_ERR err $Q_OVER overloaded $Q_HUNG hung; crashes $CRASHES)"
}

# faults_finish: like svc_finish (exit 1 on any failure, logs' tails), for a scenario.
faults_finish() { svc_finish; }

# ------------------------------------------------------------------------------------------------ services

ALL_SVCS="retriever cacheindex precompute blend"

# rss_kb LOGNAME: the resident set of a started service (kB), or 0.
rss_kb() {
  local pid=${SVC_PID[$1]:-}
  [ -n "$pid" ] && awk '/^VmRSS:/ { print $2; f = 1 } END { if (!f) print 0 }' "/proc/$pid/status" 2>/dev/null || echo 0
}
rss_mb() { echo $(( $(rss_kb "$1") / 1024 )); }

# svc_restart NAME: starts a service again under the same name and endpoint (gateway: the same port).
svc_restart() {
  local name=$1
  unset "FAULTS_EXPECT_DEAD[$name]"
  if [ "$name" = gateway ]; then
    stack_start gateway || { fail "cb-gateway did not come back on $GW"; return 1; }
    return 0
  fi
  stack_start "$name" "$name" || { fail "cb-$name did not come back"; return 1; }
}

# kill9 NAME: SIGKILL on purpose (not counted as a crash); reaped.
kill9() {
  FAULTS_EXPECT_DEAD[$1]=1
  stack_kill9 "$1"
}

# crash_check: every started service that is not expected dead must still run; a dead one is a crash
# (counted, logged, restarted so the scenario can go on).
crash_check() {
  local name pid rc
  for name in "${!SVC_PID[@]}"; do
    pid=${SVC_PID[$name]}
    [ -n "${FAULTS_EXPECT_DEAD[$name]:-}" ] && continue
    if ! kill -0 "$pid" 2>/dev/null; then
      wait "$pid" 2>/dev/null; rc=$?
      CRASHES=$((CRASHES + 1))
      fail "cb-$name died unasked (exit $rc); last log lines:"
      tail -5 "$T/$name.log" | sed 's/^/    /'
      unset "SVC_PID[$name]"
      svc_restart "$name"
    fi
  done
}

# health_all: every service answers ping (cb-send, 3 s each).
health_all() {
  local s ok=0
  for s in $ALL_SVCS; do
    "$SEND" --timeout 3000 --retries 1 "$(stack_endpoint $s)" '{"type":"ping"}' >/dev/null 2>&1 || { ok=1; echo "  cb-$s does not answer ping"; }
  done
  return $ok
}

# ------------------------------------------------------------------------------------------------ documents

# make_doc INDEX: a document of 2-3 paragraphs of made-up words (no English words, so it never changes the
# retrieval of the reference questions) around the marker word `zq<INDEX>x`, which every paragraph holds.
make_doc() {
  local i=$1 m="zq${1}x" p w words=(blorvak quendil sampret oruvex tindalo mervish kapsundo velitrax ombrel
    dusquanet halvorin pexilo trundam ysolvar gemmoth ractival nuvesto kilbarren)
  local np=$(( 2 + i % 2 ))
  for p in $(seq 1 $np); do
    printf '%s pv%s:' "$m" "$p"
    for w in $(seq 1 22); do printf ' %s' "${words[$(( (i * 7 + p * 5 + w * 3) % ${#words[@]} ))]}"; done
    printf ' %s.\n\n' "$m"
  done
}

# ingest_docs ACKFILE FIRST COUNT [VIA]: sends documents FIRST..FIRST+COUNT-1 one at a time (doc_id
# "fd-<i>") to cb-precompute (VIA=zmq, cb-send with a Lazy Pirate retry) or through the gateway (VIA=http,
# POST /v1/documents); an acknowledged one is appended to ACKFILE as "doc_id job", a refused or unanswered
# one to ACKFILE.nak with the reason. Bounded: each send waits at most ~6 s.
ingest_docs() {
  local ack=$1 first=$2 count=$3 via=${4:-zmq} i doc text out job code
  for i in $(seq "$first" $((first + count - 1))); do
    doc="fd-$i"; text=$(make_doc "$i")
    if [ "$via" = http ]; then
      out=$(curl -s --max-time 6 -H 'Content-Type: application/json' -X POST "$GW/v1/documents" \
              -d "$(jq -cn --arg id "$doc" --arg t "$text" '{documents: [{id: $id, text: $t}]}')" -w '\n%{http_code}' 2>/dev/null)
      code=$(echo "$out" | tail -n 1)
      job=$(echo "$out" | head -n -1 | jq -r '.data[0].job // empty' 2>/dev/null)
      if [ "$code" = 200 ] && [ -n "$job" ]; then echo "$doc $job" >>"$ack"; else echo "$doc http $code" >>"$ack.nak"; fi
    else
      out=$("$SEND" --timeout 2000 --retries 2 "$CB_PRECOMPUTE_ENDPOINT" \
              "$(jq -cn --arg id "$doc" --arg t "$text" '{type: "ingest", doc_id: $id, text: $t}')" 2>/dev/null)
      if [ "$(jget "$out" ok)" = true ]; then echo "$doc $(jget "$out" job)" >>"$ack"
      else echo "$doc $(jget "$out" error.code) $(jget "$out" error.message)" >>"$ack.nak"; fi
    fi
  done
}

# verify_docs ACKFILE [WAIT_S]: every acknowledged document must end up done exactly once: its job in the
# job table with state done (waits up to WAIT_S, default 60), one job for the document, and each of its
# chunks exactly once in a search for its marker word (and in the retriever's document links). Adds to
# ACKED, LOST and DUP.
verify_docs() {
  local ack=$1 wait_s=${2:-60} n pending doc job i st want hits got dups links
  [ -s "$ack" ] || return 0
  local db="$CB_DATA_DIR/precompute.db" rdb="$CB_DATA_DIR/retriever.db"
  sort -u "$ack" -o "$ack"
  n=$(wc -l <"$ack"); ACKED=$((ACKED + n))
  for i in $(seq 1 $((wait_s * 5))); do
    pending=0
    while read -r doc job; do
      st=$(sqlite3 "$db" "SELECT state FROM jobs WHERE job = '$job'" 2>/dev/null)
      [ "$st" = 2 ] || { pending=$((pending + 1)); }
      [ "$st" = 3 ] && pending=$((pending - 1))   # failed: final, counted below
    done <"$ack"
    [ "$pending" -eq 0 ] && break
    sleep 0.2
  done
  while read -r doc job; do
    st=$(sqlite3 "$db" "SELECT state || '|' || coalesce(error, '') FROM jobs WHERE job = '$job'" 2>/dev/null)
    if [ "${st%%|*}" != 2 ]; then
      LOST=$((LOST + 1)); fail "document $doc (job $job) acknowledged but not done: state '${st:-missing}'"
      continue
    fi
    [ "$(sqlite3 "$db" "SELECT count(*) FROM jobs WHERE doc_id = '$doc'")" -gt 1 ] && { DUP=$((DUP + 1)); fail "document $doc has more than one job"; continue; }
    want=$(sqlite3 "$db" "SELECT DISTINCT key FROM chunks WHERE job = '$job' ORDER BY key")
    hits=$("$SEND" --timeout 5000 --retries 1 "$CB_RETRIEVER_ENDPOINT" \
             "{\"type\":\"search\",\"query\":\"zq${doc#fd-}x\",\"k\":50}" 2>/dev/null | jq -r --arg d "$doc" '.hits[]? | select(.doc_id == $d) | .chunk_id')
    got=$(echo "$hits" | sed '/^$/d' | sort -u)
    dups=$(echo "$hits" | sed '/^$/d' | sort | uniq -d | wc -l)
    links=$(sqlite3 "$rdb" "SELECT count(*) FROM chunk_docs WHERE doc_id = '$doc'" 2>/dev/null)
    if [ "$got" != "$want" ]; then
      LOST=$((LOST + 1)); fail "document $doc: search finds $(echo "$got" | sed '/^$/d' | wc -l) of its $(echo "$want" | wc -l) chunks"
    elif [ "$dups" -gt 0 ] || [ "$links" != "$(echo "$want" | wc -l)" ]; then
      DUP=$((DUP + 1)); fail "document $doc: a chunk twice (search duplicates $dups, links $links)"
    fi
  done <"$ack"
  pass "$n acknowledged documents checked (lost so far $LOST, duplicated $DUP)"
}

# db_checks: quick_check of the three databases, no duplicate chunk rows anywhere, every cache index row's
# file present, one KV file per row at most.
db_checks() {
  local f r
  for f in precompute retriever cacheindex; do
    r=$(sqlite3 "$CB_DATA_DIR/$f.db" "PRAGMA quick_check" 2>&1 | head -1)
    [ "$r" = ok ] || fail "$f.db quick_check: $r"
  done
  r=$(sqlite3 "$CB_DATA_DIR/retriever.db" "SELECT count(*) FROM (SELECT chunk_id FROM chunks GROUP BY chunk_id HAVING count(*) > 1)")
  [ "$r" = 0 ] || fail "retriever: $r duplicated chunk rows"
  r=$(sqlite3 "$CB_DATA_DIR/precompute.db" "SELECT count(*) FROM (SELECT doc_id FROM jobs WHERE state = 2 GROUP BY doc_id, text HAVING count(*) > 1)")
  [ "$r" = 0 ] || fail "precompute: $r documents with two done jobs"
  pass "databases pass quick_check; no duplicated rows"
}

# ------------------------------------------------------------------------------------------------ queries

# The reference queries: explicit contexts (blend and full) and retrieval over data/sample. Retrieval uses k 1:
# the runner-up chunks of these questions score about 0 (only "the", "who" match), so their order flips as the
# corpus grows (BM25's IDF), and with k 2 the answer would change with every document the faults add.
C_LH="The Kettleby Lighthouse was designed by the engineer Miriam Ashcombe and first lit in 1871."
C_QO="The Quillon Chamber Orchestra was founded in 1978 by the cellist Helene Marchetti."
ref_queries_define() {
  QARGS[ctx-blend]="--mode blend --context \"\$C_LH\" --context \"\$C_QO\" 'Who designed the Kettleby Lighthouse?'"
  QARGS[ctx-full]="--mode full --context \"\$C_QO\" 'Who founded the Quillon Chamber Orchestra?'"
  QARGS[rag-blend]="--mode blend --k 1 'When was Brisket Station opened?'"
  QARGS[rag-full]="--mode full --k 1 'Who designed the Kettleby Lighthouse?'"
}

# query_run LABEL BOUND_S: runs the query, prints "rc ms" and the answer into $T/q.out (stderr $T/q.err).
# rc 124: it did not finish within BOUND_S (a hang).
query_run() {
  local label=$1 bound=${2:-30} t0 rc
  t0=$(now_ms)
  eval "timeout $bound \"\$CBCTL\" query ${QARGS[$label]}" >"$T/q.out" 2>"$T/q.err"; rc=$?
  echo "$rc $(( $(now_ms) - t0 ))"
}

# ref_queries_record: the answers of the healthy stack.
ref_queries_record() {
  local l r
  for l in "${!QARGS[@]}"; do
    r=$(query_run "$l" 60)
    [ "${r%% *}" = 0 ] || { fail "reference query $l: exit ${r%% *}: $(cat "$T/q.err")"; continue; }
    REF[$l]=$(cat "$T/q.out")
    echo "reference $l: ${REF[$l]}"
  done
}

# classify LABEL RC MS OUTFILE ERRFILE: counts one query of a driver.
classify() {
  local label=$1 rc=$2 ms=$3 out=$4 errf=$5
  [ "$ms" -gt "$Q_MAXMS" ] && Q_MAXMS=$ms
  if [ "$rc" = 0 ]; then
    if [ -n "${REF[$label]:-}" ] && [ "$(cat "$out")" != "${REF[$label]}" ]; then
      fail "query $label answered differently during the fault: '$(cat "$out")' (before: '${REF[$label]}')"
      Q_ERR=$((Q_ERR + 1))
    else Q_OK=$((Q_OK + 1)); fi
  elif [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    Q_HUNG=$((Q_HUNG + 1)); fail "query $label did not finish within its bound ($ms ms)"
  elif grep -qi overloaded "$errf" 2>/dev/null; then Q_OVER=$((Q_OVER + 1))
  elif [ -s "$errf" ]; then Q_ERR=$((Q_ERR + 1))
  else Q_ERR=$((Q_ERR + 1)); fail "query $label failed (exit $rc) without a message"; fi
}

# query_driver OUTDIR N BOUND_S: N queries one after the other (the reference labels in turn), each bounded;
# writes OUTDIR/<n>.{rc,out,err} (rc file: "label rc ms").
query_driver() {
  local dir=$1 n=$2 bound=$3 labels=("${!QARGS[@]}") k l t0 rc
  mkdir -p "$dir"
  for k in $(seq 1 "$n"); do
    l=${labels[$(( k % ${#labels[@]} ))]}
    t0=$(now_ms)
    eval "timeout $bound \"\$CBCTL\" query ${QARGS[$l]}" >"$dir/$k.out" 2>"$dir/$k.err"; rc=$?
    echo "$l $rc $(( $(now_ms) - t0 ))" >"$dir/$k.rc"
  done
}

# http_query_driver OUTDIR N BOUND_S: the same through the gateway (POST /v1/chat/completions, not streamed).
http_query_driver() {
  local dir=$1 n=$2 bound=$3 k t0 rc code body
  mkdir -p "$dir"
  body=$(jq -cn --arg c "$C_QO" '{messages: [{role: "user", content: "Who founded the Quillon Chamber Orchestra?"}],
                                  documents: [$c], cacheblend: {mode: "full"}}')
  for k in $(seq 1 "$n"); do
    t0=$(now_ms)
    code=$(curl -s -o "$dir/$k.json" -w '%{http_code}' --max-time "$bound" -H 'Content-Type: application/json' \
             -X POST "$GW/v1/chat/completions" -d "$body" 2>"$dir/$k.err"); rc=$?
    jq -r '.choices[0].message.content // empty' "$dir/$k.json" >"$dir/$k.out" 2>/dev/null
    [ "$rc" = 0 ] && [ "$code" != 200 ] && { rc=1; echo "HTTP $code: $(head -c 300 "$dir/$k.json")" >"$dir/$k.err"; }
    [ "$rc" = 28 ] && rc=124   # curl's --max-time: a hang
    [ "$rc" != 0 ] && [ "$rc" != 124 ] && [ ! -s "$dir/$k.err" ] && echo "curl exit $rc" >"$dir/$k.err"
    echo "http $rc $(( $(now_ms) - t0 ))" >"$dir/$k.rc"
  done
}

# classify_dir OUTDIR: classify every query a driver ran.
classify_dir() {
  local f label rc ms
  for f in "$1"/*.rc; do
    [ -f "$f" ] || continue
    read -r label rc ms <"$f"
    classify "$label" "$rc" "$ms" "${f%.rc}.out" "${f%.rc}.err"
  done
}

# ref_queries_check: after recovery every reference query is answered, as before.
ref_queries_check() {
  local l r
  for l in "${!QARGS[@]}"; do
    r=$(query_run "$l" 30)
    classify "$l" "${r%% *}" "${r##* }" "$T/q.out" "$T/q.err"
    [ "${r%% *}" = 0 ] || fail "after recovery, query $l: exit ${r%% *}: $(head -c 300 "$T/q.err")"
  done
}

# http_ref_record / http_ref_check: the gateway's answer to the same question.
http_ref_record() {
  http_query_driver "$T/httpref" 1 60
  REF[http]=$(cat "$T/httpref/1.out")
  [ -n "${REF[http]}" ] || fail "reference query through the gateway failed: $(cat "$T/httpref/1.err")"
  echo "reference http: ${REF[http]}"
}
