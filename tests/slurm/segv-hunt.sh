#!/usr/bin/env bash
# A hunt for the launch-time SIGSEGV of issue 31 (docs/slurm.md, "Requeue chains and launches that
# fail"); not run by ctest. Brings up the test cluster (cluster.sh), makes a checkpoint, then
# launches short 2-task `srun --mpi=pmix` steps of psgd-train that resume from it, one at a time,
# back to back, in three kinds taken in turn:
#   plain    a step right after the previous one ended;
#   killed   a step whose rank 1 is SIGKILLed at its first step (the next step then starts
#            right after srun's --kill-on-bad-exit ended it);
#   requeue  a batch job whose run requeues it once trained, hurried at once (StartTime=now,
#            without waiting for the old step's daemons): the same job and step id again,
#            as in production's requeues (3 runs per job).
# Every task runs with cores on (ulimit -c unlimited, in its own directory) and without Open
# MPI's signal handler (OMPI_MCA_opal_signal=""); a task killed by a signal other than the
# harness's SIGKILL is a crash: its log, and gdb's backtrace of its core, go to DIR/crashes.
# A rank 0 still running 5 s after its rank 1 was killed leaves its threads' stacks there too.
# cluster.sh's fences are by ring; SLURM_PMIX_FENCE=tree in this script's environment gives
# fences that do not wait, as with PMIxCollFence unset (slurm's default), where the crash came
# (1 in 112 launches; docs/slurm.md).
#   tests/slurm/segv-hunt.sh BUILD_DIR SECONDS [DIR]
# Prints one line per launch and a summary; DIR (default a new directory under /tmp) is kept.
set -euo pipefail
{  # (read whole before it runs: the script may be edited while a long hunt runs)
here=$(cd "$(dirname "$0")" && pwd)
build=$(realpath "$1")
seconds=$2
dir=$(realpath -m "${3:-$(mktemp -d "${TMPDIR:-/tmp}/dtk-segv.XXXXXX")}")
mkdir -p "$dir/work" "$dir/crashes"
prog=$build/tools/psgd-train/psgd-train
# The processes working under DIR (the steps' tasks and daemons) other than this script.
strays() {
  local p
  for p in /proc/[0-9]*; do
    p=${p#/proc/}
    [ "$p" = $$ ] && continue
    case "$(readlink "/proc/$p/cwd" 2>/dev/null)" in "$dir"/work*) echo "$p" ;; esac
  done
}
cleanup() {
  cd /
  "$here/cluster.sh" down "$dir/cluster" || true
  local left
  left=$(strays)
  [ -z "$left" ] || { kill $left 2>/dev/null || true; sleep 1; left=$(strays); [ -z "$left" ] || kill -9 $left 2>/dev/null || true; }
}
trap cleanup EXIT
eval "$("$here/cluster.sh" up "$dir/cluster")"
[ "$(id -u)" -ne 0 ] || export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_opal_signal=""
cd "$dir/work"
sizes=(--nodes=2 --ntasks-per-node=1 --gpus-per-node=0)
train=(--device cpu --model llama-tiny --global-batch 16 --micro-batch 8 --warmup 2 --lr 3e-3 --schedule constant
       --compressor powersgd --rank 4 --start-iter 2 --eval-every 0 --log-every 1 --metrics /dev/null
       --checkpoint-dir "$dir/work/ck" --checkpoint-every 2 --keep 2 --auto-resume)
# The task wrapper: cores on, its own directory (cores are written to the cwd as "core").
cat > task.sh <<EOF
#!/bin/bash
ulimit -c unlimited
d=$dir/work/tasks/\$SLURM_JOB_ID.\${SLURM_STEP_ID:-0}.r\${SLURM_RESTART_COUNT:-0}.t\$SLURM_PROCID
mkdir -p "\$d" && cd "\$d"
exec nice -n 10 "\${HUNT_PROG:-$prog}" "\$@"
EOF
chmod +x task.sh
# The batch script of the requeue kind: a run 2 steps past the latest checkpoint, then a requeue
# while the job has runs left.
cat > requeue.sbatch <<EOF
#!/bin/bash
latest=\$(sed -n 's/^step-0*\([0-9][0-9]*\)\.h5\$/\1/p' $dir/work/ck/latest)
srun --mpi=pmix --kill-on-bad-exit=1 $dir/work/task.sh "\$@" --steps \$((latest + 2))
status=\$?
echo "srun exit \$status"
if [ "\${SLURM_RESTART_COUNT:-0}" -lt 2 ]; then scontrol requeue "\$SLURM_JOB_ID"; fi
exit \$status
EOF
latest() { sed -n 's/^step-0*\([0-9][0-9]*\)\.h5$/\1/p' ck/latest 2>/dev/null || echo 0; }
n=0 runs=0 crashes=0 t_end=$((SECONDS + seconds))
declare -A count=()
# Checks the task directories (of job $1) for cores and crash reports; $2: the kind, $3: the log.
check() {
  local t found=0
  for t in tasks/*; do
    [ -d "$t" ] || continue
    if compgen -G "$t/core*" > /dev/null; then
      found=1
      local c=$dir/crashes/$(basename "$t")
      mkdir -p "$c"
      mv "$t"/core* "$c"/
      cp "$3" "$c/" 2>/dev/null || true
      gdb -batch -ex 'info signals SIGSEGV' -ex bt -ex 'info registers rip' -ex 'thread apply all bt' \
        "$prog" "$c"/core* > "$c/backtrace.txt" 2>&1 || true
      echo "CRASH: $2 launch of job $1: core of $(basename "$t") in $c; its backtrace:"
      sed -n '/^#0/,/^$/p' "$c/backtrace.txt" | head -n 20
    fi
    rm -rf "$t"
  done
  [ $found = 0 ] || crashes=$((crashes + 1))
  return 0
}
# Runs task 1's SIGKILL for step log $1 once it shows a step: the PID of rank 1 of this harness.
kill_rank1() {
  local p
  for _ in $(seq 600); do grep -q "step [0-9]*/" "$1" 2>/dev/null && break; sleep 0.1; done
  for p in $(pgrep -x psgd-train); do
    case "$(readlink "/proc/$p/cwd" 2>/dev/null)" in "$dir"/work/tasks/*.t1) kill -9 "$p" && return 0 ;; esac
  done
  return 1
}
echo "== self-check: a task that dies of SIGSEGV after MPI_Init leaves a core with a backtrace"
cat > segv.c <<'EOF_C'
#include <mpi.h>
int main(int argc, char** argv) {
  int rank = 0;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  if (rank == 1) *(volatile int*)0 = 1;
  MPI_Finalize();
  return 0;
}
EOF_C
mpicc -g -o segv segv.c
srun --mpi=pmix --kill-on-bad-exit=1 "${sizes[@]}" --export=ALL,HUNT_PROG=$PWD/segv ./task.sh > self.out 2>&1 || true
c=$(ls tasks/*.t1/core* 2>/dev/null | head -n 1)
[ -n "$c" ] && gdb -batch -ex bt "$PWD/segv" "$c" 2>&1 | grep -Eq 'in main \(.*\) at segv.c' \
  || { cat self.out; echo "segv-hunt: the self-check's task left no core with a backtrace" >&2; exit 1; }
echo "$(grep -o 'task 1: .*' self.out); core $(basename "$c") read by gdb"
rm -rf tasks
echo "== the first checkpoint"
srun --mpi=pmix "${sizes[@]}" ./task.sh "${train[@]}" --steps 2 > first.out 2>&1 || { tail first.out; exit 1; }
rm -rf tasks
kinds=(plain killed requeue)
while [ $SECONDS -lt $t_end ]; do
  kind=${kinds[$((n % 3))]}
  steps=$(( $(latest) + 2 ))
  log=$dir/work/launch-$n.out
  t0=$EPOCHREALTIME
  case $kind in
    plain|killed)
      # (a killed run is given 6 steps, so that its rank 1 dies amid them)
      [ $kind = plain ] || steps=$((steps + 4))
      srun --mpi=pmix --kill-on-bad-exit=1 "${sizes[@]}" ./task.sh "${train[@]}" --steps $steps > "$log" 2>&1 &
      p=$!
      if [ $kind = killed ] && kill_rank1 "$log"; then
        # Rank 0 should be gone within 3 s (tests/slurm); still there after 5 s: its threads' stacks.
        for _ in $(seq 50); do kill -0 $p 2>/dev/null || break; sleep 0.1; done
        for q in $(pgrep -x psgd-train); do
          case "$(readlink "/proc/$q/cwd" 2>/dev/null)" in
            "$dir"/work/tasks/*.t0)
              echo "rank 0 still runs 5 s after rank 1 was killed: its stacks in $dir/crashes/hang-$n.txt"
              gdb -batch -p "$q" -ex 'thread apply all bt' > "$dir/crashes/hang-$n.txt" 2>&1 || true ;;
          esac
        done
      fi
      rc=0; wait $p || rc=$?
      job=$(ls tasks 2>/dev/null | head -n1 | cut -d. -f1)
      ;;
    requeue)
      job=$(sbatch --parsable "${sizes[@]}" --requeue --open-mode=append --output="$log" requeue.sbatch "${train[@]}")
      # Hurried 1 s after it is pending again (at once, SLURM refused to start it: "Job credential
      # revoked"), without waiting for the old step's daemons.
      for r in 1 2; do
        for _ in $(seq 1200); do
          st=$(squeue -h -j "$job" -o %T)
          [ -n "$st" ] || break
          [ "$(scontrol show job "$job" | grep -o 'Restarts=[0-9]*' | cut -d= -f2)" = $r ] && [ "$st" = PENDING ] && break
          sleep 0.1
        done
        [ -n "$st" ] || break
        sleep 1
        scontrol update JobId="$job" StartTime=now
      done
      for _ in $(seq 1200); do [ -z "$(squeue -h -j "$job")" ] && break; sleep 0.2; done
      rc=$(grep -o 'srun exit [0-9]*' "$log" | awk '{print $3}' | tr '\n' ,)
      ;;
  esac
  took=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
  signals=$(grep -Eo 'task [0-9]+: [A-Za-z0-9 ]+( \(core dumped\))?|Segmentation fault.*|launch failed.*' "$log" | grep -v Killed | sort -u | tr '\n' ';' || true)
  count[$kind]=$(( ${count[$kind]:-0} + 1 ))
  if [ $kind = requeue ]; then runs=$((runs + $(grep -c 'srun exit' "$log" || true))); else runs=$((runs + 1)); fi
  echo "$(date +%T) launch $n: $kind job $job rc $rc ${took}s latest step $(latest) ${signals:+signals: $signals}"
  check "$job" "$kind" "$log"
  n=$((n + 1))
done
echo "SUMMARY: $runs launches of srun (plain ${count[plain]:-0}, killed ${count[killed]:-0}, the rest in ${count[requeue]:-0} requeued jobs of up to 3 runs), $crashes with a core"
exit
}
