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
#   start    starts the services that are not running, then waits until each answers (ping from that
#            process; the gateway: its HTTP port listens) and the model-loading workers (precompute, blend; the
#            router: all N workers) are ready, then shows a degraded service (a full data disk) from
#            `cbctl health`; exit 1 if one does not come up within $CB_STACK_START_TIMEOUT seconds (default
#            120), with the tail of its log
#   stop     SIGTERM to each (blend, precompute, cacheindex, retriever), waits up to
#            $CB_STACK_STOP_TIMEOUT seconds (default 30) each, then SIGKILL with a warning
#   status   each service's pid (or "stopped"), then `cbctl health`; exit 0 only when all four answer ok
#            (4: they answer, one or more degraded)
#   restart  stop, then start
#
# A command line over the launcher the tests and benchmarks use too (scripts/lib/stack.bash), with its
# processes detached from this shell and found again through their pid files.
set -u
cd "$(dirname "$0")/.."
export CB_DATA_DIR=${CB_DATA_DIR:-var}
STACK_DETACH=1
STACK_RUN="$CB_DATA_DIR/run"
STACK_LOGS="$CB_DATA_DIR/log"
STACK_FAIL="stack: "
STACK_READY_S=${CB_STACK_START_TIMEOUT:-120}
. scripts/lib/stack.bash
SERVICES=(retriever cacheindex precompute blend)
WORKERS=${CB_STACK_BLEND_WORKERS:-0}
case "$WORKERS" in ''|*[!0-9]*) echo "stack: CB_STACK_BLEND_WORKERS must be a number" >&2; exit 2 ;; esac
if [ "$WORKERS" -gt 0 ]; then
  SERVICES=(retriever cacheindex precompute router)
  for ((i = 1; i <= WORKERS; i++)); do SERVICES+=("blend-$i"); done
  export CB_BLEND_ENDPOINT=${CB_BLEND_ENDPOINT:-tcp://127.0.0.1:5555}
  export CB_ROUTER_ENDPOINT=$CB_BLEND_ENDPOINT
  export CB_ROUTER_WORKERS_ENDPOINT=${CB_ROUTER_WORKERS_ENDPOINT:-tcp://127.0.0.1:5557}
  STACK_ROUTER_WORKERS=$WORKERS
fi
[ "${CB_STACK_GATEWAY:-1}" != 0 ] && SERVICES+=(gateway)
CBCTL="$STACK_BIN/cbctl"

die() { echo "stack: $*" >&2; exit 1; }

# the program of a service name (blend-2 is a cb-blend worker)
prog() { case "$1" in blend-*) echo blend ;; *) echo "$1" ;; esac; }

start() {
  local s pid t0=$SECONDS hrc=0
  for s in "${SERVICES[@]}" cbctl; do
    local b="$STACK_BIN/cb-$(prog "$s")"; [ "$s" = cbctl ] && b="$CBCTL"
    [ -x "$b" ] || die "$b is missing: run make first"
  done
  mkdir -p "$STACK_RUN" "$STACK_LOGS" || die "cannot create $STACK_RUN and $STACK_LOGS"
  stack_config_endpoints   # the endpoints the services will bind, from the configuration
  for s in "${SERVICES[@]}"; do
    if pid=$(svc_pid "$s"); then echo "stack: cb-$s already running (pid $pid)"; continue; fi
    stack_launch "$s"
    echo "stack: started cb-$s (pid ${SVC_PID[$s]}, log $STACK_LOGS/$s.log)"
  done
  for s in "${SERVICES[@]}"; do
    stack_ready "$s" || { "$CBCTL" health >&2; die "cb-$s did not come up (logs in $STACK_LOGS)"; }
  done
  "$CBCTL" -q health 2>/dev/null || hrc=$?
  echo "stack: up in $((SECONDS - t0)) s (data in $CB_DATA_DIR)"
  [ "$hrc" = 4 ] && { echo "stack: warning: degraded (a full data disk):" >&2; "$CBCTL" health 2>&1 | grep degraded >&2; }
  return 0
}

stop() {
  local limit=${CB_STACK_STOP_TIMEOUT:-30} pid i s rc=0
  for ((i = ${#SERVICES[@]} - 1; i >= 0; i--)); do
    s=${SERVICES[$i]}
    pid=$(svc_pid "$s") || { echo "stack: cb-$s not running"; continue; }
    if stack_stop "$s" "$limit"; then echo "stack: stopped cb-$s (pid $pid)"
    else echo "stack: cb-$s (pid $pid) ignored SIGTERM for $limit s: killed it" >&2; rc=1; fi
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
