#!/usr/bin/env bash
# The example configurations (share/dtk/configs/*.toml) run as their comments launch them
# (`mpiexec -n N PROGRAM --config FILE`, the first such line), on the data they name packed by
# data-pack in a scratch directory: a trainer stops after 2 steps (--stop-at 2) with its metrics,
# comm-bench runs a short sweep (-e 4K). Every program that trains or benchmarks has PROGRAM.toml.
#   configs.sh MPIEXEC SOURCE_DIR BIN_DIR   (BIN_DIR/<program>/<program>)
set -u
mpiexec=$1 src=$(realpath "$2") bin=$(realpath "$3")
. "$(dirname "$0")/train_lib.sh"
configs=$src/share/dtk/configs

for p in psgd-train shampoo-train fsdp-train comm-bench; do
  [ -f "$configs/$p.toml" ] && ok "$p.toml exists" || bad "no $configs/$p.toml"
done

# The data the configs name, packed as their comments say.
needs() { grep -qE "^(val-)?data = \"$1\"" "$configs"/*.toml; }
if needs lic.h5; then
  "$bin/data-pack/data-pack" text /usr/share/common-licenses/* -o lic.h5 --val-fraction 0.05 --val-output lic-val.h5 \
    --log-level warn >/dev/null || bad "data-pack text (the licenses)"
fi
if needs fm-train.h5; then
  f=/usr/share/datasets/fashion-mnist
  "$bin/data-pack/data-pack" mnist $f/train-images-idx3-ubyte.gz $f/train-labels-idx1-ubyte.gz -o fm-train.h5 \
    --log-level warn >/dev/null && \
  "$bin/data-pack/data-pack" mnist $f/t10k-images-idx3-ubyte.gz $f/t10k-labels-idx1-ubyte.gz -o fm-test.h5 \
    --log-level warn >/dev/null || bad "data-pack mnist (Fashion-MNIST: apt-get install dataset-fashion-mnist)"
fi

for c in "$configs"/*.toml; do
  name=$(basename "$c" .toml)
  launch=$(grep -m1 -oE '^#   mpiexec -n [0-9]+ [a-z-]+ --config' "$c")
  n=$(awk '{ print $4 }' <<<"$launch") p=$(awk '{ print $5 }' <<<"$launch")
  if [ -z "$launch" ] || [ ! -x "$bin/$p/$p" ]; then bad "$name: no launch line naming a program"; continue; fi
  if [ "$p" = comm-bench ]; then
    run $mpiexec -n "$n" "$bin/$p/$p" --config "$c" -e 4K -n 2 -w 1
    if [ $rc = 0 ] && grep -q '^# wrong elements: 0' "$tmp/o"; then ok "$name: $p on $n ranks"
    else bad "$name: $p on $n ranks (exit $rc)" "$(cat "$tmp/o" "$tmp/e")"; fi
  else
    run $mpiexec -n "$n" "$bin/$p/$p" --config "$c" --stop-at 2 --save "$name.h5" --metrics "$name.jsonl" --log-level warn
    if [ $rc = 0 ] && [ "$(jq -s 'map(select(.loss)) | length' "$name.jsonl" 2>/dev/null)" = 2 ]; then
      ok "$name: $p on $n ranks, 2 steps, loss $(tail -1 "$name.jsonl" | jq .loss)"
    else bad "$name: $p on $n ranks (exit $rc)" "$(cat "$tmp/e")"; fi
  fi
done
finish
