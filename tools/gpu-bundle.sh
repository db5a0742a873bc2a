#!/usr/bin/env bash
# Bundle the built library for a machine that has CUDA and PyTorch but not
# the Debian libraries it links (liburcu, jansson, hiredis), and no package
# registry to install them from: build/libkvpool.so.0 and each shared
# library it needs outside the C/C++ runtime and CUDA go into one folder.
#
#   make lib && tools/gpu-bundle.sh [DIR]          (default DIR: build/gpu)
#
# There (DIR travels with the working tree):
#   LD_LIBRARY_PATH=DIR KVPOOL_LIB=DIR/libkvpool.so.0 python3 python/examples/generate.py
# The loader reads LD_LIBRARY_PATH at process start, so set it on the command.
set -euo pipefail
out=${1:-build/gpu}
lib=build/libkvpool.so.0
[[ -e $lib ]] || { echo "gpu-bundle: $lib not built (make lib)" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out"
cp -L "$lib" "$out/libkvpool.so.0"
ln -s libkvpool.so.0 "$out/libkvpool.so"
ldd "$lib" | awk '/=> \// {print $1, $3}' | while read -r name path; do
  case $name in
  libc.so* | libm.so* | libdl.so* | libpthread.so* | librt.so* | ld-linux* | libstdc++.so* | libgcc_s.so* | libcudart.so*) ;;
  *) cp -L "$path" "$out/$name" ;;
  esac
done
echo "gpu-bundle: $(ls "$out" | tr '\n' ' ')($(du -sh "$out" | cut -f1)) in $out"
