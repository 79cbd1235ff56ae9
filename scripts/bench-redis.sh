#!/usr/bin/env bash
# bench-redis.sh (`make bench-redis`): TTFT of a blend-mode query by where its chunks' KV is, side by side in
# one run (docs/kvremote.md §measurements):
#   computed  no local file, nothing in Redis: the chunks are computed (then written to a file and put in
#             Redis: that cost is on this path too, as in service);
#   file      the same query again: every chunk read from its local KV file (no memory tier, page cache warm);
#   redis     the local KV files deleted: every chunk taken from Redis (GET, full verification, the local copy
#             written), as on a host that has never seen them.
# Each repetition uses new passages (MuSiQue example r: its first BENCH_CONTEXTS passages), so that the
# three cases are measured back to back on the same chunks; p50 (and min, max) of the client TTFT (cbctl
# query: send -> first token) over BENCH_REPS (5) repetitions. cb-blend (hot_cache_bytes 0) and
# cb-cacheindex on free loopback ports (BENCH_PORT=P: P+1 and P+4), redis-server on a Unix socket
# (persistence off, allkeys-lru), all started by scripts/lib/stack.bash; state in a temporary directory. BENCH_REDIS_URL=redis://HOST:PORT uses a running
# Redis (another host) instead: its keys are written under a fresh prefix. Output: a table and
# $BENCH_OUT (build/bench-redis.json). Timings on a shared machine are noisy: compare the columns of one run.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${BENCH_REPS:-5}
NCTX=${BENCH_CONTEXTS:-3}
MAXTOK=${BENCH_MAX_TOKENS:-8}
OUT=${BENCH_OUT:-build/bench-redis.json}
PORT=${BENCH_PORT:-}
export CB_COMMON_THREADS=${CB_COMMON_THREADS:-2}
export CB_MODEL=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export CB_COMMON_MODEL=$CB_MODEL
[ -f "$CB_MODEL" ] || { echo "bench-redis: model $CB_MODEL not found (make model)" >&2; exit 1; }
for b in cb-cacheindex cb-blend cbctl cb-send; do
  [ -x build/bin/$b ] || { echo "bench-redis: build/bin/$b missing (make)" >&2; exit 1; }
done

. scripts/lib/stack.bash
STACK_FAIL="bench-redis: "
TMP=$(mktemp -d /tmp/cb-bench-redis.XXXXXX)
stack_init "$TMP/var" "$TMP"          # the processes are stopped at exit, then the folder removed
stack_at_exit 'rm -rf "$TMP"'
mkdir -p "$CB_DATA_DIR/kv"
KV="$CB_DATA_DIR/kv"
stack_ports $PORT
export CB_BLEND_MAX_TOKENS=$MAXTOK CB_BLEND_MODE=blend CB_BLEND_HOT_CACHE_BYTES=0 CB_LOG_LEVEL=warn
export CB_COMMON_KV_REMOTE_PREFIX="bench$$"

if [ -n "${BENCH_REDIS_URL:-}" ]; then
  export CB_COMMON_KV_REMOTE=$BENCH_REDIS_URL
else
  command -v redis-server >/dev/null || { echo "bench-redis: redis-server not installed" >&2; exit 1; }
  STACK_REDIS_MAXMEMORY=1gb
  stack_start redis || exit 1
  export CB_COMMON_KV_REMOTE="unix://$STACK_REDIS_SOCK"
fi
{ stack_start cacheindex && stack_start blend; } || exit 1
stat_of() { jget "$(stack_stats blend)" "$1"; }
[ "$(stat_of kv_remote_up)" = 1 ] || { echo "bench-redis: the Redis tier is not up ($CB_COMMON_KV_REMOTE)" >&2; exit 1; }

# query R: the cbctl arguments for MuSiQue example R (+1: example 0 warms up)
mkdir -p "$TMP/q"
python3 - "$((REPS + 1))" "$NCTX" "$TMP/q" <<'EOF'
import json, os, sys
n, k, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
with open("data/musique_dev.jsonl") as f:
    for i, line in enumerate(f):
        if i >= n: break
        ex = json.loads(line)
        d = os.path.join(out, str(i)); os.makedirs(d)
        open(os.path.join(d, "question"), "w").write(ex["question"])
        for j, c in enumerate(ex["ctxs"][:k]):
            open(os.path.join(d, "ctx%d" % j), "w").write("%s\n\n%s" % (c["title"], c["text"]))
EOF
query() { # R: prints the done message's JSON
  local d="$TMP/q/$1" f args=()
  for f in "$d"/ctx*; do args+=(--context "$(cat "$f")"); done
  build/bin/cbctl query --json --mode blend "${args[@]}" "$(cat "$d/question")" | tail -n 1
}
field() { python3 -c 'import json,sys; v=json.loads(sys.argv[1])
for k in sys.argv[2].split("."): v=v[k]
print(v)' "$1" "$2"; }

echo "bench-redis: $REPS repetitions, $NCTX MuSiQue passages per query, $MAXTOK tokens, $CB_COMMON_THREADS threads,"
echo "  Redis at $CB_COMMON_KV_REMOTE; client TTFT in ms (chunks: hits/misses)"
query 0 >/dev/null; rm -rf "${KV:?}"/*; query 0 >/dev/null # warm-up: model pages, both paths once
printf '  %-4s %22s %22s %22s\n' rep computed file redis
C=(); F=(); R=()
for r in $(seq 1 "$REPS"); do
  jc=$(query "$r"); jf=$(query "$r"); rm -rf "${KV:?}"/*; jr=$(query "$r")
  c=$(field "$jc" client.ttft_ms); f=$(field "$jf" client.ttft_ms); x=$(field "$jr" client.ttft_ms)
  C+=("$c"); F+=("$f"); R+=("$x")
  printf '  %-4s %12.1f (%s/%s) %14.1f (%s/%s) %14.1f (%s/%s)\n' "$r" \
    "$c" "$(field "$jc" metrics.cache_hits)" "$(field "$jc" metrics.cache_misses)" \
    "$f" "$(field "$jf" metrics.cache_hits)" "$(field "$jf" metrics.cache_misses)" \
    "$x" "$(field "$jr" metrics.cache_hits)" "$(field "$jr" metrics.cache_misses)"
done
hits=$(stat_of kv_remote_hits); bytes=$(stat_of kv_remote_bytes_read)
python3 - "$OUT" "$hits" "$bytes" "${C[*]}" "${F[*]}" "${R[*]}" <<'EOF'
import json, statistics, sys
out, hits, nbytes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
cols = {"computed": sys.argv[4], "file": sys.argv[5], "redis": sys.argv[6]}
res = {}
for name, s in cols.items():
    v = [float(x) for x in s.split()]
    res[name] = {"p50_ms": statistics.median(v), "min_ms": min(v), "max_ms": max(v), "runs": v}
# paired (same repetition, same chunks): what Redis adds over a local file, what it saves over computing
res["redis_minus_file_p50_ms"] = statistics.median([r - f for r, f in zip(res["redis"]["runs"], res["file"]["runs"])])
res["computed_minus_redis_p50_ms"] = statistics.median([c - r for c, r in zip(res["computed"]["runs"], res["redis"]["runs"])])
res["redis_hits"] = hits
res["redis_value_bytes_mean"] = nbytes / hits if hits else 0
print("  p50  %12.1f %22.1f %22.1f" % (res["computed"]["p50_ms"], res["file"]["p50_ms"], res["redis"]["p50_ms"]))
print("  paired p50: redis - file %+.1f ms, computed - redis %+.1f ms" % (res["redis_minus_file_p50_ms"],
                                                                      res["computed_minus_redis_p50_ms"]))
print("  redis: %d hits, %.0f KiB per value on average" % (hits, res["redis_value_bytes_mean"] / 1024))
json.dump(res, open(out, "w"), indent=1)
print("  written to " + out)
EOF
