#!/usr/bin/env bash
# Integration test of scripts/fetch-model.sh's CB_MODEL rule: a file that CB_MODEL names and that is not the
# default model (a user's own GGUF, as with `make bench-engine CB_MODEL=...`, which runs the fetch first) is
# kept byte for byte and nothing is fetched (exit 0, no network needed); `--path` still prints CB_MODEL.
set -u
cd "$(dirname "$0")/../.."
FAILS=0
check() {
  if [ "$2" = "$3" ]; then echo "ok: $1"; else echo "FAIL: $1: got '$2', expected '$3'"; FAILS=$((FAILS+1)); fi
}
T=$(mktemp -d /tmp/cb-fetchkeep.XXXXXX)
trap 'rm -rf "$T"' EXIT
printf 'GGUF\003\000\000\000 not the default model\n' > "$T/mine.gguf"
want=$(sha256sum "$T/mine.gguf" | cut -d' ' -f1)
out=$(CB_MODEL="$T/mine.gguf" timeout 60 scripts/fetch-model.sh 2>&1); rc=$?
check "exit status" "$rc" 0
check "the user's file is kept" "$(sha256sum "$T/mine.gguf" | cut -d' ' -f1)" "$want"
check "it says so" "$(echo "$out" | grep -c 'kept, nothing fetched')" 1
check "--path names CB_MODEL" "$(CB_MODEL="$T/mine.gguf" scripts/fetch-model.sh --path smollm2)" "$T/mine.gguf"
[ "$FAILS" -eq 0 ]
