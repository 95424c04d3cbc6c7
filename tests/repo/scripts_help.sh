#!/usr/bin/env bash
# Every script a user runs answers --help (and -h) with its usage and exits 0, doing nothing
# else: the executable files of scripts/, scripts/experiments/ and bench/ (the others, env.sh,
# lib.sh, torch-lib.sh, are sourced; pytorch_llama.py is run by bench-vs-pytorch) and the built
# dtk-plot. Each prints a line "Usage: [DIR/]NAME ..." on stdout, nothing on stderr, within
# 20 seconds, and runs none of the commands that would start work: they are stubs on PATH here
# that record any call (cmake, ninja, ctest, mpiexec, apt-get, sudo, pip, python3, nvidia-smi,
# gnuplot, jq), so that a script that ignored --help and started a build or a benchmark fails
# at once.
#   scripts_help.sh SOURCE_DIR BUILD_DIR
set -u
src=$(realpath "$1") build=$(realpath "$2")
. "$(dirname "$0")/../common/check_lib.sh"

mkdir "$tmp/stub"
for c in cmake ninja ctest mpiexec mpirun apt-get apt sudo pip pip3 python3 nvidia-smi gnuplot jq; do
  printf '#!/bin/sh\necho "%s $*" >>"%s"\nexit 97\n' "$c" "$tmp/calls" >"$tmp/stub/$c"
  chmod +x "$tmp/stub/$c"
done

scripts=()
for f in "$src"/scripts/* "$src"/scripts/experiments/* "$src"/bench/*; do
  [ -f "$f" ] && [ -x "$f" ] && scripts+=("$f")
done
[ ${#scripts[@]} -ge 10 ] || bad "the scripts found" "${scripts[@]}"
scripts+=("$build/tools/dtk-plot/dtk-plot")

cd "$tmp" || exit 1
for s in "${scripts[@]}"; do
  name=$(basename "$s") shown=${s#"$src"/}
  for opt in --help -h; do
    rm -f "$tmp/calls"
    PATH=$tmp/stub:$PATH timeout 20 "$s" "$opt" >"$tmp/out" 2>"$tmp/err" </dev/null; rc=$?
    why=()
    [ $rc = 0 ] || why+=("exit $rc")
    grep -qE "^Usage: ([^ ]*/)?$name( |\$)" "$tmp/out" || why+=("no line \"Usage: $name ...\" on stdout")
    [ -s "$tmp/err" ] && why+=("stderr: $(head -c 300 "$tmp/err")")
    [ -s "$tmp/calls" ] && why+=("it ran: $(tr '\n' ';' <"$tmp/calls")")
    if [ ${#why[@]} = 0 ]; then ok "$shown $opt: $(grep -m1 '^Usage: ' "$tmp/out")"
    else bad "$shown $opt" "${why[@]}" "stdout: $(head -c 300 "$tmp/out")"; fi
  done
done
# Nothing was left behind by a script that went ahead (a build directory named --help, an
# experiment's output folder).
left=$(ls -A "$tmp" | grep -vxE 'stub|out|err|calls' || true)
[ -z "$left" ] && ok "nothing written" || bad "written in the working directory" "$left"
finish
