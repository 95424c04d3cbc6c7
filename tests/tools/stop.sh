#!/usr/bin/env bash
# Graceful stop and resubmission, end to end (psgd-train):
#   - SIGTERM (one process) and SIGUSR1 (to mpiexec, which passes it on, 2 ranks): the step in
#     progress finishes, a checkpoint is written at it, every rank exits 3; --resume continues
#     and ends bit-identical to an uninterrupted run;
#   - the same signal twice within a fraction of a second (SLURM's time limit delivers it so) is
#     one request; a second signal 2 s later ends the process at once;
#   - --auto-resume: a fresh start on an empty directory, then a continuation; a run already at
#     its last step exits 0 at once.
#   stop.sh MPIEXEC PSGD_TRAIN SHARD_INSPECT
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 psgd=$2 si=$3
common="$small --global-batch 8 --lr 1e-2 --warmup 2 --eval-every 0 --log-level info --log-every 1"

# Starts a run in the background ($pid), waits until its log ($2) shows step $1 (or, when $1
# is not a number, the text $1).
start_until_step() {
  local n=$1 log=$2 pattern; shift 2
  pattern="step $n/"
  [[ $n =~ ^[0-9]+$ ]] || pattern=$n
  "$@" > "$log.out" 2> "$log" &
  pid=$!
  for _ in $(seq 600); do
    grep -q "$pattern" "$log" 2>/dev/null && return 0
    kill -0 $pid 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
stopped_at() { grep -o 'stopped at step [0-9]*' "$1" | awk '{print $4}'; }
now() { date +%s.%N; }

# ---- the references: 200 steps uninterrupted, on 1 and 2 ranks ----
run $psgd $common --steps 200 --save ref.h5 --metrics /dev/null
[ $rc = 0 ] || bad "reference run (exit $rc)" "$(cat $tmp/e)"
run $mpiexec -n 2 $psgd $common --steps 200 --save ref2.h5 --metrics /dev/null
[ $rc = 0 ] || bad "reference run, 2 ranks (exit $rc)" "$(cat $tmp/e)"

# ---- SIGTERM, one process ----
if start_until_step 20 term.log $psgd $common --steps 200 --checkpoint-dir ck1 --metrics /dev/null; then
  t0=$(now); kill -TERM $pid; wait $pid; rc=$?; t1=$(now)
  s=$(stopped_at term.log)
  if [ $rc = 3 ] && [ -n "$s" ] && [ -f ck1/step-$(printf %08d $s).h5 ] && grep -q "SIGTERM received" term.log; then
    ok "SIGTERM: exit 3 at step $s with its checkpoint ($(python3 -c "print(f'{$t1-$t0:.2f}')") s from signal to exit)"
  else bad "SIGTERM (exit $rc, stopped at '$s')" "$(cat term.log)" "$(ls ck1)"; fi
  run $psgd $common --steps 200 --resume ck1 --save resumed.h5 --metrics /dev/null
  run2=$rc
  run $si diff resumed.h5 ref.h5 model/ optim/ --rtol 0 --atol 0
  [ $run2 = 0 ] && [ $rc = 0 ] && ok "stopped by SIGTERM + --resume == uninterrupted, bit for bit" \
    || bad "resume after SIGTERM (exit $run2, diff $rc)" "$(cat $tmp/o $tmp/e)"
else bad "SIGTERM run did not start" "$(cat term.log)"; fi

# ---- SIGUSR1 to mpiexec, 2 ranks: every rank stops after the same step ----
if start_until_step 20 usr1.log $mpiexec -n 2 $psgd $common --steps 200 --checkpoint-dir ck2 --log-all-ranks \
     --metrics /dev/null; then
  t0=$(now); kill -USR1 $pid; wait $pid; rc=$?; t1=$(now)
  s=$(stopped_at usr1.log | sort -u)
  if [ $rc = 3 ] && [ $(echo "$s" | wc -w) = 1 ] && [ $(grep -c "stopped at step $s" usr1.log) = 2 ] \
     && [ -f ck2/step-$(printf %08d $s).h5 ]; then
    ok "SIGUSR1 to mpiexec: both ranks exit 3 at step $s ($(python3 -c "print(f'{$t1-$t0:.2f}')") s)"
  else bad "SIGUSR1 to mpiexec (exit $rc, stopped at '$s')" "$(cat usr1.log)"; fi
  run $mpiexec -n 2 $psgd $common --steps 200 --resume ck2 --save resumed2.h5 --metrics /dev/null
  run2=$rc
  run $si diff resumed2.h5 ref2.h5 model/ optim/ --rtol 0 --atol 0
  [ $run2 = 0 ] && [ $rc = 0 ] && ok "2 ranks stopped by SIGUSR1 + --resume == uninterrupted, bit for bit" \
    || bad "resume after SIGUSR1 (exit $run2, diff $rc)" "$(cat $tmp/o $tmp/e)"
else bad "SIGUSR1 run did not start" "$(cat usr1.log)"; fi

# ---- one request delivered twice; a second request ----
if start_until_step 5 twice.log $psgd $common --steps 200 --checkpoint-dir ck3 --metrics /dev/null; then
  kill -TERM $pid; sleep 0.1; kill -TERM $pid; wait $pid; rc=$?
  [ $rc = 3 ] && [ -n "$(stopped_at twice.log)" ] && ok "SIGTERM twice within 0.1 s: one graceful stop" \
    || bad "SIGTERM twice (exit $rc)" "$(cat twice.log)"
fi
# A slow first step (several seconds): the second signal, 2.5 s after the first, must not wait
# for it.
slow="--model llama-tiny --global-batch 512 --steps 50 --eval-every 0 --log-level info --log-every 1 --threads 1"
if start_until_step "the optimal loss" slow.log $psgd $slow --checkpoint-dir ck4 --metrics /dev/null; then
  kill -TERM $pid; sleep 2.5; t0=$(now); kill -TERM $pid; wait $pid; rc=$?; t1=$(now)
  if [ $rc = 143 ] && python3 -c "assert $t1 - $t0 < 1.5"; then ok "a second SIGTERM 2.5 s later ends at once"
  else bad "second SIGTERM (exit $rc, $(python3 -c "print($t1-$t0)") s)" "$(cat slow.log)"; fi
fi

# ---- --auto-resume and a finished run ----
run $psgd $common --steps 30 --stop-at 10 --checkpoint-dir ck5 --auto-resume --metrics /dev/null
[ $rc = 0 ] && [ -f ck5/step-00000010.h5 ] && ! grep -q resuming $tmp/e && ok "--auto-resume on an empty directory starts afresh" \
  || bad "--auto-resume fresh (exit $rc)" "$(cat $tmp/e)"
run $psgd $common --steps 30 --checkpoint-dir ck5 --auto-resume --save auto.h5 --metrics /dev/null
[ $rc = 0 ] && grep -q "resuming from .*step-00000010.h5 at step 10" $tmp/e && ok "--auto-resume continues from the latest" \
  || bad "--auto-resume continue (exit $rc)" "$(cat $tmp/e)"
run $psgd $common --steps 30 --checkpoint-dir ck5 --auto-resume --metrics /dev/null
[ $rc = 0 ] && grep -q "the run is complete, nothing to do" $tmp/e && [ ! -s $tmp/o ] \
  && ok "a finished run resubmitted exits 0 at once" || bad "finished run resubmitted (exit $rc)" "$(cat $tmp/e)"
run $mpiexec -n 2 $psgd $common --steps 30 --resume ck5 --metrics /dev/null
[ $rc = 0 ] && grep -q "the run is complete" $tmp/e && ok "--resume of a finished run, 2 ranks: exit 0" \
  || bad "--resume finished, 2 ranks (exit $rc)" "$(cat $tmp/e)"
expect2 "--resume beyond --steps" "is at step 30, beyond --steps 20" $psgd $common --steps 20 --resume ck5
expect2 "--auto-resume without --checkpoint-dir" "--auto-resume needs --checkpoint-dir" $psgd $common --auto-resume
finish
