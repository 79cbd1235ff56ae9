#!/usr/bin/env bash
# cb-gateway (docs/gateway.md) against the real stack, with clients no one here wrote:
#   1. POST /v1/documents ingests data/sample (job ids), GET /v1/documents/jobs/{job} reaches done;
#   2. the `openai` Python package: a plain and a streamed chat completion with `documents` answer what
#      `cbctl query --context ...` answers for the same question and contexts; without documents, what
#      `cbctl query` (retrieval) answers; usage and the `cacheblend` metrics are there; /v1/models;
#   3. `curl -N`: the SSE stream (data: lines, [DONE]);
#   4. /metrics parsed by prometheus_client's text parser: the counters moved by what the test did;
#      /health 200 with every service;
#   5. bad input: malformed JSON, wrong types, out-of-range values, a body over the limit, 10,000 headers,
#      an unknown path, a wrong method; a client that disconnects mid-stream (its query cancelled in
#      cb-blend); the gateway keeps serving others after each;
#   6. gateway.api_key: 401 without the key or with a wrong one, served with it, /health open;
#   7. cb-blend stopped (SIGSTOP): a chat completion ends 504 in bounded time; cb-blend killed: 503 and
#      /health 503 naming blend.
. "$(dirname "$0")/lib/stack.bash"
stack_setup
svc_need build/bin/cb-gateway
python3 -c 'import openai, prometheus_client' 2>/dev/null || { echo "skip: the openai and prometheus_client packages are missing (scripts/bootstrap.sh)"; exit 77; }
command -v curl >/dev/null || { echo "skip: no curl"; exit 77; }
export CB_GATEWAY_MAX_BODY_BYTES=1M CB_GATEWAY_FIRST_TIMEOUT_MS=2000
stack_start_all || svc_finish
stack_start_gateway || svc_finish

# --- 1-4: the clients --------------------------------------------------------------------------------
mapfile -t QS < data/sample/questions.lst
C1=$(head -c 1500 data/sample/kettleby-lighthouse.md)
C2=$(head -c 1500 data/sample/oraka-volcano.txt)
TOK=16
# cbctl's answers, the reference: with contexts (blend and full), and retrieved (after the ingest below)
ref_ctx_blend=$(cbctl query --max-tokens $TOK --context "$C1" --context "$C2" "${QS[0]}") || { echo "FAIL: cbctl query"; FAILS=$((FAILS+1)); }
ref_ctx_full=$(cbctl query --mode full --max-tokens $TOK --context "$C1" --context "$C2" "${QS[1]}") || { echo "FAIL: cbctl query full"; FAILS=$((FAILS+1)); }
printf '%s' "$ref_ctx_blend" >"$T/ref_blend"; printf '%s' "$ref_ctx_full" >"$T/ref_full"
printf '%s' "$C1" >"$T/c1"; printf '%s' "$C2" >"$T/c2"

python3 - "$GW" "$T" "${QS[0]}" "${QS[1]}" "${QS[2]}" "$TOK" "$CBCTL" <<'PY' || FAILS=$((FAILS + 1))
import json, os, subprocess, sys, time, urllib.request, urllib.error
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

gw, T, q0, q1, q2, tok, cbctl = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5], int(sys.argv[6]), sys.argv[7]
rd = lambda n: open(os.path.join(T, n)).read()
c1, c2, ref_blend, ref_full = rd("c1"), rd("c2"), rd("ref_blend"), rd("ref_full")
fails = 0
def check(cond, what):
    global fails
    print(("ok: " if cond else "FAIL: ") + what, flush=True)
    fails += not cond

def http(method, path, body=None, headers=None, timeout=60):
    data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
    req = urllib.request.Request(gw + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()

def metrics():
    st, text = http("GET", "/metrics")
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
def m(ms, name, **labels): return ms.get((name, tuple(sorted(labels.items()))), 0.0)

m0 = metrics()
check(m(m0, "cacheblend_service_up", service="blend") == 1, "metrics parse; cacheblend_service_up{blend} = 1")

# 1. ingest over HTTP
docs = [{"id": f, "text": open(os.path.join("data/sample", f)).read()} for f in sorted(os.listdir("data/sample")) if f != "questions.lst"]
st, body = http("POST", "/v1/documents", {"documents": docs}, {"Content-Type": "application/json"})
j = json.loads(body)
check(st == 200 and len(j.get("data", [])) == len(docs) and all(len(d["job"]) == 32 for d in j["data"]),
      f"POST /v1/documents: {len(docs)} documents acknowledged with job ids (status {st})")
deadline, states = time.time() + 120, []
while time.time() < deadline:
    states = [json.loads(http("GET", "/v1/documents/jobs/" + d["job"])[1]).get("state") for d in j.get("data", [])]
    if states and all(s == "done" for s in states): break
    time.sleep(0.5)
check(states and all(s == "done" for s in states), f"GET /v1/documents/jobs/ID: every job done ({states})")
st, body = http("GET", "/v1/documents/jobs/" + "0" * 32)
check(st == 404 and json.loads(body)["error"]["code"] == "not_found", f"unknown job: 404 not_found ({st})")

# 2. the openai client
client = OpenAI(base_url=gw + "/v1", api_key="unused", max_retries=0, timeout=120)
r = client.chat.completions.create(model="cacheblend", messages=[{"role": "system", "content": "ignored"}, {"role": "user", "content": q0}],
                                   max_tokens=tok, extra_body={"documents": [c1, c2]})
check(r.choices[0].message.content == ref_blend, f"openai plain, documents: the answer equals cbctl query's ({r.choices[0].message.content!r})")
check(r.object == "chat.completion" and r.choices[0].finish_reason in ("stop", "length"), f"openai plain: object and finish_reason ({r.choices[0].finish_reason})")
check(r.usage.prompt_tokens > 0 and r.usage.completion_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens,
      f"openai plain: usage {r.usage.prompt_tokens}+{r.usage.completion_tokens}")
ext = (r.model_extra or {}).get("cacheblend", {})
check(ext.get("mode") == "blend" and ext.get("ttft_ms", 0) > 0 and "tokens_recomputed" in ext and "cache_hits" in ext,
      f"openai plain: the cacheblend extension carries the done metrics (ttft_ms {ext.get('ttft_ms')})")
s = client.chat.completions.create(model="cacheblend", messages=[{"role": "user", "content": q1}], max_tokens=tok, stream=True,
                                   extra_body={"documents": [c1, c2], "cacheblend": {"mode": "full"}})
parts, finish = [], None
for ch in s:
    if ch.choices:
        parts.append(ch.choices[0].delta.content or "")
        finish = ch.choices[0].finish_reason or finish
check("".join(parts) == ref_full and finish in ("stop", "length"), f"openai streamed, mode full: the joined deltas equal cbctl's answer ({''.join(parts)!r}, {finish})")
ref_ret = subprocess.run([cbctl, "query", "--max-tokens", str(tok), q2], capture_output=True, text=True).stdout.rstrip("\n")
r = client.chat.completions.create(model="cacheblend", messages=[{"role": "user", "content": q2}], max_tokens=tok)
ext = (r.model_extra or {}).get("cacheblend", {})
check(r.choices[0].message.content == ref_ret and ext.get("n_chunks", 0) > 0 and ext.get("cache_hits", 0) > 0,
      f"openai without documents: retrieval, precomputed chunks hit, the answer equals cbctl's ({r.choices[0].message.content!r})")
# stop sequences and penalties reach cb-blend (its done.finish_reason becomes the choice's)
cut = ref_blend.find(" ", 12)
if cut > 0:
    stop = ref_blend[cut:cut + 4]
    r = client.chat.completions.create(model="cacheblend", messages=[{"role": "user", "content": q0}], max_tokens=tok, stop=[stop, "\u2603"],
                                       extra_body={"documents": [c1, c2]})
    want = ref_blend[:ref_blend.find(stop)]
    check(r.choices[0].message.content == want and r.choices[0].finish_reason == "stop",
          f"stop {stop!r}: the answer ends before it, finish_reason stop ({r.choices[0].message.content!r})")
r = client.chat.completions.create(model="cacheblend", messages=[{"role": "user", "content": q0}], max_tokens=tok, frequency_penalty=2.0,
                                   extra_body={"documents": [c1, c2]})
check(r.choices[0].message.content != ref_blend, f"frequency_penalty 2 changes the answer ({r.choices[0].message.content!r})")
models = client.models.list()
check(len(models.data) == 1 and models.data[0].id.endswith(".gguf") and len((models.data[0].model_extra or {}).get("fingerprint", "")) == 64,
      f"GET /v1/models: {models.data[0].id if models.data else None}")

# 3. curl -N: the SSE stream as bytes
out = subprocess.run(["curl", "-sN", "--max-time", "60", gw + "/v1/chat/completions", "-H", "Content-Type: application/json", "-d",
                      json.dumps({"messages": [{"role": "user", "content": q0}], "documents": [c1, c2], "max_tokens": tok, "stream": True})],
                     capture_output=True, text=True).stdout
events = [l for l in out.split("\n") if l.startswith("data: ")]
text = "".join(json.loads(e[6:])["choices"][0]["delta"].get("content", "") for e in events[:-1])
check(events and events[-1] == "data: [DONE]" and text == ref_blend and out.count("\n\n") >= len(events),
      f"curl -N: {len(events)} SSE events ending with [DONE], the text equals cbctl's")

# 4. metrics moved, health
m1 = metrics()
d = lambda name, **lb: m(m1, name, **lb) - m(m0, name, **lb)
ok_total = sum(v for (n, lb), v in m1.items() if n == "cacheblend_requests_total" and ("outcome", "ok") in lb) - \
           sum(v for (n, lb), v in m0.items() if n == "cacheblend_requests_total" and ("outcome", "ok") in lb)
n_ok = 6 if cut > 0 else 5
check(ok_total == n_ok, f"cacheblend_requests_total{{outcome=ok}} moved by the {n_ok} chat completions ({ok_total})")
check(d("cacheblend_requests_total", mode="full", outcome="ok") == 1, "one of them counted as mode full")
check(d("cacheblend_time_to_first_token_seconds_count", mode="blend") == n_ok - 1, f"TTFT histogram: {n_ok - 1} blend observations (the full one apart)")
check(d("cacheblend_generation_tokens_total") > 0 and d("cacheblend_prompt_tokens_total") > 0 and d("cacheblend_tokens_reused_total") > 0,
      "token counters moved (prompt, generation, reused)")
check(m(m1, "cacheblend_ingest_jobs", state="done") >= len(docs) and m(m1, "cacheblend_kv_cache_entries") > 0,
      f"ingest jobs done {m(m1, 'cacheblend_ingest_jobs', state='done')}, KV cache entries {m(m1, 'cacheblend_kv_cache_entries')}")
check(d("cacheblend_http_responses_total", handler="documents", code="200") == 1, "http responses counted by handler and code")
st, body = http("GET", "/health")
check(st == 200 and json.loads(body)["status"] == "ok" and len(json.loads(body)["services"]) == 4, f"/health: 200, 4 services ({st})")

# 5. bad input
def err(st, body): 
    try: return json.loads(body)["error"]
    except Exception: return {}
chat = lambda b, **kw: http("POST", "/v1/chat/completions", b, {"Content-Type": "application/json"}, **kw)
st, b = chat(b'{"messages": [')
check(st == 400 and err(st, b).get("type") == "invalid_request_error", f"malformed JSON: 400 ({st}, {err(st, b).get('message')})")
for body, param in [({"messages": "hi"}, "messages"), ({"messages": [{"role": "user", "content": q0}], "max_tokens": "5"}, "max_tokens"),
                    ({"messages": [{"role": "user", "content": q0}], "temperature": 3}, "temperature"),
                    ({"messages": [{"role": "user", "content": q0}], "stop": [1]}, "stop"),
                    ({"messages": [{"role": "user", "content": q0}], "documents": "x"}, "documents"),
                    ({"messages": [{"role": "user", "content": q0}], "cacheblend": {"mode": "fast"}}, "cacheblend.mode"),
                    ({"messages": [{"role": "assistant", "content": "no question"}]}, "messages")]:
    st, b = chat(body)
    check(st == 400 and err(st, b).get("param") == param, f"wrong field {param}: 400 with param ({st}, {err(st, b).get('message')})")
big = os.path.join(T, "big.json")
with open(big, "w") as f: json.dump({"messages": [{"role": "user", "content": q0}], "documents": ["x" * 2000000]}, f)
for extra, what in [([], "with Content-Length"), (["-H", "Transfer-Encoding: chunked"], "chunked")]:
    res = subprocess.run(["curl", "-s", "--max-time", "30", "-o", os.path.join(T, "413"), "-w", "%{http_code}", gw + "/v1/chat/completions",
                          "-H", "Content-Type: application/json", *extra, "--data-binary", "@" + big], capture_output=True, text=True)
    code = res.stdout.strip()
    body = open(os.path.join(T, "413")).read() if os.path.exists(os.path.join(T, "413")) else ""
    check(code == "413" and err(413, body).get("code") == "body_too_large", f"a 2 MB body over the 1 MiB limit ({what}): 413 ({code})")
st, b = chat({"messages": [{"role": "user", "content": q0}], "documents": [c1 * 20]})  # 30 KB: under the body limit
check(st == 400 and err(st, b).get("code") == "context_length_exceeded", f"a prompt over the context: 400 context_length_exceeded ({st})")
import socket
def raw(data, read=True):
    sk = socket.create_connection(("127.0.0.1", int(gw.rsplit(":", 1)[1])), timeout=10)
    sk.sendall(data)
    got = b""
    try:
        while read:
            chunk = sk.recv(65536)
            if not chunk: break
            got += chunk
    except (socket.timeout, ConnectionResetError):
        pass
    sk.close()
    return got
hdrs = b"".join(b"X-H%d: %d\r\n" % (i, i) for i in range(10000))
got = raw(b"GET /health HTTP/1.1\r\nHost: x\r\n" + hdrs + b"\r\n")
status = got.split(b" ", 2)[1] if got.startswith(b"HTTP/") else b"closed"
check(status in (b"431", b"413", b"400", b"closed"), f"10,000 headers: refused ({status.decode()})")
got = raw(b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: 1\r\n" % i for i in range(150)) + b"\r\n")
check(got.startswith(b"HTTP/1.1 431"), f"150 small headers (over gateway.max_headers 100): 431 ({got[:12]!r})")
st, b = http("GET", "/v2/nothing")
check(st == 404 and err(st, b).get("code") == "not_found", f"unknown path: 404 ({st})")
st, b = http("GET", "/v1/chat/completions")
check(st == 405, f"GET on chat completions: 405 ({st})")
# a client that goes away mid-stream: its query is cancelled in cb-blend
def blend_cancelled():
    return m(metrics(), "cacheblend_blend_queries_cancelled_total")
before = blend_cancelled()
body = json.dumps({"messages": [{"role": "user", "content": q0}], "documents": [c1, c2], "max_tokens": 400, "stream": True,
                   "cacheblend": {"mode": "full"}}).encode()
sk = socket.create_connection(("127.0.0.1", int(gw.rsplit(":", 1)[1])), timeout=30)
sk.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
first = sk.recv(4096)
sk.close()
check(first.startswith(b"HTTP/1.1 200") and b"text/event-stream" in first, "streamed request started (200, event-stream)")
deadline = time.time() + 30
while time.time() < deadline and blend_cancelled() <= before: time.sleep(0.2)
after = blend_cancelled()
check(after == before + 1, f"the client went away mid-stream: cb-blend cancelled its query ({before} -> {after})")
mm = metrics()
check(m(mm, "cacheblend_requests_total", mode="full", outcome="cancelled") >= 1, "the gateway counted it cancelled")
r = client.chat.completions.create(model="cacheblend", messages=[{"role": "user", "content": q0}], max_tokens=tok, extra_body={"documents": [c1, c2]})
check(r.choices[0].message.content == ref_blend, "after all that, the gateway still answers (same answer)")
sys.exit(1 if fails else 0)
PY

# --- 6. the API key -----------------------------------------------------------------------------------
svc_stop gateway >/dev/null
CB_GATEWAY_API_KEY=s3cret CB_GATEWAY_MAX_CONNECTIONS=4 stack_start_gateway || svc_finish
python3 - "$GW" <<'PY' || FAILS=$((FAILS + 1))
import socket, sys, time
port = int(sys.argv[1].rsplit(":", 1)[1])
held = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(4)]
time.sleep(0.3)
extra = socket.create_connection(("127.0.0.1", port), timeout=5)
extra.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
try:
    got = extra.recv(100)
except (ConnectionResetError, socket.timeout):
    got = b""
ok1 = not got.startswith(b"HTTP/1.1 200")
print(("ok: " if ok1 else "FAIL: ") + f"gateway.max_connections 4: a 5th connection is refused ({got[:12]!r})")
for s in held: s.close()
time.sleep(0.3)
s = socket.create_connection(("127.0.0.1", port), timeout=5)
s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
got = s.recv(100)
ok2 = got.startswith(b"HTTP/1.1 200")
print(("ok: " if ok2 else "FAIL: ") + f"... and served again once they close ({got[:12]!r})")
sys.exit(0 if ok1 and ok2 else 1)
PY
code=$(curl -s -o "$T/401" -w '%{http_code}' "$GW/v1/models")
check "no key: 401" "$code/$(jget "$(cat "$T/401")" error.code)" "401/invalid_api_key"
code=$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer wrong' "$GW/v1/models")
check "wrong key: 401" "$code" "401"
code=$(curl -s -o /dev/null -w '%{http_code}' -H 'Authorization: Bearer s3cret' "$GW/v1/models")
check "the key: 200" "$code" "200"
code=$(curl -s -o /dev/null -w '%{http_code}' "$GW/health")
check "/health needs no key" "$code" "200"
python3 - "$GW" "${QS[0]}" <<'PY' && echo "ok: openai client with api_key served" || { echo "FAIL: openai client with the key"; FAILS=$((FAILS+1)); }
import sys
from openai import OpenAI, AuthenticationError
c = OpenAI(base_url=sys.argv[1] + "/v1", api_key="s3cret", max_retries=0)
assert c.chat.completions.create(model="m", messages=[{"role": "user", "content": sys.argv[2]}], max_tokens=4).choices[0].message.content
try:
    OpenAI(base_url=sys.argv[1] + "/v1", api_key="nope", max_retries=0).models.list(); sys.exit(1)
except AuthenticationError:
    pass
PY

# --- 7. cb-blend stopped, then gone -------------------------------------------------------------------
BODY='{"messages":[{"role":"user","content":"Who designed the Kettleby Lighthouse?"}],"max_tokens":4,"documents":["x"]}'
# a full prefill of both contexts (~1.5 s here) that cannot come from the cache
LONG=$(python3 -c 'import json,sys; print(json.dumps({"messages":[{"role":"user","content":sys.argv[1]}],"max_tokens":400,"documents":[sys.argv[2],sys.argv[3]],"cacheblend":{"mode":"full"}}))' "${QS[3]:-${QS[0]}}" "$C2" "$C1")
# stopped before the query: no ZeroMQ handshake within the send timeout -> 503
kill -STOP "${SVC_PID[blend]}"
t0=$SECONDS
code=$(curl -s -o "$T/503s" -w '%{http_code}' --max-time 30 -H 'Authorization: Bearer s3cret' "$GW/v1/chat/completions" -d "$BODY")
check "cb-blend stopped before the query: 503 unavailable" "$code/$(jget "$(cat "$T/503s")" error.code)" "503/unavailable"
kill -CONT "${SVC_PID[blend]}"
# stopped while it answers: silent for 3 heartbeat intervals -> 504
curl -s -o "$T/504" -w '%{http_code}' --max-time 30 -H 'Authorization: Bearer s3cret' "$GW/v1/chat/completions" -d "$LONG" >"$T/504.code" &
cpid=$!
blend_running() { [ "$(stack_stat blend running)" = 1 ]; }
wait_until 10 blend_running || { echo "FAIL: the long query never ran"; FAILS=$((FAILS+1)); }
kill -STOP "${SVC_PID[blend]}"
t0=$SECONDS
wait $cpid
check "cb-blend stopped mid-answer: 504 timeout" "$(cat "$T/504.code")/$(jget "$(cat "$T/504")" error.code)" "504/timeout"
[ $((SECONDS - t0)) -le 10 ] && echo "ok: ... within $((SECONDS - t0)) s (the silence allowed)" || { echo "FAIL: 504 took $((SECONDS - t0)) s"; FAILS=$((FAILS+1)); }
kill -CONT "${SVC_PID[blend]}"
stack_kill9 blend
code=$(curl -s -o "$T/503" -w '%{http_code}' --max-time 30 -H 'Authorization: Bearer s3cret' "$GW/v1/chat/completions" -d "$BODY")
check "cb-blend gone: 503" "$code/$(jget "$(cat "$T/503")" error.code)" "503/unavailable"
code=$(curl -s -o "$T/h503" -w '%{http_code}' --max-time 30 "$GW/health")
check "/health: 503 naming blend" "$code/$(jget "$(cat "$T/h503")" down)" '503/["blend"]'
svc_stop gateway
svc_finish
