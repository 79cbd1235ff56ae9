#!/usr/bin/env bash
# scripts/demo.sh (make demo): the whole system in a few minutes.
#   1. scripts/bootstrap.sh (Debian packages), scripts/fetch-model.sh (the model), make
#   2. scripts/stack.sh start, with its state in $CB_DATA_DIR (default var/demo)
#   3. cbctl ingest --wait data/sample (four short documents: chunked, KV precomputed, indexed)
#   4. each question of data/sample/questions.lst asked in `full` mode (everything prefilled) and in `blend`
#      mode (the chunks' cached KV fused with a 15% recompute), answers and TTFT side by side; then the
#      first question once more with --frequency-penalty (its greedy blend answer repeats itself), and over
#      HTTP through cb-gateway (the OpenAI chat-completions API)
#   5. scripts/stack.sh stop (also on failure or Ctrl-C)
# MODEL=NAME (make demo MODEL=qwen2.5-coder-1.5b) serves another model that scripts/fetch-model.sh knows;
# its KV files and state then live in var/demo-NAME.
# The services use the usual endpoints (config/cacheblend.cfg or CB_* overrides); if a stack already answers
# there, the demo refuses to start a second one.
set -eu
cd "$(dirname "$0")/.."
MODEL=${MODEL:-}
if [ -n "$MODEL" ]; then
  export CB_DATA_DIR=${CB_DATA_DIR:-var/demo-$MODEL}
else
  export CB_DATA_DIR=${CB_DATA_DIR:-var/demo}
fi
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

say "1/5 packages, model, build"
scripts/bootstrap.sh
if [ -n "$MODEL" ]; then
  scripts/fetch-model.sh "$MODEL"
  CB_COMMON_MODEL=$(scripts/fetch-model.sh --path "$MODEL"); export CB_COMMON_MODEL
  echo "model: $CB_COMMON_MODEL"
  # a base model's GGUF has no chat template: its prompts are plain text
  case "$MODEL" in gemma3-270m) export CB_ENGINE_CHAT_TEMPLATE=${CB_ENGINE_CHAT_TEMPLATE:-completion} ;; esac
else
  scripts/fetch-model.sh
fi
make -j"$(nproc)" >/dev/null
echo "build/bin: $(ls build/bin | tr '\n' ' ')"

hrc=0; build/bin/cbctl -q health blend 2>/dev/null || hrc=$?
if [ "$hrc" = 0 ] || [ "$hrc" = 4 ]; then   # it answers (4: degraded, a full data disk)
  echo "demo: a cb-blend already answers on the configured endpoint; stop that stack first (scripts/stack.sh stop)" >&2
  exit 1
fi

say "2/5 starting the stack (state in $CB_DATA_DIR)"
trap 'echo; say "5/5 stopping the stack"; scripts/stack.sh stop' EXIT
scripts/stack.sh start

say "3/5 ingesting data/sample"
build/bin/cbctl ingest --wait data/sample
build/bin/cbctl stats precompute retriever cacheindex | grep -E '^[a-z]|jobs_done|chunks |docs|entries|bytes '

say "4/5 questions: full prefill vs CacheBlend"
json_field() { # JSON_LINE FIELD.PATH
  python3 -c 'import json,signal,sys
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # | head -n 1 may close the pipe before a long answer ends
v=json.loads(sys.argv[1])
for k in sys.argv[2].split("."): v=v[k]
print(v if isinstance(v,str) else round(v,1) if isinstance(v,float) else v)' "$1" "$2"
}
# one warm-up query (page cache, first allocations) that is not shown
build/bin/cbctl -q query --max-tokens 4 "warm up" || true
sum_full=0; sum_blend=0; n=0
while IFS= read -r q; do
  [ -n "$q" ] || continue
  printf '\n\033[1mQ: %s\033[0m\n' "$q"
  for mode in full blend; do
    line=$(build/bin/cbctl query --json --mode "$mode" --max-tokens 32 "$q" | tail -n 1)
    ttft=$(json_field "$line" client.ttft_ms)
    printf '  %-5s  TTFT %7.1f ms  (%s of %s prompt tokens recomputed, %s cached chunks)  %s\n' "$mode" "$ttft" \
      "$(json_field "$line" metrics.tokens_recomputed)" "$(json_field "$line" metrics.n_prompt_tokens)" \
      "$(json_field "$line" metrics.cache_hits)" "$(json_field "$line" text | head -n 1)"
    if [ "$mode" = full ]; then sum_full=$(python3 -c "print($sum_full + $ttft)"); else sum_blend=$(python3 -c "print($sum_blend + $ttft)"); fi
  done
  n=$((n + 1))
done <data/sample/questions.lst
python3 -c "f=$sum_full/$n; b=$sum_blend/$n; print(f'\nmean TTFT over {$n} questions: full {f:.1f} ms, blend {b:.1f} ms ({f/b:.2f}x faster)')"
# a greedy answer that repeats itself until --max-tokens (the first question's, in blend mode) ends on its own
# with a frequency penalty (OpenAI's frequency_penalty: each earlier use of a token lowers its logit)
q1=$(head -n 1 data/sample/questions.lst)
line=$(build/bin/cbctl query --json --mode blend --max-tokens 32 --frequency-penalty 1.0 "$q1" | tail -n 1)
printf '\n\033[1mQ: %s\033[0m  (blend, --frequency-penalty 1.0: finish_reason %s)\n  %s\n' "$q1" \
  "$(json_field "$line" finish_reason)" "$(json_field "$line" text | head -n 1)"
# the same question over HTTP, the way any OpenAI client asks it (cb-gateway, docs/gateway.md)
gw=${CB_GATEWAY_LISTEN:-127.0.0.1:8000}
body=$(python3 -c 'import json,sys; print(json.dumps({"model": "cacheblend", "max_tokens": 32, "frequency_penalty": 1.0,
  "messages": [{"role": "user", "content": sys.argv[1]}]}))' "$q1")
if reply=$(curl -sf --max-time 120 "http://$gw/v1/chat/completions" -H 'Content-Type: application/json' -d "$body"); then
  printf '\n\033[1mPOST http://%s/v1/chat/completions\033[0m  (TTFT %s ms, %s prompt + %s completion tokens)\n  %s\n' "$gw" \
    "$(json_field "$reply" cacheblend.ttft_ms)" "$(json_field "$reply" usage.prompt_tokens)" \
    "$(json_field "$reply" usage.completion_tokens)" "$(python3 -c 'import json,signal,sys; signal.signal(signal.SIGPIPE, signal.SIG_DFL); print(json.loads(sys.argv[1])["choices"][0]["message"]["content"])' "$reply" | head -n 1)"
  echo "  (the web page: http://$gw/ ; metrics: http://$gw/metrics)"
else
  echo "demo: the gateway at http://$gw did not answer" >&2
  exit 1
fi
