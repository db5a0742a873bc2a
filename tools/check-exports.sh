#!/usr/bin/env bash
# The shared library must export only kvp_* symbols.
set -euo pipefail
bad=$(nm -D --defined-only "$1" | awk '$2 ~ /[TDBRVW]/ {print $3}' | grep -v '^kvp_' || true)
if [[ -n $bad ]]; then echo "exports: symbols outside kvp_*: $bad" >&2; exit 1; fi
echo "exports: $(nm -D --defined-only "$1" | awk '$2 ~ /[TDBRVW]/' | wc -l) symbols, all kvp_*; SONAME $(objdump -p "$1" | awk '/SONAME/{print $2}')"
