#!/usr/bin/env bash
# eval-ab.sh: two cb-eval binaries (A = an earlier build, B = this tree's) on the same examples, interleaved
# one example at a time so that both see the same machine load, then a side-by-side table: answers that
# differ, and per-mode mean TTFT ratio (mode / full of the same binary) for A and B.
#
#   scripts/eval-ab.sh A_CB_EVAL [N] [MODES] [OUT]
#     A_CB_EVAL  the other cb-eval (e.g. built from the commit before a refactor)
#     N          first N examples of data/musique_dev.jsonl (default 20)
#     MODES      cb-eval --modes (default full,reuse,blend)
#     OUT        results directory (default results/ab)
# Environment: CB_EVAL_B (default build/bin/cb-eval), CB_EVAL_DATA (default data/musique_dev.jsonl).
# Each binary keeps its own KV directory, so both precompute (untimed) and stream their own files.
set -euo pipefail
cd "$(dirname "$0")/.."
A=${1:?usage: scripts/eval-ab.sh A_CB_EVAL [N] [MODES] [OUT]}
N=${2:-20}
MODES=${3:-full,reuse,blend}
OUT=${4:-results/ab}
B=${CB_EVAL_B:-build/bin/cb-eval}
DATA=${CB_EVAL_DATA:-data/musique_dev.jsonl}
mkdir -p "$OUT/a" "$OUT/b"
: > "$OUT/a/results.jsonl"
: > "$OUT/b/results.jsonl"
for ((i = 0; i < N; i++)); do
  for side in a b; do
    bin=$A; [ $side = b ] && bin=$B
    CB_LOG_LEVEL=${CB_LOG_LEVEL:-warn} OMP_WAIT_POLICY=passive "$bin" --data "$DATA" --skip "$i" --limit 1 \
      --modes "$MODES" --kv-dir "$OUT/$side/kv" --out "$OUT/$side/one" > "$OUT/$side/one.log" 2>&1 ||
      { echo "eval-ab: $side failed on example $i (see $OUT/$side/one.log)" >&2; exit 1; }
    cat "$OUT/$side/one/results.jsonl" >> "$OUT/$side/results.jsonl"
  done
  echo "eval-ab: example $((i + 1))/$N done" >&2
done
python3 - "$OUT" <<'PY'
import json, sys, collections
out = sys.argv[1]
rows = {s: [json.loads(l) for l in open(f"{out}/{s}/results.jsonl")] for s in "ab"}
by = {s: {(r["id"], r["mode"]): r for r in rows[s]} for s in "ab"}
modes = list(dict.fromkeys(r["mode"] for r in rows["a"]))
ids = list(dict.fromkeys(r["id"] for r in rows["a"]))
print("%-8s %4s %10s %10s %10s %10s %8s %8s" % ("mode", "n", "same_ans", "same_tok1", "ttft_A", "ttft_B", "ratio_A", "ratio_B"))
for m in modes:
    same = tok = 0; ta = tb = ra = rb = 0.0; n = 0
    for i in ids:
        a, b = by["a"].get((i, m)), by["b"].get((i, m))
        if not a or not b: continue
        n += 1
        same += a["answer"] == b["answer"]
        tok += a["first_token"] == b["first_token"]
        ta += a["ttft_ms"]; tb += b["ttft_ms"]
        ra += a["ttft_ms"] / by["a"][(i, "full")]["ttft_ms"]
        rb += b["ttft_ms"] / by["b"][(i, "full")]["ttft_ms"]
    print("%-8s %4d %10d %10d %10.1f %10.1f %8.3f %8.3f" % (m, n, same, tok, ta / n, tb / n, ra / n, rb / n))
diff = [(i, m) for i in ids for m in modes if by["a"][(i, m)]["answer"] != by["b"][(i, m)]["answer"]]
print("answers that differ: %d%s" % (len(diff), "" if not diff else " " + ", ".join("%s/%s" % d for d in diff)))
PY
