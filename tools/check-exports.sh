#!/usr/bin/env bash
# The shared library must export only kvp_* symbols, and stay loadable by
# dlopen in any process: no initial-exec TLS of its own (ELF flag STATIC_TLS)
# and no libjemalloc among its NEEDED (util/meta.c finds jemalloc at run time).
set -euo pipefail
dyn=$(readelf -dW "$1")
if grep -q 'NEEDED.*libjemalloc' <<<"$dyn"; then echo "exports: $1 links libjemalloc (see util/meta.c)" >&2; exit 1; fi
if grep -q 'STATIC_TLS' <<<"$dyn"; then echo "exports: $1 uses initial-exec TLS (flag STATIC_TLS)" >&2; exit 1; fi
bad=$(nm -D --defined-only "$1" | awk '$2 ~ /[TDBRVW]/ {print $3}' | grep -v '^kvp_' || true)
if [[ -n $bad ]]; then echo "exports: symbols outside kvp_*: $bad" >&2; exit 1; fi
echo "exports: $(nm -D --defined-only "$1" | awk '$2 ~ /[TDBRVW]/' | wc -l) symbols, all kvp_*; SONAME $(objdump -p "$1" | awk '/SONAME/{print $2}')"
