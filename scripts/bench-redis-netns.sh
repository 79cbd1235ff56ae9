#!/usr/bin/env bash
# bench-redis-netns.sh: scripts/bench-redis.sh with Redis on another "host": two network namespaces joined
# by a veth pair through a bridge (tests/integration/lib/netns.bash), Redis on host 1 over TCP, cb-blend and
# cb-cacheindex on host 2 (their own loopback). The same three columns (computed, local file, only in
# Redis), so the Redis column now includes a TCP transfer between namespaces (a veth link: memory
# bandwidth, not a real NIC; add the NIC's time per value on real hosts, docs/kvremote.md). Needs root.
# Environment: as bench-redis.sh (BENCH_REPS, BENCH_CONTEXTS, ...).
set -u
. "$(dirname "$0")/../tests/integration/lib/svc.bash"
svc_setup
export CB_LOG_LEVEL=warn
. tests/integration/lib/netns.bash
netns_setup 2 || exit 1
H1=$(netns_addr 1)
netns_start 1 redis -- redis-server --bind "$H1" --port 6379 --protected-mode no --save '' --appendonly no \
  --dir "$T" --maxmemory 1gb --maxmemory-policy allkeys-lru
for _ in $(seq 1 50); do
  [ "$(netns_exec 1 redis-cli -h "$H1" ping 2>/dev/null)" = PONG ] && break
  sleep 0.1
done
echo "bench-redis-netns: Redis on host 1 ($H1:6379), the stack on host 2"
netns_exec 2 env BENCH_REDIS_URL="redis://$H1:6379" BENCH_OUT="${BENCH_OUT:-build/bench-redis-netns.json}" \
  bash scripts/bench-redis.sh
