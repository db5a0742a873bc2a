#!/usr/bin/env bash
# Run test binaries, print one line each, fail if any failed.
# KVP_TEST_WRAP (e.g. valgrind ...) prefixes each run.
set -u
fail=0
for t in "$@"; do
  start=$(date +%s.%N)
  if out=$(${KVP_TEST_WRAP:-} "$t" 2>&1); then status=ok; else status=FAIL; fail=1; fi
  dur=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.2f", e-s}')
  summary=$(grep -E '^[0-9]+%: Checks' <<<"$out" | tail -1)
  printf '%-4s %-40s %6ss  %s\n' "$status" "$(basename "$t")" "$dur" "$summary"
  grep -iE 'skip' <<<"$out" | sed 's/^/       /' | head -5
  [[ $status == FAIL ]] && echo "$out" | tail -40 | sed 's/^/  | /'
done
exit $fail
