#!/usr/bin/env bash
# Run each libFuzzer harness build/fuzz/fuzz_<name> for SECONDS from its seed
# corpus (tests/fuzz/corpus/<name>), new inputs kept in build/fuzz/corpus/<name>,
# crashes in build/fuzz/crash-<name>-*. tests/fuzz/fuzz_<name>.options, when
# present, holds extra libFuzzer flags. One line per harness: runs, execs/s,
# coverage (edges), corpus size. Fails if any harness found a crash.
#   tools/run-fuzz.sh SECONDS NAME...
set -u
secs=$1
shift
fail=0
for n in "$@"; do
  bin=build/fuzz/fuzz_$n
  work=build/fuzz/corpus/$n
  mkdir -p "$work" tests/fuzz/corpus/"$n"
  log=build/fuzz/$n.log
  opts=$(cat tests/fuzz/fuzz_"$n".options 2>/dev/null || true)
  # shellcheck disable=SC2086
  "$bin" -max_total_time="$secs" -print_final_stats=1 -timeout=10 -rss_limit_mb=2048 -max_len=4096 $opts \
    -artifact_prefix=build/fuzz/crash-"$n"- "$work" tests/fuzz/corpus/"$n" >"$log" 2>&1
  rc=$?
  runs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "$log" | grep -oE '[0-9]+$')
  speed=$(grep -oE 'stat::average_exec_per_sec: *[0-9]+' "$log" | grep -oE '[0-9]+$')
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+')
  ft=$(grep -oE 'ft: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+')
  corp=$(ls "$work" | wc -l)
  status=ok
  [[ $rc -ne 0 ]] && status=FAIL && fail=1
  printf '%-4s fuzz_%-14s %5ss  %10s runs  %7s exec/s  cov %6s  ft %6s  corpus %5s\n' "$status" "$n" "$secs" \
    "${runs:-?}" "${speed:-?}" "${cov:-?}" "${ft:-?}" "$corp"
  [[ $rc -ne 0 ]] && grep -E 'ERROR|fuzz:|SUMMARY|Test unit written' "$log" | head -8 | sed 's/^/  | /'
done
exit $fail
