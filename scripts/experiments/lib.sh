# scripts/experiments/lib.sh: what the experiments share (sourced): the programs, the real data
# a Debian machine has, one training run, the summary of a run's metrics and the plot (dtk-plot).
# Needs jq and gnuplot (scripts/install-deps installs them).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
. "$root/scripts/env.sh"
build=${DTK_BUILD_DIR:-$root/build}
[ -f "$build/build.ninja" ] || cmake -S "$root" -B "$build" -G Ninja >/dev/null
cmake --build "$build" --target psgd-train shampoo-train data-pack >/dev/null
prog() { echo "$build/tools/$1/$1"; }
for tool in jq gnuplot; do
  command -v $tool >/dev/null || { echo "$(basename "$0"): $tool is missing (scripts/install-deps installs it)" >&2; exit 2; }
done

# Fashion-MNIST (dataset-fashion-mnist) packed into $1/fm-train.h5 and $1/fm-test.h5, once.
pack_fashion_mnist() {
  local f=/usr/share/datasets/fashion-mnist d=$1
  [ -f $f/train-images-idx3-ubyte.gz ] || { echo "$f: missing (apt-get install dataset-fashion-mnist)" >&2; exit 2; }
  [ -f "$d/fm-train.h5" ] || "$(prog data-pack)" mnist $f/train-images-idx3-ubyte.gz $f/train-labels-idx1-ubyte.gz \
    -o "$d/fm-train.h5" --log-level warn >/dev/null
  [ -f "$d/fm-test.h5" ] || "$(prog data-pack)" mnist $f/t10k-images-idx3-ubyte.gz $f/t10k-labels-idx1-ubyte.gz \
    -o "$d/fm-test.h5" --log-level warn >/dev/null
}

# The number of samples of a classification file (its `labels`).
samples_of() { h5ls "$1/labels" | sed -n 's/.*{\([0-9]*\)[,}].*/\1/p'; }

# The licenses under /usr/share/common-licenses as bytes, 5% held out: $1/lic.h5 and $1/lic-val.h5.
pack_licenses() {
  [ -f "$1/lic.h5" ] || "$(prog data-pack)" text /usr/share/common-licenses/* -o "$1/lic.h5" --val-fraction 0.05 \
    --val-output "$1/lic-val.h5" --log-level warn >/dev/null
}

# run OUT NAME RANKS PROGRAM ARGS...: one training run, its metrics in OUT/NAME.jsonl and its log
# in OUT/NAME.log; a failed run stops the experiment with its log's tail.
run() {
  local out=$1 name=$2 n=$3 p=$4
  shift 4
  echo "$(basename "$0"): $name ($p on $n ranks)" >&2
  rm -f "$out/$name.jsonl"  # a run that did not finish starts again
  if ! mpiexec -n "$n" "$(prog "$p")" "$@" --metrics "$out/$name.jsonl" >"$out/$name.log" 2>&1; then
    tail -5 "$out/$name.log" >&2
    echo "$(basename "$0"): $name failed (log: $out/$name.log)" >&2
    exit 1
  fi
}

# done_already OUT NAME: OUT/NAME.jsonl holds a whole run of $steps steps (an experiment run
# again with the same OUT skips it).
done_already() { [ -f "$1/$2.jsonl" ] && [ "$(tail -1 "$1/$2.jsonl" | jq -r .step)" = "$steps" ]; }

# summary OUT NAME KEY: a value of the run: last_val_loss, last_val_accuracy, best_val_accuracy,
# seconds (the sum of step times), steps, bytes (comm_bytes summed over steps), bytes_uncompressed.
summary() {
  jq -s -r --arg k "$3" '
    [.[] | select(.val_loss)] as $v |
    {last_val_loss: ($v | last | .val_loss), last_val_accuracy: ($v | last | .val_accuracy // 0),
     best_val_accuracy: ([$v[].val_accuracy // 0] | max), seconds: ([.[].step_time_ms] | add / 1000),
     steps: (last | .step), bytes: ([.[].comm_bytes // 0] | add),
     bytes_uncompressed: ([.[] | .comm_bytes_uncompressed // .comm_bytes // 0] | add)}[$k]' "$1/$2.jsonl"
}

# first_step_at OUT NAME KEY VALUE BETTER: the first step whose KEY (val_loss, val_accuracy) is at
# least as good as VALUE (BETTER: lower or higher); "-" when none is.
first_step_at() {
  jq -s -r --arg k "$3" --argjson v "$4" --arg b "$5" '
    [.[] | select(.[$k] != null) | select(if $b == "lower" then .[$k] <= $v else .[$k] >= $v end) | .step] |
    if length > 0 then .[0] else "-" end' "$1/$2.jsonl"
}

# plot OUT TITLE YKEY NAME...: OUT/plot.png by dtk-plot, four panels: the training loss and the
# validation metric (YKEY: val_loss or val_accuracy), each against step and against seconds (the
# sum of the steps' times); a line per run.
plot() {
  local out=$1 title=$2 ykey=$3 name files=()
  shift 3
  for name in "$@"; do files+=("$out/$name.jsonl"); done
  "$build/tools/dtk-plot/dtk-plot" "${files[@]}" --val "$ykey" --title "$title" -o "$out/plot.png"
}

# optimizer_of METHOD: shampoo-train's --optimizer for a method of compare_optimizers: sgd and
# adamw are themselves (the baselines); shampoo, soap and muon (and any other name) are Shampoo,
# its preconditioner in the method's own options (METHOD_args).
optimizer_of() { case $1 in sgd|adamw) echo "$1" ;; *) echo shampoo ;; esac; }

# seconds_to OUT NAME STEP: the sum of the step times (seconds, validation excluded) of steps
# 1..STEP of a run; "-" for STEP "-".
seconds_to() {
  [ "$3" = - ] && { echo -; return; }
  jq -s -r --argjson s "$3" '[.[] | select(.step <= $s) | .step_time_ms] | add / 1000' "$1/$2.jsonl"
}

# compare_optimizers OUT TITLE KEY BETTER RANKS "METHOD:LR,LR,... ..." COMMON_ARGS...: Shampoo
# and its family against the baselines as the Distributed Shampoo paper measures it. Every METHOD
# (sgd and adamw, the baselines; shampoo, soap, muon: --optimizer shampoo; each method's extra
# options in the array METHOD_args, e.g. soap_args) trains once per learning rate of its grid
# (OUT/METHOD-lrLR.jsonl); each method's best run is the one with the best final KEY
# (val_accuracy with BETTER higher, val_loss with lower). The target is the better baseline's
# final KEY (of two with the same, the one that reached it in fewer steps); the table gives, for
# each method's best run, the first step at which it reached the target (a validation every 1/20
# of the run) and that step over the baseline's, the goal being <= 0.75, the seconds to that
# step (the sum of the step times, validation excluded) and their ratio to the baseline's, the
# mean step time (root steps included), step/base* (the mean of step_time_ms / compute_ms over
# the baseline's: the step's cost in units of its forward-backward, the same work for every
# method, so that a load that slows a whole run cancels) and the steps the run has.
# OUT/table.txt, OUT/plot.png. With report_only=1 nothing runs: the table and the plot are made
# from the runs in OUT, whole or cut short (a run cut short has its last validation for its final
# value, and fewer steps run than --steps).
compare_optimizers() {
  local out=$1 title=$2 key=$3 better=$4 n=$5 grids=$6
  shift 6
  local best=() g m lrs lr name v cmp
  cmp='a > b'
  [ "$better" = lower ] && cmp='a < b'
  for g in $grids; do
    m=${g%%:*} lrs=${g#*:}
    local extra_var="${m}_args[@]" top="" topv=""
    for lr in ${lrs//,/ }; do
      name=$m-lr$lr
      if [ "${report_only:-0}" = 1 ]; then
        [ -s "$out/$name.jsonl" ] && [ -n "$(summary "$out" "$name" last_$key)" ] || continue
      else
        done_already "$out" "$name" ||
          run "$out" "$name" "$n" shampoo-train "$@" --optimizer "$(optimizer_of "$m")" --lr "$lr" ${!extra_var+"${!extra_var}"}
      fi
      v=$(summary "$out" "$name" "last_$key")
      if [ -z "$top" ] || awk -v a="$v" -v b="$topv" "BEGIN { exit !($cmp) }"; then top=$name topv=$v; fi
    done
    if [ -n "$top" ]; then best+=("$top"); fi
  done
  # The target: the better baseline's final value; of two baselines with the same, the one that
  # reached it in fewer steps.
  local base="" basev=""
  for name in "${best[@]}"; do
    [ "$(optimizer_of "${name%-lr*}")" = shampoo ] && continue
    v=$(summary "$out" "$name" "last_$key")
    if [ -z "$base" ] || awk -v a="$v" -v b="$basev" "BEGIN { exit !($cmp) }" ||
       { [ "$v" = "$basev" ] && [ "$(first_step_at "$out" "$name" "$key" "$v" "$better")" -lt \
                                  "$(first_step_at "$out" "$base" "$key" "$v" "$better")" ]; }; then
      base=$name basev=$v
    fi
  done
  [ -n "$base" ] || { echo "$(basename "$0"): no baseline (sgd or adamw) among the methods" >&2; exit 2; }
  local base_steps base_secs
  base_steps=$(first_step_at "$out" "$base" "$key" "$basev" "$better")
  base_secs=$(seconds_to "$out" "$base" "$base_steps")
  # A step's time over its own forward-backward time (compute_ms: the same work for every
  # method), the mean over the run: a load that slows a whole run cancels in its ratio.
  local norm='[.[] | .step_time_ms / .compute_ms] | add / length' base_norm
  base_norm=$(jq -s "$norm" "$out/$base.jsonl")
  {
    echo "# $title: target $key $basev (the final value of $base), $(date +%F), $(nproc) cores"
    echo "# (-: not reached; step/base*: the mean step time over the forward-backward time, over the baseline's)"
    printf "# %-22s %12s %16s %10s %12s %10s %10s %12s %10s\n" "best run" "final $key" "steps to target" "vs base" \
      "s to target" "vs base" "ms/step" "step/base*" "steps run"
    for name in "${best[@]}"; do
      local s ms secs
      s=$(first_step_at "$out" "$name" "$key" "$basev" "$better")
      secs=$(seconds_to "$out" "$name" "$s")
      ms=$(jq -s '[.[].step_time_ms] | add / length' "$out/$name.jsonl")
      awk -v nm="$name" -v v="$(summary "$out" "$name" "last_$key")" -v s="$s" -v b="$base_steps" -v ms="$ms" \
        -v t="$secs" -v bt="$base_secs" -v run="$(summary "$out" "$name" steps)" \
        -v nr="$(jq -s "$norm" "$out/$name.jsonl")" -v bn="$base_norm" \
        'BEGIN { r = (s == "-") ? "-" : sprintf("%.2f", s / b); rt = (t == "-") ? "-" : sprintf("%.2f", t / bt);
                 st = (t == "-") ? "-" : sprintf("%.1f", t);
                 printf "  %-22s %12.4f %16s %10s %12s %10s %10.1f %12.3f %10d\n", nm, v, s, r, st, rt, ms, nr / bn, run }'
    done
  } | tee "$out/table.txt"
  plot "$out" "$title" "$key" "${best[@]}"
}
