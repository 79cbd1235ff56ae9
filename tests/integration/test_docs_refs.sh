#!/usr/bin/env bash
# Integration test of scripts/check-docs-refs: the tracked files name no planning note outside the
# repository and no ticket, and tell no history by work stop or session; a copy of the tracked files with
# one planted violation each fails it with a line naming the file: a note named in a C comment, a ticket in
# a script header, a history stop in a doc. The same words in data/ (a data set's own text) or in a
# lower-case doc name (docs/reliability.md) are not violations. Needs git (exit 77 without it).
set -u
cd "$(dirname "$0")/../.."
command -v git >/dev/null && git rev-parse --is-inside-work-tree >/dev/null 2>&1 || { echo "skip: not a git work tree"; exit 77; }
FAILS=0
check() {
  if [ "$2" = "$3" ]; then echo "ok: $1"; else echo "FAIL: $1: got '$2', expected '$3'"; FAILS=$((FAILS+1)); fi
}
T=$(mktemp -d /tmp/cb-docsrefs.XXXXXX)
trap 'rm -rf "$T"' EXIT
# The planted names are put together at run time, so this file holds none of them whole.
NOTE="DESIGN"".md"; TICKET="issue"" 12"; STOP="the fifth"" stop"

# --- the real tree
out=$(scripts/check-docs-refs 2>&1); rc=$?
check "the tracked files name no note, ticket or history" "$rc" "0"
[ "$rc" -eq 0 ] || echo "$out" | sed 's/^/    /'

# a fresh copy of the tracked files (no .git: the script then checks every file) in $T/tree
fresh() {
  rm -rf "$T/tree"; mkdir -p "$T/tree"
  git ls-files -z | grep -zv '^models' | xargs -0 cp --parents -t "$T/tree" 2>/dev/null
}
# expect_violation DESCRIPTION PATTERN: check-docs-refs on the copy fails, one line matches PATTERN
expect_violation() {
  local out rc
  out=$(scripts/check-docs-refs "$T/tree" 2>&1); rc=$?
  check "$1: exit 1" "$rc" "1"
  check "$1: reported" "$(echo "$out" | grep -c -E "$2")" "1"
}

fresh
out=$(scripts/check-docs-refs "$T/tree" 2>&1); rc=$?
check "the copy checks like the real tree" "$rc" "0"

printf '/* see %s section 7 */\n' "$NOTE" >>"$T/tree/libshared/rag/qa.c"
expect_violation "a note in a C comment" '^libshared/rag/qa\.c:[0-9]+: names a document outside the repository \(DESIGN\.md\)$'

fresh
printf '# the stack (%s)\n' "$TICKET" >>"$T/tree/scripts/stack.sh"
expect_violation "a ticket in a script" '^scripts/stack\.sh:[0-9]+: names a ticket \(issue 12\)$'

fresh
printf 'Measured at %s.\n' "$STOP" >>"$T/tree/docs/engine.md"
expect_violation "a history stop in a doc" '^docs/engine\.md:[0-9]+: tells history \(fifth stop\)$'

fresh
printf '{"text": "the %s of the %s"}\n' "$TICKET" "$NOTE" >>"$T/tree/data/musique_dev.jsonl"
printf 'See docs/reliability.md and docs/design notes.\n' >>"$T/tree/docs/qa.md"
out=$(scripts/check-docs-refs "$T/tree" 2>&1); rc=$?
check "data sets and lower-case doc names are not violations" "$rc" "0"

out=$(scripts/check-docs-refs /nonexistent 2>&1); rc=$?
check "a missing root is a usage error" "$rc" "2"

if [ "$FAILS" -gt 0 ]; then echo "$FAILS check(s) failed"; exit 1; fi
echo "all checks passed"
