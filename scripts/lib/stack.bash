# scripts/lib/stack.bash: the one launcher of cacheblend's processes (cb-retriever, cb-cacheindex,
# cb-precompute, cb-blend, cb-router and its cb-blend workers, cb-gateway, redis-server). Sourced by
# scripts/stack.sh (the command line over it), the benchmarks (scripts/bench-*.sh), the integration tests
# (tests/integration/lib/svc.bash) and the fault suite (tests/faults/lib/faults.bash), so that all of them
# pick ports, start, wait for and stop the services the same way. Not a program: source it.
#
#   . scripts/lib/stack.bash
#   stack_init "$TMP/var"            # CB_DATA_DIR, logs in $TMP/var/log, processes stopped at exit
#   stack_ports                      # free loopback ports for the four services (exported CB_*_ENDPOINT)
#   stack_start_all                  # the four, each waited for (ping; precompute and blend: model loaded)
#   stack_start_gateway              # cb-gateway on a free port; $GW = http://127.0.0.1:PORT
#   stack_stop blend                 # SIGTERM, SIGKILL after a bound; the exit status in $STACK_RC
#
# Configuration is the services' own: config/cacheblend.cfg (or $CB_CONFIG) with CB_<SECTION>_<KEY>
# environment overrides; this file only exports such variables (endpoints, data_dir) and passes extra
# VAR=VALUE pairs to one process. Every wait here is bounded.
#
# Settings (variables; stack_init sets the first three):
#   STACK_LOGS     folder of the logs, NAME.log (appended to)
#   STACK_PORTS    file of the ports handed out so far by stack_free_port
#   STACK_RUN      folder of pid files NAME.pid ("" = none; scripts/stack.sh finds its services with them)
#   STACK_DETACH   1: processes outlive this shell (nohup, no stop at exit; scripts/stack.sh)
#   STACK_READY_S  seconds a service may take to answer and load its model (default 60)
#   STACK_STOP_S   seconds between SIGTERM and SIGKILL in stack_stop (default 10)
#   STACK_FAIL     prefix of the failure messages (stderr; default "FAIL: ")
#   STACK_NEED     a command run with a program's path (relative to the repository) before it is started
#                  when it is not there (the tests build it or skip)
# State: SVC_PID[NAME] the pid of each process this shell started; STACK_AT_EXIT, the commands the exit
# trap runs after stopping them (stack_at_exit CMD).
#
# Names: a process has a NAME (its log and pid file); stack_launch/stack_start/stack_ready take the
# service (retriever cacheindex precompute blend router gateway redis; blend-N: a worker of cb-router) and
# optionally another NAME, so that two instances of one service can run (stack_start blend blend2).
# The functions run with errexit off (`local -; set +e`): callers under `set -e` get their return status.

[ -n "${STACK_LIB_LOADED:-}" ] && return 0
STACK_LIB_LOADED=1
STACK_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STACK_BIN=${STACK_BIN:-$STACK_ROOT/build/bin}
STACK_SEND="$STACK_BIN/cb-send"
STACK_LOGS=${STACK_LOGS:-}
STACK_PORTS=${STACK_PORTS:-}
STACK_RUN=${STACK_RUN:-}
STACK_DETACH=${STACK_DETACH:-0}
STACK_RC=""
STACK_SERVICES=(retriever cacheindex precompute blend)
STACK_AT_EXIT=()
declare -gA SVC_PID=()
STACK_JQ=$(command -v jq || true)

stack_fail() { echo "${STACK_FAIL-FAIL: }$*" >&2; }

# stack_init DATA_DIR [LOG_DIR]: exports CB_DATA_DIR=DATA_DIR (made), logs in LOG_DIR (default DATA_DIR/log),
# and (unless STACK_DETACH=1) the exit trap that stops every process started here and runs STACK_AT_EXIT.
stack_init() {
  local -; set +e
  export CB_DATA_DIR=$1
  STACK_LOGS=${2:-$1/log}
  STACK_PORTS="$STACK_LOGS/.ports"
  mkdir -p "$CB_DATA_DIR" "$STACK_LOGS" || { stack_fail "cannot create $CB_DATA_DIR and $STACK_LOGS"; return 1; }
  if [ "$STACK_DETACH" != 1 ]; then
    trap stack_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
  fi
}

# stack_at_exit COMMAND: run by the exit trap after the processes are stopped (last added, first run).
stack_at_exit() { STACK_AT_EXIT+=("$1"); }

# stack_kill_all [SECONDS]: SIGCONT and SIGTERM to every process started here, SIGKILL to those still
# running after SECONDS (default 5, all together), every one reaped.
stack_kill_all() {
  local -; set +e
  local limit=${1:-5} name pid i alive
  for name in "${!SVC_PID[@]}"; do
    kill -CONT "${SVC_PID[$name]}" 2>/dev/null; kill -TERM "${SVC_PID[$name]}" 2>/dev/null
  done
  for ((i = 0; i < limit * 10; i++)); do
    alive=0
    for name in "${!SVC_PID[@]}"; do kill -0 "${SVC_PID[$name]}" 2>/dev/null && { alive=1; break; }; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for name in "${!SVC_PID[@]}"; do
    pid=${SVC_PID[$name]}
    kill -KILL "$pid" 2>/dev/null
    wait "$pid" 2>/dev/null
    [ -n "$STACK_RUN" ] && rm -f "$STACK_RUN/$name.pid"
  done
  SVC_PID=()
  return 0
}

# stack_cleanup: the exit trap: stack_kill_all, then STACK_AT_EXIT.
stack_cleanup() {
  local -; set +e
  local i
  stack_kill_all
  for ((i = ${#STACK_AT_EXIT[@]} - 1; i >= 0; i--)); do eval "${STACK_AT_EXIT[$i]}"; done
  STACK_AT_EXIT=()
  return 0
}

# ------------------------------------------------------------------------------------------------ ports

# stack_free_port: a free loopback port below the kernel's ephemeral range (32768+ on Linux), so that a
# client connecting to it while nothing listens can never connect to itself (TCP simultaneous open). Ports
# handed out before are in $STACK_PORTS: a port is picked once and bound later by the service, so two picks
# that both found it free would make two services race for it.
stack_free_port() {
  local -; set +e
  python3 - "$STACK_PORTS" <<'PY'
import random, socket, sys
path = sys.argv[1]
try:
    taken = set(int(x) for x in open(path).read().split()) if path else set()
except (OSError, ValueError):
    taken = set()
for _ in range(400):
    p = random.randint(20000, 32000)
    if p in taken:
        continue
    s = socket.socket()
    try:
        s.bind(("127.0.0.1", p))
    except OSError:
        continue
    finally:
        s.close()
    if path:
        with open(path, "a") as f:
            f.write("%d\n" % p)
    print(p)
    break
else:
    sys.exit("stack_free_port: no free loopback port found")
PY
}

# stack_ports [BASE]: exports the four services' endpoints (and cb-precompute's pull endpoint) on free
# loopback ports, or on BASE..BASE+4 (retriever, cacheindex, precompute, precompute pull, blend); the
# *_BIND overrides are unset, so each service binds its endpoint.
stack_ports() {
  local -; set +e
  local base=${1:-} v i=0 p
  for v in RETRIEVER_ENDPOINT CACHEINDEX_ENDPOINT PRECOMPUTE_ENDPOINT PRECOMPUTE_PULL_ENDPOINT BLEND_ENDPOINT; do
    if [ -n "$base" ]; then p=$((base + i)); else p=$(stack_free_port) || return 1; fi
    export "CB_$v=tcp://127.0.0.1:$p"
    i=$((i + 1))
  done
  unset CB_RETRIEVER_BIND CB_CACHEINDEX_BIND CB_PRECOMPUTE_BIND CB_PRECOMPUTE_PULL_BIND CB_BLEND_BIND
}

# stack_config_endpoints: exports the endpoints the configuration gives (config file and CB_* overrides,
# read through `cbctl health --json`) for those not already in the environment.
stack_config_endpoints() {
  local -; set +e
  local js s v
  js=$(CB_CBCTL_REQUEST_TIMEOUT_MS=50 CB_CBCTL_HEALTH_TIMEOUT_MS=50 "$STACK_BIN/cbctl" health --json 2>/dev/null) || true
  for s in "${STACK_SERVICES[@]}"; do
    v="CB_${s^^}_ENDPOINT"
    [ -n "${!v:-}" ] && continue
    export "$v=$(printf '%s' "$js" | python3 -c 'import json,sys
try: print(next(x["endpoint"] for x in json.load(sys.stdin)["services"] if x["name"] == sys.argv[1]))
except Exception: print("")' "$s")"
  done
}

# stack_endpoint SERVICE: its endpoint (blend-N and router: the router's, which clients reach as blend).
stack_endpoint() {
  local s=$1
  case $s in router|blend-*) s=blend ;; esac
  local v="CB_${s^^}_ENDPOINT"; echo "${!v:-}"
}

# stack_env_file FILE: the stack's CB_* environment (endpoints, data dir, ...), one VAR=VALUE a line.
stack_env_file() { env | grep -E '^CB_[A-Z0-9_]+=' | sort >"$1"; }

# ------------------------------------------------------------------------------------------------ processes

# svc_start NAME PROGRAM [VAR=VALUE...] [-- ARGS...]: runs PROGRAM in the background with the variables in
# its environment; log appended to $STACK_LOGS/NAME.log, pid in SVC_PID[NAME] (and $STACK_RUN/NAME.pid).
svc_start() {
  local -; set +e
  local name=$1 bin=$2; shift 2
  local envs=() args=()
  while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; args=("$@"); break; fi
    envs+=("$1"); shift
  done
  [ ! -x "$bin" ] && [ -n "${STACK_NEED:-}" ] && "$STACK_NEED" "${bin#"$STACK_ROOT"/}"
  mkdir -p "$STACK_LOGS"
  if [ "$STACK_DETACH" = 1 ]; then
    nohup env "${envs[@]}" "$bin" "${args[@]}" >>"$STACK_LOGS/$name.log" 2>&1 </dev/null &
  else
    env "${envs[@]}" "$bin" "${args[@]}" >>"$STACK_LOGS/$name.log" 2>&1 &
  fi
  SVC_PID[$name]=$!
  if [ -n "$STACK_RUN" ]; then mkdir -p "$STACK_RUN" && echo $! >"$STACK_RUN/$name.pid"; fi
  return 0
}

# svc_pid NAME: the pid of a process started by this shell, else of a running one in $STACK_RUN/NAME.pid
# (the program checked; a stale file is removed); false when there is none.
svc_pid() {
  local -; set +e
  local name=$1 f pid prog
  if [ -n "${SVC_PID[$name]:-}" ]; then echo "${SVC_PID[$name]}"; return 0; fi
  [ -n "$STACK_RUN" ] && f="$STACK_RUN/$name.pid" && [ -f "$f" ] || return 1
  pid=$(cat "$f" 2>/dev/null)
  prog="cb-${name%%-[0-9]*}"; [ "$name" = redis ] && prog=redis-server
  if [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null && grep -q "$prog" "/proc/$pid/cmdline" 2>/dev/null; then
    echo "$pid"; return 0
  fi
  rm -f "$f"; return 1
}

# svc_alive NAME: the process runs.
svc_alive() { local pid; pid=$(svc_pid "$1") && kill -0 "$pid" 2>/dev/null; }

# svc_log_tail NAME [LINES]: the end of its log (stderr), for a failure message.
svc_log_tail() { [ -f "$STACK_LOGS/$1.log" ] && tail -n "${2:-10}" "$STACK_LOGS/$1.log" | sed 's/^/    /' >&2; return 0; }

# stack_stop NAME [SECONDS]: SIGCONT + SIGTERM, SIGKILL after SECONDS (default STACK_STOP_S, 10); reaped.
# STACK_RC: its exit status (empty when it was not this shell's child). Returns 0 when it exited on
# SIGTERM (or was not running), 1 when it had to be killed.
stack_stop() {
  local -; set +e
  local name=$1 limit=${2:-${STACK_STOP_S:-10}} pid i child=0 rc=0
  STACK_RC=""
  [ -n "${SVC_PID[$name]:-}" ] && child=1
  pid=$(svc_pid "$name") || return 0
  kill -CONT "$pid" 2>/dev/null; kill -TERM "$pid" 2>/dev/null
  for ((i = 0; i < limit * 10; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null; rc=1; fi
  if [ "$child" = 1 ]; then wait "$pid" 2>/dev/null && STACK_RC=0 || STACK_RC=$?; fi
  unset "SVC_PID[$name]"
  [ -n "$STACK_RUN" ] && rm -f "$STACK_RUN/$name.pid"
  return $rc
}

# stack_kill9 NAME: SIGKILL, reaped, forgotten (no wait for anything else).
stack_kill9() {
  local -; set +e
  local pid=${SVC_PID[$1]:-}
  [ -n "$pid" ] && { kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null; }
  unset "SVC_PID[$1]"
  [ -n "$STACK_RUN" ] && rm -f "$STACK_RUN/$1.pid"
  return 0
}

# stack_stop_all [SECONDS]: stack_stop of every process started here, the last started first.
stack_stop_all() {
  local -; set +e
  local name rc=0
  for name in $(for n in "${!SVC_PID[@]}"; do echo "${SVC_PID[$n]} $n"; done | sort -rn | cut -d' ' -f2); do
    stack_stop "$name" "$@" || rc=1
  done
  return $rc
}

# ------------------------------------------------------------------------------------------------ probes

# stack_jget JSON PATH (also jget): the value at PATH (dot-separated; numbers index arrays); strings raw,
# others as JSON; "null" when absent. The launcher calls stack_jget, so a script's own jget cannot change it.
stack_jget() {
  local -; set +e
  if [ -n "$STACK_JQ" ]; then
    local path
    path=$(echo "$2" | awk -F. '{o=""; for(i=1;i<=NF;i++){ if($i ~ /^[0-9]+$/) o=o"["$i"]"; else o=o"[\""$i"\"]"}; print "."o}')
    printf '%s' "$1" | "$STACK_JQ" -r "${path} | if type == \"string\" then . else tojson end" 2>/dev/null || echo null
    return 0
  fi
  python3 -c '
import json, sys
try:
    v = json.loads(sys.argv[1])
except Exception:
    v = None
for p in sys.argv[2].split(".") if sys.argv[2] else []:
    try:
        v = v[int(p)] if isinstance(v, list) else v.get(p)
    except Exception:
        v = None
    if v is None: break
print(v if isinstance(v, str) else json.dumps(v, separators=(",", ":")))' "$1" "$2"
}

jget() { stack_jget "$@"; }

# svc_stats ENDPOINT: the service's stats reply ({} when it does not answer in 3 s).
svc_stats() { "$STACK_SEND" --timeout 3000 "$1" '{"type":"stats"}' 2>/dev/null || echo '{}'; }

# stack_stats SERVICE: svc_stats of its endpoint; stack_stat SERVICE FIELD: one field ("null" if none).
stack_stats() { svc_stats "$(stack_endpoint "$1")"; }
stack_stat() { stack_jget "$(stack_stats "$1")" "$2"; }

# svc_wait_ping ENDPOINT [SECONDS [PID]]: until the service answers ping (default 10 s); with PID, the
# process with that pid must answer, and it fails as soon as that process exits (a service that could not
# bind must not pass on another one's answer).
svc_wait_ping() {
  local -; set +e
  local ep=$1 limit=${2:-10} pid=${3:-} end out
  end=$((SECONDS + limit))
  while :; do
    if out=$("$STACK_SEND" --timeout 200 "$ep" '{"type":"ping"}' 2>/dev/null); then
      [ -z "$pid" ] && return 0
      [ "$(stack_jget "$out" pid)" = "$pid" ] && return 0
    fi
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
      stack_fail "the process for $ep (pid $pid) exited before it answered ping"; return 1
    fi
    [ "$SECONDS" -ge "$end" ] && break
    sleep 0.1
  done
  stack_fail "no ping answer from $ep${pid:+ by pid $pid} within ${limit}s"; return 1
}

# svc_poll NAME SECONDS COMMAND...: runs COMMAND every 0.1 s until it succeeds (0); 1 as soon as the process
# NAME has exited (said, with the end of its log); 2 after SECONDS (the caller says what did not happen).
svc_poll() {
  local name=$1 limit=$2 end; shift 2
  end=$((SECONDS + limit))
  while :; do
    "$@" && return 0
    if ! svc_alive "$name"; then stack_fail "$name exited; the end of its log:"; svc_log_tail "$name"; return 1; fi
    [ "$SECONDS" -ge "$end" ] && return 2
    sleep 0.1
  done
}

# The probes svc_poll runs: a stats field equal to a value (the last one read in SVC_GOT); a listening TCP
# socket of NAME's running process (ss from iproute2; without it, that it runs).
svc_stat_is() { SVC_GOT=$(stack_jget "$(svc_stats "$1")" "$2"); [ "$SVC_GOT" = "$3" ]; }
svc_listening() {
  local pid
  pid=$(svc_pid "$1") && kill -0 "$pid" 2>/dev/null || return 1
  command -v ss >/dev/null || return 0
  ss -Hltnp 2>/dev/null | grep -q "pid=$pid,"
}

# svc_wait_stat NAME ENDPOINT FIELD VALUE [SECONDS]: until FIELD of the stats at ENDPOINT is VALUE; fails at
# once when the process NAME exits (then the end of its log).
svc_wait_stat() {
  local -; set +e
  local name=$1 ep=$2 field=$3 want=$4 limit=${5:-${STACK_READY_S:-60}} rc
  SVC_GOT=""
  svc_poll "$name" "$limit" svc_stat_is "$ep" "$field" "$want"; rc=$?
  [ "$rc" -eq 2 ] && stack_fail "$name: stats $field is '$SVC_GOT', not '$want', after ${limit}s"
  [ "$rc" -eq 0 ]
}

# svc_wait_http NAME URL [SECONDS]: until URL answers HTTP at all (any status); fails when NAME exits.
svc_wait_http() {
  local -; set +e
  local name=$1 url=$2 limit=${3:-10} rc
  svc_poll "$name" "$limit" curl -s -o /dev/null --max-time 2 "$url"; rc=$?
  [ "$rc" -eq 2 ] && stack_fail "$name did not answer on $url within ${limit}s"
  [ "$rc" -eq 0 ]
}

# svc_wait_listen NAME [SECONDS]: until the process has a listening TCP socket (ss from iproute2; without
# it, as soon as it runs).
svc_wait_listen() {
  local -; set +e
  local name=$1 limit=${2:-10} rc
  svc_poll "$name" "$limit" svc_listening "$name"; rc=$?
  [ "$rc" -eq 2 ] && stack_fail "$name has no listening socket after ${limit}s"
  [ "$rc" -eq 0 ]
}

# ------------------------------------------------------------------------------------------------ services

# stack_launch SERVICE [NAME] [VAR=VALUE...]: starts it (build/bin/cb-SERVICE; blend-N: a cb-blend worker of
# the router at $CB_ROUTER_WORKERS_ENDPOINT) in the background, without waiting.
stack_launch() {
  local -; set +e
  local svc=$1 name=${2:-$1}; shift; [ $# -gt 0 ] && shift
  case $svc in
    blend-*|worker) svc_start "$name" "$STACK_BIN/cb-blend" CB_BLEND_ROUTER="${CB_ROUTER_WORKERS_ENDPOINT:-}" "$@" ;;
    redis) stack_launch_redis "$name" ;;
    *) svc_start "$name" "$STACK_BIN/cb-$svc" "$@" ;;
  esac
}

# stack_ready SERVICE [NAME]: waits until it serves: a ping answer from that process (20 s), and
# precompute, blend: its worker has loaded the model; router: $STACK_ROUTER_WORKERS workers (default 1) are
# ready; blend-N: it runs; gateway: it answers HTTP at $GW (or, with no CB_GATEWAY_LISTEN, it listens);
# redis: it answers PING. Bounded by STACK_READY_S (60 s) after the ping.
stack_ready() {
  local -; set +e
  local svc=$1 name=${2:-$1} ep pid
  pid=$(svc_pid "$name") || { stack_fail "$name is not running"; return 1; }
  case $svc in
    blend-*|worker) kill -0 "$pid" 2>/dev/null || { stack_fail "$name exited"; svc_log_tail "$name"; return 1; }; return 0 ;;
    gateway)
      if [ -n "${CB_GATEWAY_LISTEN:-}" ]; then svc_wait_http "$name" "http://$CB_GATEWAY_LISTEN/metrics" 10
      else svc_wait_listen "$name" 10; fi
      return ;;
    redis) stack_wait_redis "$name"; return ;;
  esac
  ep=$(stack_endpoint "$svc")
  svc_wait_ping "$ep" 20 "$pid" || { svc_log_tail "$name" 5; return 1; }
  case $svc in
    precompute|blend) svc_wait_stat "$name" "$ep" worker_ready true ;;
    router) svc_wait_stat "$name" "$ep" workers_ready "${STACK_ROUTER_WORKERS:-1}" ;;
  esac
}

# stack_start SERVICE [NAME] [VAR=VALUE...]: launch + ready.
stack_start() { stack_launch "$@" && stack_ready "$1" "${2:-$1}"; }

# stack_start_all [PREFIX]: the four services (logs PREFIX<service>), launched together, then each waited for.
stack_start_all() {
  local -; set +e
  local s p=${1:-}
  for s in "${STACK_SERVICES[@]}"; do stack_launch "$s" "$p$s"; done
  for s in "${STACK_SERVICES[@]}"; do stack_ready "$s" "$p$s" || return 1; done
}

# stack_start_router N [POLICY]: cb-router where cb-blend would listen (router.endpoint = blend.endpoint)
# and N cb-blend workers (blend-1..blend-N) on its back end (CB_ROUTER_WORKERS_ENDPOINT, a free port when
# unset); waits until the N are ready. POLICY: router.policy.
stack_start_router() {
  local -; set +e
  local n=$1 i
  [ -n "${2:-}" ] && export CB_ROUTER_POLICY=$2
  export CB_ROUTER_ENDPOINT=$CB_BLEND_ENDPOINT
  [ -n "${CB_ROUTER_WORKERS_ENDPOINT:-}" ] || export CB_ROUTER_WORKERS_ENDPOINT="tcp://127.0.0.1:$(stack_free_port)"
  stack_launch router
  for ((i = 1; i <= n; i++)); do stack_launch "blend-$i"; done
  STACK_ROUTER_WORKERS=$n stack_ready router
}

# stack_start_gateway [LISTEN]: cb-gateway (HOST:PORT; default a free loopback port) against the stack's
# endpoints; waits until it answers HTTP. Exports CB_GATEWAY_LISTEN and GW=http://LISTEN.
stack_start_gateway() {
  local -; set +e
  local listen=${1:-}
  [ -n "$listen" ] || listen="127.0.0.1:$(stack_free_port)" || return 1
  export CB_GATEWAY_LISTEN=$listen GW="http://$listen"
  stack_start gateway
}

# stack_launch_redis [NAME]: a redis-server of its own on the Unix socket $STACK_REDIS_SOCK (default
# $STACK_LOGS/redis.sock), persistence off, allkeys-lru in $STACK_REDIS_MAXMEMORY (256mb); the address
# for common.kv_remote is unix://$STACK_REDIS_SOCK. stack_start redis waits for its PING.
stack_launch_redis() {
  local -; set +e
  local name=${1:-redis}
  STACK_REDIS_SOCK=${STACK_REDIS_SOCK:-$STACK_LOGS/redis.sock}
  svc_start "$name" "$(command -v redis-server || echo redis-server)" -- --port 0 --unixsocket "$STACK_REDIS_SOCK" \
    --unixsocketperm 700 --save '' --appendonly no --dir "$(dirname "$STACK_REDIS_SOCK")" \
    --maxmemory "${STACK_REDIS_MAXMEMORY:-256mb}" --maxmemory-policy allkeys-lru
}
stack_wait_redis() {
  local -; set +e
  local name=${1:-redis} i
  for ((i = 0; i < 100; i++)); do
    [ "$(redis-cli -s "$STACK_REDIS_SOCK" ping 2>/dev/null)" = PONG ] && return 0
    svc_alive "$name" || break
    sleep 0.1
  done
  stack_fail "redis-server did not answer on $STACK_REDIS_SOCK within 10 s"; svc_log_tail "$name" 5; return 1
}

# wait_until SECONDS COMMAND...: polls COMMAND every 0.2 s until it succeeds (false after SECONDS).
wait_until() {
  local -; set +e
  local limit=$1 end; shift
  end=$((SECONDS + limit))
  while :; do
    "$@" && return 0
    [ "$SECONDS" -ge "$end" ] && return 1
    sleep 0.2
  done
}
