#!/usr/bin/env bash
# tests/integration/test_diskfull_health.sh: a full data disk is reported, not hidden. The data dir (the three
# databases and kv/) is a 16 MB tmpfs (root only: skipped, exit 77, without it), common.min_free_mb = 1; the
# four services (cb-precompute without a worker: precompute.workers = 0, so no model is loaded there) and
# cb-gateway run on it:
#   1. room on the disk: every ping says status ok, cbctl health exits 0, the gateway's /health is 200 "ok";
#   2. a filler file leaves nothing: every ping says degraded with a reason naming the disk (the data dir's
#      path, statvfs), cbctl health prints "degraded" and the reason and exits 4, /health stays 200 with
#      "status": "degraded", the four names in "degraded" and each reason; an ingest is refused (the job table
#      cannot grow) and cb-precompute's reason adds that write;
#   3. the filler goes: the three other services are ok at once; cb-precompute stays degraded for its failed
#      write (common.disk_full_hold_s) until its next write succeeds (an ingest), then all are ok again:
#      cbctl health exits 0 and /health is "ok".
. "$(dirname "$0")/lib/stack.bash"
stack_setup
if [ "$(id -u)" != 0 ]; then echo "skip: a tmpfs data disk needs root"; exit 77; fi
DATA=$CB_DATA_DIR
mount -t tmpfs -o size=16m tmpfs "$DATA" 2>/dev/null || { echo "skip: cannot mount a tmpfs on $DATA"; exit 77; }
# at exit: the services first (their files are on the tmpfs: the launcher stops them), then the mount, then
# the temp dir
stack_at_exit 'umount "$DATA" 2>/dev/null || umount -l "$DATA" 2>/dev/null'
svc_need build/bin/cb-gateway
export CB_COMMON_MIN_FREE_MB=1 CB_PRECOMPUTE_WORKERS=0 CB_CBCTL_HEALTH_TIMEOUT_MS=3000 CB_GATEWAY_HEALTH_TIMEOUT_MS=3000

# expect DESCRIPTION COMMAND...: the command must succeed
expect() { local what=$1; shift; if "$@"; then echo "ok: $what"; else echo "FAIL: $what"; FAILS=$((FAILS + 1)); fi; }

stack_start_all || exit 1
stack_start_gateway || exit 1

ping_of() { "$SEND" --timeout 3000 "$(stack_endpoint "$1")" '{"type":"ping"}' 2>/dev/null; }
health_json() { curl -s --max-time 10 -o "$T/health.json" -w '%{http_code}' "$GW/health"; }

# 1. room on the disk
for s in retriever cacheindex precompute blend; do
  check "room: cb-$s ping status" "$(jget "$(ping_of $s)" status)" ok
done
"$CBCTL" health >"$T/h.out" 2>&1; check "room: cbctl health exit" "$?" 0
code=$(health_json)
check "room: /health" "$code $(jq -r '.status' "$T/health.json")" "200 ok"

# 2. the disk full
avail=$(df -k --output=avail "$DATA" | tail -1)
fallocate -l $((avail * 1024)) "$DATA/filler" 2>/dev/null || dd if=/dev/zero of="$DATA/filler" bs=1K count="$avail" 2>/dev/null
echo "free on the data disk: $(df -k --output=avail "$DATA" | tail -1) KB"
for s in retriever cacheindex precompute blend; do
  p=$(ping_of $s)
  check "full: cb-$s ping status" "$(jget "$p" status)" degraded
  r=$(jget "$p" reason)
  expect "full: cb-$s reason names the disk ($r)" grep -q "data disk full: .* free on the file system of .*$DATA.*statvfs" <<<"$r"
  check "full: cb-$s disk_free_bytes under 1 MiB" "$(( $(jget "$p" disk_free_bytes) < 1048576 ))" 1
done
out=$("$SEND" --timeout 3000 "$CB_PRECOMPUTE_ENDPOINT" '{"type":"ingest","doc_id":"d1","text":"Some text for a chunk."}' 2>&1)
check "full: an ingest is refused" "$(jget "$out" ok)/$(jget "$out" error.code)" "false/internal"
r=$(jget "$(ping_of precompute)" reason)
expect "full: cb-precompute's reason adds the failed job table write ($r)" grep -q "a write to the job table failed .* ago: .*full" <<<"$r"
"$CBCTL" health >"$T/h.out" 2>&1; rc=$?
cat "$T/h.out"
check "full: cbctl health exit (every service answers, degraded)" "$rc" 4
check "full: cbctl health lines saying degraded with the disk" "$(grep -c "degraded .*data disk full: .*$DATA" "$T/h.out")" 4
check "full: cbctl health summary" "$(tail -n 1 "$T/h.out")" "4 of 4 services answer, 4 degraded"
"$CBCTL" health --json precompute >"$T/h.json" 2>&1
check "full: cbctl health --json" "$(jq -r '[.status, .degraded, .services[0].status] | join(" ")' "$T/h.json")" "degraded 1 degraded"
code=$(health_json)
jq -c . "$T/health.json"
check "full: /health code and status" "$code $(jq -r '.status' "$T/health.json")" "200 degraded"
check "full: /health degraded services" "$(jq -r '.degraded | sort | join(",")' "$T/health.json")" "blend,cacheindex,precompute,retriever"
check "full: /health down services" "$(jq -r '.down | length' "$T/health.json")" 0
check "full: /health reasons naming the disk" \
  "$(jq -r '.services[] | select(.status == "degraded") | .reason' "$T/health.json" | grep -c "data disk full: .*$DATA")" 4

# 3. room again
rm -f "$DATA/filler"
for s in retriever cacheindex blend; do
  check "room again: cb-$s ping status" "$(jget "$(ping_of $s)" status)" ok
done
p=$(ping_of precompute)
check "room again: cb-precompute still degraded for its failed write" "$(jget "$p" status)" degraded
expect "room again: only the failed write is left in the reason" grep -qv "statvfs" <<<"$(jget "$p" reason)"
"$CBCTL" health >"$T/h.out" 2>&1; check "room again, before a write: cbctl health exit" "$?" 4
out=$("$SEND" --timeout 3000 "$CB_PRECOMPUTE_ENDPOINT" '{"type":"ingest","doc_id":"d1","text":"Some text for a chunk."}' 2>&1)
check "room again: the ingest is acknowledged" "$(jget "$out" ok)" true
check "room again: cb-precompute ping status after a write" "$(jget "$(ping_of precompute)" status)" ok
"$CBCTL" health >"$T/h.out" 2>&1; check "room again: cbctl health exit" "$?" 0
check "room again: cbctl health summary" "$(tail -n 1 "$T/h.out")" "4 of 4 services answer"
code=$(health_json)
check "room again: /health" "$code $(jq -r '.status' "$T/health.json") $(jq -r '.degraded | length' "$T/health.json")" "200 ok 0"
grep -q "degraded: data disk full" "$T/retriever.log" && grep -q "the data disk has room again" "$T/retriever.log" \
  && echo "ok: cb-retriever logged the change both ways" || { echo "FAIL: cb-retriever's log"; FAILS=$((FAILS + 1)); }
svc_finish
