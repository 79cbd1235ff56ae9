# tests/integration/lib/stack.bash: helpers for tests that run the whole stack (cb-retriever,
# cb-cacheindex, cb-precompute, cb-blend) on random loopback ports with a temporary data directory, and
# talk to it with cbctl, cb-send, cb-push and the in-process reference cb-rag. Source it after nothing
# else (it sources svc.bash):
#
#   . "$(dirname "$0")/lib/stack.bash"
#   stack_setup                  # temp dir, ports, CB_* exports, binaries (builds or skips), model (or skips)
#   stack_start retriever        # NAME [LOGNAME]: starts build/bin/cb-NAME, waits for ping (and the worker)
#   stack_start_all
#   cbctl ingest --wait data/sample
#   stack_stat blend cache_hits  # one field of a service's stats
#   stack_kill9 blend            # SIGKILL, no wait
#
# Everything is exported, so cbctl, cb-rag and the services agree on endpoints and settings. Small
# defaults keep the model work short: 64-token chunks, 12 generated tokens.

. "$(dirname "${BASH_SOURCE[0]}")/svc.bash"

CBCTL="$ROOT/build/bin/cbctl"
RAG="$ROOT/build/bin/cb-rag"
PUSH="$ROOT/build/bin/cb-push"

stack_setup() {
  svc_setup
  export CB_LOG_LEVEL=info   # the tests read some info lines of the services' logs (tests/run.sh sets warn)
  svc_need build/bin/cb-retriever build/bin/cb-cacheindex build/bin/cb-precompute build/bin/cb-blend \
           build/bin/cbctl build/bin/cb-send build/bin/cb-rag build/bin/cb-push
  export CB_MODEL=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
  if [ ! -f "$CB_MODEL" ]; then echo "skip: no model at $CB_MODEL (scripts/fetch-model.sh)"; exit 77; fi
  export CB_COMMON_MODEL="$CB_MODEL"
  local p
  for s in RETRIEVER CACHEINDEX PRECOMPUTE BLEND; do
    p=$(svc_free_port); export "CB_${s}_ENDPOINT=tcp://127.0.0.1:$p"
  done
  p=$(svc_free_port); export CB_PRECOMPUTE_PULL_ENDPOINT="tcp://127.0.0.1:$p"
  export CB_COMMON_THREADS=${CB_COMMON_THREADS:-2}
  export CB_PRECOMPUTE_CHUNK_TOKENS=${CB_PRECOMPUTE_CHUNK_TOKENS:-64}
  export CB_BLEND_MAX_TOKENS=${CB_BLEND_MAX_TOKENS:-12}
  export CB_BLEND_CTX_SIZE=${CB_BLEND_CTX_SIZE:-1024}
  export CB_CBCTL_REQUEST_TIMEOUT_MS=${CB_CBCTL_REQUEST_TIMEOUT_MS:-5000}
  export CB_CBCTL_INGEST_TIMEOUT_MS=${CB_CBCTL_INGEST_TIMEOUT_MS:-60000}
  export CB_CACHEINDEX_GC_MIN_AGE_S=${CB_CACHEINDEX_GC_MIN_AGE_S:-60}
  KV="$CB_DATA_DIR/kv"
}

# stack_endpoint NAME: the service's endpoint.
stack_endpoint() { local v="CB_${1^^}_ENDPOINT"; echo "${!v}"; }

# stack_launch NAME [LOGNAME]: starts cb-NAME in the background (log in $T/LOGNAME.log).
stack_launch() { svc_start "${2:-$1}" "build/bin/cb-$1"; }

# stack_ready NAME [LOGNAME]: waits until cb-NAME answers ping and, for precompute and blend, until its
# worker has loaded the model.
stack_ready() {
  local name=$1 log=${2:-$1} ep i
  ep=$(stack_endpoint "$name")
  svc_wait_ping "$ep" 20 "${SVC_PID[$log]:-}" || return 1
  if [ "$name" = precompute ] || [ "$name" = blend ]; then
    for i in $(seq 1 300); do
      [ "$(stack_stat "$name" worker_ready)" = "true" ] && return 0
      kill -0 "${SVC_PID[$log]}" 2>/dev/null || { echo "FAIL: cb-$name exited"; tail -5 "$T/$log.log"; return 1; }
      sleep 0.1
    done
    echo "FAIL: cb-$name worker not ready in 30 s"; return 1
  fi
}

# stack_start NAME [LOGNAME]: launch + ready.
stack_start() { stack_launch "$@" && stack_ready "$@"; }

stack_start_all() {
  local s
  for s in retriever cacheindex precompute blend; do stack_launch $s; done
  for s in retriever cacheindex precompute blend; do stack_ready $s || return 1; done
}

# stack_stats NAME: the service's whole stats reply ({} when unreachable), for reading several fields of one
# moment; stack_stat NAME FIELD: one field of it ("null" when unreachable).
stack_stats() { "$SEND" --timeout 3000 "$(stack_endpoint "$1")" '{"type":"stats"}' 2>/dev/null || echo '{}'; }
stack_stat() { jget "$(stack_stats "$1")" "$2"; }

# stack_kill9 LOGNAME: SIGKILL, reaped, forgotten.
stack_kill9() {
  local pid=${SVC_PID[$1]}
  kill -KILL "$pid" 2>/dev/null; wait "$pid" 2>/dev/null
  unset "SVC_PID[$1]"
}

cbctl() { "$CBCTL" "$@"; }

# rag ARGS...: the in-process answer (same config; its own memory tier).
rag() { "$RAG" --hot_cache_bytes 256M "$@"; }

# wait_until SECONDS COMMAND...: polls COMMAND every 0.2 s until it succeeds.
wait_until() {
  local limit=$1 i; shift
  for i in $(seq 1 $((limit * 5))); do "$@" && return 0; sleep 0.2; done
  return 1
}

# stack_start_gateway: starts build/bin/cb-gateway on a free loopback port (CB_GATEWAY_LISTEN) against
# the stack's endpoints and waits until it answers HTTP; exports GW=http://127.0.0.1:PORT.
stack_start_gateway() {
  svc_need build/bin/cb-gateway
  local p i
  p=$(svc_free_port)
  export CB_GATEWAY_LISTEN="127.0.0.1:$p" GW="http://127.0.0.1:$p"
  svc_start gateway build/bin/cb-gateway
  for i in $(seq 1 100); do
    curl -s -o /dev/null --max-time 2 "$GW/metrics" && return 0
    kill -0 "${SVC_PID[gateway]}" 2>/dev/null || { echo "FAIL: cb-gateway exited"; tail -5 "$T/gateway.log"; return 1; }
    sleep 0.1
  done
  echo "FAIL: cb-gateway did not answer on $GW within 10 s"; return 1
}
