#!/usr/bin/env bash
# The Debian package: `cpack -G DEB` in the build tree, then, without installing it:
#   - its Depends names openmpi-bin, jq and gnuplot-nox, and the package of every shared library
#     the packaged programs load directly (dpkg -S of what the dynamic loader finds);
#   - it holds only /usr: the programs and dtk-plot in /usr/bin (nothing else there), their man
#     pages, share/dtk (configs, SLURM templates, the completion), one completion per program;
#   - unpacked into a scratch root (dpkg-deb -x), every program prints its --version
#     ("PROGRAM (dtk) VERSION", VERSION the package's), psgd-train and dtk-plot their --help, and
#     the packaged completion completes psgd-train's options.
# A build with the CUDA backend links cudart and NCCL, which no Debian package holds: they are
# reported as such and left out of the Depends check (the package then needs the CUDA Toolkit
# under /usr/local/cuda, as its description says), and the programs run with the toolkit's
# library directory from the build's CMakeCache.txt on LD_LIBRARY_PATH. Every other library
# that dpkg does not know fails the test.
#   package.sh BUILD_DIR
set -u
build=$(realpath "$1")
. "$(dirname "$0")/../common/check_lib.sh"
# The programs: tools/CMakeLists.txt's list (BUILD_DIR/programs.txt), compiled ones and scripts.
mapfile -t programs < <(programs "$build" binary)
mapfile -t scripts < <(programs "$build" script)
[ ${#programs[@]} -gt 0 ] || { bad "the list of programs" "$build/programs.txt"; finish; exit 1; }

cd "$build"
if ! cpack -G DEB -B "$tmp/out" >"$tmp/cpack.log" 2>&1; then
  bad "cpack -G DEB" "$(cat "$tmp/cpack.log")"
  finish; exit 1
fi
debs=("$tmp"/out/*.deb)
[ ${#debs[@]} = 1 ] && [ -f "${debs[0]}" ] || { bad "cpack made one .deb" "$(ls "$tmp/out")"; finish; exit 1; }
deb=${debs[0]}
version=$(dpkg-deb -f "$deb" Version)
[[ $(basename "$deb") == dtk_${version}_$(dpkg --print-architecture).deb ]] && [ "$(dpkg-deb -f "$deb" Package)" = dtk ] \
  && ok "cpack -G DEB: $(basename "$deb"), $(du -k "$deb" | cut -f1) KiB" || bad "package name" "$(basename "$deb")"

# ---- Depends ----
depends=$(dpkg-deb -f "$deb" Depends)
echo "     Depends: $depends"
declare -A dep=()
IFS=',' read -ra parts <<<"$depends"
for d in "${parts[@]}"; do d=${d%%(*}; d=${d//[[:space:]]/}; dep[$d]=1; done
for d in openmpi-bin jq gnuplot-nox; do
  [ -n "${dep[$d]:-}" ] && ok "Depends: $d" || bad "Depends: no $d" "$depends"
done

dpkg-deb -x "$deb" "$tmp/root"
root=$tmp/root bin=$tmp/root/usr/bin

# The library directory of the build's CUDA Toolkit, when it has one.
cuda_lib=$(sed -n 's/^CUDAToolkit_LIBRARY_DIR:[A-Z]*=//p' "$build/CMakeCache.txt" 2>/dev/null)
[ -z "$cuda_lib" ] || export LD_LIBRARY_PATH=$cuda_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# The package that holds a library file (usrmerge: dpkg may know it under /lib or /usr/lib).
owner() {
  local f=$1 real p
  real=$(readlink -f "$f")
  for p in "$f" "$real" "${f/#\/usr\/lib\//\/lib\/}" "${f/#\/lib\//\/usr\/lib\/}" \
           "${real/#\/usr\/lib\//\/lib\/}" "${real/#\/lib\//\/usr\/lib\/}"; do
    dpkg -S "$p" 2>/dev/null | sed -n '1s/:.*//p' | grep . && return 0
  done
  return 1
}
libs_ok=1 cuda_seen=""
declare -A checked=()
for p in "${programs[@]}"; do
  [ -x "$bin/$p" ] || continue
  while read -r lib; do
    [ -z "${checked[$lib]:-}" ] || continue
    checked[$lib]=1
    # ldd names most libraries "name => path", the dynamic loader itself by its path alone.
    path=$(ldd "$bin/$p" | awk -v l="$lib" '$1 == l { print $3; exit } $1 ~ ("/" l "$") { print $1; exit }')
    if [ -z "$path" ] || [ "$path" = "not" ]; then
      bad "$p: $lib not found by the dynamic loader" "$(ldd "$bin/$p")"; libs_ok=0; continue
    fi
    if ! pkg=$(owner "$path"); then
      if [[ $lib == libcudart* || $lib == libnccl* || $lib == libcuda.* || $lib == libcublas* || $lib == libcusolver* ]]; then
        cuda_seen+=" $lib"; continue
      fi
      bad "$p: $lib ($path) belongs to no Debian package"; libs_ok=0; continue
    fi
    # OpenBLAS's builds (pthread, openmp, serial) each provide libopenblas.so.0 through the
    # alternatives system; the package asks for the OpenMP one.
    if [[ $pkg == libopenblas0-* ]] && [ -z "${dep[$pkg]:-}" ]; then
      for d in "${!dep[@]}"; do [[ $d == libopenblas0-* ]] && pkg=$d; done
    fi
    [ -n "${dep[$pkg]:-}" ] || { bad "$p: $lib is in package $pkg, which Depends does not name" "$depends"; libs_ok=0; }
  done < <(objdump -p "$bin/$p" | awk '$1 == "NEEDED" { print $2 }' | sort -u)
done
[ $libs_ok = 1 ] && ok "Depends names the package of every library the programs load"
[ -z "$cuda_seen" ] || echo "note CUDA libraries, no Debian package, left out of Depends (the package needs the CUDA Toolkit):$(tr ' ' '\n' <<<"$cuda_seen" | sort -u | tr '\n' ' ')"

# ---- contents ----
outside=$(dpkg-deb -c "$deb" | awk '{ print $6 }' | grep -v -e '^\./$' -e '^\./usr/' || true)
[ -z "$outside" ] && ok "everything under /usr" || bad "files outside /usr" "$outside"
want=$(printf '%s\n' "${programs[@]}" "${scripts[@]}" | sort)
have=$(ls "$bin" | sort)
[ "$have" = "$want" ] && ok "/usr/bin: the programs (${programs[*]}) and ${scripts[*]}, nothing else" \
  || bad "/usr/bin" "$have"
missing=()
for p in "${programs[@]}" "${scripts[@]}"; do
  [ -s "$root/usr/share/man/man1/$p.1" ] || missing+=("man1/$p.1")
  [ -f "$root/usr/share/bash-completion/completions/$p" ] || missing+=("completions/$p")
done
[ -s "$root/usr/share/man/man5/dtk-checkpoint.5" ] || missing+=("man5/dtk-checkpoint.5")
for p in psgd-train shampoo-train fsdp-train comm-bench; do
  [ -s "$root/usr/share/dtk/configs/$p.toml" ] || missing+=("configs/$p.toml")
done
for s in psgd-train comm-bench; do [ -s "$root/usr/share/dtk/slurm/$s.sbatch" ] || missing+=("slurm/$s.sbatch"); done
[ ${#missing[@]} = 0 ] && ok "man pages, configs, SLURM templates and a completion for every program" \
  || bad "missing from the package" "${missing[@]}"

# ---- the unpacked programs run ----
# (the compiled programs' second line names the CUDA backend; a script, dtk-plot, has one line)
for p in "${programs[@]}" "${scripts[@]}"; do
  out=$("$bin/$p" --version 2>&1); rc=$?
  [ $rc = 0 ] && [ "$(head -n 1 <<<"$out")" = "$p (dtk) $version" ] \
    && { [[ " ${scripts[*]} " == *" $p "* ]] || grep -q '^CUDA: .*GPUs visible: ' <<<"$out"; } \
    && ok "$p --version: $(head -n 1 <<<"$out")" || bad "$p --version (exit $rc)" "$out"
done
out=$("$bin/psgd-train" --help 2>&1); rc=$?
[ $rc = 0 ] && grep -q '^Usage: psgd-train' <<<"$out" && grep -q -- '--compressor' <<<"$out" \
  && ok "psgd-train --help" || bad "psgd-train --help (exit $rc)" "$out"
out=$("$bin/dtk-plot" --help 2>&1); rc=$?
[ $rc = 0 ] && grep -q '^Usage: dtk-plot' <<<"$out" && ok "dtk-plot --help" || bad "dtk-plot --help (exit $rc)" "$out"

# ---- the packaged completion, loaded as bash-completion loads it (its per-program file) ----
out=$(PATH=$bin:$PATH bash -c '
  . "$1/usr/share/bash-completion/completions/psgd-train"
  COMP_WORDS=(psgd-train --compr); COMP_CWORD=1; _dtk_complete; echo "${COMPREPLY[*]}"
  COMP_WORDS=(shard-inspect re); COMP_CWORD=1; _dtk_complete; echo "${COMPREPLY[*]}"' _ "$root" 2>&1)
[ "$out" = $'--compress-ratio --compressor\nreshard' ] && ok "the packaged completion completes" \
  || bad "the packaged completion" "$out"

finish
