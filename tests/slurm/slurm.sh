#!/usr/bin/env bash
# The shipped SLURM scripts (share/dtk/slurm/*.sbatch) on a real SLURM cluster started here
# (tests/slurm/cluster.sh: slurmctld and two slurmd, nodes n1 and n2 of one CPU each), with only
# sizes, times and the CPU device set on the command line:
#   - a PMIx fence across the two nodes waits for the later task (cluster.sh's fences by ring);
#   - the launch-failure block is the same in every sbatch script;
#   - comm-bench.sbatch over srun --mpi=pmix, one task per node; srun without it: exit 2, one line;
#   - a rank still exiting when srun --kill-on-bad-exit ends it exits with the agreed status
#     (2 after bad input, 3 after a stop), not killed by srun's SIGTERM (143);
#   - a rank killed with SIGKILL: srun --kill-on-bad-exit ends the job, the other rank gone
#     within 3 s (the stop request finds its peer gone over the watchdog's side channel);
#   - a rank stopped (SIGSTOP): the watchdog names it in one line within --comm-timeout + 2 s,
#     and the running rank leaves its flight records in --debug-dir;
#   - psgd-train reaching its time limit stops with a checkpoint and, resubmitted, ends with the
#     weights of an uninterrupted run, bit for bit;
#   - psgd-train warned before its time limit (SIGUSR1 to the batch script) stops with a
#     checkpoint, the script requeues it, and it ends bit-identical too;
#   - ranks under srun take their share of the host's cores (emulated nodes share one host);
#   - scancel during training: a checkpoint at the step it stopped at, nothing left behind;
#     during the start-up: cancelled, not requeued;
#   - a resubmission after the run finished exits 0 at once;
#   - a launch that fails (task 1 killed by SIGSEGV at its start, as Open MPI's start-up did once
#     in a requeued job) is requeued, says so in one line, and the run ends bit-identical; a job
#     whose launch always fails is requeued DTK_LAUNCH_RETRIES times, then ends FAILED.
# The daemons are stopped by PID at the end, pass or fail, and the jobs' processes left with them.
#   tests/slurm/slurm.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
build=$(realpath "$1")
scratch=$(mktemp -d "${TMPDIR:-/tmp}/dtk-slurm.XXXXXX")
hogs=()  # busy loops that slow a job down (the time-limit case)
# The processes working under the scratch directory (the tasks and step daemons of this test's
# jobs) other than this script: stopping the daemons leaves a running job's tasks running.
strays() {
  local p
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" = $$ ] && continue
    case "$(readlink "/proc/$p/cwd" 2>/dev/null)" in "$scratch"/*) echo "$p" ;; esac
  done
}
cleanup() {
  cd /
  [ ${#hogs[@]} = 0 ] || kill "${hogs[@]}" 2>/dev/null || true
  "$here/cluster.sh" down "$scratch/cluster" || true
  local left
  left=$(strays)
  if [ -n "$left" ]; then
    kill $left 2>/dev/null || true
    sleep 1
    left=$(strays)
    [ -z "$left" ] || kill -9 $left 2>/dev/null || true
  fi
  rm -rf "$scratch"
}
trap cleanup EXIT
eval "$("$here/cluster.sh" up "$scratch/cluster")"
export DTK_BUILD=$build
[ "$(id -u)" -ne 0 ] || export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir "$scratch/work"
cd "$scratch/work"

# Reports a failure: the other jobs' logs briefly, then job $j's state and log, the reason last.
fail() {
  local f cur=""
  [ -z "${j:-}" ] || cur=$(ls "$scratch"/work/*-"$j".out 2>/dev/null | head -n 1)
  for f in "$scratch"/work/*.out; do
    [ -f "$f" ] && [ "$f" != "$cur" ] && { echo "--- $f" >&2; tail -n 12 "$f" >&2; }
  done
  [ -z "${j:-}" ] || scontrol show job "$j" | grep -E 'JobState|Restarts|RunTime|StartTime' >&2 || true
  [ -z "$cur" ] || { echo "--- $cur" >&2; tail -n 40 "$cur" >&2; }
  echo "FAIL: $*" >&2
  exit 1
}
state() { scontrol show job "$1" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
field() { scontrol show job "$1" | grep -o "$2=[^ ]*" | cut -d= -f2; }
# Waits until job $1 is in one of the states $2 (a regex), at most $3 seconds.
wait_state() {
  local s
  for _ in $(seq $(($3 * 2))); do
    s=$(state "$1")
    if [[ $s =~ ^($2)$ ]]; then
      # An ended job may still be completing (its tasks finishing within KillWait): wait for that.
      if [[ ! $s =~ ^(PENDING|RUNNING)$ ]]; then
        for _ in $(seq 120); do [ -z "$(squeue -h -j "$1" 2>/dev/null)" ] && break; sleep 0.5; done
      fi
      echo "$s"
      return 0
    fi
    sleep 0.5
  done
  fail "job $1 is $s after $3 s, expected $2"
}
sizes=(--nodes=2 --ntasks-per-node=1 --gpus-per-node=0)
# psgd-train's run for the tests: 500 steps, about 100 s on two 1-CPU nodes; a constant
# learning rate, so that a shorter run ends where the reference passed (its checkpoints). The
# script's PowerSGD options are restated for the reference run.
train=(--device cpu --model llama-tiny --global-batch 64 --micro-batch 16 --steps 500 --warmup 20 --lr 3e-3
       --schedule constant --compressor powersgd --rank 4 --start-iter 100 --eval-every 0 --log-every 50)
# Fails unless the model of checkpoint $1 equals $2's bit for bit.
same_weights() {
  "$build/tools/shard-inspect/shard-inspect" diff "$1" "$2" model/ --rtol 0 --atol 0 > diff.txt 2>&1 \
    || { head -n 4 diff.txt >&2; tail -n 1 diff.txt >&2; fail "$1 differs from $2"; }
}
# SLURM holds a requeued job about 2 minutes; hurry job $1, but only once its previous run's step
# daemons have gone: the requeued job has the same id, so its step has the same id too, and while
# the old slurmstepd still holds that step's PMIx socket the new step fails to launch, and srun
# (slurm 22.05) then exits 0, so the job ends COMPLETED without having trained (seen in CI).
hurry() {
  for _ in $(seq 120); do
    # (the slurmstepd processes of a step of that id, and their sockets in this cluster's spool
    # directories)
    [ "$(sinfo -h -N -o '%t' | sort -u | tr -d '\n')" = idle ] \
      && ! compgen -G "$scratch/cluster/spool/n*/n*_$1.*" > /dev/null \
      && ! compgen -G "$scratch/cluster/spool/n*/*pmix.$1.*" > /dev/null \
      && ! pgrep -f "^slurmstepd: \[$1\." > /dev/null && break
    sleep 0.5
  done
  sleep 1
  scontrol update JobId="$1" StartTime=now
}
# Waits until job $1 is pending after its $2-th requeue, at most $3 seconds.
wait_requeued() {
  for _ in $(seq $(($3 * 2))); do
    [ "$(state "$1")" = PENDING ] && [ "$(field "$1" Restarts)" = "$2" ] && return 0
    sleep 0.5
  done
  fail "job $1 was not requeued $2 times (state $(state "$1"), restarts $(field "$1" Restarts))"
}
# Waits until job $1's log $2 shows step $3. A launch that failed on the way (a task killed in
# its start-up: a SIGSEGV inside Open MPI's MPI_Init was seen here about once in three runs of
# this test while the cluster's PMIx fences did not wait, before cluster.sh set them by ring) is
# requeued by the script: that is reported, Open MPI's lines about it shown, and the requeued
# run hurried and waited for.
reach_step() {
  local j=$1 out=$2 step=$3 handled=0 n
  for _ in $(seq 1200); do
    grep -q "step $step/" "$out" 2>/dev/null && return 0
    n=$(grep -c "dtk: job $j: the launch failed" "$out" 2>/dev/null || true)
    if [ "${n:-0}" -gt $handled ]; then
      handled=$n
      echo "job $j: $(grep -o 'the launch failed.*' "$out" | tail -n 1); waiting for the requeued run"
      grep -E '^\[[^]]+:[0-9]+\] ' "$out" | tail -n 12 >&2 || true  # Open MPI's report of the signal
      wait_requeued "$j" "$handled" 150
      hurry "$j"
      wait_state "$j" RUNNING 60 > /dev/null
    fi
    sleep 0.2
  done
  fail "job $j: no step $step in $out"
}
# Checks that each stop in log $1 wrote its checkpoint into directory $2; prints the steps.
stops_checkpointed() {
  local stops s
  stops=$(grep -o 'stopped at step [0-9]*' "$1" | awk '{print $4}' | sort -un)
  [ -n "$stops" ] || fail "$1: no graceful stop"
  for s in $stops; do [ -f "$2/step-$(printf %08d "$s").h5" ] || fail "$1: no checkpoint at step $s"; done
  echo $stops
}

echo "== srun without --mpi=pmix: every task stops in one line, exit 2"
set +e
srun --nodes=2 --ntasks-per-node=1 "$build/tools/comm-bench/comm-bench" --op allreduce -e 1K > nopmix.out 2>&1
rc=$?
set -e
[ $rc = 2 ] && [ "$(grep -c 'without PMIx, which Open MPI needs' nopmix.out)" = 2 ] \
  || { cat nopmix.out >&2; fail "srun without --mpi=pmix: exit $rc"; }

echo "== a PMIx fence across the two nodes waits for the later task (cluster.sh: fences by ring)"
# Unset (slurm's default) or by tree, it returned at once on this cluster (two slurmd on one host): then so
# does MPI_Init's last fence, and a rank's first message could reach a peer still in MPI_Init,
# which died of SIGSEGV (tests/slurm/early-message.sh shows it).
# shellcheck disable=SC2046
gcc $(pkg-config --cflags pmix) -o pmix_fence "$here/pmix_fence.c" $(pkg-config --libs pmix) || fail "cannot build pmix_fence.c"
waited=$(srun --mpi=pmix --nodes=2 --ntasks-per-node=1 ./pmix_fence) || fail "pmix_fence: srun failed"
python3 -c "assert $waited > 1.5" || fail "task 0 waited $waited s in a PMIx fence that task 1 entered 2 s late"
echo "task 0 waited $waited s"

echo "== the launch-failure block is the same in every sbatch script"
launch_block() { sed -n '/^# ---- launch failures/,/^# ---- end of the launch-failure block/p' "$1"; }
first=""
for f in "$src"/share/dtk/slurm/*.sbatch; do
  [ "$(launch_block "$f" | wc -l)" -gt 10 ] || fail "$f has no launch-failure block"
  grep -q '^launch_started$' "$f" && grep -q 'launch_check "\$status"' "$f" || fail "$f does not call launch_started and launch_check"
  [ -n "$first" ] || first=$f
  [ "$(launch_block "$f")" = "$(launch_block "$first")" ] || fail "the launch-failure blocks of $first and $f differ"
done

echo "== comm-bench.sbatch over srun --mpi=pmix, one task per node"
j=$(sbatch --parsable "${sizes[@]}" --time=2 "$src/share/dtk/slurm/comm-bench.sbatch" \
      --device cpu --backend mpi --op allreduce -b 8 -e 64K)
[ "$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 120)" = COMPLETED ] || fail "comm-bench job $j"
python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); assert d["config"]["nranks"] == 2 and d["results"] and d["wrong"] == 0, d' "comm-bench-$j.json" \
  || fail "comm-bench job $j: its JSON"
! grep -q "launch failed" "comm-bench-$j.out" || fail "comm-bench job $j: a launch failure reported"

echo "== a rank still exiting when srun --kill-on-bad-exit ends it keeps the agreed status"
# Rank 1 lingers 3 s in MPI_Finalize (a PMPI shim, LD_PRELOAD), so that rank 0 exits first and
# srun sends it SIGTERM there: it must still exit 2 (bad input) or 3 (stopped), not 143.
cat > slow_finalize.c <<'EOF_C'
#include <mpi.h>
#include <unistd.h>
int MPI_Finalize(void) {
  int rank = 0;
  PMPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 1) sleep(3);
  return PMPI_Finalize();
}
EOF_C
mpicc -shared -fPIC -o slow_finalize.so slow_finalize.c || fail "cannot build the MPI_Finalize shim"
slow=(srun --mpi=pmix --kill-on-bad-exit=1 "${sizes[@]}" --export=ALL,LD_PRELOAD=$PWD/slow_finalize.so)
set +e
"${slow[@]}" "$build/tools/psgd-train/psgd-train" --device cpu --lr -1 > slowbad.out 2>&1
rc=$?
set -e
[ $rc = 2 ] || { cat slowbad.out >&2; fail "bad input, rank 1 slow to finalize: srun exit $rc, not 2"; }
"${slow[@]}" "$build/tools/psgd-train/psgd-train" "${train[@]}" --steps 100000 --checkpoint-dir cks > slowstop.out 2>&1 &
p=$!
for _ in $(seq 300); do grep -q 'step 50/' slowstop.out && break; sleep 0.2; done
kill -USR1 $p
rc=0
wait $p || rc=$?
[ $rc = 3 ] && grep -q 'stopped at step' slowstop.out \
  || { tail -n 8 slowstop.out >&2; fail "stopped, rank 1 slow to finalize: srun exit $rc, not 3"; }
grep -q 'Exited with exit code 3' slowstop.out && ! grep -q 'task 1: Terminated' slowstop.out \
  || { tail -n 8 slowstop.out >&2; fail "stopped, rank 1 slow to finalize: a task was killed"; }
echo "bad input: srun exit 2; stopped: srun exit 3 (rank 1 given SIGTERM in MPI_Finalize)"

# The tasks of this test's jobs (psgd-train processes working in this directory: another
# cluster on this machine may run the same command lines), as "PID RANK" lines.
tasks() {
  local p
  for p in $(pgrep -x psgd-train); do
    [ "$(readlink "/proc/$p/cwd" 2>/dev/null)" = "$scratch/work" ] || continue
    echo "$p $(tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | sed -n 's/^SLURM_PROCID=//p')"
  done
}
now() { date +%s.%N; }

echo "== a rank killed: --kill-on-bad-exit=1 ends the job, the other rank gone within 3 s"
j=$(sbatch --parsable "${sizes[@]}" --time=5 --output=killed-%j.out \
      "$src/share/dtk/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ckk)
wait_state "$j" RUNNING 60 > /dev/null
reach_step "$j" "killed-$j.out" 50
victim=$(tasks | awk '$2 == 1 {print $1}')
[ -n "$victim" ] || fail "job $j: no task of rank 1 found"
t0=$(now)
kill -9 "$victim"
for _ in $(seq 600); do [ -z "$(tasks)" ] && break; sleep 0.02; done
t1=$(now)
[ -z "$(tasks)" ] || fail "job $j: rank 0 still runs 12 s after rank 1 was killed"
[ "$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 60)" = FAILED ] || fail "job $j with a killed rank"
elapsed=$(python3 -c "print(f'{$t1 - $t0:.2f}')")
python3 -c "assert $t1 - $t0 < 3" || fail "job $j: rank 0 was gone $elapsed s after rank 1 was killed (limit 3 s)"
# Rank 0 names rank 1's death, unless srun tore the step's output down first: then rank 0's
# line had nowhere to go and its write ended it (srun: "task 0: Broken pipe"; seen once in CI).
if grep -q "cannot complete after the stop request: rank 1 has exited" "killed-$j.out"; then
  echo "a rank killed: the other gone $elapsed s later, and it said why"
elif grep -q "task 0: Broken pipe" "killed-$j.out"; then
  echo "a rank killed: the other gone $elapsed s later (srun closed its output before it could say why)"
else
  fail "job $j: rank 0 did not say that rank 1 had exited"
fi

echo "== a rank stopped: the watchdog names it within --comm-timeout + 2 s"
j=$(sbatch --parsable "${sizes[@]}" --time=5 --output=stopped-%j.out \
      "$src/share/dtk/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ckstop --comm-timeout 5 --debug-dir dbg)
wait_state "$j" RUNNING 60 > /dev/null
reach_step "$j" "stopped-$j.out" 50
victim=$(tasks | awk '$2 == 1 {print $1}')
[ -n "$victim" ] || fail "job $j: no task of rank 1 found"
kill -STOP "$victim"
t0=$(now)
for _ in $(seq 1000); do grep -q "collective timeout" "stopped-$j.out" && break; sleep 0.02; done
t1=$(now)
[ "$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 60)" = FAILED ] || fail "job $j with a stopped rank"
kill -CONT "$victim" 2>/dev/null || true
elapsed=$(python3 -c "print(f'{$t1 - $t0:.2f}')")
[ "$(grep -c "collective timeout" "stopped-$j.out")" = 1 ] || fail "job $j: not one line naming the stopped rank"
grep -Eq "collective timeout \(5.0 s\): rank 1 never reached [a-z_]+ #[0-9]+ \([^)]*, world\), where 1 of 2 ranks wait; it does not answer" \
  "stopped-$j.out" || fail "job $j: the line does not name rank 1"
python3 -c "assert $t1 - $t0 <= 7" || fail "job $j: the line came $elapsed s after SIGSTOP (limit 5 + 2 s)"
[ -s dbg/flight-rank-00000.json ] || fail "job $j: --debug-dir holds $(ls dbg)"
echo "a rank stopped: named $elapsed s after SIGSTOP: $(grep -o 'collective timeout.*' "stopped-$j.out")"

echo "== psgd-train: uninterrupted reference run (mpiexec)"
mpiexec -n 2 --bind-to none "$build/tools/psgd-train/psgd-train" "${train[@]}" --checkpoint-dir refck \
  --checkpoint-every 100 --keep 10 --save ref.h5 --metrics /dev/null > ref.out 2>&1 || fail "the reference run"

echo "== psgd-train: a job reaches its time limit, is resubmitted and resumes"
# 1 minute, and no early warning (SIGURG, which the script ignores, in place of SIGUSR1): the
# time limit's SIGTERM stops it (SLURM delivers it to each task twice: one request). The run
# must outlast its minute by more than SLURM's check of the limits (every 30 s or so): on this
# project's idle 2-core machine the 500 steps took 62 s and ended before the SIGTERM. A busy
# loop per core while the job runs makes its steps about twice as long; the weights do not
# depend on the speed.
for _ in $(seq "$(nproc)"); do (while :; do :; done) & hogs+=($!); done
j=$(sbatch --parsable "${sizes[@]}" --time=1 --signal=B:URG@1 --output=limit-%j.out \
      "$src/share/dtk/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ck --checkpoint-every 100)
s=$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 200)
kill "${hogs[@]}"; wait "${hogs[@]}" 2>/dev/null || true; hogs=()
[ "$s" = TIMEOUT ] || fail "job $j ended $s, not at its time limit"
grep -q "SIGTERM received" "limit-$j.out" || fail "job $j: no SIGTERM at the time limit"
stop=$(stops_checkpointed "limit-$j.out" ck)
grep -q "CPU threads per rank: $(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 )) ($(nproc) cores shared by 2 rank" \
  "limit-$j.out" || fail "ranks under srun do not share the host's cores"
# 10 minutes: the script's warning comes 120 s before the limit, and with other work on the
# machine (load 15) the remaining 413 steps outlasted the 3 minutes that --time=5 left.
j=$(sbatch --parsable "${sizes[@]}" --time=10 --output=resubmit-%j.out \
      "$src/share/dtk/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ck --checkpoint-every 100 --save final.h5)
[ "$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 540)" = COMPLETED ] || fail "resubmitted job $j"
grep -q "resuming from .* at step $stop" "resubmit-$j.out" || fail "job $j did not resume from step $stop"
same_weights final.h5 ref.h5
echo "stopped at step $stop by the time limit; resubmitted, the weights equal the uninterrupted run's"

echo "== psgd-train: warned before its time limit (SIGUSR1 to the batch script), requeued, resumed"
j=$(sbatch --parsable "${sizes[@]}" --time=10 --output=warned-%j.out \
      "$src/share/dtk/slurm/psgd-train.sbatch" "${train[@]}" --steps 300 --checkpoint-dir ckw --save warned.h5)
wait_state "$j" RUNNING 60 > /dev/null
reach_step "$j" "warned-$j.out" 100
scancel --batch --signal=USR1 "$j"  # what --signal=B:USR1@120 sends
wait_requeued "$j" 1 120
hurry "$j"
[ "$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 540)" = COMPLETED ] || fail "requeued job $j"
grep -q "requeueing job $j" "warned-$j.out" || fail "the script did not say it requeued job $j"
stop=$(stops_checkpointed "warned-$j.out" ckw)
same_weights warned.h5 refck/step-00000300.h5
echo "stopped at step $stop by SIGUSR1; requeued, the weights equal the uninterrupted run's at step 300"

echo "== psgd-train: a resubmission after the run finished exits 0 at once"
# 5 minutes: the script's --signal=B:USR1@120 comes 120 s before the limit, give or take 60 s;
# with --time=2 it came 0.7 s after the start, during start-up, and the job was requeued as a
# launch that failed (the test then saw it PENDING).
j=$(sbatch --parsable "${sizes[@]}" --time=5 --output=again-%j.out \
      "$src/share/dtk/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ck)
[ "$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 120)" = COMPLETED ] || fail "resubmitted job $j"
grep -q "the run is complete, nothing to do" "again-$j.out" || fail "job $j did not say the run was complete"

echo "== psgd-train: scancel during training"
j=$(sbatch --parsable "${sizes[@]}" --time=5 --output=cancel-%j.out \
      "$src/share/dtk/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ck2 --checkpoint-every 0)
wait_state "$j" RUNNING 60 > /dev/null
reach_step "$j" "cancel-$j.out" 50
scancel "$j"
s=$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 60)
[ "$s" = CANCELLED ] || fail "cancelled job $j ended $s"
stop=$(grep -o 'stopped at step [0-9]*' "cancel-$j.out" | awk '{print $4}' | sort -u)
[ -n "$stop" ] || fail "job $j did not stop gracefully on scancel"
[ -f "ck2/step-$(printf %08d "$stop").h5" ] || fail "no checkpoint at step $stop after scancel"
[ -z "$(ls -A ck2 | grep -v -e '^step-' -e '^latest$')" ] || fail "scancel left debris: $(ls -A ck2)"
! grep -q "requeueing" "cancel-$j.out" || fail "a cancelled job was requeued"
echo "scancel: stopped at step $stop with its checkpoint"

echo "== psgd-train: scancel during the start-up is not taken for a failed launch"
j=$(sbatch --parsable "${sizes[@]}" --time=5 --output=cancel0-%j.out \
      "$src/share/dtk/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ck3)
wait_state "$j" RUNNING 60 > /dev/null
for _ in $(seq 100); do pgrep -f "psgd-train.*ck3" > /dev/null && break; sleep 0.1; done  # srun has started
scancel "$j"
s=$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 60)
[ "$s" = CANCELLED ] && [ "$(field "$j" Restarts)" = 0 ] && ! grep -q "launch failed" "cancel0-$j.out" \
  || fail "job $j cancelled in its start-up: $s, restarts $(field "$j" Restarts)"
echo "== psgd-train: a launch that fails is requeued, and the run continues"
# The program, given to the script through DTK_BUILD: a wrapper whose task 1 dies of SIGSEGV at
# the start of the job's first run (as Open MPI's start-up did once in a requeued job), then
# runs psgd-train.
mkdir -p crash/tools/psgd-train
cat > crash/tools/psgd-train/psgd-train <<EOF_W
#!/bin/bash
ulimit -c 0
if [ "\${SLURM_RESTART_COUNT:-0}" -lt "\$CRASH_RUNS" ] && [ "\$SLURM_PROCID" = 1 ]; then kill -SEGV \$\$; fi
exec "$build/tools/psgd-train/psgd-train" "\$@"
EOF_W
chmod +x crash/tools/psgd-train/psgd-train
j=$(DTK_BUILD=$PWD/crash CRASH_RUNS=1 sbatch --parsable "${sizes[@]}" --time=10 --output=launch-%j.out \
      "$src/share/dtk/slurm/psgd-train.sbatch" "${train[@]}" --steps 100 --checkpoint-dir ckl --save launch.h5)
wait_requeued "$j" 1 120
grep -q "dtk: job $j: the launch failed (srun exit 1[34][0-9], [0-9.]* s after it started): requeueing it (launch failure 1 of at most 3 in a row)" \
  "launch-$j.out" || fail "job $j: no line saying that its failed launch is requeued"
[ "$(squeue -h -j "$j" -o %k)" = dtk-launch-failures=1 ] || fail "job $j: Comment $(squeue -h -j "$j" -o %k)"
hurry "$j"
[ "$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 300)" = COMPLETED ] || fail "job $j after its failed launch"
c=$(squeue -h -t all -j "$j" -o %k)
[[ $c =~ ^(|\(null\))$ ]] || fail "job $j: the count of failed launches is not cleared: Comment $c"
same_weights launch.h5 refck/step-00000100.h5
echo "$(grep -o 'the launch failed.*' "launch-$j.out")"

echo "== psgd-train: a job whose launch always fails ends after DTK_LAUNCH_RETRIES requeues"
j=$(DTK_BUILD=$PWD/crash CRASH_RUNS=99 DTK_LAUNCH_RETRIES=2 sbatch --parsable "${sizes[@]}" --time=5 \
      --output=never-%j.out "$src/share/dtk/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ckn)
for r in 1 2; do wait_requeued "$j" $r 120; hurry "$j"; done
[ "$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 120)" = FAILED ] || fail "job $j whose launch always fails"
[ "$(grep -c 'requeueing it (launch failure [12] of at most 2 in a row)' "never-$j.out")" = 2 ] \
  && grep -q "the launch failed (srun exit 1[34][0-9], [0-9.]* s after it started), 3 times in a row: not requeueing it again (DTK_LAUNCH_RETRIES=2)" \
     "never-$j.out" || fail "job $j: not the lines expected"
[ "$(field "$j" Restarts)" = 2 ] || fail "job $j: restarted $(field "$j" Restarts) times"
echo "PASS"
