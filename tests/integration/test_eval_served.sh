#!/usr/bin/env bash
# test_eval_served: cb-eval measures the served path. For one answerable example (3 passages of ~60 words)
# cb-eval's answer in each mode (full, prefix, reuse, blend; greedy, at most 8 tokens, ending at its first
# line) is the beginning of cb-blend's answer to `cbctl query --mode M --context P1 --context P2 ...` with
# the same question and passages ("{title}\n\n{text}", as cb-eval builds a passage's chunk), token for token,
# with the same prompt size and the same counts of reused and recomputed rows:
# the same session (svc/session.h), prompt (ragprompt.h) and blend options, with every chunk's KV stored
# first on both sides. Both frame the prompt with the configuration's system prompt (blend.system_prompt,
# given to cb-eval with --system-prompt): it is part of the prefix every chunk's KV is computed after, so
# a different one changes the answers (reuse, which recomputes no chunk row, first). One thread on both sides.
# Exit 0 pass, 77 skip (no model or python3).
. "$(dirname "$0")/lib/stack.bash"
command -v python3 >/dev/null || { echo "skip: no python3"; exit 77; }
stack_setup
export CB_COMMON_THREADS=1
export CB_BLEND_MAX_TOKENS=8
export CB_BLEND_HOT_CACHE_BYTES=0   # chunks from their KV files on both sides (cb-eval's default: --mem-mb 0)
# the served configuration's system prompt, on both sides
SYS=$(sed -n 's/^ *system_prompt = "\(.*\)"$/\1/p' config/cacheblend.cfg | head -n 1)
[ -n "$SYS" ] || SYS="You are a helpful assistant."
export CB_BLEND_SYSTEM_PROMPT="$SYS"

python3 - "$T" <<'PY' || { echo "FAIL: making the data"; exit 1; }
import json, sys
d = sys.argv[1]
line = open("data/answerable.jsonl").readline()
ex = json.loads(line)
keep = sorted(set(ex["planted"]) | {0, 1})[:3]
ex["ctxs"] = [{"title": ex["ctxs"][k]["title"], "text": " ".join(ex["ctxs"][k]["text"].split()[:60])} for k in keep]
open(d + "/data.jsonl", "w").write(json.dumps(ex) + "\n")
open(d + "/question", "w").write(ex["question"])
for i, c in enumerate(ex["ctxs"]):
    open("%s/ctx%d" % (d, i), "w").write(c["title"] + "\n\n" + c["text"])
PY

build/bin/cb-eval --threads 1 --system-prompt "$SYS" --data "$T/data.jsonl" --modes full,prefix,reuse,blend --max-new 8 \
  --kv-dir "$T/evkv" --out "$T/ev" > "$T/eval.txt" 2> "$T/eval.err" ||
  { cat "$T/eval.err"; echo "FAIL: cb-eval"; exit 1; }

stack_start cacheindex && stack_start blend || svc_finish
CTX=()
for f in "$T"/ctx*; do CTX+=(--context "$(cat "$f")"); done
Q=$(cat "$T/question")
# cb-eval precomputes every chunk before it answers; so does one query here (a chunk computed in the query
# that reads it is used as computed, not as stored)
cbctl query --mode reuse "${CTX[@]}" "$Q" >/dev/null 2>&1
for mode in full prefix blend reuse; do
  out=$(cbctl query --json --mode "$mode" "${CTX[@]}" "$Q" 2>"$T/q.err") || { cat "$T/q.err"; }
  served=$(printf '%s\n' "$out" | tail -n 1)
  python3 - "$T/ev/results.jsonl" "$mode" "$served" > "$T/cmp.txt" 2>&1 <<'PY'
import json, sys
ev = [json.loads(l) for l in open(sys.argv[1]) if json.loads(l)["mode"] == sys.argv[2]][0]
sv = json.loads(sys.argv[3])
served, m = sv["text"], sv["metrics"]
out = ev["output"]
# the same prompt, and the same rows loaded and recomputed
shape = (ev["n_tokens"], ev["tokens_reused"], ev["tokens_recomputed"])
sshape = (m["n_prompt_tokens"], m["tokens_reused"], m["tokens_recomputed"])
print("eval %r served %r; prompt, reused, recomputed: eval %s served %s" % (out, served, shape, sshape))
sys.exit(0 if out and served.startswith(out) and shape == sshape else 1)
PY
  rc=$?
  check "$mode: cb-eval's answer is the start of cb-blend's ($(cat "$T/cmp.txt"))" "$rc" "0"
done
svc_finish
