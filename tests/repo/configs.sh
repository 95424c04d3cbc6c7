#!/usr/bin/env bash
# The example configurations (share/dtk/configs/*.toml) run as their heads say: every launch line
# of a file's head comment (a comment line indented by three spaces: `#   COMMAND`) runs as
# written, in order, in a scratch directory of its own holding a copy of the file (the lines name
# it without a path) and the programs on PATH by name (doc_lib.sh's doc_bin), so that the data
# they pack is there for the runs and the runs' metrics for dtk-plot. Only the sizes are changed,
# by options appended after the line's own (a repeated option takes its last value): a trainer
# stops after 2 steps with a checkpoint and a validation (--stop-at 2 --save ... --eval-every 2
# --eval-batches 1; with --print-plan nothing is appended: it exits after timing two steps),
# comm-bench runs a short sweep (-e 4K -n 2 -w 1). A file for GPUs (device = "cuda") runs on the
# CPU (--device cpu), and one of a billion-parameter llama preset (llama-1b, llama3-*) with its
# vocabulary, data and options but a toy's width, depth and context ($toy): two steps of the
# preset's own shapes would take minutes on two cores. A line under srun needs a SLURM cluster:
# listed as skipped. Each line must exit 0 with its outputs written (doc_lib.sh's doc_check). Every
# program that trains or benchmarks has PROGRAM.toml, and every file has a launch line.
#   configs.sh MPIEXEC SOURCE_DIR BIN_DIR   (BIN_DIR/<program>/<program>)
set -u
mpiexec=$1 src=$(realpath "$2") bin=$(realpath "$3") here=$(cd "$(dirname "$0")" && pwd)
. "$here/../common/train_lib.sh"
. "$here/../common/doc_lib.sh"
set -o pipefail
configs=$src/share/dtk/configs

for p in psgd-train shampoo-train fsdp-train comm-bench; do
  [ -f "$configs/$p.toml" ] && ok "$p.toml exists" || bad "no $configs/$p.toml"
done

# The lines say `mpiexec`: the one this build found.
doc_bin "$tmp/bin" "$bin"
mpiexec_dir=$(dirname "$(command -v "${mpiexec%% *}")")
export PATH=$tmp/bin:$mpiexec_dir:$PATH
doc_log=$tmp/log
mkdir -p "$doc_log"
skipped=()
toy="--dim 32 --layers 1 --heads 2 --kv-heads 1 --ffn-hidden 64 --seq-len 32"

for c in "$configs"/*.toml; do
  name=$(basename "$c" .toml)
  mkdir "$tmp/$name" && cp "$c" "$tmp/$name/" && cd "$tmp/$name" || { bad "$name: no scratch directory"; continue; }
  mapfile -t launch < <(sed -n '/^[^#]/q; s/^#   \([^ ].*\)$/\1/p' "$c")
  shrink=""
  grep -qE '^device *= *"cuda"' "$c" && shrink="--device cpu"
  case $(sed -n 's/^model *= *"\([^"]*\)".*/\1/p' "$c") in llama-1b|llama3-*) shrink+=" $toy" ;; esac
  started=0
  for l in "${launch[@]}"; do
    case $l in
      srun\ *) skipped+=("$name.toml: $l (needs a SLURM cluster)"); continue ;;
      *--print-plan*) export DTK_DOC_APPEND="--log-level warn $shrink" ;;
      *comm-bench\ *) export DTK_DOC_APPEND="-e 4K -n 2 -w 1" ;;
      *) export DTK_DOC_APPEND="--stop-at 2 --save $name-stop.h5 --eval-every 2 --eval-batches 1 --log-level warn $shrink" ;;
    esac
    [[ $l =~ (^|[ /])(psgd-train|shampoo-train|fsdp-train|comm-bench)\ --config\ $name.toml ]] && started=1
    doc_run "$name.toml" "$l"
  done
  [ $started = 1 ] || bad "$name.toml: no launch line (#   [mpiexec -n N] PROGRAM --config $name.toml)"
  unset DTK_DOC_APPEND
done
cd "$tmp"
echo "skipped ${#skipped[@]} line(s):"
printf '  %s\n' "${skipped[@]}"
finish
