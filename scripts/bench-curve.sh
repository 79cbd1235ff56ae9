#!/usr/bin/env bash
# bench-curve.sh (`make bench-curve`): what CURVE + ZAP cost, side by side in one run.
#
#   Two fresh stacks of the four services at once (scripts/lib/stack.bash, no gateway), the same
#   configuration but common.curve: "off" and "on" (with a key set made by `cbctl keys init`), each on free
#   loopback ports (BENCH_CURVE_PORT=P: "off" on P..P+4, "on" on P+10..P+14); state in a temporary directory
#   removed on exit.
#   1. Ingest throughput: BENCH_CURVE_ROUNDS rounds; each round takes BENCH_CURVE_DOCS new MuSiQue passages
#      (BENCH_CURVE_MUSIQUE, default /work/shared/data/musique_dev.jsonl; data/sample's documents when it
#      is missing) and runs `cbctl ingest --wait` of them on one stack, then on the other, alternating which
#      goes first. Documents/s = passages / wall time of the cbctl run (cbctl -> cb-precompute ->
#      cb-retriever + cb-cacheindex; the KV compute dominates).
#   2. TTFT of cached queries: data/sample ingested into both; then BENCH_CURVE_QUERIES identical
#      `cbctl query --json` of one sample question (retrieval by cb-blend from cb-retriever, the chunks'
#      KV cached), alternating which stack goes first, after 3 warm-up queries each. Client TTFT (cbctl's
#      query sent -> first token, a new connection and handshake each time, as cbctl makes) and
#      cb-blend's metrics.ttft_ms (the service receiving the query -> first token).
#   3. The transport alone, against cb-retriever: 6 x 4000 round trips on one connection (`cb-send --repeat`)
#      of a ping and of a search (a reply of 5 chunk texts), and 6 x 400 pings on a new connection each
#      (`--fresh`: connect + handshake + request), alternating the stacks: medians of the p50s, and the CPU
#      time per request of the client and of cb-retriever (robust to the other processes on the machine).
# Output: a table on stdout and $BENCH_CURVE_OUT/summary.json (default results/bench-curve);
# BENCH_CURVE_KEEP=1 keeps the services' logs (off-*.log, on-*.log; cb-precompute's "doc ... done in N ms"
# lines time the compute).
# A benchmark, not a test: timings on a shared machine are noisy; compare the columns of one run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${BENCH_CURVE_ROUNDS:-2}
NDOCS=${BENCH_CURVE_DOCS:-16}
NQ=${BENCH_CURVE_QUERIES:-30}
MAXTOK=${BENCH_CURVE_MAX_TOKENS:-4}
PORT=${BENCH_CURVE_PORT:-}
MUSIQUE=${BENCH_CURVE_MUSIQUE:-/work/shared/data/musique_dev.jsonl}
OUTDIR=${BENCH_CURVE_OUT:-results/bench-curve}
die() { echo "bench-curve: $*" >&2; exit 1; }
for b in cb-retriever cb-cacheindex cb-precompute cb-blend cbctl; do [ -x build/bin/$b ] || die "build/bin/$b missing (make)"; done
export CB_MODEL=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
export CB_COMMON_MODEL=$CB_MODEL
[ -f "$CB_COMMON_MODEL" ] || die "model $CB_COMMON_MODEL not found (make model)"
. scripts/lib/stack.bash
STACK_FAIL="bench-curve: "
TMP=$(mktemp -d /tmp/cb-bench-curve.XXXXXX)
stack_init "$TMP/off" "$TMP/log"   # the services of both stacks are stopped at exit, then:
stack_at_exit 'if [ -n "${BENCH_CURVE_KEEP:-}" ]; then echo "bench-curve: logs kept in $TMP/log"; else rm -rf "$TMP"; fi'
export CB_COMMON_THREADS=${CB_COMMON_THREADS:-2} CB_LOG_LEVEL=${CB_LOG_LEVEL:-warn}
export CB_CBCTL_INGEST_TIMEOUT_MS=600000 CB_COMMON_KEYS_DIR="$TMP/keys"
build/bin/cbctl keys init "$TMP/keys" >/dev/null || die "cbctl keys init failed"

# the two stacks, one after the other in this shell's environment (logs off-<service>, on-<service>); each
# one's CB_* environment is kept in $TMP/<stack>.env for the measurements below
for s in off on; do
  export CB_DATA_DIR="$TMP/$s" CB_COMMON_CURVE=$s
  mkdir -p "$CB_DATA_DIR"
  base=""; [ -n "$PORT" ] && base=$PORT && [ $s = on ] && base=$((PORT + 10))
  stack_ports $base
  stack_start_all "$s-" || die "the curve-$s stack did not start (logs in $TMP/log)"
  stack_env_file "$TMP/$s.env"
done
mkdir -p "$OUTDIR"

python3 - "$TMP" "$ROUNDS" "$NDOCS" "$NQ" "$MAXTOK" "$MUSIQUE" "$OUTDIR" "${SVC_PID[off-retriever]}" "${SVC_PID[on-retriever]}" <<'PY'
import json, os, statistics, subprocess, sys, time
tmp, rounds, ndocs, nq, maxtok, musique, outdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7]
rpid = {"off": int(sys.argv[8]), "on": int(sys.argv[9])}   # the cb-retriever of each stack

# each stack's environment (endpoints, data dir, curve), as the launcher wrote it
stack_env = {s: dict(l.rstrip("\n").split("=", 1) for l in open(f"{tmp}/{s}.env") if "=" in l) for s in ("off", "on")}
def env(s):
    return dict(os.environ, **stack_env[s])

def cbctl(s, *args):
    return subprocess.run(["build/bin/cbctl", *args], env=env(s), capture_output=True, text=True, check=True).stdout

# passages: distinct MuSiQue contexts (data/sample's documents when the file is missing)
texts = []
if os.path.exists(musique):
    seen = set()
    for line in open(musique):
        for c in json.loads(line)["ctxs"]:
            t = c["text"].strip()
            if t and t not in seen:
                seen.add(t); texts.append(t)
    source = f"MuSiQue passages ({musique})"
else:
    texts = [open(os.path.join("data/sample", f)).read() for f in sorted(os.listdir("data/sample")) if f != "questions.lst"]
    source = "data/sample (MuSiQue file missing)"
need = rounds * ndocs
if len(texts) < need:
    sys.exit(f"bench-curve: {len(texts)} passages, {need} needed (lower BENCH_CURVE_DOCS or BENCH_CURVE_ROUNDS)")

ingest = {"off": [], "on": []}   # (docs, seconds) per run
for r in range(rounds):
    d = os.path.join(tmp, f"docs{r}")
    os.makedirs(d)
    for i, t in enumerate(texts[r * ndocs:(r + 1) * ndocs]):
        open(os.path.join(d, f"p{r}-{i:03d}.txt"), "w").write(t)
    for s in (("off", "on") if r % 2 == 0 else ("on", "off")):
        t0 = time.perf_counter()
        cbctl(s, "-q", "ingest", "--wait", d)
        ingest[s].append((ndocs, time.perf_counter() - t0))

for s in ("off", "on"):
    cbctl(s, "-q", "ingest", "--wait", "data/sample")
q = [l.strip() for l in open("data/sample/questions.lst") if l.strip()][0]
def query(s):
    out = cbctl(s, "query", "--json", "--max-tokens", str(maxtok), q).strip().split("\n")[-1]
    o = json.loads(out)
    return o["client"]["ttft_ms"], o["metrics"]["ttft_ms"], o["metrics"].get("cache_hits", 0)
for s in ("off", "on"):
    for _ in range(3): query(s)
ttft = {"off": [], "on": []}
for i in range(nq):
    for s in (("off", "on") if i % 2 == 0 else ("on", "off")):
        ttft[s].append(query(s))

# 3. the transport itself: round trips (cb-send --repeat) of a ping (about 100 bytes each way) and of a
# search (a reply of k chunk texts, several KiB) on one connection, and of a ping on a new connection each
# (--fresh: connect, handshake, request), alternating the stacks. Wall time is at the mercy of the other
# processes on the machine; the CPU time the client and cb-retriever spend is not, so it is counted too.
import re, resource
def cpu_children():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
def cpu_pid(pid):
    f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
def rtt(s, req, n, fresh):
    c0, s0 = cpu_children(), cpu_pid(rpid[s])
    r = subprocess.run(["build/bin/cb-send", "--repeat", str(n)] + (["--fresh"] if fresh else []) +
                       [stack_env[s]["CB_RETRIEVER_ENDPOINT"], req], env=env(s), capture_output=True, text=True, check=True)
    c1, s1 = cpu_children(), cpu_pid(rpid[s])
    m = re.search(r"mean ([0-9.]+) ms, p50 ([0-9.]+) ms", r.stderr)
    return float(m.group(1)), float(m.group(2)), len(r.stdout), c1 - c0, s1 - s0, n
reqs = {"ping": ('{"type":"ping"}', 4000, False), "search": (json.dumps({"type": "search", "query": q, "k": 5}), 4000, False),
        "ping_new_connection": ('{"type":"ping"}', 400, True)}
rt = {k: {"off": [], "on": []} for k in reqs}
for k, (req, n, fresh) in reqs.items():
    for i in range(6):
        for s in (("off", "on") if i % 2 == 0 else ("on", "off")):
            rt[k][s].append(rtt(s, req, n, fresh))

res = {"source": source, "rounds": rounds, "docs_per_round": ndocs, "queries": nq, "question": q, "max_tokens": maxtok}
for s in ("off", "on"):
    docs = sum(n for n, _ in ingest[s]); secs = sum(t for _, t in ingest[s])
    cl = [c for c, _, _ in ttft[s]]; sv = [v for _, v, _ in ttft[s]]
    res[s] = {"ingest_docs": docs, "ingest_s": round(secs, 3), "docs_per_s": round(docs / secs, 3),
              "ingest_runs_s": [round(t, 3) for _, t in ingest[s]],
              "client_ttft_ms": {"median": round(statistics.median(cl), 3), "mean": round(statistics.mean(cl), 3),
                                 "p90": round(sorted(cl)[int(0.9 * (len(cl) - 1))], 3)},
              "server_ttft_ms": {"median": round(statistics.median(sv), 3), "mean": round(statistics.mean(sv), 3),
                                 "p90": round(sorted(sv)[int(0.9 * (len(sv) - 1))], 3)},
              "cache_hits_min": min(h for _, _, h in ttft[s])}
    for k in reqs:
        runs = rt[k][s]
        total = sum(r[5] for r in runs)
        res[s][f"{k}_rtt_ms"] = {"p50": round(statistics.median(r[1] for r in runs), 4),
                                 "mean": round(statistics.mean(r[0] for r in runs), 4),
                                 "client_cpu_us": round(1e6 * sum(r[3] for r in runs) / total, 2),
                                 "server_cpu_us": round(1e6 * sum(r[4] for r in runs) / total, 2),
                                 "requests": total, "reply_bytes": runs[0][2]}
def pct(a, b): return round(100.0 * (b - a) / a, 2) if a else None
res["cost_pct"] = {"docs_per_s": round(100.0 * (res["off"]["docs_per_s"] - res["on"]["docs_per_s"]) / res["off"]["docs_per_s"], 2),
                   "client_ttft_median": pct(res["off"]["client_ttft_ms"]["median"], res["on"]["client_ttft_ms"]["median"]),
                   "server_ttft_median": pct(res["off"]["server_ttft_ms"]["median"], res["on"]["server_ttft_ms"]["median"])}
json.dump(res, open(os.path.join(outdir, "summary.json"), "w"), indent=2)
print(f"bench-curve: {source}; ingest {rounds} x {ndocs} passages per stack; {nq} identical cached queries, max_tokens {maxtok}")
print(f"{'':28}{'curve off':>12}{'curve on':>12}{'CURVE cost':>12}")
print(f"{'ingest documents/s':28}{res['off']['docs_per_s']:>12.2f}{res['on']['docs_per_s']:>12.2f}{res['cost_pct']['docs_per_s']:>11.2f}%")
for k, name in (("client_ttft_ms", "client TTFT median (ms)"), ("server_ttft_ms", "server TTFT median (ms)")):
    a, b = res["off"][k]["median"], res["on"][k]["median"]
    print(f"{name:28}{a:>12.2f}{b:>12.2f}{100.0 * (b - a) / a:>11.2f}%")
for k, name in (("client_ttft_ms", "client TTFT mean (ms)"), ("server_ttft_ms", "server TTFT mean (ms)")):
    a, b = res["off"][k]["mean"], res["on"][k]["mean"]
    print(f"{name:28}{a:>12.2f}{b:>12.2f}{100.0 * (b - a) / a:>11.2f}%")
for k in reqs:
    o, n = res["off"][f"{k}_rtt_ms"], res["on"][f"{k}_rtt_ms"]
    a, b = o["p50"], n["p50"]
    print(f"{k + ' round trip p50 (ms)':28}{a:>12.4f}{b:>12.4f}{100.0 * (b - a) / a:>11.2f}%   ({1000 * (b - a):+.1f} us)")
    a, b = o["client_cpu_us"] + o["server_cpu_us"], n["client_cpu_us"] + n["server_cpu_us"]
    print(f"{'  CPU a request (us)':28}{a:>12.1f}{b:>12.1f}{100.0 * (b - a) / a:>11.2f}%   ({b - a:+.1f} us: client + cb-retriever, {o['requests']} requests)")
print(f"(cost: on vs off; positive = CURVE slower; summary: {os.path.join(outdir, 'summary.json')})")
PY
