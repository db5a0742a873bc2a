#!/usr/bin/env bash
# One pass over everything that needs a GPU, in the order that matters when
# device time is short: the GPU suites, then compute-sanitizer (memcheck
# with leak check, racecheck) on a narrowed sweep, then the benchmark
# sections, then torch's baselines. Logs go to OUTDIR (default build/gpu-check),
# one file per step; the last lines printed are a summary.
#
#   tools/gpu-check.sh [OUTDIR]
#   KVP_GPU_CHECK_STEPS="tests sanitize bench torch" (default: all four)
#   KVP_GPU_SPEC=qvg      narrows the suites' codec sweeps (see Makefile)
#   KVP_BENCH_ONLY=qvg,attend   narrows the benchmark (kvpool-bench-gpu)
#   KVP_GPU_SAN_BINS="attend codecs"   the suites the sanitize step runs (names
#                         without check_gpu_; default: all), and
#   KVP_GPU_SAN_TOOLS="memcheck"       its tools (default: memcheck racecheck),
#                         to split the sanitize step across runs when each is
#                         time-limited
#
# Builds first (make -j, the GPU suites and kvpool-bench-gpu). Exit status:
# nonzero when a suite or a sanitizer run failed.
set -u
out=${1:-build/gpu-check}
steps=${KVP_GPU_CHECK_STEPS:-"tests sanitize bench torch"}
mkdir -p "$out"
cs=${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer
jobs=$(nproc 2>/dev/null || echo 4)
gpu_bin=$(make -s -p -n 2>/dev/null | sed -n 's/^GPU_BIN := //p' | head -1)
if ! make -j"$jobs" lib build/kvpool-bench-gpu $gpu_bin >"$out/build.log" 2>&1; then
  tail -30 "$out/build.log"
  echo "gpu-check: build failed (see $out/build.log)"
  exit 1
fi
fail=0
summary=()
for step in $steps; do
  case $step in
  tests)
    CK_FORK=no tools/run-tests.sh $gpu_bin >"$out/tests.log" 2>&1 || fail=1
    summary+=("$(grep -cE '^ok ' "$out/tests.log") GPU suites ok, $(grep -cE '^FAIL ' "$out/tests.log") failed")
    ;;
  sanitize)
    : >"$out/sanitize.log"
    for t in $gpu_bin; do
      if [ -n "${KVP_GPU_SAN_BINS:-}" ]; then
        case " $KVP_GPU_SAN_BINS " in *" ${t##*check_gpu_} "*) ;; *) continue ;; esac
      fi
      for tool in ${KVP_GPU_SAN_TOOLS:-memcheck racecheck}; do
        extra=""
        [ $tool = memcheck ] && extra="--leak-check full"
        case $t in *check_gpu_region) extra="$extra --report-api-errors no" ;; esac
        echo "== $tool $t" >>"$out/sanitize.log"
        if ! KVP_GPU_QUICK=1 KVP_GPU_SPEC=${KVP_GPU_SPEC:-qvg} CK_FORK=no "$cs" --tool $tool --error-exitcode 9 $extra "$t" \
          >>"$out/sanitize.log" 2>&1; then
          fail=1
          summary+=("$tool $(basename "$t"): FAILED")
        fi
      done
    done
    summary+=("sanitizers: $(grep -c 'ERROR SUMMARY: 0 errors' "$out/sanitize.log") memcheck runs clean, $(grep -c 'RACECHECK SUMMARY: 0 hazards' "$out/sanitize.log") racecheck runs clean")
    ;;
  bench)
    build/kvpool-bench-gpu --rounds 9 >"$out/bench.txt" 2>&1 || fail=1
    summary+=("bench: $(grep -c '^{' "$out/bench.txt") figures in $out/bench.txt")
    ;;
  torch)
    python3 tools/bench_torch.py "$out/bench.txt" >"$out/torch.txt" 2>&1
    summary+=("torch: $(grep -c '^{' "$out/torch.txt") comparisons in $out/torch.txt")
    ;;
  esac
done
for f in tests.log sanitize.log bench.txt torch.txt; do
  [ -f "$out/$f" ] && { echo "--- $f"; grep -vE '^\{' "$out/$f" | tail -25; }
done
printf '%s\n' "${summary[@]}"
exit $fail
