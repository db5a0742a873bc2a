#!/usr/bin/env bash
# Install the Debian packages kvpool needs, only those that are missing.
# Quick when everything is present (one dpkg-query). Uses sudo when not root.
# Required packages must install; optional ones (plots, the Python binding's
# tests) are tried and only warned about when the machine cannot get them
# (a GPU machine without a package registry, say).
set -euo pipefail
required=(libjemalloc-dev liburcu-dev check pkg-config libjansson-dev)
optional=(gnuplot-nox python3-numpy python3-pytest python3-cffi)
missing() {
  local p st
  for p in "$@"; do
    st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
    [[ $st == "install ok installed" ]] || echo "$p"
  done
}
mapfile -t need < <(missing "${required[@]}" "${optional[@]}")
[[ ${#need[@]} -eq 0 ]] && exit 0
echo "deps: installing ${need[*]}"
sudo=""
[[ $(id -u) -ne 0 ]] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
install() { $sudo apt-get install -y --no-install-recommends "$@"; }
install "${need[@]}" || { $sudo apt-get update -q || true; install "${need[@]}"; } || true
mapfile -t still < <(missing "${required[@]}")
if [[ ${#still[@]} -gt 0 ]]; then
  echo "deps: could not install required packages: ${still[*]}" >&2
  exit 1
fi
mapfile -t opt < <(missing "${optional[@]}")
[[ ${#opt[@]} -eq 0 ]] || echo "deps: optional packages missing (their features skip with a message): ${opt[*]}" >&2
exit 0
