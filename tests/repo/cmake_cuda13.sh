#!/usr/bin/env bash
# dtk configures with the CUDA backend on a stock Debian 12 machine with NVIDIA's CUDA 13 (issue
# 44, item 8). Debian's CMake 3.25.1 FindCUDAToolkit.cmake sets a property on CUDA::nvToolsExt,
# which CUDA 12.9 and 13 no longer ship, whenever the project asks for CMake 3.25; this
# machine's copy may be patched to hide that. The test rebuilds Debian's own file (checked
# against the md5 dpkg recorded for cmake-data), shows that it fails a project that asks for 3.25
# (so that the test can fail), and configures dtk with it in front of the system's modules.
#   cmake_cuda13.sh SOURCE_DIR CUDA_COMPILER (empty: none was found, the test skips)
set -u
. "$(dirname "$0")/../common/check_lib.sh"
src=$1 nvcc=${2:-}
[ -n "$nvcc" ] && [ -x "$nvcc" ] || { echo "skipped: no CUDA compiler"; exit 77; }

echo 'message("${CMAKE_ROOT}")' >$tmp/root.cmake
root=$(cmake -P $tmp/root.cmake 2>&1)
system=$root/Modules/FindCUDAToolkit.cmake rel=${root#/}/Modules/FindCUDAToolkit.cmake
want=$(awk -v f="$rel" '$2 == f { print $1 }' /var/lib/dpkg/info/cmake-data.md5sums 2>/dev/null)
[ -n "$want" ] || { echo "skipped: dpkg records no md5 for $rel (not Debian's cmake-data)"; exit 77; }

# Debian's file: the system's, or the system's with the one known patch taken out.
mods=$tmp/modules
mkdir -p $mods && cp -rs "$root/Modules/." $mods/ && rm $mods/FindCUDAToolkit.cmake
sed 's/if(TARGET CUDA::nvToolsExt AND CMAKE_MINIMUM_REQUIRED_VERSION/if(CMAKE_MINIMUM_REQUIRED_VERSION/' \
  "$system" >$mods/FindCUDAToolkit.cmake
got=$(md5sum <$mods/FindCUDAToolkit.cmake | cut -d' ' -f1)
if [ "$got" = "$want" ]; then ok "Debian's FindCUDAToolkit.cmake rebuilt (md5 $want, as dpkg recorded)"
else bad "the rebuilt FindCUDAToolkit.cmake is not Debian's" "md5 $got, dpkg: $want ($system)"; finish; exit; fi

# The failure, reproduced: a project that asks for 3.25 and finds the toolkit.
toolkit=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
mkdir -p $tmp/control
printf 'cmake_minimum_required(VERSION 3.25)\nproject(control LANGUAGES NONE)\nfind_package(CUDAToolkit REQUIRED)\n' \
  >$tmp/control/CMakeLists.txt
cmake -S $tmp/control -B $tmp/control/build -DCMAKE_MODULE_PATH=$mods -DCUDAToolkit_ROOT="$toolkit" \
  >$tmp/o 2>$tmp/e
rc=$?
if [ $rc = 0 ]; then echo "skipped: $toolkit still ships nvToolsExt; the failure does not reproduce"; exit 77; fi
if grep -q 'CUDA::nvToolsExt' $tmp/e; then ok "Debian's module fails a project of CMake 3.25 on $toolkit (CUDA::nvToolsExt)"
else bad "the control project failed otherwise (exit $rc)" "$(cat $tmp/e)"; fi

# dtk's configure with Debian's module, the CUDA backend asked for.
cmake -S "$src" -B $tmp/build -G Ninja -DDTK_WITH_CUDA=ON -DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_MODULE_PATH=$mods \
  >$tmp/o 2>$tmp/e
rc=$?
if [ $rc = 0 ] && grep -q 'dtk: CUDA backend ON' $tmp/o; then ok "dtk configures with Debian's module and CUDA ($toolkit)"
else bad "dtk's configure with Debian's module (exit $rc)" "$(cat $tmp/e)"; fi
finish
