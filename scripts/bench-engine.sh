#!/usr/bin/env bash
# bench-engine.sh: our CPU engine against llama.cpp (llama-cpp-python) on the same GGUF, same prompt
# token ids and the same thread count, side by side (`make bench-engine`).
#
# Measures prefill tokens/s at each prompt length (default 512, 2048, 8000), decode tokens/s (greedy
# steps after the first prompt) and peak RSS, and prints ours / llama.cpp ratios, then the decode bound of
# this machine's memory bandwidth (cb-bench --bandwidth) and both decodes as a fraction of it. llama.cpp runs with
# flash attention off and on (its default in llama-cpp-python is off; llama-cli's "auto" turns it on
# for CPU) and, per row, the faster of the two is the reference. Its weight-repacking / AMX buffer
# types are off unless BENCH_LLAMA_EXTRA_BUFTS=1: on VMs that advertise AMX without enabling it (this
# one) that path dies with SIGILL, and Q4_1 has no repacked CPU kernel anyway.
#
# Environment: CB_MODEL, BENCH_THREADS (2), BENCH_LENS (512,2048,8000), BENCH_DECODE (128),
# BENCH_REPS (1: best of N per prefill), BENCH_FA ("0 1": llama.cpp flash-attention settings to try),
# BENCH_OUT (build/bench-engine.json), BENCH_BASE (another cb-bench binary, e.g. one built from an earlier
# commit: run right after ours with the same arguments and shown as a "base" column with ours/base, so a
# change is measured side by side in one run).
# Timings on a shared machine are noisy: compare the two columns of one run, not runs of different days.
set -euo pipefail
cd "$(dirname "$0")/.."

MODEL=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
THREADS=${BENCH_THREADS:-2}
LENS=${BENCH_LENS:-512,2048,8000}
DECODE=${BENCH_DECODE:-128}
REPS=${BENCH_REPS:-1}
FA=${BENCH_FA:-0 1}
OUT=${BENCH_OUT:-build/bench-engine.json}

[ -f "$MODEL" ] || { echo "bench-engine: model $MODEL not found (make model)" >&2; exit 1; }
[ -x build/bin/cb-bench ] || make -j2 build/bin/cb-bench >/dev/null
mkdir -p "$(dirname "$OUT")"

echo "bench-engine: $MODEL, $THREADS threads, prompt lengths $LENS, $DECODE decode steps" >&2
echo "  ours ..." >&2
ours=$(build/bin/cb-bench --model "$MODEL" --threads "$THREADS" --lens "$LENS" --decode "$DECODE" --reps "$REPS" --bandwidth --json)
base=null
if [ -n "${BENCH_BASE:-}" ]; then
  echo "  base ($BENCH_BASE) ..." >&2
  base=$("$BENCH_BASE" --model "$MODEL" --threads "$THREADS" --lens "$LENS" --decode "$DECODE" --reps "$REPS" --json)
fi

llama_runs=()
if python3 -c "import llama_cpp" 2>/dev/null; then
  for fa in $FA; do
    echo "  llama.cpp (flash_attn=$fa) ..." >&2
    run=$(python3 - "$MODEL" "$THREADS" "$LENS" "$DECODE" "$REPS" "$fa" <<'PY'
import ctypes, json, os, resource, sys, time
import numpy as np
import llama_cpp.llama_cpp as lowlevel
model, threads, lens, n_dec, reps, fa = sys.argv[1], int(sys.argv[2]), [int(x) for x in sys.argv[3].split(",")], \
    int(sys.argv[4]), int(sys.argv[5]), sys.argv[6] == "1"
if os.environ.get("BENCH_LLAMA_EXTRA_BUFTS") != "1":
    default_params = lowlevel.llama_model_default_params
    def params():
        p = default_params()
        p.use_extra_bufts = False
        return p
    lowlevel.llama_model_default_params = params
from llama_cpp import Llama
base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # the interpreter, numpy, llama_cpp
ctx = max(lens[-1], lens[0] + n_dec) + 16
t0 = time.time()
llm = Llama(model_path=model, n_ctx=ctx, n_batch=512, n_ubatch=512, n_threads=threads, n_threads_batch=threads,
            flash_attn=fa, logits_all=False, seed=0, verbose=False)
load_ms = (time.time() - t0) * 1e3
n_vocab = llm.n_vocab()
def last_logits():
    ptr = lowlevel.llama_get_logits_ith(llm._ctx.ctx, -1)
    return np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,))
toks = [(i * 7919) % 30000 + 100 for i in range(max(lens))]   # the ids cb-bench uses
prefill, decode_tok_s = [], 0.0
for li, n in enumerate(lens):
    best = 1e30
    for _ in range(reps):
        llm.reset()
        t0 = time.time()
        llm.eval(toks[:n])
        best = min(best, time.time() - t0)
    prefill.append({"n": n, "ms": best * 1e3, "tok_s": n / best})
    if li == 0 and n_dec > 0:
        t0 = time.time()
        for _ in range(n_dec):
            llm.eval([int(np.argmax(last_logits()))])
        decode_tok_s = n_dec / (time.time() - t0)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
print(json.dumps({"engine": "llama.cpp", "flash_attn": fa, "threads": threads, "load_ms": load_ms,
                  "prefill": prefill, "decode_tok_s": decode_tok_s, "peak_rss_mb": rss,
                  "python_rss_mb": base_rss}))
PY
) || { echo "bench-engine: llama.cpp run (flash_attn=$fa) failed" >&2; continue; }
    llama_runs+=("$run")
  done
else
  echo "bench-engine: python3 cannot import llama_cpp (pip install llama-cpp-python); ours only" >&2
fi

python3 - "$OUT" "$ours" "$base" "${llama_runs[@]}" <<'PY'
import json, sys
out, ours, base, runs = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), [json.loads(r) for r in sys.argv[4:]]
def best(key_fn):
    vals = [(key_fn(r), r["flash_attn"]) for r in runs]
    return max(vals) if vals else (None, None)
rows = []
for i, p in enumerate(ours["prefill"]):
    ref, fa = best(lambda r: r["prefill"][i]["tok_s"])
    rows.append(("prefill %d tok/s" % p["n"], p["tok_s"], ref, fa, base["prefill"][i]["tok_s"] if base else None))
ref, fa = best(lambda r: r["decode_tok_s"])
rows.append(("decode tok/s (after %d)" % ours["decode_after"], ours["decode_tok_s"], ref, fa,
             base["decode_tok_s"] if base else None))
rss_ref = min((r["peak_rss_mb"] for r in runs), default=None)
bcols = lambda a, b: " %10s %9s" % ("%.1f" % b, "%.3fx" % (a / b)) if base else ""
print("\n%-28s %12s %12s %8s%s" % ("threads=%d" % ours["threads"], "ours", "llama.cpp", "ratio",
                                   " %10s %9s" % ("base", "ours/base") if base else ""))
for name, a, b, fa, bb in rows:
    print("%-28s %12.1f %12s %8s%s%s" % (name, a, "%.1f" % b if b else "-", "%.2fx" % (a / b) if b else "-",
                                         bcols(a, bb), "  (llama.cpp fa=%s)" % ("on" if fa else "off") if b else ""))
print("%-28s %12.0f %12s %8s%s" % ("peak RSS MB", ours["peak_rss_mb"], "%.0f" % rss_ref if rss_ref else "-",
                                   "%.2fx" % (ours["peak_rss_mb"] / rss_ref) if rss_ref else "-",
                                   bcols(ours["peak_rss_mb"], base["peak_rss_mb"]) if base else ""))
if ours.get("decode_bound_tok_s"):
    print("decode bound: triad %.1f GB/s over %.0f MB of weights + %.1f MB of KV per step = %.1f tok/s; ours at %.0f %%%s"
          % (ours["triad_gbs"], ours["decode_weight_mb"], ours["decode_kv_mb"], ours["decode_bound_tok_s"],
             100 * ours["decode_tok_s"] / ours["decode_bound_tok_s"],
             ", llama.cpp at %.0f %%" % (100 * best(lambda r: r["decode_tok_s"])[0] / ours["decode_bound_tok_s"])
             if runs else ""))
py = min((r.get("python_rss_mb", 0) for r in runs), default=0)
if runs:
    print("(llama.cpp's RSS includes the Python interpreter with numpy and llama_cpp imported: %.0f MB before the"
          " model loads; both include the mapped weights and the KV cache of the context)" % py)
json.dump({"ours": ours, "base": base, "llama_cpp": runs}, open(out, "w"), indent=1)
print("wrote " + out)
PY
