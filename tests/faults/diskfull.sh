#!/usr/bin/env bash
# tests/faults/diskfull.sh: a full disk. The whole data dir (the three databases and kv/) is a small tmpfs
# (mount -t tmpfs, unmounted in the EXIT trap; needs root: skipped, exit 77, where mount is not allowed), and
# a filler file takes all but a little of it:
#   kvfull    room for the databases but not for a KV file: documents are acknowledged (the job table has
#             room), their KV writes fail; then the filler goes and every acknowledged document must finish
#             (by itself: the worker's back-off, or a client's retry counted separately in the note);
#   dbfull    no room at all: an ingest is refused up front with a clear error, or acknowledged and finished
#             after the space comes back; nothing half-written stays;
#   kvwrite   cb-blend computes chunks that miss and writes their KV files (blend.store_misses) on the full
#             disk: the answers equal the in-process engine's (cb-rag), no file is left half-written, and
#             once there is room the files are written and hit;
#   truncated a KV file cut in half (what a torn write would leave without the temp-and-rename protocol):
#             a miss, recomputed, the answer unchanged.
# Throughout: no service dies, every service answers ping, and cb-kvcheck finds every *.kv file whole (header,
# size, payload checksums) and no stray temporary file once the writes are over. The disk full is reported:
# while it is (each row's full phase), `cbctl health` exits 4 with every service `degraded` and a reason naming
# the data dir, and cb-gateway's /health answers 200 with "status": "degraded", the four services and their
# reasons; once the space is back (kvfull, dbfull, allfull), both say ok again within 70 s (a failed write
# counts for common.disk_full_hold_s = 60 s, unless a later write of its kind succeeds first).
. "$(dirname "$0")/lib/faults.bash"
faults_begin diskfull
if [ "$(id -u)" != 0 ] || ! faults_mount_tmpfs "$CB_DATA_DIR" 256m; then
  echo "skip: cannot mount a tmpfs on $CB_DATA_DIR (needs root)"; exit 77
fi
KVCHECK="$ROOT/build/bin/cb-kvcheck"
svc_need build/bin/cb-kvcheck
stack_start_all || faults_finish
stack_start_gateway || faults_finish
cbctl ingest --wait data/sample >/dev/null 2>&1 || fail "ingest of data/sample"
ref_queries_define
unset "QARGS[rag-full]" "QARGS[ctx-full]"   # two are enough here
ref_queries_record
KVBYTES=$(find "$KV" -name '*.kv' -printf '%s\n' | sort -n | tail -1)
echo "largest KV file: $KVBYTES bytes"

# fill_to KB: the filler leaves about KB kilobytes free on the data dir.
fill_to() {
  local want=$1 avail
  rm -f "$CB_DATA_DIR/filler"
  sync
  avail=$(df -k --output=avail "$CB_DATA_DIR" | tail -1)
  if [ "$avail" -gt "$want" ]; then
    fallocate -l $(( (avail - want) * 1024 )) "$CB_DATA_DIR/filler" 2>/dev/null ||
      dd if=/dev/zero of="$CB_DATA_DIR/filler" bs=1K count=$((avail - want)) 2>/dev/null
  fi
  echo "free on the data dir: $(df -k --output=avail "$CB_DATA_DIR" | tail -1) KB"
}
unfill() { rm -f "$CB_DATA_DIR/filler"; echo "filler removed: $(df -k --output=avail "$CB_DATA_DIR" | tail -1) KB free"; }

# degraded_check WHEN: the full disk is reported: cbctl health exits 4 (every service answers, degraded) with
# each of the four "degraded" and a reason naming the data dir; the gateway's /health is 200 "degraded", with
# the four in "degraded" and each one's reason naming the data dir.
degraded_check() {
  local when=$1 rc n code st why
  "$CBCTL" health >"$T/health.out" 2>&1; rc=$?
  n=$(grep -c "degraded .*data disk full: .*$CB_DATA_DIR" "$T/health.out")
  if [ "$rc" = 4 ] && [ "$n" = 4 ]; then pass "$when: cbctl health exits 4, the four services degraded, the reason naming $CB_DATA_DIR"
  else fail "$when: cbctl health exit $rc, $n of 4 services degraded with the disk named: $(head -c 800 "$T/health.out")"; fi
  code=$(curl -s --max-time 10 -o "$T/health.json" -w '%{http_code}' "$GW/health")
  st=$(jq -r '.status' "$T/health.json" 2>/dev/null)
  n=$(jq -r --arg d "$CB_DATA_DIR" '[.services[] | select(.status == "degraded" and (.reason // "" | contains($d)))] | length' \
        "$T/health.json" 2>/dev/null)
  if [ "$code $st $n" = "200 degraded 4" ]; then pass "$when: /health 200 \"degraded\", the four services with reasons naming the disk"
  else fail "$when: /health $code \"$st\", $n of 4 degraded with the disk named: $(head -c 800 "$T/health.json")"; fi
  why=$(jq -r '.services.precompute.reason // ""' "$T/health.json" 2>/dev/null | sed "s#$CB_DATA_DIR#DATA#g")
  note "$when: cbctl health exit $rc, /health $code \"$st\" (cb-precompute: \"${why:0:300}\")"
}

# ok_again WHEN: once the space is back, cbctl health exits 0 and /health is 200 "ok" again, within 70 s (a write
# that failed on the full disk counts for common.disk_full_hold_s, 60 s, unless a later one of its kind succeeds).
ok_again() {
  local when=$1 t0=$SECONDS rc code st
  while :; do
    "$CBCTL" health >"$T/health.out" 2>&1; rc=$?
    code=$(curl -s --max-time 10 -o "$T/health.json" -w '%{http_code}' "$GW/health")
    st=$(jq -r '.status' "$T/health.json" 2>/dev/null)
    [ "$rc $code $st" = "0 200 ok" ] && break
    [ $((SECONDS - t0)) -ge 70 ] && break
    sleep 1
  done
  if [ "$rc $code $st" = "0 200 ok" ]; then pass "$when: ok again after $((SECONDS - t0)) s (cbctl health exit 0, /health 200 \"ok\")"
  else fail "$when: not ok 70 s after the space came back: cbctl health exit $rc, /health $code \"$st\": $(grep degraded "$T/health.out" | head -c 600)"; fi
}

# kv_whole WHEN: every KV file whole, no temporary file left.
kv_whole() {
  local out
  out=$("$KVCHECK" "$KV" 2>"$T/kvcheck.err")
  if [ "$(jget "$out" invalid)" = 0 ] && [ "$(jget "$out" tmp)" = 0 ]; then pass "$1: $(jget "$out" files) KV files, all whole, no temporary file"
  else fail "$1: KV files $out: $(head -3 "$T/kvcheck.err")"; fi
}

# up WHEN: nobody died, everybody answers.
up() {
  crash_check
  health_all && pass "$1: every service answers ping" || fail "$1: a service does not answer ping"
}

# retry_failed ACKFILE: a client's retry of the acknowledged documents whose job failed (an ingest of a failed
# job queues it again, docs/protocol.md 6); prints how many were retried.
retry_failed() {
  local n=0 doc job st
  while read -r doc job; do
    st=$(sqlite3 "$CB_DATA_DIR/precompute.db" "SELECT state FROM jobs WHERE job = '$job'")
    [ "$st" = 3 ] || continue
    "$SEND" --timeout 3000 --retries 1 "$CB_PRECOMPUTE_ENDPOINT" \
      "$(jq -cn --arg id "$doc" --arg t "$(make_doc "${doc#fd-}")" '{type: "ingest", doc_id: $id, text: $t}')" >/dev/null 2>&1
    n=$((n + 1))
  done <"$1"
  echo "$n"
}

# --- kvfull: the job table has room, a KV file has not --------------------------------------------------
faults_row_begin kvfull
fill_to $(( KVBYTES / 1024 / 3 ))
ingest_docs "$T/ack-kv.txt" 2000 5
acked=$(wc -l <"$T/ack-kv.txt" 2>/dev/null || echo 0)
[ "$acked" -gt 0 ] && pass "$acked of 5 documents acknowledged with the disk nearly full" || note "no document acknowledged with the disk nearly full"
sleep 4
states=$(sqlite3 "$CB_DATA_DIR/precompute.db" "SELECT group_concat(n || ' ' || s, ', ') FROM (SELECT CASE state WHEN 0 THEN 'queued' WHEN 1 THEN 'running' WHEN 2 THEN 'done' ELSE 'failed' END AS s, count(*) AS n FROM jobs WHERE doc_id LIKE 'fd-20%' GROUP BY state)")
why=$(sqlite3 "$CB_DATA_DIR/precompute.db" "SELECT error FROM jobs WHERE doc_id LIKE 'fd-20%' AND state = 3 LIMIT 1" | sed 's#/[^ :]*/##g')
note "jobs 4 s after their acknowledgement: ${states:-none}${why:+ (\"$why\")}"
up "KV dir full"
kv_whole "KV dir full"
degraded_check "KV dir full"
unfill
sleep 3
retried=0
for i in $(seq 1 20); do
  pending=$(sqlite3 "$CB_DATA_DIR/precompute.db" "SELECT count(*) FROM jobs WHERE doc_id LIKE 'fd-2%' AND state IN (0, 1)")
  [ "$pending" = 0 ] && break
  sleep 1
done
nfail=$(sqlite3 "$CB_DATA_DIR/precompute.db" "SELECT count(*) FROM jobs WHERE doc_id LIKE 'fd-2%' AND state = 3")
if [ "$nfail" -gt 0 ]; then
  fail "$nfail acknowledged documents failed on the full disk and stay failed after the space came back (no retry by the service)"
  LOST_BEFORE_RETRY=$nfail
  retried=$(retry_failed "$T/ack-kv.txt")
  note "$nfail acknowledged jobs failed on ENOSPC and were not retried by cb-precompute; a client re-ingest of them ($retried) finished them"
fi
# verify_docs counts what is still not done after the retry as lost; before the retry they were lost to a
# client that does not retry, which the FAIL above records
verify_docs "$T/ack-kv.txt" 60
[ "${LOST_BEFORE_RETRY:-0}" -gt 0 ] && LOST=$((LOST + LOST_BEFORE_RETRY))
kv_whole "after the space came back"
up "after the space came back"
ok_again "after the space came back"
faults_row_end

# --- dbfull: no room at all -----------------------------------------------------------------------------
faults_row_begin dbfull
fill_to 0
ingest_docs "$T/ack-db.txt" 2100 3
acked=0; [ -f "$T/ack-db.txt" ] && acked=$(wc -l <"$T/ack-db.txt")
refused=0; [ -f "$T/ack-db.txt.nak" ] && refused=$(wc -l <"$T/ack-db.txt.nak")
if [ "$refused" -gt 0 ]; then
  msg=$(head -1 "$T/ack-db.txt.nak" | cut -d' ' -f2-)
  if echo "$msg" | grep -qiE "full|space|disk"; then pass "ingest refused up front on a full disk: $msg"
  else fail "ingest refused on a full disk without saying why: '$msg'"; fi
fi
note "$acked acknowledged, $refused refused with no space at all"
up "disk full"
degraded_check "disk full"
out=$(cbctl query --mode blend --k 1 'When was Brisket Station opened?' 2>&1); rc=$?
check "disk full: a query over cached chunks is answered as before" "$rc/$out" "0/${REF[rag-blend]}"
unfill
sleep 2
nfail=$(sqlite3 "$CB_DATA_DIR/precompute.db" "SELECT count(*) FROM jobs WHERE doc_id LIKE 'fd-21%' AND state = 3")
if [ "$nfail" -gt 0 ]; then
  fail "$nfail documents acknowledged on the full disk failed"
  LOST=$((LOST + nfail)); retry_failed "$T/ack-db.txt" >/dev/null
fi
verify_docs "$T/ack-db.txt" 60
# the refused ones can be sent again now
: >"$T/ack-db2.txt"
while read -r doc _; do ingest_docs "$T/ack-db2.txt" "${doc#fd-}" 1; done <"$T/ack-db.txt.nak" 2>/dev/null
verify_docs "$T/ack-db2.txt" 60
kv_whole "after the space came back"
db_checks
up "after the space came back"
ok_again "after the space came back"
faults_row_end

# --- allfull: documents acknowledged, then the disk fills up while they are processed ---------------------
faults_row_begin allfull
unfill
# a long document first (12 paragraphs: several seconds of work), so that the worker is busy with it when
# the disk fills up right after the next four are acknowledged: they all meet the full disk (KV files and
# job table alike) in the queue, deterministically
big=""
for p in $(seq 1 6); do big="$big$(make_doc $((2290 + p)) | sed "s/zq$((2290 + p))x/zq2290x/g")"$'\n\n'; done
out=$("$SEND" --timeout 3000 "$CB_PRECOMPUTE_ENDPOINT" "$(jq -cn --arg t "$big" '{type: "ingest", doc_id: "fd-2290", text: $t}')")
[ "$(jget "$out" ok)" = true ] && echo "fd-2290 $(jget "$out" job)" >>"$T/ack-all.txt"
ingest_docs "$T/ack-all.txt" 2200 4
fill_to 0
w0=$(grep -c . "$T/precompute.log")
c0=$(awk '{ print $14 + $15 }' "/proc/${SVC_PID[precompute]}/stat")
sleep 5
c1=$(awk '{ print $14 + $15 }' "/proc/${SVC_PID[precompute]}/stat")
states=$(sqlite3 "$CB_DATA_DIR/precompute.db" "SELECT group_concat(state, ',') FROM jobs WHERE doc_id LIKE 'fd-22%' OR doc_id = 'fd-2290'")
cpu_ms=$(( (c1 - c0) * 10 )) lines=$(( $(grep -c . "$T/precompute.log") - w0 ))
note "5 s on a full disk: job states ${states:-none} (0 queued, 1 running, 2 done, 3 failed); cb-precompute used $cpu_ms ms of CPU and wrote $lines log lines"
if [ "$cpu_ms" -gt 1000 ] || [ "$lines" -gt 20 ]; then
  fail "cb-precompute retries a job on a full disk without back-off: $cpu_ms ms of CPU and $lines log lines in 5 s (the job is taken up again at once, over and over)"
fi
up "disk full while processing"
kv_whole "disk full while processing"
degraded_check "disk full while processing"
unfill
sleep 2
nfail=$(sqlite3 "$CB_DATA_DIR/precompute.db" "SELECT count(*) FROM jobs WHERE (doc_id LIKE 'fd-22%' OR doc_id = 'fd-2290') AND state = 3")
if [ "$nfail" -gt 0 ]; then
  fail "$nfail acknowledged documents failed when the disk filled up under them"
  LOST=$((LOST + nfail)); retry_failed "$T/ack-all.txt" >/dev/null
fi
verify_docs "$T/ack-all.txt" 60
kv_whole "after the space came back"
up "after the space came back"
ok_again "after the space came back"
faults_row_end

# --- kvwrite: cb-blend writes the KV of chunks it computes, on a full disk --------------------------------
faults_row_begin kvwrite
N1="The Varrow Tunnel under the Esk estuary was dug by hand between 1902 and 1911 by miners from Ledbury."
N2="The Varrow Tunnel is 3.2 kilometres long and carried trams until 1958, when buses replaced them."
QN="Who dug the Varrow Tunnel?"
refn=$(rag --mode blend --context "$N1" --context "$N2" "$QN")
fill_to 0
m0=$(stack_stat blend cache_misses)
out=$(timeout 60 "$CBCTL" query --mode blend --context "$N1" --context "$N2" "$QN" 2>"$T/q.err"); rc=$?
classify kvwrite "$rc" 0 <(echo "$out") "$T/q.err"
check "disk full: a blend query whose chunks must be computed is answered as in process" "$rc/$out" "0/$refn"
note "blend misses during the full disk: $(( $(stack_stat blend cache_misses) - m0 ))"
sleep 2
kv_whole "after cb-blend's writes on the full disk"
up "blend on the full disk"
degraded_check "blend on the full disk"
unfill
# the memory tier holds the chunks now; a restart empties it, so the next query computes them again and,
# with room on the disk, writes their files; after another restart the query must read those files
svc_stop blend
stack_start blend || faults_finish
out=$(timeout 60 "$CBCTL" query --json --mode blend --context "$N1" --context "$N2" "$QN" 2>"$T/q.err"); rc=$?
classify kvwrite "$rc" 0 <(echo "$out") "$T/q.err"
check "space back: the same answer" "$rc/$(echo "$out" | head -n -1)" "0/$refn"
nfiles=0
for cid in $(echo "$out" | tail -n 1 | jq -r '.chunk_ids[]?'); do [ -f "$KV/${cid:0:2}/$cid.kv" ] && nfiles=$((nfiles + 1)); done
check "space back: both chunks' KV files written" "$nfiles" 2
svc_stop blend
stack_start blend || faults_finish
h0=$(stack_stat blend cache_hits)
out=$(timeout 60 "$CBCTL" query --mode blend --context "$N1" --context "$N2" "$QN" 2>"$T/q.err"); rc=$?
classify kvwrite "$rc" 0 <(echo "$out") "$T/q.err"
check "after a restart: the same answer, both chunks read from their files" "$rc/$out/$(( $(stack_stat blend cache_hits) - h0 ))" "0/$refn/2"
kv_whole "after the space came back"
faults_row_end

# --- truncated: a KV file cut in half is a miss ---------------------------------------------------------
faults_row_begin truncated
svc_stop blend
# the file of the chunk the retrieval query reads (its top hit)
cid=$("$SEND" "$CB_RETRIEVER_ENDPOINT" '{"type":"search","query":"When was Brisket Station opened?","k":1}' | jq -r '.hits[0].chunk_id')
f="$KV/${cid:0:2}/$cid.kv"
size=$(stat -c %s "$f" 2>/dev/null || echo 0)
[ "$size" -gt 0 ] || fail "no KV file for chunk $cid"
truncate -s $((size / 2)) "$f"
stack_start blend || faults_finish
c0=$(stack_stat blend cache_misses)
r=$(query_run rag-blend 60); classify rag-blend "${r%% *}" "${r##* }" "$T/q.out" "$T/q.err"
check "a truncated KV file: the answer is unchanged" "$(cat "$T/q.out")" "${REF[rag-blend]}"
misses=$(( $(stack_stat blend cache_misses) - c0 ))
[ "$misses" -ge 1 ] && pass "the truncated file was a miss ($misses), corrupt $(stack_stat blend cache_corrupt)" \
  || fail "the truncated file was not a miss (misses $misses)"
sleep 1
[ "$(stat -c %s "$f")" = "$size" ] && pass "the file was written again whole ($size bytes)" || note "the file has $(stat -c %s "$f" 2>/dev/null) bytes after the query"
kv_whole "after the truncated file was read"
up "truncated KV file"
faults_row_end
faults_finish
c0=$(stack_stat blend cache_misses)
for l in rag-blend ctx-blend; do
  r=$(query_run "$l" 60); classify "$l" "${r%% *}" "${r##* }" "$T/q.out" "$T/q.err"
done
# every sample chunk once more, so the cut file is certainly asked for
for q in "Who designed the Kettleby Lighthouse?" "Who founded the Quillon Chamber Orchestra?" "What is Oraka?" "When was Brisket Station opened?"; do
  timeout 60 "$CBCTL" query --mode blend --k 3 "$q" >/dev/null 2>&1 || true
done
note "misses after the cut: $(( $(stack_stat blend cache_misses) - c0 )), corrupt $(stack_stat blend cache_corrupt)"
kv_whole "after the truncated file was read"
up "truncated KV file"
faults_row_end
faults_finish
