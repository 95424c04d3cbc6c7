#!/usr/bin/env bash
# What a resumed run keeps, end to end on 1 and 2 ranks (issue 28):
#  - `--resume` alone continues with the checkpoint's options (the learning rate, its warm-up and
#    schedule, the batch, the seed, a --config file's values): the metrics after resume equal an
#    uninterrupted run's, bit for bit, and --metrics continues its file without repeating a step;
#  - an option given again with another value is named in one warning line; the same value
#    written another way (0.0003 for 3e-4), or repeated with the same last value, is no change; options the state cannot follow
#    (--optimizer, --rank) are refused with exit 2 before any work;
#  - --metrics refuses an existing file on a fresh run (exit 2, the file untouched) unless
#    --metrics-append; stdout carries the metric lines alone (`| jq` parses every line), and with
#    --metrics FILE it carries the checkpoint paths;
#  - another program's checkpoint is refused with a line naming the program that wrote it;
#  - the resumed checkpoint is opened once (its metadata and its tensors; rank 0's debug log);
#  - checkpoints written in the background (--async-checkpoint) equal synchronous ones, bit for
#    bit, for every trainer and kind of checkpoint, and a resume from one is exact.
#  - a checkpoint of N ranks resumes on M as the M-rank run (issue 31; the last section).
#   resume.sh MPIEXEC BIN_DIR   (BIN_DIR/<program>/<program>)
set -u
mpiexec=$1 bin=$(realpath "$2")
. "$(dirname "$0")/../common/train_lib.sh"
psgd=$bin/psgd-train/psgd-train shampoo=$bin/shampoo-train/shampoo-train
job="$small --global-batch 8 --eval-every 0 --log-level warn"
# The run's options: a warm-up and a peak learning rate the defaults do not have.
opts="--steps 8 --lr 3e-4 --warmup 3 --seed 5 --compressor powersgd --rank 2 --start-iter 2"
# Columns of the metrics that a resume must reproduce exactly.
cols() { jq -c '[.step, .loss, .lr, .grad_norm]' "$1"; }

for n in 1 2; do
  launch=$psgd
  [ $n = 2 ] && launch="$mpiexec -n 2 $psgd"
  d=n$n
  mkdir -p $d
  run $launch $job $opts --metrics $d/full.jsonl
  [ $rc = 0 ] || bad "$n rank(s): the uninterrupted run (exit $rc)" "$(cat "$tmp/e")"

  # Interrupted at step 4, resumed with no option of the run's.
  run $launch $job $opts --stop-at 4 --checkpoint-dir $d/ck --metrics $d/m.jsonl
  [ $rc = 0 ] && [ "$(cat "$tmp/o")" = "$d/ck/step-00000004.h5" ] \
    && ok "$n rank(s): with --metrics FILE, stdout names the checkpoint" || bad "$n: stop at 4 (exit $rc)" "$(cat "$tmp/o" "$tmp/e")"
  echo '{"step":5,"loss":0}' >> $d/m.jsonl  # a step the killed run had logged after its checkpoint
  run $launch $job --resume $d/ck --metrics $d/m.jsonl
  if [ $rc = 0 ] && ! grep -q warning "$tmp/e" && [ "$(cols $d/m.jsonl)" = "$(cols $d/full.jsonl)" ]; then
    ok "$n rank(s): --resume alone keeps lr, warm-up, seed and compressor; metrics equal the uninterrupted run's"
  else
    bad "$n rank(s): --resume alone (exit $rc)" "$(cat "$tmp/e"; diff <(cols $d/m.jsonl) <(cols $d/full.jsonl))"
  fi

  # The resumed checkpoint is opened once, for its metadata and its tensors (issue 45): the
  # options kept from it, the model, the checks and the load share one ckpt::Reader.
  run $launch $job --resume $d/ck --metrics $d/once.jsonl --log-level debug
  if [ $rc = 0 ] && grep -q "$d/ck/step-00000004.h5 was opened 1 time(s) by this process" "$tmp/e"; then
    ok "$n rank(s): the resumed checkpoint is opened once"
  else bad "$n: the resumed checkpoint's opens (exit $rc)" "$(grep "opened" "$tmp/e")"; fi

  # shard-inspect takes the checkpoint directory as --resume does: its latest checkpoint.
  run $bin/shard-inspect/shard-inspect show --json $d/ck
  [ $rc = 0 ] && [ "$(jq .step "$tmp/o")" = 4 ] && ok "$n rank(s): shard-inspect reads a --checkpoint-dir's latest" \
    || bad "$n: shard-inspect show DIR (exit $rc)" "$(cat "$tmp/e")"

  # Given again: the same value written otherwise is no change; another value is one warning.
  run $launch $job --resume $d/ck/step-00000004.h5 --lr 0.0003 --seed 5 --metrics $d/same.jsonl
  [ $rc = 0 ] && ! grep -q warning "$tmp/e" && [ "$(cols $d/same.jsonl)" = "$(cols $d/full.jsonl | tail -4)" ] \
    && ok "$n rank(s): --lr 0.0003 is the checkpoint's 3e-4" || bad "$n: same value (exit $rc)" "$(cat "$tmp/e")"
  # A repeated option is its last value (a batch script's defaults before the user's arguments):
  # --compressor given twice is the checkpoint's, not a change that the state cannot follow.
  run $launch $job --resume $d/ck/step-00000004.h5 --compressor none --compressor powersgd --metrics $d/twice.jsonl
  [ $rc = 0 ] && ! grep -q warning "$tmp/e" && [ "$(cols $d/twice.jsonl)" = "$(cols $d/full.jsonl | tail -4)" ] \
    && ok "$n rank(s): --compressor none --compressor powersgd is the checkpoint's powersgd" \
    || bad "$n: repeated option (exit $rc)" "$(cat "$tmp/e")"
  run $launch $job --resume $d/ck/step-00000004.h5 --lr 1e-3 --warmup 0 --metrics $d/diff.jsonl
  want="warning: resuming with options that differ from the checkpoint's: --lr 1e-3 (the checkpoint's: 3e-4), --warmup 0 (the checkpoint's: 3)"
  if [ $rc = 0 ] && [ "$(grep -c warning "$tmp/e")" = 1 ] && grep -qF -- "$want" "$tmp/e" \
     && [ "$(jq -c .lr $d/diff.jsonl | head -1)" != "$(jq -c .lr $d/full.jsonl | sed -n 5p)" ]; then
    ok "$n rank(s): options that differ are named in one warning and used"
  else
    bad "$n rank(s): options that differ (exit $rc)" "$(cat "$tmp/e")"
  fi
  for o in "--optimizer sgd" "--rank 4"; do
    expect2 "$n rank(s): --resume with $o" "error: ${o% *} ${o#* } differs from the checkpoint's" \
      $launch $job --resume $d/ck $o --metrics $d/refused.jsonl
  done
  [ ! -e $d/refused.jsonl ] && ok "$n rank(s): a refused resume creates no metrics file" || bad "$n: refused.jsonl exists"

  # --metrics FILE that exists: refused on a fresh run, left as it was; --metrics-append adds.
  cp $d/full.jsonl $d/before.jsonl
  expect2 "$n rank(s): --metrics on an existing file" "--metrics $d/full.jsonl: the file exists" \
    $launch $job $opts --metrics $d/full.jsonl
  cmp -s $d/full.jsonl $d/before.jsonl && ok "$n rank(s): the existing metrics file is untouched" || bad "$n: full.jsonl changed"
  run $launch $job --steps 2 --metrics $d/full.jsonl --metrics-append
  [ $rc = 0 ] && [ "$(wc -l <$d/full.jsonl)" = 10 ] && ok "$n rank(s): --metrics-append adds to it" \
    || bad "$n: --metrics-append (exit $rc)" "$(cat "$tmp/e")"

  # stdout: the metrics alone when they go there, checkpoints or not.
  run $launch $job --steps 3 --checkpoint-dir $d/ck2 --save $d/s.h5 --log-level info
  if [ $rc = 0 ] && [ "$(jq -r .loss "$tmp/o" | grep -c '^[0-9]')" = 3 ] && [ "$(wc -l <"$tmp/o")" = 3 ] \
     && grep -q "checkpoint written: $d/s.h5" "$tmp/e"; then
    ok "$n rank(s): stdout carries the metric lines alone; paths are logged"
  else
    bad "$n rank(s): stdout with checkpoints (exit $rc)" "$(cat "$tmp/o" "$tmp/e")"
  fi
done

# A --config file's values are the run's: kept on resume like the command line's.
printf 'lr = 3e-4\nwarmup = 3\nsteps = 8\nseed = 5\ncompressor = "powersgd"\nrank = 2\nstart-iter = 2\n' > job.toml
run $psgd $job --config job.toml --stop-at 4 --save cfg.h5 --metrics cfg.jsonl
run $psgd $job --resume cfg.h5 --metrics cfg.jsonl
[ $rc = 0 ] && [ "$(cols cfg.jsonl)" = "$(cols n1/before.jsonl)" ] && ok "a --config file's options are kept on resume" \
  || bad "--config then --resume (exit $rc)" "$(cat "$tmp/e")"
# An option given again on resume that excludes a kept one wins (--steps over the run's --epochs).
data-pack() { "$bin/data-pack/data-pack" "$@"; }
data-pack synthetic --kind tokens --vocab 64 --seq-len 16 --samples 64 -o tok.h5 --log-level warn >/dev/null
run $psgd $job --data tok.h5 --epochs 1 --stop-at 2 --save ep.h5 --metrics /dev/null
run $psgd $job --resume ep.h5 --steps 12 --metrics ep.jsonl
[ $rc = 0 ] && [ "$(jq -s 'last.step' ep.jsonl)" = 12 ] && grep -qF -- "--steps 12 (the checkpoint's: --epochs 1)" "$tmp/e" \
  && ok "--steps given on resume over the run's --epochs, and named" \
  || bad "--epochs then --steps (exit $rc)" "$(cat "$tmp/e")"

# Checkpoints written in the background (--async-checkpoint, the default) hold what synchronous
# ones hold, bit for bit (those of steps 3, 6 and 9, written while training went on, and the
# last), for each trainer and kind: a full file with per-rank state (PowerSGD's error feedback),
# owned state (Shampoo's blocks), sharded states (fsdp-train, HSDP); `latest` names the last; the
# checkpoint steps report checkpoint_blocked_ms and the writes checkpoint_write_ms; a resume
# from a checkpoint written in the background ends as the uninterrupted run.
fsdp=$bin/fsdp-train/fsdp-train si=$bin/shard-inspect/shard-inspect
async_cases=("psgd|2|$psgd --compressor powersgd --rank 2 --start-iter 2"
             "shampoo|2|$shampoo --precondition-frequency 2"
             "fsdp|2|$fsdp --optimizer adamw"
             "hsdp|4|$fsdp --optimizer shampoo --replicate 2")
for c in "${async_cases[@]}"; do
  IFS='|' read -r name n cmd <<<"$c"
  a="$mpiexec -n $n $cmd $job --steps 12 --checkpoint-every 3 --keep 4"
  run $a --no-async-checkpoint --checkpoint-dir as-$name-sync --metrics as-$name-sync.jsonl
  rs=$rc
  run $a --checkpoint-dir as-$name --metrics as-$name.jsonl
  ra=$rc
  same=1
  for st in 3 6 9 12; do
    e=$(cd as-$name && ls -d step-$(printf %08d $st)* 2>/dev/null)
    [ -n "$e" ] && $si diff as-$name-sync/$e as-$name/$e --rtol 0 --atol 0 >/dev/null 2>&1 || same=0
  done
  # 4 checkpoint steps; a write completed at each of them, or after it (the last step may complete
  # the one before it and its own: it reports its own)
  blocked=$(jq -s '[.[] | select(.checkpoint_blocked_ms)] | length' as-$name.jsonl)
  writes=$(jq -s '[.[] | select(.checkpoint_write_ms)] | length' as-$name.jsonl)
  counts="$blocked blocked, $writes writes"
  if [ $rs = 0 ] && [ $ra = 0 ] && [ $same = 1 ] && [ "$(cat as-$name/latest)" = "$(cat as-$name-sync/latest)" ] \
     && [ "$blocked" = 4 ] && [ "$writes" -ge 3 ]; then
    ok "$name: checkpoints in the background equal synchronous ones bit for bit, steps 3 to 12"
  else bad "$name: async checkpoints (exit $rs/$ra, equal $same, counts $counts)" "$(cat "$tmp/e")"; fi
  e=$(cd as-$name && ls -d step-00000006*)
  run $a --resume as-$name/$e --checkpoint-dir as-$name-r --metrics as-$name-r.jsonl
  e=$(cd as-$name && ls -d step-00000012*)
  [ $rc = 0 ] && run $si diff as-$name/$e as-$name-r/$e --rtol 0 --atol 0
  [ $rc = 0 ] && ok "$name: resumed from a checkpoint written in the background == uninterrupted, bit for bit" \
    || bad "$name: resume from an async checkpoint (exit $rc)" "$(cat "$tmp/o" "$tmp/e")"
done

# Another program's checkpoint: the program that wrote it, and what to do.
expect2 "shampoo-train --resume of psgd-train's checkpoint" "it was written by psgd-train with --optimizer adamw" \
  $shampoo $job --resume cfg.h5 --metrics /dev/null
# Without --model, --init-from and --resume take the checkpoint's model, whatever it is (the
# default llama-tiny applies only without a checkpoint).
run $psgd --model mlp-small --global-batch 8 --eval-every 0 --log-level warn --steps 2 --save mlp.h5 --metrics /dev/null
[ $rc = 0 ] && run $psgd --global-batch 8 --eval-every 0 --log-level warn --steps 2 --init-from mlp.h5 --metrics /dev/null
[ $rc = 0 ] && run $psgd --global-batch 8 --eval-every 0 --log-level warn --steps 3 --resume mlp.h5 --metrics /dev/null
[ $rc = 0 ] && ok "--init-from and --resume of an mlp-small checkpoint without --model" || bad "init-from mlp without --model" "$(cat $tmp/e)"

# ---- Resume at any world size (issue 31) ----
# A run checkpointed at step 3 on N ranks resumes on M ranks and ends where the uninterrupted
# M-rank run ends, with no warning: 1->2, 2->4, 4->2, 4->1 for every trainer (PowerSGD's error
# feedback carried over as its mean, Shampoo's blocks by parameter and block, fsdp-train's rows
# read on any shard count). The data order is part of it: the synthetic language, a token file
# and an image file (with --augment), with micro-batches of 1 and 2 samples on any rank count.
# Ranks add in another order, so 1, 2 and 4 uninterrupted ranks end apart; the resumed runs are
# as far from the M-rank run as the N-rank run is. Measured (largest weight difference, these
# runs, RelWithDebInfo): none 1.2e-7 to 2.7e-7, powersgd 3.7e-6 to 5.0e-6, shampoo 1.7e-6 to
# 2.1e-6, fsdp-adamw 7.0e-6 to 1.0e-5, fsdp-shampoo 1.8e-5 to 3.0e-5; a 1% higher learning rate
# after the resume moves the weights by 1.7e-4 (none) and 2.5e-4 (fsdp-shampoo). atol 6e-5 is
# twice the largest spread and fails the 1% change (checked below).
fsdp=$bin/fsdp-train/fsdp-train si=$bin/shard-inspect/shard-inspect
tol="--rtol 1e-4 --atol 6e-5"
rz="--global-batch 8 --eval-every 0 --log-level warn --steps 6 --lr 1e-2 --seed 3"
# Shampoo: blocks of 8 (--kv-heads 4 kept from when fsdp-train cut its blocks from the shards).
sh="$small --kv-heads 4 --precondition-frequency 3 --max-preconditioner-dim 8 --shampoo-epsilon 1e-6"
data-pack synthetic --kind tokens --vocab 64 --seq-len 16 --samples 40 --seed 3 -o rtok.h5 --log-level warn >/dev/null
python3 - <<'PY'  # 40 random 28 x 28 images, MNIST's idx format
import random, struct
random.seed(3)
open("img", "wb").write(struct.pack(">iiii", 0x803, 40, 28, 28) + bytes(random.randrange(256) for _ in range(40 * 784)))
open("lab", "wb").write(struct.pack(">ii", 0x801, 40) + bytes(random.randrange(10) for _ in range(40)))
PY
data-pack mnist img lab -o rimg.h5 --log-level warn >/dev/null || bad "data-pack mnist of a tiny idx file"
# resize_check NAME PROGRAM OPTIONS...: 1, 2 and 4 ranks with a checkpoint at step 3, then the resumes.
resize_check() {
  local name=$1 prog=$2 n m c; shift 2
  for n in 1 2 4; do
    run $mpiexec -n $n $prog $rz "$@" --checkpoint-every 3 --checkpoint-dir $name$n --save $name-full$n.ckpt --metrics /dev/null
    [ $rc = 0 ] || bad "$name on $n rank(s) (exit $rc)" "$(cat "$tmp/e")"
  done
  for c in "1 2" "2 4" "4 2" "4 1"; do
    n=${c% *} m=${c#* }
    run $mpiexec -n $m $prog --resume "$(ls -d $name$n/step-00000003*)" --save $name-r$n$m.ckpt --metrics /dev/null \
      --log-level warn
    if [ $rc = 0 ] && ! grep -q warning "$tmp/e" && run $si diff $name-full$m.ckpt $name-r$n$m.ckpt model/ $tol && [ $rc = 0 ]; then
      ok "$name: $n -> $m rank(s) continues as $m rank(s) throughout, no warning"
    else
      bad "$name: $n -> $m ranks (exit $rc)" "$(cat "$tmp/e" "$tmp/o")"
    fi
  done
}
resize_check powersgd $psgd $small --compressor powersgd --rank 2 --start-iter 1
resize_check none $psgd $small --data rtok.h5 --micro-batch 1
resize_check shampoo $shampoo $sh
resize_check fsdp-adamw $fsdp --model mlp-mnist --data rimg.h5 --augment crop-flip --micro-batch 2
resize_check fsdp-shampoo $fsdp $sh --optimizer shampoo
# shard-inspect keeps the blocks by name: a 4-rank state resharded for 2 ranks, or consolidated
# into one file, resumes as the 4-rank state does.
run $si reshard fsdp-shampoo4/step-00000003 -n 2 -o fs-2 && [ $rc = 0 ] \
  && run $mpiexec -n 2 $fsdp --resume fs-2 --save fs-r2.ckpt --metrics /dev/null --log-level warn && [ $rc = 0 ] \
  && ! grep -q warning "$tmp/e" && run $si diff fsdp-shampoo-full2.ckpt fs-r2.ckpt model/ $tol && [ $rc = 0 ] \
  && ok "fsdp-shampoo: resharded 4 -> 2 by shard-inspect, resumed on 2 ranks, no warning" \
  || bad "fsdp-shampoo: reshard then resume (exit $rc)" "$(cat "$tmp/e" "$tmp/o")"
run $si consolidate fsdp-shampoo4/step-00000003 -o fs-1.h5 && [ $rc = 0 ] \
  && run $fsdp --resume fs-1.h5 --save fs-r1.ckpt --metrics /dev/null --log-level warn && [ $rc = 0 ] \
  && ! grep -q warning "$tmp/e" && run $si diff fsdp-shampoo-full1.ckpt fs-r1.ckpt model/ $tol && [ $rc = 0 ] \
  && ok "fsdp-shampoo: consolidated, resumed on 1 rank, no warning" \
  || bad "fsdp-shampoo: consolidate then resume (exit $rc)" "$(cat "$tmp/e" "$tmp/o")"
# What cannot continue exactly says so, in one line: topk's error feedback (each rank sends its
# own largest entries). Shampoo on shards now always can: its default blocks, which merge a
# whole [64, 32] weight's rows and columns into one [1024] block that no shard holds whole,
# resume on 1 rank from 2 without a warning (fsdp-train's blocks are the whole parameters').
run $mpiexec -n 2 $psgd $small $rz --compressor topk --compress-ratio 0.1 --start-iter 1 --stop-at 3 --save topk.h5 --metrics /dev/null
run $psgd --resume topk.h5 --log-level warn --metrics /dev/null
[ $rc = 0 ] && [ "$(grep -c warning "$tmp/e")" = 1 ] \
  && grep -qF "topk.h5 was written by 2 ranks, this job has 1: topk's per-rank error feedback is carried over as its mean" "$tmp/e" \
  && ok "topk on another number of ranks: one warning, the mean carried over" || bad "topk 2 -> 1 (exit $rc)" "$(cat "$tmp/e")"
run $mpiexec -n 2 $fsdp $small $rz --optimizer shampoo --precondition-frequency 3 --stop-at 3 --save fs.ckpt --metrics /dev/null
run $fsdp --resume fs.ckpt --log-level warn --metrics /dev/null
[ $rc = 0 ] && ! grep -q warning "$tmp/e" \
  && ok "fsdp-train Shampoo's default blocks (across shards): 2 -> 1 rank, no warning" || bad "fsdp shampoo 2 -> 1 (exit $rc)" "$(cat "$tmp/e")"
# The tolerance tells a real change: the 4 -> 2 resume with a learning rate 1% higher fails it.
run $mpiexec -n 2 $psgd --resume powersgd4/step-00000003.h5 --lr 1.01e-2 --save lr.ckpt --metrics /dev/null --log-level warn
run $si diff powersgd-full2.ckpt lr.ckpt model/ $tol
[ $rc = 1 ] && ok "a 1% learning-rate change after the resume is outside the tolerance" || bad "lr 1% (diff exit $rc)" "$(cat "$tmp/o")"
finish
