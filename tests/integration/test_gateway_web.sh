#!/usr/bin/env bash
# Headless-browser test of cb-gateway's web page (services/gateway/www/index.html) against the real stack
# (cb-retriever, cb-cacheindex, cb-precompute, cb-blend) and cb-gateway, driven by Selenium and the
# system's headless Chromium and chromedriver (skipped, exit 77, when one of them is missing):
#   - the page loads from $GW/ and has its controls;
#   - one document typed in a textarea, one picked with the file input, a question, max tokens 16: the
#     `full` and `blend` columns both stream a non-empty answer and show the browser's TTFT, the server's
#     ttft_ms and the cacheblend counts of the final chunk;
#   - asked again: blend finds both documents' KV (2 hits, 0 misses) and recomputes fewer tokens than
#     full, and gives a non-empty answer;
#   - max tokens 0: both columns show the gateway's HTTP 400 and its error message;
#   - "Ingest these documents": the page shows a job per document and polls them until done; a
#     question without documents (the retriever's top-k), both columns asked together, then answers in both.
# A screenshot of the page after the second question is kept in build/test-logs/gateway-web.png.
. "$(dirname "$0")/lib/stack.bash"

CHROME=$(command -v chromium || command -v chromium-browser || true)
DRIVER=/usr/bin/chromedriver
if [ -z "$CHROME" ]; then echo "skip: no chromium (apt-get install chromium)"; exit 77; fi
if [ ! -x "$DRIVER" ]; then echo "skip: no $DRIVER (apt-get install chromium-driver)"; exit 77; fi
if ! python3 -c 'import selenium, sys; sys.exit(int(selenium.__version__.split(".")[0]) < 4)' 2>/dev/null; then
  echo "skip: no python3 selenium 4.x (pip install selenium)"; exit 77
fi

stack_setup
stack_start_all || svc_finish
stack_start_gateway || svc_finish

curl -s --max-time 5 "$GW/" | cmp -s - services/gateway/www/index.html
check "the gateway serves the current www/index.html (else: make build/bin/cb-gateway)" "$?" 0

# The browser runs in its own session (process group), ended with the rest at exit whatever happens.
WEB_PID=""
web_cleanup() { [ -n "$WEB_PID" ] && kill -KILL -- "-$WEB_PID" 2>/dev/null; svc_cleanup; }
trap web_cleanup EXIT

cat >"$T/drive.py" <<'EOF'
# Drives the page; prints one JSON object (what the DOM showed at each step) on stdout.
import json, os, signal, sys, time
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import Select, WebDriverWait

gw, tmp, chrome, driver_path = sys.argv[1:5]
signal.signal(signal.SIGTERM, lambda *_: sys.exit(3))   # so that `finally` quits the browser
opts = webdriver.ChromeOptions()
opts.binary_location = chrome
opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,1100",
          "--user-data-dir=" + os.path.join(tmp, "chrome-profile")):
    opts.add_argument(a)
out = {}
d = None
try:
    d = webdriver.Chrome(service=Service(driver_path, log_output=os.path.join(tmp, "chromedriver.log")), options=opts)
    d.set_page_load_timeout(20)
    d.set_script_timeout(20)
    by_id = lambda i: d.find_element(By.ID, i)
    text = lambda i: by_id(i).text

    def set_field(i, v):
        e = by_id(i); e.clear(); e.send_keys(v)

    def columns():
        r = {}
        for m in ("full", "blend"):
            r[m] = {"state": by_id("col-" + m).get_attribute("data-state"), "answer": text("answer-" + m),
                    "error": text("error-" + m)}
            for f in ("ttft", "server-ttft", "recomputed", "reused", "hits", "misses"):
                r[m][f] = text(f + "-" + m)
        return r

    def ask(limit):
        t0 = time.time()
        by_id("ask").click()
        try:
            WebDriverWait(d, limit, poll_frequency=0.2).until(lambda _: all(
                by_id("col-" + m).get_attribute("data-state") in ("done", "error") for m in ("full", "blend"))
                and by_id("ask").is_enabled())
        except Exception:
            pass   # the states say so
        r = columns()
        r["seconds"] = round(time.time() - t0, 1)
        return r

    d.get(gw + "/")
    WebDriverWait(d, 10).until(lambda _: d.find_elements(By.ID, "ask"))
    out["title"] = d.title
    out["controls"] = all(d.find_elements(By.ID, i) for i in
                          ("question", "max-tokens", "apikey", "docs", "add-doc", "files", "ingest", "order"))
    out["links"] = sorted(a.get_attribute("pathname") for a in d.find_elements(By.CSS_SELECTOR, "header nav a"))

    # one document typed, one picked as a file
    with open("data/sample/kettleby-lighthouse.md") as f:
        d.find_element(By.CSS_SELECTOR, "#docs .doc-text").send_keys(f.read())
    by_id("files").send_keys(os.path.abspath("data/sample/oraka-volcano.txt"))
    WebDriverWait(d, 10).until(lambda _: len(d.find_elements(By.CSS_SELECTOR, "#docs .doc")) == 2)
    out["doc_ids"] = [e.get_attribute("value") for e in d.find_elements(By.CSS_SELECTOR, "#docs .doc-id")]
    out["file_doc_bytes"] = d.execute_script("return document.querySelectorAll('#docs .doc-text')[1].value.length")
    set_field("question", "Who designed the Kettleby Lighthouse?")
    set_field("max-tokens", "16")
    out["first"] = ask(45)
    out["second"] = ask(30)
    d.save_screenshot(os.path.join(tmp, "gateway-web.png"))

    set_field("max-tokens", "0")
    out["bad"] = ask(10)
    set_field("max-tokens", "16")

    by_id("ingest").click()
    try:
        WebDriverWait(d, 40, poll_frequency=0.25).until(
            lambda _: by_id("ingest-status").get_attribute("data-state") in ("done", "error"))
    except Exception:
        pass
    out["ingest"] = {"state": by_id("ingest-status").get_attribute("data-state"), "text": text("ingest-status")}

    for b in d.find_elements(By.CSS_SELECTOR, "#docs .remove-doc"):
        b.click()
    set_field("question", "When did Mount Oraka last erupt?")
    Select(by_id("order")).select_by_value("together")
    out["retrieved"] = ask(30)
    out["retrieved"]["n_docs"] = len(d.find_elements(By.CSS_SELECTOR, "#docs .doc"))
    out["console_errors"] = [e["message"] for e in d.get_log("browser") if e.get("level") == "SEVERE" and "status of 400" not in e["message"]]
except BaseException as e:   # reported by the test
    out["exception"] = "%s: %s" % (type(e).__name__, str(e).splitlines()[0] if str(e) else "")
finally:
    if d is not None:
        try: d.quit()
        except Exception: pass
print(json.dumps(out))
EOF

start=$(date +%s)
setsid python3 "$T/drive.py" "$GW" "$T" "$CHROME" "$DRIVER" >"$T/web.json" 2>"$T/drive.log" &
WEB_PID=$!
for _ in $(seq 1 1500); do kill -0 "$WEB_PID" 2>/dev/null || break; sleep 0.1; done   # 150 s at most
if kill -0 "$WEB_PID" 2>/dev/null; then
  echo "FAIL: the browser run did not end within 150 s"; FAILS=$((FAILS+1))
  kill -TERM -- "-$WEB_PID" 2>/dev/null; sleep 2
fi
kill -KILL -- "-$WEB_PID" 2>/dev/null; wait "$WEB_PID" 2>/dev/null; WEB_PID=""
echo "browser run: $(( $(date +%s) - start )) s"
W=$(tail -n 1 "$T/web.json"); [ -n "$W" ] || W='{}'
mkdir -p build/test-logs
[ -f "$T/gateway-web.png" ] && cp "$T/gateway-web.png" build/test-logs/gateway-web.png

check "the driver ran without an exception" "$(jget "$W" exception)" null
[ "$(jget "$W" exception)" = null ] || tail -5 "$T/drive.log"
check "page title" "$(jget "$W" title)" cacheblend
check "page has its controls" "$(jget "$W" controls)" true
check "page links /health, /metrics and /v1/models" "$(jget "$W" links)" '["/health","/metrics","/v1/models"]'
check "a typed and a picked document" "$(jget "$W" doc_ids.1)/$(jget "$W" file_doc_bytes)" \
  "oraka-volcano.txt/$(wc -c <data/sample/oraka-volcano.txt)"

# positive: a number in "N ms" / a count
ms_ok() { [[ "$1" =~ ^[0-9]+(\.[0-9]+)?\ ms ]]; }
int_ok() { [[ "$1" =~ ^[0-9]+$ ]]; }
for step in first second retrieved; do
  for m in full blend; do
    c="$step.$m"
    check "$step question, $m: stream done" "$(jget "$W" "$c.state")/$(jget "$W" "$c.error")" "done/"
    a=$(jget "$W" "$c.answer")
    [ -n "$a" ] && [ "$a" != null ] && echo "ok: $step question, $m: answer '${a//$'\n'/ }'" \
      || { echo "FAIL: $step question, $m: empty answer"; FAILS=$((FAILS+1)); }
    ms_ok "$(jget "$W" "$c.ttft")" && ms_ok "$(jget "$W" "$c.server-ttft")" \
      && echo "ok: $step question, $m: TTFT $(jget "$W" "$c.ttft") (browser), $(jget "$W" "$c.server-ttft") (server)" \
      || { echo "FAIL: $step question, $m: TTFT '$(jget "$W" "$c.ttft")' / '$(jget "$W" "$c.server-ttft")'"; FAILS=$((FAILS+1)); }
    int_ok "$(jget "$W" "$c.recomputed")" && int_ok "$(jget "$W" "$c.reused")" && int_ok "$(jget "$W" "$c.hits")" \
      && int_ok "$(jget "$W" "$c.misses")" \
      && echo "ok: $step question, $m: recomputed $(jget "$W" "$c.recomputed"), reused $(jget "$W" "$c.reused"), hits/misses $(jget "$W" "$c.hits")/$(jget "$W" "$c.misses")" \
      || { echo "FAIL: $step question, $m: counts missing: $(jget "$W" "$c")"; FAILS=$((FAILS+1)); }
  done
  echo "     ($step question: $(jget "$W" "$step.seconds") s in the browser)"
done
check "second question, blend: both documents' KV found" "$(jget "$W" second.blend.hits)/$(jget "$W" second.blend.misses)" "2/0"
rf=$(jget "$W" second.full.recomputed); rb=$(jget "$W" second.blend.recomputed)
int_ok "$rf" && int_ok "$rb" && [ "$rb" -lt "$rf" ] && echo "ok: blend recomputes fewer tokens than full ($rb < $rf)" \
  || { echo "FAIL: blend recomputed $rb tokens, full $rf"; FAILS=$((FAILS+1)); }
for m in full blend; do
  e=$(jget "$W" "bad.$m.error")
  check "max tokens 0, $m: an error column" "$(jget "$W" "bad.$m.state")" error
  [[ "$e" == "HTTP 400"*max_tokens* ]] && echo "ok: max tokens 0, $m: shows '$e'" \
    || { echo "FAIL: max tokens 0, $m: error text '$e'"; FAILS=$((FAILS+1)); }
done
check "ingest: every job done" "$(jget "$W" ingest.state)" done
it=$(jget "$W" ingest.text)
check "ingest: two jobs shown, each done" "$(grep -c ' job [0-9a-f]\+ *done' <<<"$it")" 2
check "retrieval question: no documents on the page" "$(jget "$W" retrieved.n_docs)" 0
check "no errors in the browser console" "$(jget "$W" console_errors)" "[]"
check "precompute: the page's two documents ingested" "$(stack_stat precompute jobs_done)" 2
svc_finish
