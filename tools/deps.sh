#!/usr/bin/env bash
# Install the Debian packages kvpool needs, only those that are missing.
# Quick when everything is present (one dpkg-query). Uses sudo when not root.
set -euo pipefail
pkgs=(libjemalloc-dev liburcu-dev check pkg-config libjansson-dev gnuplot-nox python3-numpy python3-pytest python3-cffi)
missing=()
for p in "${pkgs[@]}"; do
  st=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ $st == "install ok installed" ]] || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
echo "deps: installing ${missing[*]}"
sudo=""
[[ $(id -u) -ne 0 ]] && sudo="sudo"
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get install -y --no-install-recommends "${missing[@]}" || {
  $sudo apt-get update -q && $sudo apt-get install -y --no-install-recommends "${missing[@]}"
}
