#!/usr/bin/env bash
# Install the Debian packages kvpool needs, only those that are missing.
# Quick when everything is present (one dpkg-query). Uses sudo when not root.
# Required packages must install (with no package manager at all, say so
# and go on: a GPU machine built elsewhere may lack hiredis and redis-server,
# and then builds without the store tier, its tests skipping); optional ones (plots, the Python binding's
# tests, clang and libFuzzer for `make fuzz`) are tried one by one and only
# warned about when they cannot (a GPU machine without a registry, say).
set -euo pipefail
required=(libjemalloc-dev liburcu-dev check pkg-config libjansson-dev libhiredis-dev redis-server)
optional=(gnuplot-nox python3-numpy python3-pytest python3-cffi clang libclang-rt-dev)
missing_of() {
  local p st
  for p in "$@"; do
    st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [[ $st == "install ok installed" ]] || echo "$p"
  done
}
mapfile -t need < <(missing_of "${required[@]}")
mapfile -t want < <(missing_of "${optional[@]}")
[[ ${#need[@]} -eq 0 && ${#want[@]} -eq 0 ]] && exit 0
if ! command -v apt-get >/dev/null 2>&1; then
  echo "deps: no apt-get here; missing: ${need[*]} ${want[*]} (features needing them are skipped)" >&2
  exit 0
fi
sudo=""
[[ $(id -u) -ne 0 ]] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
updated=0
install() { # install "$@", updating the package lists once if the first try fails
  $sudo apt-get install -y --no-install-recommends "$@" && return 0
  [[ $updated -eq 1 ]] && return 1
  updated=1
  $sudo apt-get update -q && $sudo apt-get install -y --no-install-recommends "$@"
}
if [[ ${#need[@]} -gt 0 ]]; then
  echo "deps: installing ${need[*]}"
  install "${need[@]}"
fi
for p in "${want[@]}"; do
  echo "deps: installing optional $p"
  install "$p" || echo "deps: optional package $p could not be installed (what needs it skips with a message)" >&2
done
exit 0
