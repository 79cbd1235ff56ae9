#!/usr/bin/env bash
# The stack in containers, for real (`make test-compose`): builds the base image when it is missing
# (scripts/base-image.sh), builds cacheblend:cpu from docker/Dockerfile.cpu, brings docker/compose.yml up
# with podman-compose as project "cbtest" on free host ports, ingests data/sample, asks a question (over
# HTTP through cb-gateway when the image has it, else `cbctl query` inside the blend container), restarts
# the blend container and asks again: the second answer's cache_hits > 0 with an empty in-memory cache
# shows that the chunk KV files on the cbdata volume were used. Then takes the stack down and removes what
# it created (containers, the volume, the network; the images stay, so a rerun builds from cache).
#
# podman-compose, not docker-compose against podman's API socket: it is the Debian package
# scripts/bootstrap.sh installs, it needs no `podman system service` running, and what it runs is plain
# `podman run` lines (CB_TEST_COMPOSE_VERBOSE=1 shows them). Its gaps (no profiles, no depends_on
# conditions, no healthcheck timers without systemd) are handled here: the services are named on `up`,
# and the compose file's health checks are run with `podman healthcheck run`.
#
# Every wait is bounded; on a failure the containers' logs are printed. ok:/FAIL: lines; exit 0 when all
# passed, 1 on a failure, 77 (skipped, with the reason) where this machine cannot run containers at all
# (no podman or podman-compose, podman refusing to start a container, no DNS on podman networks, no
# Debian mirror or model to fetch). tests/run.sh (make test) finds this file too: it skips there unless
# CB_TEST_COMPOSE=1, which the Makefile's test-compose target sets.
# Environment: CB_TEST_COMPOSE_BUILD_TIMEOUT (900 s), CB_TEST_COMPOSE_UP_TIMEOUT (240 s: all healthy),
# CB_BASE_IMAGE (localhost/debian:12-slim), CB_TEST_COMPOSE_VIA=cbctl|gateway (how the questions go; the
# gateway when the image has it), CB_TEST_COMPOSE_KEEP=1 leaves the stack up for a look.
set -u
cd "$(dirname "$0")/../.."
if [ "${CB_TEST_COMPOSE:-0}" != 1 ]; then
  echo "skip: the containers test runs under make test-compose (CB_TEST_COMPOSE=1)"; exit 77
fi
F=docker/compose.yml
P=cbtest
IMAGE=cacheblend:cpu
BASE=${CB_BASE_IMAGE:-localhost/debian:12-slim}
LOGS=build/test-logs
mkdir -p "$LOGS"
FAILS=0 PASSES=0 T0=$SECONDS
ok() { echo "ok: $1"; PASSES=$((PASSES + 1)); }
bad() { echo "FAIL: $1"; FAILS=$((FAILS + 1)); }
SKIP=""
skip() { SKIP=$1; echo "skip: $1"; exit 77; }
secs() { echo "$((SECONDS - $1)) s"; }

for c in podman podman-compose curl python3 timeout flock; do
  command -v "$c" >/dev/null || skip "$c is not installed (scripts/bootstrap.sh installs what this test needs)"
done
# one run at a time on a machine: the project name, volume and network are fixed
exec 9>"${TMPDIR:-/tmp}/cacheblend-test-compose.lock"
flock -w 900 9 || { bad "another make test-compose held the lock for 15 minutes"; exit 1; }

# ---- compose and podman helpers ----
PC=(timeout 300 podman-compose -p "$P" -f "$F")
[ "${CB_TEST_COMPOSE_VERBOSE:-0}" = 1 ] || PC+=(--no-ansi)
pc() { # quiet unless CB_TEST_COMPOSE_VERBOSE=1; the output is kept in $LOGS/compose-run.log
  if [ "${CB_TEST_COMPOSE_VERBOSE:-0}" = 1 ]; then "${PC[@]}" "$@" 2>&1 | tee -a "$LOGS/compose-run.log"; return "${PIPESTATUS[0]}"
  else "${PC[@]}" "$@" >>"$LOGS/compose-run.log" 2>&1; fi
}
ctr() { podman ps -a --filter "label=io.podman.compose.project=$P" --filter "label=com.docker.compose.service=$1" --format '{{.Names}}' | head -1; }
px() { local c; c=$(ctr "$1"); shift; timeout 600 podman exec "$c" "$@"; }   # a command in a service's container
jfield() { python3 -c 'import json,sys
d = json.loads(sys.argv[1])
for k in sys.argv[2].split("."):
    d = d[int(k)] if isinstance(d, list) else d.get(k) if isinstance(d, dict) else None
print("null" if d is None else json.dumps(d) if isinstance(d, (dict, list, bool)) else d)' "$1" "$2" 2>/dev/null || echo null; }

SERVICES=(retriever cacheindex precompute blend)
dump_logs() {
  local s c
  for s in "${SERVICES[@]}"; do
    c=$(ctr "$s"); [ -n "$c" ] || continue
    echo "---- logs of $c ($(podman inspect --format '{{.State.Status}}, last exit {{.State.ExitCode}}, {{.RestartCount}} restarts' "$c" 2>/dev/null)) ----"
    podman logs "$c" 2>&1 | grep -v '^[^ ]* info  cb-[a-z]* config ' | tail -30 | sed 's/^/    /'   # less the config dump
  done
  echo "---- the end of $LOGS/compose-run.log ----"; tail -20 "$LOGS/compose-run.log" 2>/dev/null | sed 's/^/    /'
}
cleaned=0
teardown() { # [force]: also under CB_TEST_COMPOSE_KEEP=1
  [ $cleaned = 1 ] && return; cleaned=1
  if [ "${CB_TEST_COMPOSE_KEEP:-0}" = 1 ] && [ "${1:-}" != force ]; then echo "note: CB_TEST_COMPOSE_KEEP=1: project $P left up"; return; fi
  pc down -v -t 10 || true
  # what podman-compose 1.0.3 leaves behind (it keeps the network), or what a killed run left
  local ids
  ids=$(podman ps -aq --filter "label=io.podman.compose.project=$P")
  [ -n "$ids" ] && podman rm -f -t 5 $ids >/dev/null 2>&1
  podman volume rm -f "${P}_cbdata" >/dev/null 2>&1
  podman network rm -f "${P}_default" >/dev/null 2>&1
  true
}
finish() {
  local rc=$?
  [ $FAILS -gt 0 ] && dump_logs
  teardown
  if [ $cleaned = 1 ] && [ "${CB_TEST_COMPOSE_KEEP:-0}" != 1 ]; then
    local left
    left="$(podman ps -aq --filter "label=io.podman.compose.project=$P")$(podman volume ls -q --filter "name=^${P}_")$(podman network ls -q --filter "name=^${P}_")"
    if [ -z "$left" ]; then echo "ok: down: no container, volume or network of project $P is left"
    else echo "FAIL: project $P left: $left"; FAILS=$((FAILS + 1)); fi
  fi
  if [ $rc -eq 77 ]; then echo "skipped: $SKIP"; exit 77; fi
  if [ $FAILS -eq 0 ] && [ $rc -eq 0 ]; then echo "all checks passed in $(secs $T0)"; exit 0; fi
  echo "$FAILS check(s) failed in $(secs $T0)"; exit 1
}
trap finish EXIT
trap 'bad "interrupted"; exit 1' INT TERM
fatal() { bad "$1"; exit 1; }
: >"$LOGS/compose-run.log"
teardown force; cleaned=0   # a stack an earlier run left (killed, or kept)

# ---- the model on the host (the image build copies it: docker/Dockerfile.cpu says why) ----
scripts/fetch-model.sh >"$LOGS/compose-model.log" 2>&1 || skip "cannot fetch the model: $(tail -1 "$LOGS/compose-model.log")"

# ---- the base image, and podman able to run it ----
t=$SECONDS
CB_BASE_IMAGE=$BASE scripts/base-image.sh >"$LOGS/compose-base-image.log" 2>&1; rc=$?
case $rc in
  0) ok "base image $BASE ($(secs $t); $(grep -o 'exists\|ready.*' "$LOGS/compose-base-image.log" | tail -1))" ;;
  3) skip "this machine cannot build or run containers: $(grep 'base-image:' "$LOGS/compose-base-image.log" | tail -1)" ;;
  *) cat "$LOGS/compose-base-image.log" | tail -20; fatal "scripts/base-image.sh exited $rc" ;;
esac

# ---- the image ----
# The build stage is tagged too ($IMAGE-build), so that the layer cache a rerun starts from is named, and
# the untagged layers of earlier builds (each code change leaves a few hundred MB) can be pruned; the
# Dockerfile labels its layers, so nothing else on the machine is touched.
t=$SECONDS
build() { timeout "${CB_TEST_COMPOSE_BUILD_TIMEOUT:-900}" podman build --pull=never --build-arg BASE_IMAGE="$BASE" \
            -f docker/Dockerfile.cpu "$@" . >>"$LOGS/compose-build.log" 2>&1; }
: >"$LOGS/compose-build.log"
if build --target build -t "$IMAGE-build" && build -t "$IMAGE"; then
  ok "podman build -f docker/Dockerfile.cpu -t $IMAGE ($(secs $t); $(podman image inspect --format '{{.Size}}' "$IMAGE" | awk '{ printf "%.0f MB", $1 / 1e6 }'))"
else
  tail -30 "$LOGS/compose-build.log"; fatal "podman build failed (log: $LOGS/compose-build.log)"
fi
n=$(podman image prune -f --filter label=io.cacheblend.image 2>/dev/null | wc -l)
[ "$n" -gt 0 ] && echo "note: pruned $n superseded cacheblend image layers"
GATEWAY=0
if ls services/gateway/cb*.c >/dev/null 2>&1; then
  if podman run --rm --pull=never "$IMAGE" test -x bin/cb-gateway; then GATEWAY=1; ok "the image carries cb-gateway"
  else bad "services/gateway exists but the image has no bin/cb-gateway"; fi
fi
[ $GATEWAY = 1 ] && SERVICES+=(gateway)
VIA=${CB_TEST_COMPOSE_VIA:-$([ $GATEWAY = 1 ] && echo gateway || echo cbctl)}
[ "$VIA" = gateway ] && [ $GATEWAY = 0 ] && fatal "CB_TEST_COMPOSE_VIA=gateway, but the image has no cb-gateway"

# ---- up, on free host ports (a stack of the host's own may hold the default ones) ----
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
export CB_PUBLISH_PRECOMPUTE=$(free_port) CB_PUBLISH_PRECOMPUTE_PULL=$(free_port) CB_PUBLISH_BLEND=$(free_port)
export CB_PUBLISH_GATEWAY=$(free_port) CB_PUBLISH_BLEND_CUDA=$(free_port)
t=$SECONDS
# the CURVE keys first (podman-compose 1.0.3 does not wait on depends_on conditions)
pc run --rm keys || fatal "podman-compose run keys (cbctl keys init) failed (log: $LOGS/compose-run.log)"
ok "CURVE keys made in the volume (cbctl keys init /data/keys)"
pc up -d --no-build "${SERVICES[@]}" || fatal "podman-compose up failed (log: $LOGS/compose-run.log)"
for s in "${SERVICES[@]}"; do [ -n "$(ctr "$s")" ] || fatal "podman-compose up created no container for $s"; done
ok "podman-compose up -d ${SERVICES[*]} ($(secs $t))"
dns=$(podman network inspect "${P}_default" --format '{{.DNSEnabled}}' 2>/dev/null)
[ "$dns" = true ] || skip "network ${P}_default has no DNS (dns_enabled=$dns), so containers cannot reach each other by service name: install golang-github-containernetworking-plugin-dnsname (CNI) or netavark + aardvark-dns"

# the compose file's own health checks, run by hand (podman schedules them through systemd timers)
wait_healthy() { # $1 = seconds
  local limit=$1 t=$SECONDS s c pending
  while :; do
    pending=()
    for s in "${SERVICES[@]}"; do
      c=$(ctr "$s")
      [ "$(podman inspect --format '{{.State.Status}}' "$c" 2>/dev/null)" = running ] || { bad "$s: container $c is not running"; return 1; }
      timeout 30 podman healthcheck run "$c" >/dev/null 2>&1 || pending+=("$s")
    done
    if [ ${#pending[@]} -eq 0 ]; then
      # the health checks ask for ping; the model-loading workers must be ready too
      local r=0
      for s in precompute blend; do [ "$(jfield "$(px blend cbctl stats --json "$s" 2>/dev/null)" "$s.worker_ready")" = true ] && r=$((r + 1)); done
      [ $r -eq 2 ] && return 0
      pending=(workers)
    fi
    [ $((SECONDS - t)) -ge "$limit" ] && { bad "not healthy within $limit s: ${pending[*]}"; return 1; }
    sleep 2
  done
}
t=$SECONDS
wait_healthy "${CB_TEST_COMPOSE_UP_TIMEOUT:-240}" || exit 1
ok "every service healthy (its compose healthcheck) and both workers ready ($(secs $t))"
for s in precompute blend; do
  src=$(podman inspect --format '{{range .Mounts}}{{if eq .Destination "/data"}}{{.Type}}:{{.Name}}{{end}}{{end}}' "$(ctr "$s")")
  [ "$src" = "volume:${P}_cbdata" ] && ok "$s: /data is the named volume ${P}_cbdata" || bad "$s: /data is '$src', not volume ${P}_cbdata"
done

# ---- ingest, then a question ----
t=$SECONDS
out=$(px precompute env CB_CBCTL_INGEST_TIMEOUT_MS=300000 cbctl ingest --wait data/sample 2>&1) \
  && ok "cbctl ingest --wait data/sample in the precompute container ($(secs $t))" || fatal "ingest: $out"
nkv=$(px blend sh -c 'find /data/kv -type f -name "*.kv" | wc -l' 2>/dev/null)
[ "${nkv:-0}" -gt 0 ] && ok "$nkv chunk KV files on the volume" || bad "no KV files under /data/kv on the volume ($nkv)"

QUESTION=$(head -1 data/sample/questions.lst)
ask() { # prints the metrics object (JSON) of one answer to $QUESTION (its text in $LOGS/compose-answer.txt), or fails
  local out text
  if [ "$VIA" = gateway ]; then
    local body
    body=$(python3 -c 'import json,sys; print(json.dumps({"model": "cacheblend", "max_tokens": 16,
      "messages": [{"role": "user", "content": sys.argv[1]}]}))' "$QUESTION")
    out=$(curl -sS --max-time 300 "http://127.0.0.1:$CB_PUBLISH_GATEWAY/v1/chat/completions" \
            -H 'Content-Type: application/json' -d "$body" 2>&1) || { echo "curl: $out"; return 1; }
    text=$(jfield "$out" choices.0.message.content)
    [ "$(jfield "$out" object)" = chat.completion ] && [ -n "$text" ] && [ "$text" != null ] || { echo "not an OpenAI answer: $out"; return 1; }
    printf '%s' "$text" >"$LOGS/compose-answer.txt"
    jfield "$out" cacheblend
  else
    out=$(px blend env CB_CBCTL_QUERY_TIMEOUT_MS=300000 cbctl query --json --max-tokens 16 "$QUESTION" 2>&1) || { echo "cbctl query: $out"; return 1; }
    out=$(echo "$out" | tail -1)
    text=$(jfield "$out" text)
    [ -n "$text" ] && [ "$text" != null ] || { echo "no text in: $out"; return 1; }
    printf '%s' "$text" >"$LOGS/compose-answer.txt"
    jfield "$out" metrics
  fi
}
via="cbctl query in the blend container"; [ "$VIA" = gateway ] && via="POST /v1/chat/completions on the gateway"
if [ $GATEWAY = 1 ]; then
  h=$(curl -s -o /dev/null -w '%{http_code}' --max-time 10 "http://127.0.0.1:$CB_PUBLISH_GATEWAY/health")
  [ "$h" = 200 ] && ok "GET /health on the gateway (host port $CB_PUBLISH_GATEWAY): 200" || bad "GET /health: HTTP $h"
fi
t=$SECONDS
answer() { echo "\"$(head -c 60 "$LOGS/compose-answer.txt" | tr '\n' ' ')...\""; }
m1=$(ask) && ok "question 1 answered ($via, $(secs $t)): $(answer) cache_hits=$(jfield "$m1" cache_hits) cache_misses=$(jfield "$m1" cache_misses)" \
  || fatal "question 1 ($via): $m1"

# ---- restart cb-blend: its memory cache is gone, the volume is not ----
t=$SECONDS
started() { podman inspect --format '{{.State.StartedAt}}' "$(ctr blend)"; }
before=$(started)
pc restart blend || fatal "podman-compose restart blend failed"
[ "$(started)" != "$before" ] || fatal "podman-compose restart blend did not restart the container"
wait_healthy "${CB_TEST_COMPOSE_UP_TIMEOUT:-240}" || exit 1
hot=$(jfield "$(px blend cbctl stats --json blend 2>&1)" blend.hot_entries)
[ "$hot" = 0 ] && ok "blend restarted and healthy again ($(secs $t)); its memory cache is empty (hot_entries 0)" \
  || bad "after the restart hot_entries is '$hot' (a new process should start empty)"
t=$SECONDS
m2=$(ask) || fatal "question 2 after the restart ($via): $m2"
h2=$(jfield "$m2" cache_hits)
if [ "$h2" != null ] && [ "$h2" -gt 0 ]; then
  ok "question 2 after the restart ($(secs $t)): $(answer) cache_hits=$h2 > 0, read from the KV files on the volume"
else
  bad "question 2 after the restart: cache_hits=$h2 (metrics: $m2)"
fi
hh=$(jfield "$(px blend cbctl stats --json blend 2>&1)" blend.hot_hits)
[ "$hh" = 0 ] && ok "the restarted blend served them from files, not memory (hot_hits 0)" || bad "hot_hits after the restart: '$hh'"
exit 0
