# tests/integration/lib/svc.bash: helpers for integration tests that run the real service binaries on
# loopback. Source it from a test script (it is not a test itself: run.sh only runs *.sh files one
# level up). Processes are started, waited for and stopped by the launcher every script shares,
# scripts/lib/stack.bash (svc_start, svc_wait_ping, stack_free_port, stack_stop, ...); this file adds the
# test side: a temp dir, the binaries a test needs, and the checks.
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
# Every started process is killed at exit (trap), and $T removed. Logs: $T/NAME.log.

set -u
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
ROOT=$(pwd)
. "$ROOT/scripts/lib/stack.bash"
SEND="$ROOT/build/bin/cb-send"
JQ=$STACK_JQ   # fast JSON access when present; python3 otherwise
T=""
FAILS=0

# svc_cleanup: the exit trap: every started process stopped (stack_cleanup), then $T removed.
svc_cleanup() { stack_cleanup; }

svc_setup() {
  T=$(mktemp -d /tmp/cb-it.XXXXXX)
  stack_init "$T/data" "$T"   # logs and the ports handed out in $T; stops everything at exit
  stack_at_exit 'rm -rf "$T"'
  STACK_NEED=svc_need        # a program the launcher starts is built when missing (or the test skipped)
  export CB_LOG_LEVEL=info   # the tests read the per-request log lines
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

# svc_free_port: a free loopback port, never handed out twice in one test (stack_free_port).
svc_free_port() { stack_free_port; }

# svc_stop NAME: SIGTERM, up to 5 s (then SIGKILL), the exit status must be 0.
svc_stop() {
  local name=$1
  if ! stack_stop "$name" 5; then echo "FAIL: $name did not exit within 5 s of SIGTERM"; FAILS=$((FAILS+1)); return 1; fi
  if [ "$STACK_RC" != 0 ]; then echo "FAIL: $name exited with $STACK_RC after SIGTERM"; FAILS=$((FAILS+1)); return 1; fi
  echo "ok: $name exited 0 on SIGTERM"
}

# send ENDPOINT JSON [cb-send options...]: prints the reply line; the exit status is cb-send's.
send() { local ep=$1 js=$2; shift 2; "$SEND" --timeout 3000 "$@" "$ep" "$js"; }

# jget JSON PATH: scripts/lib/stack.bash.

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
