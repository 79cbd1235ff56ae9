# tests/integration/lib/stack.bash: helpers for tests that run the whole stack (cb-retriever,
# cb-cacheindex, cb-precompute, cb-blend) on random loopback ports with a temporary data directory, and
# talk to it with cbctl, cb-send, cb-push and the in-process reference cb-rag. Source it after nothing
# else (it sources svc.bash):
#
#   . "$(dirname "$0")/lib/stack.bash"
#   stack_setup                  # temp dir, ports, CB_* exports, binaries (builds or skips), model (or skips)
#   stack_start retriever        # NAME [LOGNAME]: starts build/bin/cb-NAME, waits for ping (and the worker)
#   stack_start_all
#   stack_start_gateway          # cb-gateway on a free port, $GW
#   cbctl ingest --wait data/sample
#   stack_stat blend cache_hits  # one field of a service's stats
#   stack_kill9 blend            # SIGKILL, no wait
#
# Everything is exported, so cbctl, cb-rag and the services agree on endpoints and settings. Small
# defaults keep the model work short: 64-token chunks, 12 generated tokens. Starting, waiting and stopping
# are the launcher's (scripts/lib/stack.bash: stack_launch, stack_ready, stack_start, stack_start_all,
# stack_start_gateway, stack_start_router, stack_stats, stack_stat, stack_kill9, wait_until); this file
# sets the test defaults.

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
  stack_ports
  STACK_READY_S=30   # a worker loads the small model in well under that
  export CB_COMMON_THREADS=${CB_COMMON_THREADS:-2}
  export CB_PRECOMPUTE_CHUNK_TOKENS=${CB_PRECOMPUTE_CHUNK_TOKENS:-64}
  export CB_BLEND_MAX_TOKENS=${CB_BLEND_MAX_TOKENS:-12}
  export CB_BLEND_CTX_SIZE=${CB_BLEND_CTX_SIZE:-1024}
  export CB_CBCTL_REQUEST_TIMEOUT_MS=${CB_CBCTL_REQUEST_TIMEOUT_MS:-5000}
  export CB_CBCTL_INGEST_TIMEOUT_MS=${CB_CBCTL_INGEST_TIMEOUT_MS:-60000}
  export CB_CACHEINDEX_GC_MIN_AGE_S=${CB_CACHEINDEX_GC_MIN_AGE_S:-60}
  KV="$CB_DATA_DIR/kv"
}

cbctl() { "$CBCTL" "$@"; }

# rag ARGS...: the in-process answer (same config; its own memory tier).
rag() { "$RAG" --hot_cache_bytes 256M "$@"; }
