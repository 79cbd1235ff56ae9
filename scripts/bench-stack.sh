#!/usr/bin/env bash
# bench-stack.sh (`make bench-stack`): the same RAG queries through the stack and in process, side by side.
#
#   1. Latency before the first token, blend mode, measured back to back for each repetition (the load of a
#      shared machine drifts less within a few seconds): in process (cb-rag: same prompt, config and code
#      path; its warm run, chunks in memory), then through the stack (cbctl query: client-side TTFT, send ->
#      first token message) with cb-blend's memory tier, then through a second cb-blend over the same
#      cache without a memory tier (every chunk loaded from its KV file, page cache warm). Every chunk was
#      computed and stored by one warm-up query first.
#      The stack's added latency is reported two ways, both as a share of the in-process TTFT (target < 5%):
#        - measured from its parts (robust on a busy machine): messaging = client TTFT - server TTFT;
#          service = server TTFT - fused prefill (queueing, cache-index lookup, tokenizing, sampling);
#          file load on the critical path = resolve + load wait inside the prefill (KV files only);
#        - side by side: stack TTFT - in-process TTFT (medians of the paired runs per query; noisy when
#          other jobs share the CPU, since both sides are dominated by the prefill).
#      Full-prefill TTFT in process is shown for scale.
#   2. Throughput with N concurrent clients (N in BENCH_CLIENTS, default "1 4 16"): queries/s and client
#      TTFT p50/p99 (cb-load), blend mode, memory tier on.
#
# Queries: the first BENCH_QUERIES (6) MuSiQue examples of data/musique_dev.jsonl, each with its first
# BENCH_CONTEXTS (2) passages as explicit contexts ("{title}\n\n{text}"), BENCH_MAX_TOKENS (16) generated
# tokens, greedy. BENCH_REPS (3) measured runs per query and setting. BENCH_LOAD_QUERIES (16) queries per
# throughput point (at least N). Threads: CB_COMMON_THREADS (2). Output: a table on stdout and
# $BENCH_OUT (build/bench-stack.json). The stack (scripts/lib/stack.bash) runs on free loopback ports
# (BENCH_PORT=P: P..P+4, the file-only cb-blend on P+5) with its state in a temporary directory. Timings on
# a shared machine are noisy: compare the columns of one run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
NQ=${BENCH_QUERIES:-6}
NCTX=${BENCH_CONTEXTS:-2}
MAXTOK=${BENCH_MAX_TOKENS:-16}
REPS=${BENCH_REPS:-3}
CLIENTS=${BENCH_CLIENTS:-1 4 16}
LOADQ=${BENCH_LOAD_QUERIES:-16}
OUT=${BENCH_OUT:-build/bench-stack.json}
PORT=${BENCH_PORT:-}
export CB_COMMON_THREADS=${CB_COMMON_THREADS:-2}
export CB_MODEL=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export CB_COMMON_MODEL=$CB_MODEL
[ -f "$CB_MODEL" ] || { echo "bench-stack: model $CB_MODEL not found (make model)" >&2; exit 1; }
for b in cb-retriever cb-cacheindex cb-precompute cb-blend cbctl cb-rag cb-load; do
  [ -x build/bin/$b ] || { echo "bench-stack: build/bin/$b missing (make)" >&2; exit 1; }
done

. scripts/lib/stack.bash
STACK_FAIL="bench-stack: "
TMP=$(mktemp -d /tmp/cb-bench.XXXXXX)
stack_init "$TMP/var"                 # the services are stopped at exit, then the folder removed
stack_at_exit 'rm -rf "$TMP"'
stack_ports $PORT
export CB_BLEND_MAX_TOKENS=$MAXTOK CB_BLEND_MODE=blend CB_BLEND_CTX_SIZE=${CB_BLEND_CTX_SIZE:-2048}
export CB_BLEND_MAX_QUEUE=64 CB_CBCTL_QUERY_TIMEOUT_MS=600000

python3 - "$NQ" "$NCTX" >"$TMP/queries.jsonl" <<'EOF'
import json, sys
n, k = int(sys.argv[1]), int(sys.argv[2])
with open("data/musique_dev.jsonl") as f:
    for i, line in enumerate(f):
        if i >= n: break
        ex = json.loads(line)
        ctx = ["%s\n\n%s" % (c["title"], c["text"]) for c in ex["ctxs"][:k]]
        print(json.dumps({"question": ex["question"], "contexts": ctx}))
EOF

# args_for I: the cb-rag / cbctl arguments (contexts, question) of query I, one per line (NUL-safe via files)
mkdir -p "$TMP/q"
python3 - "$TMP/queries.jsonl" "$TMP/q" <<'EOF'
import json, sys, os
for i, line in enumerate(open(sys.argv[1])):
    q = json.loads(line)
    d = os.path.join(sys.argv[2], str(i)); os.makedirs(d)
    open(os.path.join(d, "question"), "w").write(q["question"])
    for j, c in enumerate(q["contexts"]):
        open(os.path.join(d, "ctx%d" % j), "w").write(c)
EOF
qargs() { local d="$TMP/q/$1" f; ARGS=(); for f in "$d"/ctx*; do ARGS+=(--context "$(cat "$f")"); done; QUESTION=$(cat "$d/question"); }
median() { python3 -c 'import sys,statistics; v=[float(x) for x in sys.argv[1:]]; print(statistics.median(v))' "$@"; }
jfield() { python3 -c 'import json,sys; v=json.loads(sys.argv[1])
for k in sys.argv[2].split("."): v=v[int(k)] if isinstance(v,list) else v[k]
print(v)' "$1" "$2"; }

echo "bench-stack: $NQ queries x $NCTX MuSiQue passages, $MAXTOK tokens, $CB_COMMON_THREADS threads, $REPS runs each"
echo "== in process, full prefill (cb-rag), for scale"
declare -a IN_BLEND IN_FULL NPROMPT ST_MEM ST_FILE
for i in $(seq 0 $((NQ - 1))); do
  qargs "$i"
  js=$(build/bin/cb-rag --mode full --repeat 2 --json "${ARGS[@]}" "$QUESTION")
  IN_FULL[$i]=$(python3 -c 'import json,sys; print(min(json.loads(sys.argv[1])["ttft_ms"]))' "$js")
  NPROMPT[$i]=$(jfield "$js" n_prompt)
  printf '  query %d: %4d prompt tokens: full-prefill TTFT %7.1f ms\n' "$i" "${NPROMPT[$i]}" "${IN_FULL[$i]}"
done

# Two cb-blend instances over the same cache: the stack's (memory tier on) and a second one without a memory
# tier (every chunk read from its KV file), so that each repetition measures in process, memory tier and
# files back to back (paired: the machine's load drifts less within a few seconds).
stack_start_all || exit 1
if [ -n "$PORT" ]; then FILE_EP=tcp://127.0.0.1:$((PORT + 5)); else FILE_EP=tcp://127.0.0.1:$(stack_free_port); fi
stack_launch blend blend-files CB_BLEND_ENDPOINT="$FILE_EP" CB_BLEND_HOT_CACHE_BYTES=0
svc_wait_ping "$FILE_EP" 20 "${SVC_PID[blend-files]}" && svc_wait_stat blend-files "$FILE_EP" worker_ready true || exit 1
# one query: in process (warm run of cb-rag), stack with memory tier, stack from files; appends the
# stack's --json lines to $TMP/mem.jsonl and $TMP/file.jsonl; prints "in mem file"
one_rep() {
  local i=$1 js inp m f
  js=$(build/bin/cb-rag --mode blend --repeat 2 --json "${ARGS[@]}" "$QUESTION")
  inp=$(jfield "$js" ttft_ms.1)
  js=$(build/bin/cbctl query --json --mode blend "${ARGS[@]}" "$QUESTION" | tail -n 1)
  printf '{"q":%d,"r":%s}\n' "$i" "$js" >>"$TMP/mem.jsonl"; m=$(jfield "$js" client.ttft_ms)
  js=$(build/bin/cbctl "--blend.endpoint=$FILE_EP" query --json --mode blend "${ARGS[@]}" "$QUESTION" | tail -n 1)
  printf '{"q":%d,"r":%s}\n' "$i" "$js" >>"$TMP/file.jsonl"; f=$(jfield "$js" client.ttft_ms)
  echo "$inp $m $f"
}
echo "== blend mode: in process (cb-rag, chunks in memory) | stack, memory tier | stack, KV files   (client TTFT, ms)"
for i in $(seq 0 $((NQ - 1))); do
  qargs "$i"
  build/bin/cbctl query --json --mode blend "${ARGS[@]}" "$QUESTION" >/dev/null                      # computes + stores the chunks
  build/bin/cbctl "--blend.endpoint=$FILE_EP" query --json --mode blend "${ARGS[@]}" "$QUESTION" >/dev/null  # page cache
  ins=(); mems=(); files=()
  for r in $(seq 1 "$REPS"); do
    read -r a b c < <(one_rep "$i")
    ins+=("$a"); mems+=("$b"); files+=("$c")
    printf '  query %d run %d: %7.1f | %7.1f | %7.1f\n' "$i" "$r" "$a" "$b" "$c"
  done
  IN_BLEND[$i]=$(median "${ins[@]}"); ST_MEM[$i]=$(median "${mems[@]}"); ST_FILE[$i]=$(median "${files[@]}")
done
stack_stop blend-files

echo "== throughput (cb-load, blend mode, memory tier on)"
LOADJS=()
for n in $CLIENTS; do
  q=$LOADQ; [ "$q" -lt "$n" ] && q=$n
  js=$(build/bin/cb-load --clients "$n" --queries "$q" --mode blend --max-tokens "$MAXTOK" --json "$CB_BLEND_ENDPOINT" "$TMP/queries.jsonl")
  LOADJS+=("$js")
  printf '  %2d clients: %2d queries in %6.2f s: %.3f queries/s, TTFT p50 %7.1f ms, p99 %7.1f ms (errors %d)\n' "$n" "$q" \
    "$(jfield "$js" wall_s)" "$(jfield "$js" qps)" "$(jfield "$js" ttft_ms.p50)" "$(jfield "$js" ttft_ms.p99)" "$(jfield "$js" errors)"
done

mkdir -p "$(dirname "$OUT")"
python3 - "$OUT" "$NQ" "$TMP/mem.jsonl" "$TMP/file.jsonl" "${IN_FULL[*]}" "${IN_BLEND[*]}" "${ST_MEM[*]}" "${ST_FILE[*]}" "${NPROMPT[*]}" "${LOADJS[@]}" <<'EOF2'
import json, statistics, sys
out, nq, memf, filef = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
full, inb, mem, fil, npr = ([float(x) for x in a.split()] for a in sys.argv[5:10])
loads = [json.loads(x) for x in sys.argv[10:]]
med = statistics.median
base = med(inb)
def parts(path, files):
    rows = [json.loads(l) for l in open(path)]
    msg = [r["r"]["client"]["ttft_ms"] - r["r"]["metrics"]["ttft_ms"] for r in rows]
    svc = [r["r"]["metrics"]["ttft_ms"] - r["r"]["metrics"]["blend_ms"] for r in rows]
    load = [r["r"]["metrics"]["resolve_ms"] + r["r"]["metrics"]["load_wait_ms"] for r in rows] if files else [0.0] * len(rows)
    lookup = [r["r"]["metrics"]["lookup_ms"] for r in rows]
    tot = [a + b + c for a, b, c in zip(msg, svc, load)]
    return {"messaging_ms": med(msg), "service_ms": med(svc), "lookup_ms": med(lookup), "file_load_ms": med(load),
            "added_ms": med(tot), "added_pct": 100 * med(tot) / base, "runs": len(rows)}
def side(st):
    d = [s - b for s, b in zip(st, inb)]
    return {"added_ms_median": med(d), "added_pct_median": 100 * med([x / b for x, b in zip(d, inb)])}
res = {"queries": nq, "prompt_tokens": npr, "inprocess_full_ttft_ms": full, "inprocess_blend_ttft_ms": inb,
       "stack_mem_ttft_ms": mem, "stack_file_ttft_ms": fil,
       "parts_mem": parts(memf, False), "parts_file": parts(filef, True),
       "side_by_side_mem": side(mem), "side_by_side_file": side(fil), "throughput": loads}
json.dump(res, open(out, "w"), indent=2)
pm, pf = res["parts_mem"], res["parts_file"]
print("\nsummary (medians; in-process TTFT blend %.1f ms, full %.1f ms; %d prompt tokens):" % (base, med(full), med(npr)))
print("  stack added latency before the first token, from its parts:")
print("    memory tier: messaging %.2f + service %.2f (lookup %.2f) = %.2f ms = %.2f%% of in-process TTFT"
      % (pm["messaging_ms"], pm["service_ms"], pm["lookup_ms"], pm["added_ms"], pm["added_pct"]))
print("    KV files:    messaging %.2f + service %.2f (lookup %.2f) + file load %.2f = %.2f ms = %.2f%%"
      % (pf["messaging_ms"], pf["service_ms"], pf["lookup_ms"], pf["file_load_ms"], pf["added_ms"], pf["added_pct"]))
print("  side by side (stack - in process, paired per query; noisy): memory tier %+.1f ms (%+.1f%%), KV files %+.1f ms (%+.1f%%)"
      % (res["side_by_side_mem"]["added_ms_median"], res["side_by_side_mem"]["added_pct_median"],
         res["side_by_side_file"]["added_ms_median"], res["side_by_side_file"]["added_pct_median"]))
for l in loads:
    print("  %2d clients: %.3f queries/s, TTFT p50 %.1f ms, p99 %.1f ms" % (l["clients"], l["qps"], l["ttft_ms"]["p50"], l["ttft_ms"]["p99"]))
print("written to " + out)
EOF2
