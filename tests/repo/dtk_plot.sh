#!/usr/bin/env bash
# dtk-plot on the metrics of real psgd-train runs: a PNG and an SVG with a line per run (named
# after its file), the panels asked for (--x, --val, validation panels only where a run has the
# key), the version of the other programs; bad input (a missing or empty file, a line that is not
# JSON or lacks loss or step_time_ms, a bad option or output name) exits 2 with one line naming
# the problem, writes nothing and leaves an existing output as it was; no temporary file is left.
#   dtk_plot.sh DTK_PLOT PSGD_TRAIN
set -u
plot=$(realpath "$1") psgd=$(realpath "$2")
. "$(dirname "$0")/../common/train_lib.sh"
mkdir t; export TMPDIR=$tmp/t

# Two real runs: PowerSGD and plain all-reduce, a validation every 3 steps.
for c in powersgd none; do
  "$psgd" $small --global-batch 4 --steps 6 --eval-every 3 --compressor $c --start-iter 0 --metrics "$c.jsonl" \
    --log-level warn >/dev/null 2>&1 || bad "psgd-train --compressor $c" "$(cat "$c.jsonl" 2>/dev/null)"
done
[ "$(wc -l <powersgd.jsonl)" = 6 ] && [ "$(jq -s '[.[] | select(.val_loss)] | length' powersgd.jsonl)" = 2 ] \
  && ok "two runs of 6 steps with 2 validations each" || bad "the runs' metrics" "$(cat powersgd.jsonl)"

run "$plot" powersgd.jsonl none.jsonl -o both.png --title "PowerSGD's test"
[ $rc = 0 ] && [ ! -s "$tmp/o" ] && [ ! -s "$tmp/e" ] && [ "$(head -c 8 both.png | od -An -tx1 | tr -d ' \n')" = 89504e470d0a1a0a ] \
  && ok "a PNG, nothing printed" || bad "png (exit $rc)" "$(cat "$tmp/e")"
run "$plot" powersgd.jsonl none.jsonl -o both.svg --title "PowerSGD's test"
absent=""
for w in ">powersgd<" ">none<" ">step<" ">seconds<" ">training loss<" ">validation loss<" "PowerSGD's test"; do
  grep -qF -- "$w" both.svg 2>/dev/null || absent+=" $w"
done
[ $rc = 0 ] && grep -q '<svg' both.svg && [ -z "$absent" ] \
  && ok "an SVG: a line per run named after its file, step and seconds, loss and validation loss, the title" \
  || bad "svg (exit $rc), without:$absent" "$(cat "$tmp/e")"
run "$plot" powersgd.jsonl --x step -o step.svg
[ $rc = 0 ] && grep -qF '>step<' step.svg && ! grep -qF '>seconds<' step.svg && ok "--x step: no time axis" \
  || bad "--x step (exit $rc)" "$(cat "$tmp/e")"
run "$plot" powersgd.jsonl --x time -o time.svg
[ $rc = 0 ] && grep -qF '>seconds<' time.svg && ! grep -qF '>step<' time.svg && ok "--x time: no step axis" \
  || bad "--x time (exit $rc)" "$(cat "$tmp/e")"
run "$plot" powersgd.jsonl none.jsonl --x step,bytes,time -o bytes.svg
[ $rc = 0 ] && grep -qF '>step<' bytes.svg && grep -qF '>seconds<' bytes.svg && grep -qF '>GB sent (comm_bytes)<' bytes.svg \
  && ok "--x step,bytes,time: three axes, the bytes of comm_bytes" || bad "--x step,bytes,time (exit $rc)" "$(cat "$tmp/e")"
run "$plot" powersgd.jsonl --val val_accuracy -o noval.svg
[ $rc = 0 ] && ! grep -qF 'validation' noval.svg && grep -qF '>training loss<' noval.svg \
  && ok "--val KEY that no run has: the loss panels only" || bad "--val val_accuracy (exit $rc)" "$(cat "$tmp/e")"

run "$plot" --version
[ $rc = 0 ] && [ "$(cat "$tmp/o")" = "dtk-plot (dtk) $("$psgd" --version | awk 'NR == 1 { print $3 }')" ] \
  && ok "--version: $(cat "$tmp/o")" || bad "--version" "$(cat "$tmp/o" "$tmp/e")"
run "$plot" --help
[ $rc = 0 ] && grep -q '^Usage: dtk-plot' "$tmp/o" && ok "--help" || bad "--help (exit $rc)"

# ---- bad input: exit 2, one line on stderr, nothing on stdout, no output, old output kept ----
printf '{"step":1,"loss":2,"step_time_ms":5}\nnot json\n' > notjson.jsonl
printf '{"step":1,"loss":2,"step_time_ms":5}\n{"step":2,"lss":2,"step_time_ms":5}\n' > noloss.jsonl
printf '{"step":1,"loss":2}\n' > notime.jsonl
printf '[1,2]\n' > array.jsonl
: > empty.jsonl
echo keep > kept.png
refused() {
  local name=$1 msg=$2; shift 2
  run "$plot" "$@"
  if [ $rc = 2 ] && [ "$(wc -l <"$tmp/e")" = 1 ] && grep -qF -- "$msg" "$tmp/e" && [ ! -s "$tmp/o" ] \
     && [ ! -e new.png ] && [ "$(cat kept.png)" = keep ]; then ok "bad input: $name"
  else bad "bad input: $name (exit $rc, want 2 and one line with '$msg')" "$(cat "$tmp/o" "$tmp/e")"; fi
}
refused "a missing file" "missing.jsonl: no such file" missing.jsonl -o new.png
refused "not JSON, the line named" "notjson.jsonl: line 2: not JSON" notjson.jsonl -o kept.png
refused "no loss" 'noloss.jsonl: line 2: no numeric "loss"' powersgd.jsonl noloss.jsonl -o kept.png
refused "no step_time_ms for the time axis" 'notime.jsonl: line 1: no numeric "step_time_ms"' notime.jsonl -o new.png
refused "not an object" "array.jsonl: line 1: not a JSON object" array.jsonl -o new.png
refused "an empty file" "empty.jsonl: no metrics" empty.jsonl -o new.png
refused "no -o" "no output given" powersgd.jsonl
refused "no file" "no metrics file given" -o new.png
refused "an output that is neither png nor svg" "must end in .png or .svg" powersgd.jsonl -o new.pdf
refused "an output directory that does not exist" "no directory nodir" powersgd.jsonl -o nodir/new.png
refused "an unknown option" "unknown option --bogus" powersgd.jsonl -o new.png --bogus
refused "--x other" "--x seconds: expected step, time or bytes" powersgd.jsonl -o new.png --x seconds
refused "--x an axis twice" "--x step,step: an axis twice" powersgd.jsonl -o new.png --x step,step
refused "--bytes a key no line has" 'powersgd.jsonl: no numeric "outer_bytes" on any line' powersgd.jsonl -o new.png --x bytes --bytes outer_bytes
refused "--size" "--size 0,0" powersgd.jsonl -o new.png --size 0,0
run "$plot" notime.jsonl --x step -o notime.png
[ $rc = 0 ] && [ -s notime.png ] && ok "--x step needs no step_time_ms" || bad "--x step without step_time_ms" "$(cat "$tmp/e")"
[ -z "$(ls -A t)" ] && [ -z "$(ls -A | grep '^\.dtk-plot')" ] && ok "no temporary file left" \
  || bad "temporary files left" "$(ls -A t .)"
finish
