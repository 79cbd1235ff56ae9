#!/usr/bin/env bash
# bench-serve.sh (`make bench-serve`): the real stack under concurrent load, full prefill against blend, and
# optionally the blend points again with another cb-blend binary (a baseline), side by side in one run.
# A benchmark, not a test: it fails only when the stack cannot be set up; failed queries are counted.
#
#   1. A fresh stack (the four services, scripts/lib/stack.bash: free loopback ports, or BENCH_SERVE_PORT..+4
#      when set; state in a temporary directory removed on exit). Documents: every passage of the first MuSiQue examples (one document per passage,
#      "{title}\n\n{text}", about 600 tokens) through `cbctl ingest`: cb-precompute chunks them
#      (precompute.chunk_tokens = BENCH_SERVE_CHUNK_TOKENS, so a passage stays one chunk), computes each
#      chunk's KV file and indexes its text in cb-retriever. The script polls cb-precompute's stats until
#      every job is done (bounded: BENCH_SERVE_INGEST_TIMEOUT s overall, 120 s without progress).
#   2. Queries: the first BENCH_SERVE_QUESTIONS distinct MuSiQue questions of those examples, without
#      contexts: cb-blend retrieves blend.k = BENCH_SERVE_K chunks per question from cb-retriever, so a
#      prompt is about K x 600 + 80 tokens (k = 3: ~1,900, reported as "prompt" from the done metrics),
#      blend.ctx_size = BENCH_SERVE_CTX_SIZE, at most BENCH_SERVE_MAX_TOKENS new tokens, greedy.
#   3. For each N in BENCH_SERVE_CLIENTS: cb-load with N concurrent clients, each sending
#      BENCH_SERVE_PER_CLIENT queries (default: the whole question set) one after the other from its own
#      offset in the set (client c at question c x Q / N), in `full` mode and in `blend` mode, and with
#      BENCH_SERVE_BASE in blend mode again as `base_blend` (only cb-blend is restarted between binaries;
#      the KV files, indexes and the page cache are shared). The order of the modes alternates from one N to
#      the next (full, blend, base_blend; then base_blend, blend, full; ...): fewer restarts, and no mode
#      always runs first. After every cb-blend start, BENCH_SERVE_WARMUP blend queries (not measured).
#      cb-blend's `stats` is read before and after each point (cb-send).
#
# Reported per mode and N: queries/s (answered / wall), client TTFT p50/p99 (send -> first token), output
# tokens/s (sum of n_generated / wall), mean generated and prompt tokens (done metrics), aggregate decode
# tokens/s (delta of stats decode_tokens / delta of decode_ms: the batched engine's counters; null with a
# cb-blend that has none), mean tokens per engine step (delta decode_tokens / delta steps, null likewise),
# errors and overloaded answers; then the ratios blend/full qps and blend/base_blend qps at each N, and
# decode (and output) tok/s at the largest N over the smallest (N = 1 by default) per mode. Output: a table
# on stdout, $BENCH_SERVE_OUT/summary.json (per mode and N, the ratios, and every point's cb-load JSON with
# cb-blend's stats before and after), points.jsonl (the same points, one a line, written as they finish),
# cb-load's stderr in cb-load.log, the services' logs copied to logs/ (all under $BENCH_SERVE_OUT).
#
# Environment (defaults):
#   BENCH_SERVE_QUESTIONS (32)      distinct questions; their examples' passages are the documents
#   BENCH_SERVE_DOC_EXAMPLES (= Q)  MuSiQue examples whose passages are ingested (more: distractors)
#   BENCH_SERVE_PASSAGES (0 = all)  passages ingested per example, its first ones (a larger model's ingest
#                                   is slow: 8 questions x 3 passages keeps a 1.5B model's to ~6 min)
#   BENCH_SERVE_CLIENTS ("1 4 16")  concurrency levels N
#   BENCH_SERVE_PER_CLIENT (= Q)    queries each client sends per point (N x this per point)
#   BENCH_SERVE_MAX_TOKENS (32)     new tokens at most per answer (greedy)
#   BENCH_SERVE_K (3)               chunks retrieved per question (blend.k)
#   BENCH_SERVE_CHUNK_TOKENS (1024) precompute.chunk_tokens (>= the longest passage: one chunk each)
#   BENCH_SERVE_CTX_SIZE (4096)     blend.ctx_size
#   BENCH_SERVE_MODES ("full blend") the modes measured with the cb-blend under test
#   BENCH_SERVE_BLEND (build/bin/cb-blend)  the cb-blend under test
#   BENCH_SERVE_BASE (unset)        a baseline cb-blend binary, e.g. the one-at-a-time one of a commit:
#                                   git worktree add /tmp/cb-base HEAD && make -C /tmp/cb-base -j2 build/bin/cb-blend
#   BENCH_SERVE_WARMUP (2)          unmeasured blend queries after each cb-blend start
#   BENCH_SERVE_DATA (data/musique_dev.jsonl, else ../shared/data/musique_dev.jsonl)
#   BENCH_SERVE_PORT (unset)        ports PORT..PORT+4 (unset: free loopback ports)
#   BENCH_SERVE_OUT (results/bench-serve)
#   BENCH_SERVE_INGEST_TIMEOUT (3600)  seconds for the whole ingest
#   BENCH_SERVE_STATE (unset)       keep the stack's state in this folder (not removed) and reuse a finished
#                                   ingest of the same documents found there (saves the ingest on a rerun)
#   BENCH_SERVE_QUERY_BOUND_S (60)  a point is stopped after N x per-client x this + 300 s (a bound only)
#   CB_COMMON_THREADS (2), CB_MODEL; any other CB_<SECTION>_<KEY> is passed on to the services, e.g. the
#   batched cb-blend's CB_BLEND_MAX_SEQS, CB_BLEND_MAX_BATCH_TOKENS, CB_BLEND_KV_POOL_BYTES (16 sequences
#   of ~2K tokens need a pool of that many positions; the default holds max_seqs + 1 of ctx_size),
#   CB_BLEND_HOT_CACHE_BYTES (default 256M: ~9 chunks of 600 tokens, so the default question set's ~96
#   chunks mostly come from their KV files, page cache warm). CB_BLEND_MAX_QUEUE defaults to 64 here.
#
# Cost on a 2-core CPU (one-at-a-time cb-blend, measured): a ~1,900-token query takes ~3.2 s in full mode
# (TTFT ~3 s), ~1 s in blend mode (TTFT ~0.7 s); the ingest ~1.6 s per passage. The defaults (32
# questions, 320 passages, N = 1 4 16, every client the whole set) are 21 x 32 = 672 queries per mode:
# ~9 min of ingest, ~36 min for `full`, ~11 min for `blend` and as much for `base_blend`. The script prints
# an estimate first and a measured one after the first N. Small run (~3 min):
#   BENCH_SERVE_CLIENTS="1 2" BENCH_SERVE_QUESTIONS=4 BENCH_SERVE_PER_CLIENT=2 scripts/bench-serve.sh
# Timings on a shared machine are noisy: compare the columns of one run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
NQ=${BENCH_SERVE_QUESTIONS:-32}
NDOCEX=${BENCH_SERVE_DOC_EXAMPLES:-$NQ}
NPER=${BENCH_SERVE_PASSAGES:-0}
CLIENTS=${BENCH_SERVE_CLIENTS:-1 4 16}
PER=${BENCH_SERVE_PER_CLIENT:-$NQ}
MAXTOK=${BENCH_SERVE_MAX_TOKENS:-32}
K=${BENCH_SERVE_K:-3}
CHUNK=${BENCH_SERVE_CHUNK_TOKENS:-1024}
CTX=${BENCH_SERVE_CTX_SIZE:-4096}
MODES=${BENCH_SERVE_MODES:-full blend}
BLEND_BIN=${BENCH_SERVE_BLEND:-build/bin/cb-blend}
BASE_BIN=${BENCH_SERVE_BASE:-}
WARMUP=${BENCH_SERVE_WARMUP:-2}
PORT=${BENCH_SERVE_PORT:-}
OUTDIR=${BENCH_SERVE_OUT:-results/bench-serve}
INGEST_TIMEOUT=${BENCH_SERVE_INGEST_TIMEOUT:-3600}
QBOUND=${BENCH_SERVE_QUERY_BOUND_S:-60}
DATA=${BENCH_SERVE_DATA:-}
if [ -z "$DATA" ]; then
  DATA=data/musique_dev.jsonl; [ -f "$DATA" ] || DATA=../shared/data/musique_dev.jsonl
fi
export CB_COMMON_THREADS=${CB_COMMON_THREADS:-2}
export CB_MODEL=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export CB_COMMON_MODEL=$CB_MODEL

die() { echo "bench-serve: $*" >&2; exit 1; }
isint() { [[ "$1" =~ ^[0-9]+$ ]] && [ "$1" -ge "${2:-1}" ]; }
for v in NQ NDOCEX PER MAXTOK K CHUNK CTX INGEST_TIMEOUT QBOUND; do isint "${!v}" || die "$v=${!v}: expected a positive integer"; done
[ -z "$PORT" ] || isint "$PORT" || die "BENCH_SERVE_PORT=$PORT: expected a positive integer"
isint "$NPER" 0 || die "BENCH_SERVE_PASSAGES=$NPER: expected an integer >= 0"
isint "$WARMUP" 0 || die "BENCH_SERVE_WARMUP=$WARMUP: expected an integer >= 0"
for n in $CLIENTS; do isint "$n" && [ "$n" -le 256 ] || die "BENCH_SERVE_CLIENTS: $n is not in 1..256"; done
[ -n "$CLIENTS" ] || die "BENCH_SERVE_CLIENTS is empty"
for m in $MODES; do case $m in full|prefix|reuse|blend) ;; *) die "BENCH_SERVE_MODES: unknown mode $m" ;; esac; done
[ -f "$CB_MODEL" ] || die "model $CB_MODEL not found (make model)"
[ -f "$DATA" ] || die "$DATA not found (BENCH_SERVE_DATA)"
for b in cb-retriever cb-cacheindex cb-precompute cb-blend cbctl cb-load cb-send; do
  [ -x build/bin/$b ] || die "build/bin/$b missing (make)"
done
abspath() { case $1 in /*) echo "$1" ;; *) echo "$ROOT/$1" ;; esac; }
BLEND_BIN=$(abspath "$BLEND_BIN"); [ -x "$BLEND_BIN" ] || die "BENCH_SERVE_BLEND: $BLEND_BIN is not executable"
if [ -n "$BASE_BIN" ]; then BASE_BIN=$(abspath "$BASE_BIN"); [ -x "$BASE_BIN" ] || die "BENCH_SERVE_BASE: $BASE_BIN is not executable"; fi
[ "$NDOCEX" -ge "$NQ" ] || NDOCEX=$NQ

if [ -n "${BENCH_SERVE_STATE:-}" ]; then TMP=$(abspath "$BENCH_SERVE_STATE"); mkdir -p "$TMP"
else TMP=$(mktemp -d /tmp/cb-bench-serve.XXXXXX); fi
. scripts/lib/stack.bash
STACK_FAIL="bench-serve: "
STACK_READY_S=120
stack_init "$TMP/var"   # the services are stopped at exit (then cleanup below)
stack_ports $PORT
export CB_PRECOMPUTE_CHUNK_TOKENS=$CHUNK
export CB_BLEND_K=$K CB_BLEND_CTX_SIZE=$CTX CB_BLEND_MAX_TOKENS=$MAXTOK CB_BLEND_TEMPERATURE=0
export CB_BLEND_MAX_QUEUE=${CB_BLEND_MAX_QUEUE:-64}
export CB_CBCTL_QUERY_TIMEOUT_MS=600000 CB_CBCTL_INGEST_TIMEOUT_MS=120000
EP=$CB_BLEND_ENDPOINT
LOG=$STACK_LOGS
CUR_BIN=""

cleanup() {   # after the launcher has stopped the services
  [ -n "${LOADPID:-}" ] && kill -TERM "$LOADPID" 2>/dev/null
  [ -d "$LOG" ] && mkdir -p "$OUTDIR/logs" && cp "$LOG"/*.log "$OUTDIR/logs/" 2>/dev/null
  [ -n "${BENCH_SERVE_STATE:-}" ] || rm -rf "$TMP"
  return 0
}
stack_at_exit cleanup

mkdir -p "$OUTDIR"
rm -rf "$OUTDIR/logs"
: >"$OUTDIR/cb-load.log"
POINTS="$OUTDIR/points.jsonl"
: >"$POINTS"

# questions (distinct, first NQ) and the documents (the passages of the first NDOCEX examples)
python3 - "$DATA" "$NQ" "$NDOCEX" "$TMP/queries.jsonl" "$TMP/docs.jsonl" "$NPER" <<'EOF' || die "cannot read $DATA"
import json, sys
path, nq, ndoc, qout, dout = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
nper = int(sys.argv[6])
exs = [json.loads(l) for l in open(path) if l.strip()]
seen, qs, used = set(), [], 0
for i, ex in enumerate(exs):
    if len(qs) >= nq: break
    q = ex["question"].strip()
    if q in seen: continue
    seen.add(q); qs.append(q); used = i + 1
if len(qs) < nq:
    sys.exit("bench-serve: only %d distinct questions in %s" % (len(qs), path))
with open(qout, "w") as f:
    for q in qs: f.write(json.dumps({"question": q}) + "\n")
with open(dout, "w") as f:
    for ex in exs[:max(used, ndoc)]:
        f.write(json.dumps({"id": ex["id"], "ctxs": ex["ctxs"][:nper] if nper else ex["ctxs"]}) + "\n")
EOF
NPASS=$(python3 -c 'import json,sys; print(sum(len(json.loads(l)["ctxs"]) for l in open(sys.argv[1])))' "$TMP/docs.jsonl")

# the estimate (one-at-a-time CPU costs per ~2K-token query with <= 32 tokens out: full ~3.3 s, blend ~1 s)
QPERMODE=0; for n in $CLIENTS; do QPERMODE=$((QPERMODE + n * PER)); done
NMODES=$(echo $MODES | wc -w); [ -n "$BASE_BIN" ] && NMODES=$((NMODES + 1))
python3 - "$NPASS" "$QPERMODE" "$MODES" "${BASE_BIN:+base_blend}" <<'EOF'
import sys
npass, q, modes = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split() + sys.argv[4].split()
cost = {"full": 3.3, "prefix": 3.0, "reuse": 0.9, "blend": 1.0, "base_blend": 1.0}
t = npass * 1.6 + sum(q * cost[m] for m in modes)
print("bench-serve: estimate (2 CPU cores, one query at a time; a batching cb-blend should be faster): ingest "
      "%d passages ~%.0f min, then %d queries per mode x %d modes (%s) ~%.0f min in all"
      % (npass, npass * 1.6 / 60.0, q, len(modes), " ".join(modes), t / 60.0))
EOF

jfield() { python3 -c 'import json,sys
try: v=json.loads(sys.argv[1])
except Exception: print(""); sys.exit()
for k in sys.argv[2].split("."):
    v = v.get(k) if isinstance(v, dict) else None
print("" if v is None else v)' "$1" "$2"; }
stats_of() { build/bin/cb-send --timeout 5000 --retries 0 "$1" '{"type":"stats"}' 2>/dev/null | tail -n 1; }

echo "bench-serve: stack on ${PORT:+ports $PORT..$((PORT + 4)), }state in $TMP; $CB_COMMON_THREADS threads"
stack_start_all || die "the stack did not start"
CUR_BIN=$STACK_BIN/cb-blend

# ---- ingest (skipped when BENCH_SERVE_STATE holds a finished one of the same documents)
T0=$SECONDS
if [ -f "$TMP/ingested" ] && [ "$(cat "$TMP/ingested")" = "$NPASS" ]; then
  echo "bench-serve: reusing the ingest of $NPASS passages in $TMP"
  INGEST_S=0
else
build/bin/cbctl -q ingest "$TMP/docs.jsonl" || die "cbctl ingest failed"
echo "bench-serve: $NPASS passages acknowledged; waiting for cb-precompute (chunks, KV files, index)"
last="" last_t=$SECONDS t_print=0
while :; do
  js=$(stats_of "$CB_PRECOMPUTE_ENDPOINT")
  q=$(jfield "$js" jobs_queued) r=$(jfield "$js" jobs_running) d=$(jfield "$js" jobs_done) f=$(jfield "$js" jobs_failed) c=$(jfield "$js" chunks_done)
  if [ -n "$q" ] && [ -n "$r" ]; then
    [ "$q" -eq 0 ] && [ "$r" -eq 0 ] && break
    [ "$d $f $c" != "$last" ] && { last="$d $f $c"; last_t=$SECONDS; }
  fi
  if [ $((SECONDS - t_print)) -ge 15 ]; then
    t_print=$SECONDS; echo "  ... ${d:-?} of $NPASS documents done (${c:-?} chunks, ${f:-?} failed), $((SECONDS - T0)) s"
  fi
  [ $((SECONDS - last_t)) -ge 120 ] && die "cb-precompute made no progress for 120 s (logs: $OUTDIR/logs)"
  [ $((SECONDS - T0)) -ge "$INGEST_TIMEOUT" ] && die "ingest not done in $INGEST_TIMEOUT s (BENCH_SERVE_INGEST_TIMEOUT)"
  sleep 1
done
INGEST_S=$((SECONDS - T0))
RJS=$(stats_of "$CB_RETRIEVER_ENDPOINT")
echo "bench-serve: ingest done in $INGEST_S s: $d documents, $c chunks (${f} failed); retriever: $(jfield "$RJS" chunks) chunks"
[ "$f" -eq 0 ] || echo "bench-serve: warning: $f documents failed in cb-precompute" >&2
echo "$NPASS" >"$TMP/ingested"
fi

# ---- cb-blend binaries
start_blend() { # BIN: start it as cb-blend, wait for its worker
  svc_start blend "$1" && stack_ready blend || die "$1 did not start"
  CUR_BIN=$1
}
warmup() {
  [ "$WARMUP" -gt 0 ] || return 0
  timeout 600 build/bin/cb-load --clients 1 --queries "$WARMUP" --mode blend --max-tokens 2 --timeout 120000 --json \
    "$EP" "$TMP/queries.jsonl" >/dev/null 2>>"$OUTDIR/cb-load.log" || echo "bench-serve: warning: warm-up query failed" >&2
}
use_blend() { # BIN
  if [ "$1" != "$CUR_BIN" ]; then
    echo "  (cb-blend: $1)"
    stack_stop blend 30 || echo "bench-serve: cb-blend ignored SIGTERM for 30 s: killed it" >&2
    start_blend "$1"; warmup
  fi
}
if [ "$BLEND_BIN" = "$CUR_BIN" ]; then warmup; else use_blend "$BLEND_BIN"; fi

# ---- the points
run_point() { # LABEL MODE N
  local label=$1 mode=$2 n=$3 s0 s1 js rc=0 bound
  s0=$(stats_of "$EP")
  bound=$((n * PER * QBOUND + 300))
  build/bin/cb-load --clients "$n" --per-client "$PER" --mode "$mode" --max-tokens "$MAXTOK" --timeout 120000 --json \
    "$EP" "$TMP/queries.jsonl" >"$TMP/load.json" 2>>"$OUTDIR/cb-load.log" &
  LOADPID=$!
  local t0=$SECONDS
  while kill -0 "$LOADPID" 2>/dev/null; do
    [ $((SECONDS - t0)) -ge "$bound" ] && { echo "bench-serve: $label N=$n ran past $bound s: stopped" >&2; kill -TERM "$LOADPID"; break; }
    sleep 0.2
  done
  wait "$LOADPID" || rc=$?
  LOADPID=""
  s1=$(stats_of "$EP")
  js=$(tail -n 1 "$TMP/load.json" 2>/dev/null || true)
  python3 - "$label" "$mode" "$n" "$rc" "${js:-null}" "${s0:-null}" "${s1:-null}" "$CUR_BIN" >>"$POINTS" <<'EOF'
import json, sys
def load(s):
    try: return json.loads(s)
    except Exception: return None
print(json.dumps({"label": sys.argv[1], "mode": sys.argv[2], "clients": int(sys.argv[3]), "rc": int(sys.argv[4]),
                  "load": load(sys.argv[5]), "stats_before": load(sys.argv[6]), "stats_after": load(sys.argv[7]),
                  "binary": sys.argv[8]}))
EOF
  tail -n 1 "$POINTS" | python3 -c '
import json, sys
p = json.loads(sys.stdin.read()); l = p["load"]
if not l: print("  %-10s N=%-3d  no result (cb-load exit %d; see cb-load.log)" % (p["label"], p["clients"], p["rc"])); sys.exit()
print("  %-10s N=%-3d %4d queries in %7.1f s: %6.3f q/s, TTFT p50 %7.0f p99 %7.0f ms, %6.1f out tok/s, prompt %s, errors %d (overloaded %d)"
      % (p["label"], p["clients"], l["queries"], l["wall_s"], l["qps"], l["ttft_ms"]["p50"], l["ttft_ms"]["p99"],
         l.get("tokens_per_s") or 0, "%.0f" % l["prompt_tokens_mean"] if l.get("prompt_tokens_mean") is not None else "?",
         l["errors"], l["overloaded"]))'
}

CONFIGS=()
for m in $MODES; do CONFIGS+=("$m:$m:$BLEND_BIN"); done
[ -n "$BASE_BIN" ] && CONFIGS+=("base_blend:blend:$BASE_BIN")
echo "bench-serve: $NQ questions, k=$K, <= $MAXTOK tokens, $PER queries per client; N in: $CLIENTS; modes: ${CONFIGS[*]%%:*}"
idx=0 TSTART=$SECONDS
for n in $CLIENTS; do
  order=("${CONFIGS[@]}")
  if [ $((idx % 2)) -eq 1 ]; then order=(); for ((j = ${#CONFIGS[@]} - 1; j >= 0; j--)); do order+=("${CONFIGS[$j]}"); done; fi
  echo "== N = $n clients"
  for c in "${order[@]}"; do
    label=${c%%:*} rest=${c#*:}; mode=${rest%%:*} bin=${rest#*:}
    use_blend "$bin"
    run_point "$label" "$mode" "$n"
  done
  if [ $idx -eq 0 ]; then  # a measured estimate of the rest, as if it scaled like one-at-a-time serving
    done_q=$((n * PER)) left=$((QPERMODE - n * PER)) el=$((SECONDS - TSTART))
    [ $left -gt 0 ] && echo "bench-serve: the first N took $el s; the rest ($left queries per mode) at that rate: ~$(( (el * left / done_q + 59) / 60 )) min (less if batching helps)"
  fi
  idx=$((idx + 1))
done

python3 - "$POINTS" "$OUTDIR/summary.json" "$NQ" "$PER" "$MAXTOK" "$K" "$CTX" "$CHUNK" "$NPASS" "$INGEST_S" "$CLIENTS" "$BLEND_BIN" "$BASE_BIN" <<'EOF'
import json, sys
pts_path, out = sys.argv[1], sys.argv[2]
nq, per, maxtok, k, ctx, chunk, npass, ingest_s = (int(x) for x in sys.argv[3:11])
clients = [int(x) for x in sys.argv[11].split()]
blend_bin, base_bin = sys.argv[12], sys.argv[13] or None
pts = [json.loads(l) for l in open(pts_path) if l.strip()]

def delta(p, key):
    a, b = p.get("stats_before") or {}, p.get("stats_after") or {}
    if not isinstance(a.get(key), (int, float)) or not isinstance(b.get(key), (int, float)): return None
    return b[key] - a[key]

rows = {}
for p in pts:
    l = p["load"] or {}
    dt, dms, dsteps = delta(p, "decode_tokens"), delta(p, "decode_ms"), delta(p, "steps")
    r = {"clients": p["clients"], "queries": l.get("queries"), "ok": l.get("ok"), "wall_s": l.get("wall_s"),
         "qps": l.get("qps"), "ttft_p50_ms": (l.get("ttft_ms") or {}).get("p50"), "ttft_p99_ms": (l.get("ttft_ms") or {}).get("p99"),
         "total_p50_ms": (l.get("total_ms") or {}).get("p50"),
         "tokens_generated": l.get("tokens_generated"), "output_tok_s": l.get("tokens_per_s"),
         "decode_tok_s": (dt / (dms / 1000.0)) if dt is not None and dms else None,
         "tokens_per_step": (dt / dsteps) if dt is not None and dsteps else None,
         "prefill_ms": delta(p, "prefill_ms"), "decode_ms": dms, "decode_tokens": dt, "steps": dsteps,
         "prompt_tokens_mean": l.get("prompt_tokens_mean"), "generated_mean": l.get("generated_mean"),
         "errors": l.get("errors"), "overloaded": l.get("overloaded"), "cb_load_rc": p["rc"], "binary": p["binary"]}
    rows.setdefault(p["label"], {})[p["clients"]] = r

def ratio(a, b):
    return a / b if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None
def get(label, n, key):
    return (rows.get(label, {}).get(n) or {}).get(key)
ratios = {"blend_over_full_qps": {str(n): ratio(get("blend", n, "qps"), get("full", n, "qps")) for n in clients},
          "blend_over_base_blend_qps": {str(n): ratio(get("blend", n, "qps"), get("base_blend", n, "qps")) for n in clients}
                                        if "base_blend" in rows else None}
lo, hi = min(clients), max(clients)
ratios["decode_tok_s_max_n_over_min_n"] = {"n": [hi, lo], **{lab: ratio(get(lab, hi, "decode_tok_s"), get(lab, lo, "decode_tok_s")) for lab in rows}}
ratios["output_tok_s_max_n_over_min_n"] = {"n": [hi, lo], **{lab: ratio(get(lab, hi, "output_tok_s"), get(lab, lo, "output_tok_s")) for lab in rows}}
res = {"config": {"questions": nq, "per_client": per, "max_tokens": maxtok, "k": k, "ctx_size": ctx, "chunk_tokens": chunk,
                  "passages": npass, "ingest_s": ingest_s, "clients": clients, "blend_binary": blend_bin, "base_binary": base_bin},
       "modes": {lab: {str(n): r for n, r in sorted(v.items())} for lab, v in rows.items()},
       "ratios": ratios, "points": pts}
json.dump(res, open(out, "w"), indent=2)

def f(v, fmt):
    return "-" if v is None else fmt % v
print("\nsummary (%d questions, k=%d, <= %d tokens, %d queries per client; client-side TTFT):" % (nq, k, maxtok, per))
print("  %-10s %4s %8s %9s %9s %9s %10s %7s %7s %5s %6s %9s" % ("mode", "N", "q/s", "TTFTp50", "TTFTp99", "out tok/s",
      "dec tok/s", "tok/stp", "prompt", "gen", "errors", "overload"))
for lab in rows:
    for n in sorted(rows[lab]):
        r = rows[lab][n]
        print("  %-10s %4d %8s %9s %9s %9s %10s %7s %7s %5s %6s %9s" % (lab, n, f(r["qps"], "%.3f"), f(r["ttft_p50_ms"], "%.0f"),
              f(r["ttft_p99_ms"], "%.0f"), f(r["output_tok_s"], "%.1f"), f(r["decode_tok_s"], "%.1f"), f(r["tokens_per_step"], "%.2f"),
              f(r["prompt_tokens_mean"], "%.0f"), f(r["generated_mean"], "%.1f"), f(r["errors"], "%d"), f(r["overloaded"], "%d")))
print("  blend/full q/s:       " + ", ".join("N=%d %s" % (n, f(ratios["blend_over_full_qps"][str(n)], "%.2fx")) for n in clients))
if ratios["blend_over_base_blend_qps"]:
    print("  blend/base_blend q/s: " + ", ".join("N=%d %s" % (n, f(ratios["blend_over_base_blend_qps"][str(n)], "%.2fx")) for n in clients))
for key, name in (("decode_tok_s_max_n_over_min_n", "decode tok/s"), ("output_tok_s_max_n_over_min_n", "output tok/s")):
    d = ratios[key]
    print("  %s N=%d / N=%d: " % (name, hi, lo) + ", ".join("%s %s" % (lab, f(d[lab], "%.2fx")) for lab in rows))
print("written to " + out)
EOF
