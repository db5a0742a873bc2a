#!/usr/bin/env bash
# Run the Python binding's pytest suite with one summary line, like
# tools/run-tests.sh; skip with a message when pytest or numpy is missing.
#
#   tools/run-pytest.sh PYTHON DIR            the host suite (make test)
#   tools/run-pytest.sh --gpu "PYTHONS" FILE  the GPU test, with the first of PYTHONS that imports
#                                             torch (with CUDA) and transformers (make test-gpu)
set -u
if [[ ${1:-} == --gpu ]]; then
  py=""
  for p in $2; do
    if command -v "$p" >/dev/null 2>&1 &&
      "$p" -c 'import torch, transformers, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
      py=$p
      break
    fi
  done
  if [[ -z $py ]]; then
    echo "skip gpu_hf_test.py                          skipped: no python with torch (CUDA) and transformers"
    exit 0
  fi
  echo "gpu_hf_test.py with $py ($("$py" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'))"
  if "$py" -c 'import pytest' >/dev/null 2>&1; then
    exec "$py" -m pytest -v -s -p no:cacheprovider "$3"
  fi
  exec "$py" "$3" # the file runs its tests itself without pytest
fi
py=$1
dir=$2
missing=$("$py" -c '
import importlib.util as u
print(" ".join(m for m in ("pytest", "numpy") if u.find_spec(m) is None))' 2>/dev/null || echo "python3")
if [[ -n $missing ]]; then
  echo "skip pytest $dir                     skipped: $py lacks $missing (make deps installs python3-${missing// /, python3-})"
  exit 0
fi
start=$(date +%s.%N)
# the GPU test runs in make test-gpu (its own python, with torch)
out=$("$py" -m pytest -q -p no:cacheprovider -rs --ignore="$dir/gpu_hf_test.py" "$dir" 2>&1)
rc=$?
dur=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN{printf "%.2f", e-s}')
summary=$(grep -E '(passed|failed|error|skipped)' <<<"$out" | tail -1 | sed 's/=//g; s/^ *//; s/ *$//')
if [[ $rc -eq 0 ]]; then status=ok; else status=FAIL; fi
printf '%-4s %-40s %6ss  %s\n' "$status" "pytest $dir" "$dur" "$summary"
grep -E '^SKIPPED' <<<"$out" | sed 's/^/       /' | head -5
[[ $status == FAIL ]] && echo "$out" | tail -60 | sed 's/^/  | /'
exit $rc
