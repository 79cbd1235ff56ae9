#!/usr/bin/env bash
# make test-models: every real model present in models/ against llama.cpp (scripts/compare-llamacpp), then
# "N passed, N failed (N skipped)". A model that is not there, or a machine without llama-cpp-python, skips.
set -u
cd "$(dirname "$0")/.."
pass=0; fail=0; skip=0
models=(models/SmolLM2-135M-Instruct.Q4_1.gguf models/Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf models/gemma-3-270m-q4_k_m.gguf)
if ! python3 -c "import llama_cpp, numpy" 2>/dev/null; then
  echo "skip test-models: llama-cpp-python is not installed (pip install llama-cpp-python)"
  echo "0 passed, 0 failed (${#models[@]} skipped)"
  exit 0
fi
mkdir -p build/test-logs
for m in "${models[@]}"; do
  name=$(basename "$m" .gguf)
  if [ ! -f "$m" ]; then echo "skip $name (not fetched: scripts/fetch-model.sh)"; skip=$((skip + 1)); continue; fi
  if out=$(scripts/compare-llamacpp --model "$m" --tokens 2048 2>"build/test-logs/models-$name.err"); then
    echo "ok $name $out"; pass=$((pass + 1))
  else
    echo "FAIL $name $out"; tail -5 "build/test-logs/models-$name.err" | sed 's/^/    /'; fail=$((fail + 1))
  fi
done
echo "$pass passed, $fail failed ($skip skipped)"
[ "$fail" -eq 0 ]
