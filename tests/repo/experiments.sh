#!/usr/bin/env bash
# The experiments of scripts/experiments end to end in a reduced form (a few steps, fewer
# methods and learning rates): each writes its metrics, a table with a row per method and a PNG.
# Their full CPU-scale results are in docs/RESULTS.md.
#   experiments.sh BUILD_DIR
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
export DTK_BUILD_DIR=$1
. "$(dirname "$0")/../common/check_lib.sh"
# check NAME ROWS: the experiment's table has these rows, its plot is a PNG, every run its metrics.
check() {
  local d=$tmp/$1 rows=$2
  shift 2
  if [ "$(grep -vc '^#' "$d/table.txt")" = "$rows" ] && [ "$(head -c 4 "$d/plot.png" | tail -c 3)" = PNG ] &&
     ! grep -q nan "$d/table.txt"; then ok "$*"
  else bad "$*" "$(cat "$d/table.txt" 2>&1)" "$(ls "$d")"; fi
}
"$root/scripts/experiments/powersgd-resnet" -o "$tmp/p" --ranks 2 --steps 12 --methods "allreduce powersgd-r2 topk signum" \
  >"$tmp/p.out" 2>"$tmp/p.err" && check p 4 "powersgd-resnet: 4 methods, table and plot" \
  || bad "powersgd-resnet (exit $?)" "$(cat "$tmp/p.err")"
grep -q "powersgd-r2 .* -\?[0-9.]*% .*[0-9.]* *[0-9.]* *[0-9.]*$" "$tmp/p/table.txt" || bad "powersgd-resnet table row" "$(cat "$tmp/p/table.txt")"
"$root/scripts/experiments/shampoo-resnet" -o "$tmp/r" --steps 8 --grids "sgd:0.1 adamw:0.003 shampoo:0.1 soap:0.003 muon:0.003" \
  >"$tmp/r.out" 2>"$tmp/r.err" && check r 5 "shampoo-resnet: 5 methods (soap and muon among them), table and plot" \
  || bad "shampoo-resnet (exit $?)" "$(cat "$tmp/r.err")"
# The target is a baseline's (sgd, adamw), whose row reaches it at ratio 1.00 in steps and seconds.
base=$(sed -n 's/.*(the final value of \([a-z]*-lr[0-9.e-]*\)).*/\1/p' "$tmp/r/table.txt")
[[ $base == sgd-* || $base == adamw-* ]] && grep -q "^  $base .* 1\.00 .* 1\.00 " "$tmp/r/table.txt" \
  && ok "shampoo-resnet: the target is a baseline's, steps and seconds to it" || bad "shampoo-resnet target" "$(cat "$tmp/r/table.txt")"
"$root/scripts/experiments/shampoo-text" -o "$tmp/t" --steps 8 --grids "adamw:0.003,0.01 sgd:0.3 shampoo:0.003 soap:0.003 muon:0.003" \
  >"$tmp/t.out" 2>"$tmp/t.err" && check t 5 "shampoo-text: the best of a grid per method, table and plot" \
  || bad "shampoo-text (exit $?)" "$(cat "$tmp/t.err")"
ls "$tmp/t"/adamw-lr0.01.jsonl >/dev/null 2>&1 && ok "shampoo-text: every learning rate of the grid ran" || bad "grid runs" "$(ls "$tmp/t")"
"$root/scripts/experiments/powersgd-resnet" -o "$tmp/x" --bogus >/dev/null 2>&1
[ $? = 2 ] && ok "an unknown argument: exit 2" || bad "unknown argument"
finish
