#!/usr/bin/env bash
# bench-router.sh (`make bench-router`): cb-router in front of cb-blend workers (docs/router.md).
#
#   1. Load balancing: queries/s (cb-load, BENCH_CLIENTS concurrent clients, default 4; BENCH_LOAD_QUERIES, 12) through the router
#      with 1 worker, then with 2 workers (policy least_loaded). Each worker has CB_COMMON_THREADS (1)
#      threads; on a machine with fewer free cores than workers it cannot double: the ratio is reported.
#   2. Cache-aware routing: a workload whose queries repeat their chunks (BENCH_SETS, 5, distinct MuSiQue
#      context sets of 2 passages, each asked BENCH_REPEAT, 4, times, interleaved so that a set comes back after
#      the others; 5 sets over 2 workers, so that round robin does not land a set on the same worker by
#      chance; each passage cut to BENCH_CONTEXT_CHARS, 600), 2 workers, policy round_robin, then cache. Reported: client TTFT p50/p90 (cb-load) and the
#      memory-tier hit share (hot_hits / (hot_hits + hot_misses), summed over the workers: a miss there is
#      a KV file load, or a computation the first time a chunk is seen anywhere).
# BENCH_PARTS ("lb cache") runs only some of them (then no JSON is written).
# Every run starts from an empty data directory (no KV files, no cache index), so the runs compare like
# with like. BENCH_MAX_TOKENS (6) generated tokens, greedy, blend mode. Output: a table on stdout and
# $BENCH_OUT (build/bench-router.json). The processes (scripts/lib/stack.bash) use free loopback ports;
# state in a temporary directory (BENCH_KEEP=1 keeps it, with the logs).
# Timings on a shared machine are noisy: compare the rows of one run.
set -euo pipefail
cd "$(dirname "$0")/.."
CLIENTS=${BENCH_CLIENTS:-4}
LOADQ=${BENCH_LOAD_QUERIES:-12}
SETS=${BENCH_SETS:-5}
REPEAT=${BENCH_REPEAT:-4}
MAXTOK=${BENCH_MAX_TOKENS:-6}
CTX_CHARS=${BENCH_CONTEXT_CHARS:-600}
OUT=${BENCH_OUT:-build/bench-router.json}
export CB_COMMON_THREADS=${CB_COMMON_THREADS:-1}
export CB_COMMON_MODEL=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export CB_BLEND_MAX_TOKENS=$MAXTOK CB_LOG_LEVEL=${CB_LOG_LEVEL:-warn}
[ -f "$CB_COMMON_MODEL" ] || { echo "bench-router: model $CB_COMMON_MODEL not found (make model)" >&2; exit 1; }
for b in cb-cacheindex cb-blend cb-router cb-send cb-load; do
  [ -x "build/bin/$b" ] || { echo "bench-router: build/bin/$b missing (make)" >&2; exit 1; }
done
. scripts/lib/stack.bash
STACK_FAIL="bench-router: "
TMP=$(mktemp -d /tmp/cb-bench-router.XXXXXX)
stack_init "$TMP/var" "$TMP"          # the processes are stopped at exit, then:
stack_at_exit 'if [ -n "${BENCH_KEEP:-}" ]; then echo "state and logs kept in $TMP"; else rm -rf "$TMP"; fi'
stat() { build/bin/cb-send --timeout 3000 "$CB_BLEND_ENDPOINT" '{"type":"stats"}'; }

# queries: SETS context sets x REPEAT, interleaved (set 0..SETS-1, then again)
python3 - "$SETS" "$REPEAT" "$CTX_CHARS" >"$TMP/repeat.jsonl" <<'EOF'
import json, sys
n, r, cut = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
sets = []
with open("data/musique_dev.jsonl") as f:
    for i, line in enumerate(f):
        if i >= n: break
        ex = json.loads(line)
        sets.append({"question": ex["question"], "contexts": [("%s\n\n%s" % (c["title"], c["text"]))[:cut] for c in ex["ctxs"][:2]]})
for _ in range(r):
    for s in sets: print(json.dumps(s))
EOF

# stack NWORKERS POLICY: cacheindex, router and workers on fresh ports and a fresh data dir; waits for ready
stack() {
  local n=$1 policy=$2
  stack_stop_all
  export CB_DATA_DIR="$TMP/run-$n-$policy"
  mkdir -p "$CB_DATA_DIR"
  stack_ports
  unset CB_ROUTER_WORKERS_ENDPOINT
  { stack_start cacheindex "cacheindex-$n-$policy" && stack_start_router "$n" "$policy"; } \
    || { echo "bench-router: $n workers not ready" >&2; exit 1; }
}
load() { build/bin/cb-load --clients "$1" --queries "$2" --mode blend --max-tokens "$MAXTOK" --json "$CB_BLEND_ENDPOINT" "$3"; }

PARTS=${BENCH_PARTS:-lb cache}   # which parts to run
declare -A QPS
[[ " $PARTS " == *" lb "* ]] && echo "== 1. load balancing: $CLIENTS clients, $LOADQ queries, least_loaded"
for n in 1 2; do
  [[ " $PARTS " == *" lb "* ]] || break
  stack "$n" least_loaded
  load 1 "$SETS" "$TMP/repeat.jsonl" >/dev/null            # warm: every chunk computed and stored once
  js=$(load "$CLIENTS" "$LOADQ" "$TMP/repeat.jsonl")
  echo "$js" >"$TMP/lb-$n.json"
  QPS[$n]=$(echo "$js" | jq .qps)
  printf '  %d worker(s): %6.2f queries/s, TTFT p50 %6.0f ms, p90 %6.0f ms, %s errors\n' "$n" "${QPS[$n]}" \
    "$(echo "$js" | jq .ttft_ms.p50)" "$(echo "$js" | jq .ttft_ms.p90)" "$(echo "$js" | jq .errors)"
done
[[ " $PARTS " == *" lb "* ]] && echo "  2 vs 1: x$(python3 -c "print(round(${QPS[2]} / ${QPS[1]}, 2))") (cores: $(nproc), load average $(cut -d' ' -f1 /proc/loadavg))"

[[ " $PARTS " == *" cache "* ]] && echo "== 2. repeated chunks: $SETS context sets x $REPEAT, 2 workers, 2 clients"
for policy in round_robin cache; do
  [[ " $PARTS " == *" cache "* ]] || break
  stack 2 "$policy"
  js=$(load 2 "$((SETS * REPEAT))" "$TMP/repeat.jsonl")
  sleep 1.5   # the workers' counters reach the router with their heartbeats
  st=$(stat)
  echo "$js" >"$TMP/cache-$policy.json"
  echo "$st" >"$TMP/cache-$policy-stats.json"
  printf '  %-12s TTFT p50 %6.0f ms, p90 %6.0f ms; memory tier hits %s of %s (%s); %s queries/s\n' "$policy" \
    "$(echo "$js" | jq .ttft_ms.p50)" "$(echo "$js" | jq .ttft_ms.p90)" "$(echo "$st" | jq .hot_hits)" \
    "$(echo "$st" | jq '.hot_hits + .hot_misses')" \
    "$(echo "$st" | jq 'if .hot_hits + .hot_misses > 0 then (100 * .hot_hits / (.hot_hits + .hot_misses) | floor | tostring) + "%" else "-" end' -r)" \
    "$(echo "$js" | jq .qps)"
done

mkdir -p "$(dirname "$OUT")"
[ "$PARTS" = "lb cache" ] || { echo "(BENCH_PARTS=$PARTS: no $OUT)"; exit 0; }
jq -n --slurpfile l1 "$TMP/lb-1.json" --slurpfile l2 "$TMP/lb-2.json" \
      --slurpfile rr "$TMP/cache-round_robin.json" --slurpfile rrs "$TMP/cache-round_robin-stats.json" \
      --slurpfile ca "$TMP/cache-cache.json" --slurpfile cas "$TMP/cache-cache-stats.json" \
      --arg cores "$(nproc)" --arg threads "$CB_COMMON_THREADS" \
  '{cores: ($cores | tonumber), threads_per_worker: ($threads | tonumber),
    load_balancing: {one_worker: $l1[0], two_workers: $l2[0], speedup: ($l2[0].qps / $l1[0].qps)},
    repeated_chunks: {round_robin: {load: $rr[0], hot_hits: $rrs[0].hot_hits, hot_misses: $rrs[0].hot_misses},
                      cache: {load: $ca[0], hot_hits: $cas[0].hot_hits, hot_misses: $cas[0].hot_misses}}}' >"$OUT"
echo "wrote $OUT"
