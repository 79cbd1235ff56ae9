#!/usr/bin/env bash
# The KV pool under a small budget (docs/engine.md): cb-blend with blend.kv_pool_bytes of 12 blocks answers a
# query that fits, answers `overloaded` (cbctl exit 3) for one whose blocks the pool cannot hold, returns
# that query's blocks (stats: only the shared context's blocks stay used) and keeps answering, with the
# same answer as before the refusal.
. "$(dirname "$0")/lib/stack.bash"
stack_setup
# SmolLM2: K + V of 30 layers x 16 positions x 192 values of 2 bytes (engine.kv_dtype = f16, the default:
# 368,640 bytes a block) or 4 (f32: 737,280)
vb=2; [ "${CB_ENGINE_KV_DTYPE:-f16}" = f32 ] && vb=4
export CB_BLEND_KV_POOL_BYTES=$((12 * 2 * 30 * 16 * 192 * vb))
export CB_BLEND_CTX_SIZE=1024
export CB_BLEND_HOT_CACHE_BYTES=0
stack_start_all || svc_finish
BL=$(stack_endpoint blend)
check "pool: 12 blocks" "$(stack_stat blend pool_blocks_total)" 12

C1="The Quillon Chamber Orchestra was founded in 1978 by the cellist Helene Marchetti."
Q1="Who founded the Quillon Chamber Orchestra?"
a1=$(cbctl query --mode blend --max-tokens 16 --context "$C1" "$Q1"); rc=$?
check "a query that fits: answered" "$rc" 0
used=$(stack_stat blend pool_blocks_used)
echo "after the first query: $used blocks used (the shared context)"

LONG=$(cat data/sample/kettleby-lighthouse.md data/sample/oraka-volcano.txt)
cbctl query --mode blend --max-tokens 16 --context "$LONG" "Who designed the Kettleby Lighthouse?" \
  >"$T/q.out" 2>"$T/q.err"; rc=$?
check "a query the pool cannot hold: cbctl exits 3" "$rc" 3
grep -q "overloaded" "$T/q.err" && echo "ok: it says overloaded: $(head -c 200 "$T/q.err")" \
  || { echo "FAIL: no 'overloaded' in: $(cat "$T/q.err")"; FAILS=$((FAILS+1)); }
check "stats: one overloaded query" "$(stack_stat blend queries_overloaded)" 1
check "its blocks went back to the pool" "$(stack_stat blend pool_blocks_used)" "$used"

a2=$(cbctl query --mode blend --max-tokens 16 --context "$C1" "$Q1"); rc=$?
check "the service keeps answering" "$rc" 0
check "with the same answer" "$a2" "$a1"
check "still no leaked blocks" "$(stack_stat blend pool_blocks_used)" "$used"

for s in blend precompute cacheindex retriever; do svc_stop $s; done
svc_finish
