#!/usr/bin/env bash
# tests/fuzz/make-corpora.sh: (re)generates the committed seed corpora of the libFuzzer targets,
# tests/fuzz/corpus_{msg,kvfile,gguf,tokenizer,qa}/, with build/tests/gen_corpora (tests/fuzz/gen_corpora.c:
# the real message, KV-file and GGUF writers, so every valid seed is a file the readers accept). The
# hand-built seeds of corpus_gguf (*.seed without the synth_ prefix) and the README files are kept.
# Deterministic: run it after a format change and commit the result.
#
#   tests/fuzz/make-corpora.sh
set -eu
cd "$(dirname "$0")/../.."
make -s -j2 build/tests/gen_corpora
tmp=$(mktemp -d /tmp/cb-corpora.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
build/tests/gen_corpora "$tmp" tests/fixtures/tokenizer.jsonl
for name in msg kvfile gguf tokenizer qa; do
  dst=tests/fuzz/corpus_$name
  mkdir -p "$dst"
  if [ "$name" = gguf ]; then rm -f "$dst"/synth_*.seed "$dst"/trunc_synth_*.seed
  else find "$dst" -maxdepth 1 -type f ! -name README.md -delete; fi
  cp "$tmp/corpus_$name"/* "$dst"/
  echo "$dst: $(find "$dst" -maxdepth 1 -type f ! -name README.md | wc -l) seeds, $(du -sk "$dst" | cut -f1) KB"
done
