#!/usr/bin/env bash
# tests/faults/sigstop.sh: SIGSTOP / SIGCONT of every service (a frozen process: the socket stays open but
# nothing answers), CB_FAULTS_ROUNDS rounds each (default 2), each freeze 3-5 s long (seeded), while an ingest and
# a series of queries run. Checks:
#   - while it is stopped, a health probe reports it down in bounded time (cbctl health exits non-zero within
#     5 s; the gateway's own probe times out at the client), and the queries sent then end with a clear error
#     (cbctl: cb-blend's heartbeats stop, "no answer" after 3 intervals) or are answered once it resumes;
#     none hangs past its 30 s bound;
#   - after SIGCONT every service answers again and the reference queries give the answers of before;
#   - every acknowledged document is processed exactly once.
. "$(dirname "$0")/lib/faults.bash"
faults_begin sigstop
ROUNDS=${CB_FAULTS_ROUNDS_STOP:-2}
[ "$FAULTS_QUICK" = 1 ] && ROUNDS=1
stack_start_all || faults_finish
stack_start_gateway || faults_finish
cbctl ingest --wait data/sample >/dev/null 2>&1 || fail "ingest of data/sample"
ref_queries_define
ref_queries_record
http_ref_record

next=1000
for svc in retriever cacheindex precompute blend gateway; do
  faults_row_begin "$svc"
  points="" probes=""
  via=zmq; [ "$svc" = gateway ] && via=http
  for r in $(seq 1 "$ROUNDS"); do
    ingest_docs "$T/ack-$svc.txt" "$next" 4 "$via" &
    di=$!
    if [ "$svc" = gateway ]; then http_query_driver "$T/q-$svc-$r" 3 30 &
    else query_driver "$T/q-$svc-$r" 3 30 & fi
    dq=$!
    d=$(rand_between 100 800)
    len=$(rand_between 3000 5000)
    ms_sleep "$d"
    pid=${SVC_PID[$svc]}
    FAULTS_EXPECT_DEAD[$svc]=1
    kill -STOP "$pid"
    t0=$(now_ms)
    # the probe: the frozen service is reported, not waited for
    if [ "$svc" = gateway ]; then
      curl -s -o /dev/null --max-time 2 "$GW/health"; prc=$?
      [ "$prc" = 28 ] && pass "gateway stopped: its /health times out at the client (2 s)" || fail "gateway stopped: /health gave curl exit $prc"
    else
      timeout 10 "$CBCTL" health >"$T/health.out" 2>&1; prc=$?
      pms=$(( $(now_ms) - t0 ))
      if [ "$prc" != 0 ] && [ "$prc" != 124 ] && [ "$pms" -lt 5000 ]; then pass "cb-$svc stopped: cbctl health exits $prc in $pms ms"
      else fail "cb-$svc stopped: cbctl health exit $prc after $pms ms"; fi
      probes="${probes}${pms}ms "
    fi
    left=$(( len - ($(now_ms) - t0) ))
    [ "$left" -gt 0 ] && ms_sleep "$left"
    kill -CONT "$pid"
    unset "FAULTS_EXPECT_DEAD[$svc]"
    points="${points}${d}+${len} "
    wait "$di" "$dq"
    next=$((next + 4))
    classify_dir "$T/q-$svc-$r"
    health_all || fail "after SIGCONT of cb-$svc not every service answers ping"
    ref_queries_check
    if [ "$svc" = gateway ]; then http_query_driver "$T/qr-$svc-$r" 1 30; classify_dir "$T/qr-$svc-$r"; fi
    crash_check
  done
  verify_docs "$T/ack-$svc.txt" 90
  nak=0; [ -f "$T/ack-$svc.txt.nak" ] && nak=$(wc -l <"$T/ack-$svc.txt.nak")
  note "stops (ms after the start + length): ${points% }"
  [ -n "$probes" ] && note "cbctl health during the stop took ${probes% }"
  note "$nak of $((ROUNDS * 4)) documents not acknowledged (timed out while stopped)"
  faults_row_end
done
db_checks
faults_finish
