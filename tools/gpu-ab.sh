#!/usr/bin/env bash
# A/B of kvpool-bench-gpu on one GPU: this tree against another revision's
# tree, both built here, run alternately (base first), then compared figure
# by figure (tools/bench_ab.py: medians of each side, and the speed
# new/base). Same device, same process order each turn: the ratio is what to
# report, not one side's time against another call's.
#
#   tools/gpu-ab.sh BASE_DIR [TURNS]        (TURNS: 2 runs of each side)
#
# Make BASE_DIR on the development host and carry it to the GPU machine:
#   mkdir -p .ab/base && git archive 28f09a8 | tar -x -C .ab/base
# The environment narrows both runs alike (KVP_BENCH_ONLY=attend,
# KVP_ATTEND_CODECS=kv=nvfp4, KVP_ATTEND_MAXCTX=32768, CUDA_ARCH=90 for the
# builds); KVP_AB_ARGS: the bench's arguments (default --rounds 5);
# KVP_AB_OUT: where the runs' outputs and build logs go (build/ab).
set -u
base=${1:?usage: tools/gpu-ab.sh BASE_DIR [TURNS]}
turns=${2:-2}
out=${KVP_AB_OUT:-build/ab}
jobs=$(nproc 2>/dev/null || echo 4)
[ -f "$base/Makefile" ] || { echo "gpu-ab: $base holds no kvpool tree"; exit 1; }
mkdir -p "$out"
make -j"$jobs" lib build/kvpool-bench-gpu >"$out/build-new.log" 2>&1 &
pn=$!
make -C "$base" -j"$jobs" lib build/kvpool-bench-gpu >"$out/build-base.log" 2>&1 &
pb=$!
ok=1
wait $pn || { tail -20 "$out/build-new.log"; echo "gpu-ab: this tree did not build"; ok=0; }
wait $pb || { tail -20 "$out/build-base.log"; echo "gpu-ab: $base did not build"; ok=0; }
[ $ok = 1 ] || exit 1
news=() bases=()
for i in $(seq 1 "$turns"); do
  for side in base new; do
    dir=.
    [ $side = base ] && dir=$base
    f="$out/$side-$i.txt"
    # shellcheck disable=SC2086
    if ! "$dir/build/kvpool-bench-gpu" ${KVP_AB_ARGS:---rounds 5} >"$f" 2>"$out/$side-$i.err"; then
      tail -5 "$out/$side-$i.err"
      echo "gpu-ab: the $side run $i failed (its figures: $f)"
      exit 1
    fi
    if [ $side = new ]; then news+=("$f"); else bases+=("$f"); fi
  done
done
python3 "$(dirname "$0")/bench_ab.py" --new "${news[@]}" --base "${bases[@]}"
