#!/usr/bin/env bash
# The module order of docs/DESIGN.md, enforced by the build (lib/dtk/CMakeLists.txt): every module
# compiles with only its own headers and its dependencies' on the include path. For every pair
# of modules (M, N), this preprocesses `#include "dtk/N/<a header>"` with M's include flags,
# exactly as M's sources compile: a module later than M (or one M does not link) must fail with
# "No such file or directory"; M itself and its dependencies must be found. A relative include
# ("../train/trainer.h") would get around that, so none may exist. And train/ names no technique.
# Usage: layering.sh CXX SOURCE_DIR BUILD_DIR
set -uo pipefail
cxx=$1 src=$2 build=$3
mapfile -t modules <"$build/modules/order.txt"  # kDtkModules, as CMake wrote it
[ ${#modules[@]} -ge 10 ] || { echo "FAIL: $build/modules/order.txt lists ${#modules[@]} modules"; exit 1; }
fails=0 checks=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

if hits=$(grep -rnE '#include +"\.\./' "$src/lib/dtk"); then fail "relative includes in lib/dtk:"$'\n'"$hits"; fi
# The loop, the resume and the options name no technique: what they need of one is the
# component's (core/component.h; docs/DESIGN.md, "Components").
checks=$((checks + 1))
if hits=$(grep -inE 'compressor|shampoo|powersgd|fsdp' "$src"/lib/dtk/train/{run_state,options,trainer}.cpp); then
  fail "lib/dtk/train names a technique:"$'\n'"$hits"
fi

for ((i = 0; i < ${#modules[@]}; i++)); do
  m=${modules[i]}
  flagfile=$build/modules/$m.flags
  [ -s "$flagfile" ] || { fail "$flagfile missing (configure the build first)"; continue; }
  mapfile -t dirs < "$flagfile"
  flags=()
  for d in "${dirs[@]}"; do [ -n "$d" ] && flags+=("-I$d"); done
  for ((j = 0; j < ${#modules[@]}; j++)); do
    n=${modules[j]}
    header=$(cd "$src/lib/dtk/$n" && ls *.h | head -1)
    visible=no
    for d in "${dirs[@]}"; do [ "$d" = "$build/modules/$n" ] && visible=yes; done
    if ((j > i)) && [ $visible = yes ]; then fail "$m sees the headers of $n, a later module"; fi
    out=$(echo "#include \"dtk/$n/$header\"" | "$cxx" -std=c++20 -E -x c++ - "${flags[@]}" -o /dev/null 2>&1)
    rc=$?
    checks=$((checks + 1))
    if [ $visible = yes ]; then
      [ $rc -eq 0 ] || fail "$m cannot include dtk/$n/$header, which it links: $(echo "$out" | grep -m1 error)"
    elif [ $rc -eq 0 ]; then
      fail "$m includes dtk/$n/$header although it does not link $n"
    elif ! grep -q "dtk/$n/$header: No such file or directory" <<<"$out"; then
      fail "$m including dtk/$n/$header failed, but not for want of the header: $(echo "$out" | grep -m1 error)"
    fi
  done
done
echo "layering: $checks includes checked, $fails failures"
[ $fails -eq 0 ]
