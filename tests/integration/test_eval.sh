#!/usr/bin/env bash
# test_eval: cb-eval on two short answerable examples (3 passages of ~60 words each) with the real model:
# every mode writes a line per example, the blend modes get a first-token KL against full, a mode with
# kv=q8_0 reads q8_0 chunk files from KV_DIR/q8_0 while the others read f16 files from KV_DIR, the summary
# names the run's dtype, --summarize rebuilds it from the results, and a bad mode token is refused.
# Exit 0 pass, 77 skip (no model or python3).
set -u
cd "$(dirname "$0")/../.."
model=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$model" ] && command -v python3 >/dev/null || { echo "skip: no model or python3"; exit 77; }
d=$(mktemp -d /tmp/test_eval.XXXXXX)
trap 'rm -rf "$d"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

python3 - "$d/data.jsonl" <<'EOF' || fail "making the data"
import json, sys
out = open(sys.argv[1], "w")
for i, line in enumerate(open("data/answerable.jsonl")):
    if i == 2:
        break
    d = json.loads(line)
    keep = sorted(set(d["planted"]) | {0, 1})[:3]
    d["ctxs"] = [{"title": d["ctxs"][k]["title"], "text": " ".join(d["ctxs"][k]["text"].split()[:60])} for k in keep]
    out.write(json.dumps(d) + "\n")
EOF

modes=full,blend,blend:kv=q8_0,reuse:kv=q8_0
build/bin/cb-eval --model "$model" --threads 1 --data "$d/data.jsonl" --modes $modes --max-new 4 \
  --kv-dir "$d/kv" --out "$d/out" > "$d/eval.txt" 2> "$d/eval.err" || { cat "$d/eval.err"; fail "cb-eval failed"; }

python3 - "$d" <<'EOF' || fail "results"
import glob, json, os, struct, sys
d = sys.argv[1]
rows = [json.loads(l) for l in open(f"{d}/out/results.jsonl")]
modes = ["full", "blend", "blend:kv=q8_0", "reuse:kv=q8_0"]
assert len(rows) == 8, len(rows)
for r in rows:
    assert r["mode"] in modes, r["mode"]
    if r["mode"] != "full":
        assert isinstance(r["kl_first"], float) and r["kl_first"] >= 0, r
def dtypes(pattern):
    out = set()
    for p in glob.glob(pattern):
        with open(p, "rb") as f:
            h = f.read(256)
        assert h[:8] == b"CBKVFILE", p
        out.add(struct.unpack_from("<I", h, 128)[0])
    return out
# 2 examples x 3 distinct passages: each chunk once per dtype
assert dtypes(f"{d}/kv/[0-9a-f][0-9a-f]/*.kv") == {1}, "f16 files in KV_DIR"
assert dtypes(f"{d}/kv/q8_0/[0-9a-f][0-9a-f]/*.kv") == {8}, "q8_0 files in KV_DIR/q8_0"
n16 = len(glob.glob(f"{d}/kv/[0-9a-f][0-9a-f]/*.kv"))
n8 = len(glob.glob(f"{d}/kv/q8_0/[0-9a-f][0-9a-f]/*.kv"))
assert n16 == n8 == 6, (n16, n8)
s = json.load(open(f"{d}/out/summary.json"))
assert s["config"]["kv_dtype"] == "f16", s["config"]
assert set(s["modes"]) == set(modes), s["modes"].keys()
assert s["modes"]["blend:kv=q8_0"]["n"] == 2
EOF

build/bin/cb-eval --out "$d/sum" --summarize "$d/out/results.jsonl" > /dev/null 2> "$d/sum.err" ||
  { cat "$d/sum.err"; fail "--summarize"; }
grep -q '"blend:kv=q8_0"' "$d/sum/summary.json" || fail "--summarize lost the kv= mode"

build/bin/cb-eval --model "$model" --data "$d/data.jsonl" --modes full,blend:kv=q4 --kv-dir "$d/kv" \
  --out "$d/bad" > /dev/null 2> "$d/bad.err"
[ $? -eq 2 ] || fail "a bad kv= dtype was not refused with exit 2"
grep -q 'bad mode "blend:kv=q4"' "$d/bad.err" || { cat "$d/bad.err"; fail "bad mode message"; }
echo "cb-eval ok"
