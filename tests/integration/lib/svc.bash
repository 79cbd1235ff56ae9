# tests/integration/lib/svc.bash: helpers for integration tests that run the real service binaries on
# loopback. Source it from a test script (it is not a test itself: run.sh only runs *.sh files one
# level up):
#
#   . "$(dirname "$0")/lib/svc.bash"
#   svc_setup                                  # temp dir in $T, CB_DATA_DIR=$T/data, trap EXIT cleanup
#   svc_need build/bin/cb-retriever build/bin/cb-send   # builds them if missing, else exit 77
#   port=$(svc_free_port)
#   svc_start retriever build/bin/cb-retriever CB_RETRIEVER_ENDPOINT=tcp://127.0.0.1:$port
#   svc_wait_ping tcp://127.0.0.1:$port
#   out=$(send tcp://127.0.0.1:$port '{"type":"ping"}')
#   jget "$out" service                        # -> cb-retriever  (path: a.b.0.c)
#   svc_stop retriever                         # SIGTERM, waits, checks exit status 0
#
# Every started process is killed at exit (trap), and $T removed.

set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
ROOT=$(pwd)
SEND="$ROOT/build/bin/cb-send"
JQ=$(command -v jq || true)   # fast JSON access when present; python3 otherwise
declare -A SVC_PID=()
T=""
FAILS=0

svc_cleanup() {
  local name pid
  for name in "${!SVC_PID[@]}"; do
    pid=${SVC_PID[$name]}
    kill -TERM "$pid" 2>/dev/null
  done
  for name in "${!SVC_PID[@]}"; do
    pid=${SVC_PID[$name]}
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
  done
  [ -n "$T" ] && rm -rf "$T"
}

svc_setup() {
  T=$(mktemp -d /tmp/cb-it.XXXXXX)
  export CB_DATA_DIR="$T/data"
  export CB_LOG_LEVEL=info   # the tests read the per-request log lines
  mkdir -p "$CB_DATA_DIR"
  trap svc_cleanup EXIT
}

# svc_need FILE...: the binaries must exist; try to build them once, else skip (77).
svc_need() {
  local missing=()
  for f in "$@"; do [ -x "$f" ] || missing+=("$f"); done
  if [ ${#missing[@]} -gt 0 ]; then
    make -s -j2 "${missing[@]}" >/dev/null 2>&1 || true
    for f in "${missing[@]}"; do
      if [ ! -x "$f" ]; then echo "skip: $f could not be built"; exit 77; fi
    done
  fi
}

# A free loopback port below the kernel's ephemeral range (32768+ on Linux), so that a client connecting
# to it while nothing listens can never connect to itself (TCP simultaneous open).
svc_free_port() {
  # Ports handed out earlier in this test are in $T/.ports: a port is picked once and bound later by the
  # service, so two picks that both found it free would make two services race for it (the loser cannot
  # bind, and a ping to its endpoint is answered by the winner).
  python3 - "${T:+$T/.ports}" <<'PY'
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
PY
}

# svc_start NAME BINARY [VAR=VALUE...] [-- ARGS...]: runs BINARY in the background with the variables
# in its environment; log in $T/NAME.log.
svc_start() {
  local name=$1 bin=$2; shift 2
  local envs=() args=()
  while [ $# -gt 0 ]; do
    if [ "$1" = "--" ]; then shift; args=("$@"); break; fi
    envs+=("$1"); shift
  done
  env "${envs[@]}" "$bin" "${args[@]}" >>"$T/$name.log" 2>&1 &
  SVC_PID[$name]=$!
}

# svc_wait_ping ENDPOINT [SECONDS [PID]]: until the service answers ping (with PID: the process with that pid,
# and a failure as soon as it exits: a service that could not bind must not pass on another one's answer).
svc_wait_ping() {
  local ep=$1 limit=${2:-10} pid=${3:-} i out
  for i in $(seq 1 $((limit * 10))); do
    if out=$("$SEND" --timeout 200 "$ep" '{"type":"ping"}' 2>/dev/null); then
      [ -z "$pid" ] && return 0
      [ "$(jget "$out" pid)" = "$pid" ] && return 0
    fi
    if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then
      echo "FAIL: the process for $ep (pid $pid) exited before it answered ping"; return 1
    fi
    sleep 0.1
  done
  echo "FAIL: no ping answer from $ep${pid:+ by pid $pid} within ${limit}s"; return 1
}

# svc_stop NAME: SIGTERM, wait up to 5 s, the exit status must be 0.
svc_stop() {
  local name=$1 pid=${SVC_PID[$1]} rc
  kill -TERM "$pid"
  for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then echo "FAIL: $name did not exit within 5 s of SIGTERM"; FAILS=$((FAILS+1)); return 1; fi
  wait "$pid"; rc=$?
  unset "SVC_PID[$name]"
  if [ "$rc" -ne 0 ]; then echo "FAIL: $name exited with $rc after SIGTERM"; FAILS=$((FAILS+1)); return 1; fi
  echo "ok: $name exited 0 on SIGTERM"
}

# send ENDPOINT JSON [cb-send options...]: prints the reply line; the exit status is cb-send's.
send() { local ep=$1 js=$2; shift 2; "$SEND" --timeout 3000 "$@" "$ep" "$js"; }

# jget JSON PATH: prints the value at PATH (dot-separated; numbers index arrays); strings raw,
# others as JSON; "null" when absent.
jget() {
  if [ -n "$JQ" ]; then
    local path=".${2}"; [ -z "$2" ] && path="."
    # a.0.b -> .["a"][0]["b"]
    path=$(echo "$2" | awk -F. '{o=""; for(i=1;i<=NF;i++){ if($i ~ /^[0-9]+$/) o=o"["$i"]"; else o=o"[\""$i"\"]"}; print "."o}')
    printf '%s' "$1" | "$JQ" -r "${path} | if type == \"string\" then . else tojson end" 2>/dev/null || echo null
    return
  fi
  python3 -c '
import json, sys
v = json.loads(sys.argv[1])
for p in sys.argv[2].split(".") if sys.argv[2] else []:
    try:
        v = v[int(p)] if isinstance(v, list) else v.get(p)
    except Exception:
        v = None
    if v is None: break
print(v if isinstance(v, str) else json.dumps(v, separators=(",", ":")))' "$1" "$2"
}

# json_str TEXT: TEXT as a JSON string literal (with quotes).
json_str() {
  if [ -n "$JQ" ]; then printf '%s' "$1" | "$JQ" -Rs .; else python3 -c 'import json,sys; print(json.dumps(sys.argv[1]))' "$1"; fi
}

# check DESCRIPTION ACTUAL EXPECTED
check() {
  if [ "$2" = "$3" ]; then echo "ok: $1"; else echo "FAIL: $1: got '$2', expected '$3'"; FAILS=$((FAILS+1)); fi
}

# check_error DESCRIPTION REPLY CODE: REPLY is an error reply with error.code CODE.
check_error() {
  check "$1" "$(jget "$2" ok)/$(jget "$2" error.code)" "false/$3"
}

svc_finish() {
  if [ "$FAILS" -gt 0 ]; then
    echo "$FAILS check(s) failed"
    for f in "$T"/*.log; do [ -f "$f" ] && { echo "--- $f (tail)"; tail -20 "$f"; }; done
    exit 1
  fi
  echo "all checks passed"
  exit 0
}
