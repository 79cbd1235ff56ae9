#!/usr/bin/env bash
# bench-gateway.sh (`make bench-gateway`): what cb-gateway adds, side by side in one run.
#
#   1. A fresh stack with the gateway (scripts/lib/stack.bash; free loopback ports, or BENCH_GW_PORT..+4 and
#      HTTP on BENCH_GW_HTTP when set; state in a temporary directory removed on exit); data/sample ingested
#      through POST /v1/documents.
#   2. Added latency to the first token: BENCH_GW_ROUNDS rounds over the sample questions, each with the
#      four sample documents as contexts (the same prompt both ways, its chunks cached after a warm-up),
#      max_tokens BENCH_GW_MAX_TOKENS, mode blend; per question one `cbctl query --json` and one streamed
#      chat completion over HTTP (a new connection each, as a client library makes), alternating which
#      goes first. Client TTFT: cbctl's own (query sent -> first token) and, for HTTP, request sent -> first
#      content delta read. Both also carry cb-blend's server-side ttft_ms, so the messaging overhead of
#      each path is client TTFT - server TTFT; the gateway adds the difference of the two (medians).
#   3. Requests/s of GET /health (which pings the four services) and GET /metrics (stats of the four,
#      rendered) with 32 concurrent keep-alive connections: `ab -k -l -c 32 -n BENCH_GW_REQUESTS` (bounded
#      by -t 60 s as well).
# Output: a table on stdout and $BENCH_GW_OUT/summary.json (default results/bench-gateway).
# A benchmark, not a test: timings on a shared machine are noisy; compare the columns of one run.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
ROUNDS=${BENCH_GW_ROUNDS:-10}
MAXTOK=${BENCH_GW_MAX_TOKENS:-4}
NREQ=${BENCH_GW_REQUESTS:-5000}
PORT=${BENCH_GW_PORT:-}
HTTP=${BENCH_GW_HTTP:-}
OUTDIR=${BENCH_GW_OUT:-results/bench-gateway}
die() { echo "bench-gateway: $*" >&2; exit 1; }
for b in cb-retriever cb-cacheindex cb-precompute cb-blend cb-gateway cbctl; do [ -x build/bin/$b ] || die "build/bin/$b missing (make)"; done
command -v ab >/dev/null || die "ab is missing (apt-get install apache2-utils; scripts/bootstrap.sh)"
export CB_MODEL=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf} CB_COMMON_MODEL=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
[ -f "$CB_COMMON_MODEL" ] || die "model $CB_COMMON_MODEL not found (make model)"
. scripts/lib/stack.bash
STACK_FAIL="bench-gateway: "
TMP=$(mktemp -d /tmp/cb-bench-gw.XXXXXX)
stack_init "$TMP/var"                 # the services are stopped at exit, then the folder removed
stack_at_exit 'rm -rf "$TMP"'
export CB_COMMON_THREADS=${CB_COMMON_THREADS:-2} CB_LOG_LEVEL=${CB_LOG_LEVEL:-warn}
stack_ports $PORT
{ stack_start_all && stack_start_gateway ${HTTP:+127.0.0.1:$HTTP}; } || die "the stack did not start (logs in $STACK_LOGS)"
mkdir -p "$OUTDIR"

python3 - "$GW" "$ROUNDS" "$MAXTOK" "$OUTDIR" <<'PY'
import http.client, json, os, statistics, subprocess, sys, time
gw, rounds, maxtok, outdir = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
host, port = gw[7:].split(":")
docs = {f: open(os.path.join("data/sample", f)).read() for f in sorted(os.listdir("data/sample")) if f != "questions.lst"}
qs = [l.strip() for l in open("data/sample/questions.lst") if l.strip()]
ctx = list(docs.values())

def post(path, body):
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    c.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    r = c.getresponse(); data = r.read(); c.close()
    return r.status, json.loads(data)
st, j = post("/v1/documents", {"documents": [{"id": k, "text": v} for k, v in docs.items()]})
assert st == 200, j
for d in j["data"]:
    for _ in range(600):
        c = http.client.HTTPConnection(host, int(port), timeout=30); c.request("GET", "/v1/documents/jobs/" + d["job"])
        s = json.loads(c.getresponse().read()); c.close()
        if s["state"] in ("done", "failed"): break
        time.sleep(0.5)

def via_cbctl(q):
    args = ["build/bin/cbctl", "query", "--json", "--max-tokens", str(maxtok)]
    for t in ctx: args += ["--context", t]
    out = subprocess.run(args + [q], capture_output=True, text=True, check=True).stdout.strip().split("\n")[-1]
    o = json.loads(out)
    return o["client"]["ttft_ms"], o["metrics"]["ttft_ms"]

def via_http(q):
    body = json.dumps({"model": "cacheblend", "messages": [{"role": "user", "content": q}], "max_tokens": maxtok,
                       "stream": True, "documents": ctx})
    c = http.client.HTTPConnection(host, int(port), timeout=300)
    t0 = time.perf_counter()
    c.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
    r = c.getresponse()
    ttft, server = None, None
    buf = b""
    while True:
        line = r.fp.readline()
        if not line: break
        if not line.startswith(b"data: "): continue
        if line.startswith(b"data: [DONE]"): break
        ev = json.loads(line[6:])
        if ttft is None and ev["choices"] and ev["choices"][0]["delta"].get("content"):
            ttft = (time.perf_counter() - t0) * 1e3
        if "cacheblend" in ev: server = ev["cacheblend"]["ttft_ms"]
    c.close()
    return ttft, server

for q in qs: via_cbctl(q); via_http(q)  # warm-up: every chunk cached, both paths exercised
rows = {"cbctl": [], "http": []}
for r in range(rounds):
    for i, q in enumerate(qs):
        order = [("cbctl", via_cbctl), ("http", via_http)]
        if (r + i) % 2: order.reverse()
        for name, fn in order: rows[name].append(fn(q))
med = lambda xs: statistics.median(xs)
res = {}
for name, v in rows.items():
    res[name] = {"n": len(v), "client_ttft_ms_p50": med([a for a, _ in v]), "server_ttft_ms_p50": med([b for _, b in v]),
                 "overhead_ms_p50": med([a - b for a, b in v]), "overhead_ms_mean": statistics.mean([a - b for a, b in v])}
added = res["http"]["overhead_ms_p50"] - res["cbctl"]["overhead_ms_p50"]
res["gateway_added_ms_p50"] = added
res["gateway_added_share_of_ttft"] = added / res["cbctl"]["client_ttft_ms_p50"]
json.dump(res, open(os.path.join(outdir, "ttft.json"), "w"), indent=2)
print(f"TTFT, {rounds} rounds x {len(qs)} questions, mode blend, max_tokens {maxtok}:")
print(f"  {'path':6} {'n':>4} {'client p50 ms':>14} {'server p50 ms':>14} {'overhead p50 ms':>16}")
for name in ("cbctl", "http"):
    x = res[name]
    print(f"  {name:6} {x['n']:4d} {x['client_ttft_ms_p50']:14.2f} {x['server_ttft_ms_p50']:14.2f} {x['overhead_ms_p50']:16.2f}")
print(f"  the gateway adds {added:.2f} ms to the first token (p50), {100 * res['gateway_added_share_of_ttft']:.2f}% of cbctl's TTFT")
PY

ab_run() { # $1 = path: requests/s, mean ms, failed
  ab -k -l -q -t 60 -c 32 -n "$NREQ" "$GW$1" 2>/dev/null >"$TMP/ab.out" || true  # -l: bodies vary in length
  local rps fails mean
  rps=$(awk '/^Requests per second/ {print $4}' "$TMP/ab.out")
  mean=$(awk '/^Time per request:.*\(mean\)$/ {print $4; exit}' "$TMP/ab.out")
  fails=$(awk '/^Failed requests/ {print $3}' "$TMP/ab.out")
  non2xx=$(awk '/^Non-2xx responses/ {print $3}' "$TMP/ab.out")
  done_n=$(awk '/^Complete requests/ {print $3}' "$TMP/ab.out")
  echo "{\"path\": \"$1\", \"requests\": ${done_n:-0}, \"rps\": ${rps:-0}, \"mean_ms\": ${mean:-0}, \"failed\": ${fails:-0}, \"non2xx\": ${non2xx:-0}}"
}
echo "Requests/s with 32 concurrent keep-alive connections (ab -k -c 32 -n $NREQ):"
h=$(ab_run /health); m=$(ab_run /metrics)
python3 - "$h" "$m" "$OUTDIR" <<'PY'
import json, os, sys
h, m, outdir = json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
for x in (h, m):
    print(f"  {x['path']:9} {x['requests']:6d} requests  {x['rps']:9.1f} req/s  mean {x['mean_ms']:.2f} ms/request (x32)  failed {x['failed']}, non-2xx {x['non2xx']}")
ttft = json.load(open(os.path.join(outdir, "ttft.json")))
json.dump({"ttft": ttft, "health": h, "metrics": m}, open(os.path.join(outdir, "summary.json"), "w"), indent=2)
print(f"summary: {os.path.join(outdir, 'summary.json')}")
PY
