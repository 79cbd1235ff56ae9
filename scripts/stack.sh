#!/usr/bin/env bash
# scripts/stack.sh start|stop|status|restart: the four cacheblend services and the HTTP gateway
# (cb-gateway, gateway.listen: 127.0.0.1:8000 by default; CB_STACK_GATEWAY=0 leaves it out) in the
# background on this host.
#
# CB_STACK_BLEND_WORKERS=N (N > 0; default 0: one cb-blend as before) runs cb-router (docs/router.md)
# where cb-blend would listen (blend.endpoint, so clients need no change: $CB_BLEND_ENDPOINT, default
# tcp://127.0.0.1:5555) and N cb-blend workers (blend-1..blend-N) connected to its back end
# ($CB_ROUTER_WORKERS_ENDPOINT, default tcp://127.0.0.1:5557).
#
# State lives under $CB_DATA_DIR (default ./var): run/<service>.pid, log/<service>.log, the databases and
# the KV directory (the services' own config keys, relative to data_dir). Configuration: $CB_CONFIG or
# config/cacheblend.cfg, with the usual CB_<SECTION>_<KEY> environment overrides (they are passed on).
#
#   start    starts the services that are not running, then waits until `cbctl health` passes (every service
#            answers: ok, or degraded by a full data disk, which is then shown) and the
#            model-loading workers (precompute, blend) are ready; exit 1 if they do not come up in
#            $CB_STACK_START_TIMEOUT seconds (default 120), with the tail of the failing log
#   stop     SIGTERM to each (blend, precompute, cacheindex, retriever), waits up to
#            $CB_STACK_STOP_TIMEOUT seconds (default 30) each, then SIGKILL with a warning
#   status   each service's pid (or "stopped"), then `cbctl health`; exit 0 only when all four answer ok
#            (4: they answer, one or more degraded)
#   restart  stop, then start
set -u
cd "$(dirname "$0")/.."
ROOT=$(pwd)
export CB_DATA_DIR=${CB_DATA_DIR:-var}
RUN="$CB_DATA_DIR/run"
LOG="$CB_DATA_DIR/log"
SERVICES=(retriever cacheindex precompute blend)
WORKERS=${CB_STACK_BLEND_WORKERS:-0}
case "$WORKERS" in ''|*[!0-9]*) echo "stack: CB_STACK_BLEND_WORKERS must be a number" >&2; exit 2 ;; esac
if [ "$WORKERS" -gt 0 ]; then
  SERVICES=(retriever cacheindex precompute router)
  for ((i = 1; i <= WORKERS; i++)); do SERVICES+=("blend-$i"); done
  export CB_BLEND_ENDPOINT=${CB_BLEND_ENDPOINT:-tcp://127.0.0.1:5555}
  export CB_ROUTER_ENDPOINT=$CB_BLEND_ENDPOINT
  export CB_ROUTER_WORKERS_ENDPOINT=${CB_ROUTER_WORKERS_ENDPOINT:-tcp://127.0.0.1:5557}
fi
[ "${CB_STACK_GATEWAY:-1}" != 0 ] && SERVICES+=(gateway)
BIN="$ROOT/build/bin"
CBCTL="$BIN/cbctl"

die() { echo "stack: $*" >&2; exit 1; }

# the program of a service name (blend-2 is a cb-blend worker)
prog() { case "$1" in blend-*) echo blend ;; *) echo "$1" ;; esac; }

# pid of a running service, or nothing (a stale pid file is removed)
svc_pid() {
  local f="$RUN/$1.pid" pid
  [ -f "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null)
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q "cb-$(prog "$1")" "/proc/$pid/cmdline" 2>/dev/null; then
    echo "$pid"; return 0
  fi
  rm -f "$f"; return 1
}

# true once cb-gateway has a listening socket (ss from iproute2; without it, once it is running)
gateway_listening() {
  local pid
  pid=$(svc_pid gateway) || return 1
  command -v ss >/dev/null || return 0
  ss -Hltnp 2>/dev/null | grep -q "pid=$pid,"
}

start() {
  for s in "${SERVICES[@]}" cbctl; do
    local b="$BIN/cb-$(prog "$s")"; [ "$s" = cbctl ] && b="$CBCTL"
    [ -x "$b" ] || die "$b is missing: run make first"
  done
  mkdir -p "$RUN" "$LOG" || die "cannot create $RUN and $LOG"
  for s in "${SERVICES[@]}"; do
    if pid=$(svc_pid "$s"); then echo "stack: cb-$s already running (pid $pid)"; continue; fi
    if [[ $s == blend-* ]]; then
      CB_BLEND_ROUTER=$CB_ROUTER_WORKERS_ENDPOINT nohup "$BIN/cb-blend" >>"$LOG/$s.log" 2>&1 </dev/null &
    else
      nohup "$BIN/cb-$s" >>"$LOG/$s.log" 2>&1 </dev/null &
    fi
    echo $! >"$RUN/$s.pid"
    echo "stack: started cb-$s (pid $!, log $LOG/$s.log)"
  done
  local limit=${CB_STACK_START_TIMEOUT:-120} t0=$SECONDS hrc=0
  while :; do
    for s in "${SERVICES[@]}"; do
      svc_pid "$s" >/dev/null || { echo "stack: cb-$s exited; the end of $LOG/$s.log:" >&2; tail -n 15 "$LOG/$s.log" >&2; exit 1; }
    done
    if [ "${SERVICES[-1]}" = gateway ] && ! gateway_listening; then
      :  # the gateway has not bound its address yet
    elif hrc=0; "$CBCTL" -q health 2>/dev/null || hrc=$?; [ "$hrc" = 0 ] || [ "$hrc" = 4 ]; then  # 4: degraded
      local ready=0
      for s in precompute blend; do
        "$CBCTL" stats "$s" 2>/dev/null | grep -q "worker_ready *true" && ready=$((ready + 1))
      done
      # behind the router: every worker ready
      [ "$WORKERS" -gt 0 ] && ! "$CBCTL" stats blend 2>/dev/null | grep -q "workers_ready *$WORKERS\$" && ready=0
      [ $ready -eq 2 ] && break
    fi
    [ $((SECONDS - t0)) -ge "$limit" ] && { "$CBCTL" health >&2; die "the stack did not come up within $limit s (logs in $LOG)"; }
    sleep 0.5
  done
  echo "stack: up in $((SECONDS - t0)) s (data in $CB_DATA_DIR)"
  [ "$hrc" = 4 ] && { echo "stack: warning: degraded (a full data disk):" >&2; "$CBCTL" health 2>&1 | grep degraded >&2; }
  return 0
}

stop() {
  local limit=${CB_STACK_STOP_TIMEOUT:-30} pid i s rc=0
  for ((i = ${#SERVICES[@]} - 1; i >= 0; i--)); do
    s=${SERVICES[$i]}
    pid=$(svc_pid "$s") || { echo "stack: cb-$s not running"; continue; }
    kill -TERM "$pid" 2>/dev/null
    local t0=$SECONDS
    while kill -0 "$pid" 2>/dev/null && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then
      echo "stack: cb-$s (pid $pid) ignored SIGTERM for $limit s: killing it" >&2
      kill -KILL "$pid" 2>/dev/null; rc=1
    else
      echo "stack: stopped cb-$s (pid $pid)"
    fi
    rm -f "$RUN/$s.pid"
  done
  return $rc
}

status() {
  local s pid
  for s in "${SERVICES[@]}"; do
    if pid=$(svc_pid "$s"); then printf 'cb-%-11s running (pid %s)\n' "$s" "$pid"
    else printf 'cb-%-11s stopped\n' "$s"; fi
  done
  [ -x "$CBCTL" ] || die "$CBCTL is missing: run make first"
  "$CBCTL" health
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  restart) stop; start ;;
  *) echo "usage: scripts/stack.sh start|stop|status|restart   (state under \$CB_DATA_DIR, default ./var)" >&2; exit 2 ;;
esac
