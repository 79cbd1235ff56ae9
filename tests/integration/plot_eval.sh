#!/usr/bin/env bash
# plot_eval: scripts/plot-eval turns two synthetic summary.json files (written to a temporary
# directory and removed again; the numbers mean nothing) into a PNG, and rejects a bad file.
# Exit 0 pass, 77 skip (no gnuplot or python3).
set -u
cd "$(dirname "$0")/../.."
command -v gnuplot >/dev/null && command -v python3 >/dev/null || exit 77
d=$(mktemp -d /tmp/plot_eval.XXXXXX)
trap 'rm -rf "$d"' EXIT
for r in 0.15 0.3; do
  cat > "$d/s$r.json" <<JSON
{"modes": {"full": {"n": 2, "f1": 0.5, "agree_f1": 1.0, "first_token_match": 1.0, "ttft_ms": 100, "ttft_ratio": 1.0, "recompute_frac": 1.0},
           "blend": {"n": 2, "f1": 0.4, "agree_f1": 0.7, "first_token_match": 0.5, "ttft_ms": $(python3 -c "print(20+100*$r)"), "ttft_ratio": $(python3 -c "print(0.2+$r)"), "recompute_frac": $r}},
 "config": {"ratio": $r}}
JSON
done
scripts/plot-eval -o "$d/a.png" "$d/s0.15.json" "$d/s0.3.json" > "$d/out.txt" || { cat "$d/out.txt"; exit 1; }
grep -q "blend r=0.15" "$d/out.txt" && grep -q "^full " "$d/out.txt" || { echo "unexpected table:"; cat "$d/out.txt"; exit 1; }
[ "$(head -c 8 "$d/a.png" | od -An -tx1 | tr -d ' \n')" = "89504e470d0a1a0a" ] || { echo "not a PNG"; exit 1; }
scripts/plot-eval --x ratio --logx --no-merge -o "$d/b.png" "$d/s0.15.json" "$d/s0.3.json" > /dev/null || exit 1
[ -s "$d/b.png" ] || exit 1
echo '{"config": {}}' > "$d/bad.json"
if scripts/plot-eval -o "$d/c.png" "$d/bad.json" 2> "$d/err.txt"; then echo "bad summary accepted"; exit 1; fi
grep -q 'no "modes" object' "$d/err.txt" || { cat "$d/err.txt"; exit 1; }
echo "plot-eval ok"
