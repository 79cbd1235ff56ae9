#!/usr/bin/env bash
# Integration test of cbctl health and stats against real cb-retriever and cb-cacheindex processes
# (cb-precompute and cb-blend are pointed at free ports where nothing listens): exit codes, the DOWN
# report, --json output, service selection, -q, usage errors.
. "$(dirname "$0")/lib/svc.bash"
svc_setup
svc_need build/bin/cb-retriever build/bin/cb-cacheindex build/bin/cbctl build/bin/cb-send

for s in RETRIEVER CACHEINDEX PRECOMPUTE BLEND; do export CB_${s}_ENDPOINT=tcp://127.0.0.1:$(svc_free_port); done
export CB_CBCTL_HEALTH_TIMEOUT_MS=500
svc_start retriever build/bin/cb-retriever
svc_start cacheindex build/bin/cb-cacheindex
svc_wait_ping "$CB_RETRIEVER_ENDPOINT" || svc_finish
svc_wait_ping "$CB_CACHEINDEX_ENDPOINT" || svc_finish
CBCTL=build/bin/cbctl

out=$($CBCTL health 2>&1); rc=$?
check "health with two services down: exit 3" "$rc" "3"
check "health lists precompute as DOWN" "$(echo "$out" | grep -c '^precompute  DOWN.*unavailable')" "1"
check "health lists retriever as ok" "$(echo "$out" | grep -c '^retriever   ok')" "1"
check "health summary" "$(echo "$out" | tail -1)" "2 of 4 services answer"
$CBCTL health retriever cacheindex >/dev/null; check "health of the two running services: exit 0" "$?" "0"
out=$($CBCTL -q health); rc=$?
check "-q prints nothing" "$out/$rc" "/3"
out=$($CBCTL health --json)
check "health --json: ok false" "$(jget "$out" ok)/$(jget "$out" up)/$(jget "$out" total)" "false/2/4"
check "health --json: service fields" "$(jget "$out" services.1.name)/$(jget "$out" services.1.service)" "cacheindex/cb-cacheindex"
check "health --json: error code" "$(jget "$out" services.3.code)" "unavailable"
out=$($CBCTL stats --json retriever cacheindex); rc=$?
check "stats --json of running services: exit 0" "$rc" "0"
check "stats --json fields" "$(jget "$out" retriever.chunks)/$(jget "$out" cacheindex.entries)/$(jget "$out" cacheindex.budget)" "0/0/2147483648"
out=$($CBCTL stats 2>/dev/null); rc=$?
check "stats with services down: exit 3" "$rc" "3"
check "stats prints the running ones" "$(echo "$out" | grep -c '^  service ')" "2"
$CBCTL stats --json blend >/dev/null 2>&1; check "stats of a down service: exit 3" "$?" "3"
$CBCTL health nosuch 2>/dev/null; check "unknown service: usage exit 2" "$?" "2"
$CBCTL frobnicate 2>/dev/null; check "unknown command: exit 2" "$?" "2"
$CBCTL --cbctl.nosuchkey=1 health 2>/dev/null; check "unknown config key: exit 2" "$?" "2"
$CBCTL help | grep -q "health" && echo "ok: help lists commands" || { echo "FAIL: help"; FAILS=$((FAILS+1)); }
# a flag override beats the environment
$CBCTL --retriever.endpoint="tcp://127.0.0.1:$(svc_free_port)" health retriever >/dev/null
check "flag override of an endpoint (to a dead port): exit 3" "$?" "3"
svc_stop retriever
$CBCTL health retriever >/dev/null 2>&1; check "after the retriever stops: exit 3" "$?" "3"
svc_stop cacheindex
svc_finish
