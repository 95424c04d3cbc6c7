#!/usr/bin/env bash
# CMake finds NCCL where it is installed apart from the CUDA toolkit: a prefix named by NCCL_HOME
# or NCCL_ROOT (CMake or environment variable), with only the versioned libnccl.so.2 (as NVIDIA's
# tarball and pip's nvidia-nccl-cu13 wheel ship it); a named prefix without NCCL is an error
# that says so; without a name, the toolkit's. Configures the project only (no build).
#   find_nccl.sh SOURCE_DIR NCCL_INCLUDE_DIR NCCL_LIBRARY
set -u
src=$1 inc=$2 lib=$3
. "$(dirname "$0")/../common/check_lib.sh"
real=$(readlink -f "$lib")

# A prefix holding nccl.h and libnccl.so.2 only (links to the real files: NCCL is 200 MB).
prefix() {
  mkdir -p "$1/include" "$1/lib"
  ln -sf "$inc/nccl.h" "$1/include/nccl.h"
  ln -sf "$real" "$1/lib/libnccl.so.2"
}
prefix "$tmp/tarball"
prefix "$tmp/site-packages/nvidia/nccl"
mkdir -p "$tmp/empty"

# configure NAME WANT_LIBRARY [env ...] -- [cmake args ...]: NCCL_LIBRARY in the cache must be WANT.
configure() {
  local name=$1 want=$2; shift 2
  local envs=()
  while [ "$1" != -- ]; do envs+=("$1"); shift; done
  shift
  rm -rf "$tmp/b"
  env -u NCCL_HOME -u NCCL_ROOT "${envs[@]}" cmake -S "$src" -B "$tmp/b" -G Ninja -DDTK_BUILD_TESTS=OFF "$@" \
    >"$tmp/out" 2>&1
  local rc=$? got
  got=$(sed -n 's/^NCCL_LIBRARY:FILEPATH=//p' "$tmp/b/CMakeCache.txt" 2>/dev/null)
  if [ $rc -eq 0 ] && [ "$got" = "$want" ] && grep -q "dtk: NCCL [0-9.]*: $want" "$tmp/out"; then ok "$name"; else
    bad "$name: exit $rc, NCCL_LIBRARY '$got' (want '$want')" "$(cat "$tmp/out")"; fi
}
configure "-DNCCL_HOME, only libnccl.so.2" "$tmp/tarball/lib/libnccl.so.2" -- -DNCCL_HOME="$tmp/tarball"
configure "NCCL_ROOT in the environment" "$tmp/tarball/lib/libnccl.so.2" NCCL_ROOT="$tmp/tarball" --
configure "pip's wheel by NCCL_HOME" "$tmp/site-packages/nvidia/nccl/lib/libnccl.so.2" \
  NCCL_HOME="$tmp/site-packages/nvidia/nccl" --
configure "no prefix named: the toolkit's" "$lib" --

rm -rf "$tmp/b"
env -u NCCL_ROOT NCCL_HOME="$tmp/empty" cmake -S "$src" -B "$tmp/b" -G Ninja -DDTK_BUILD_TESTS=OFF >"$tmp/out" 2>&1
rc=$?
[ $rc -ne 0 ] && grep -q "^  NCCL_HOME/NCCL_ROOT (" "$tmp/out" && ok "a prefix without NCCL is an error naming it" \
  || bad "a prefix without NCCL (exit $rc)" "$(cat "$tmp/out")"
finish
