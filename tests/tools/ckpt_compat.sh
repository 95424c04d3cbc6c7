#!/usr/bin/env bash
# Older checkpoints keep loading (issue 30: state declares its own placement). The checkpoints in
# tests/data/ckpt-f8dadf6 were written by the programs of commit f8dadf6, before the change, on 2
# ranks at step 4 of 8 (their make.sh): PowerSGD's per-rank error feedback with AdamW, Shampoo's
# owned and packed blocks, and fsdp-train's sharded states with AdamW and with Shampoo (per-rank
# blocks). Today's programs resume each of them on 2 ranks with no warning (every piece of state,
# per-rank ones included, found where it is declared, with its shape and dtype), train 2 steps
# and write a checkpoint with the same tensors (names, shapes, dtypes) as the old one, except
# fsdp-train's Shampoo blocks: cut from the shards then (ranks/<r>/optim/shampoo/<param>/
# block<i>/..., i by shard), the whole parameters' blocks since issue 32 (dtk-checkpoint(5)),
# so that state is not today's: fsdp-train resumes the weights and AdamW-free rest, starts
# Shampoo afresh with one warning saying so, and its checkpoint holds the model as before.
#   ckpt_compat.sh MPIEXEC BIN_DIR FIXTURES   (BIN_DIR/<program>/<program>)
set -u
mpiexec=$1 bin=$(realpath "$2") fixtures=$(realpath "$3")
. "$(dirname "$0")/../common/train_lib.sh"
# The datasets of an HDF5 file: name, shape, type (h5ls), without the attributes' values.
# Shampoo's block names without what says which block (ranks/<r>/, rows<a>-<b>/, block<i>);
# groups left out (the datasets name them).
layout() {
  h5ls -r "$1" | grep -v ' Group$' | sed 's/, *\(H5S_UNLIMITED\|[0-9]*\)\/[0-9A-Z_]*//g' \
    | sed -E 's#^/ranks/[0-9]+/optim/shampoo/#/optim/shampoo/#; s#/rows[0-9]+-[0-9]+/block[0-9]+/#/block/#; s#/optim/shampoo/(.*)/block[0-9]+/#/optim/shampoo/\1/block/#' \
    | sort
}
# A checkpoint's files: one, or a sharded state's index and rank files.
files() { if [ -d "$1" ]; then (cd "$1" && ls *.h5); else echo .; fi; }
# same_layout OLD NEW [EXCLUDE]: the same tensors in every file, but those matching EXCLUDE.
same_layout() {
  local old=$1 new=$2 ex=${3:-^$} f
  for f in $(files "$old"); do
    [ "$f" = . ] && f= || f=/$f
    diff <(layout "$old$f" | grep -v "$ex") <(layout "$new$f" | grep -v "$ex") | head || return 1
    [ "$(layout "$old$f" | grep -v "$ex")" = "$(layout "$new$f" | grep -v "$ex")" ] || return 1
  done
}

for c in psgd-train:psgd.h5 shampoo-train:shampoo.h5 fsdp-train:fsdp fsdp-train:fsdp-shampoo; do
  prog=${c%%:*} ck=$fixtures/${c#*:}
  name=$(basename "$ck")
  run $mpiexec -n 2 "$bin/$prog/$prog" --resume "$ck" --stop-at 6 --threads 1 --log-level warn \
    --checkpoint-dir "$name.out" --metrics "$name.jsonl"
  steps=$(jq -c .step "$name.jsonl" 2>/dev/null | tr '\n' ' ')
  if [ "$name" = fsdp-shampoo ]; then
    if [ $rc = 0 ] && [ "$(wc -l <"$tmp/e")" = 1 ] && grep -q "blocks were cut from the shards.*Shampoo starts afresh" "$tmp/e" &&
       [ "$steps" = "5 6 " ]; then
      ok "$prog resumes $name (f8dadf6): its weights, Shampoo afresh with one warning"
    else
      bad "$prog --resume $name (exit $rc)" "$(cat "$tmp/e")"
    fi
    new=$(ls -d "$name.out"/step-00000006*)
    if d=$(same_layout "$ck" "$new" optim/shampoo); then
      ok "$prog: its checkpoint at step 6 holds $name's tensors but Shampoo's"
    else bad "$prog: the tensors of $name and of today's checkpoint differ" "$d"; fi
    continue
  fi
  if [ $rc = 0 ] && [ ! -s "$tmp/e" ] && [ "$steps" = "5 6 " ]; then
    ok "$prog resumes $name (f8dadf6) with all its state, no warning"
  else
    bad "$prog --resume $name (exit $rc)" "$(cat "$tmp/e")"
    continue
  fi
  new=$(ls -d "$name.out"/step-00000006*)
  if d=$(same_layout "$ck" "$new"); then ok "$prog: its checkpoint at step 6 holds the tensors $name does"
  else bad "$prog: the tensors of $name and of today's checkpoint differ" "$d"; fi
done
finish
