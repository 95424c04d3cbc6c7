#!/usr/bin/env bash
# The shipped SLURM scripts (scripts/slurm/*.sbatch) on a real SLURM cluster started here
# (tests/slurm/cluster.sh: slurmctld and two slurmd, nodes n1 and n2 of one CPU each), with only
# sizes, times and the CPU device set on the command line:
#   - comm-bench over srun --mpi=pmix, one task per node;
#   - psgd-train warned before its time limit: it stops with a checkpoint, the script requeues
#     it, it resumes, and its final weights are bit-identical to an uninterrupted run's;
#   - ranks under srun take their share of the host's cores (emulated nodes share one host);
#   - scancel during training: a checkpoint at the step it stopped at, nothing left behind;
#   - a resubmission after the run finished exits 0 at once.
# The daemons are stopped by PID at the end, pass or fail.
#   tests/slurm/slurm.sh BUILD_DIR
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src=$(cd "$here/../.." && pwd)
build=$(realpath "$1")
scratch=$(mktemp -d "${TMPDIR:-/tmp}/dtk-slurm.XXXXXX")
cleanup() {
  "$here/cluster.sh" down "$scratch/cluster" || true
  rm -rf "$scratch"
}
trap cleanup EXIT
eval "$("$here/cluster.sh" up "$scratch/cluster")"
export DTK_BUILD=$build
[ "$(id -u)" -ne 0 ] || export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
mkdir "$scratch/work"
cd "$scratch/work"

fail() {
  echo "FAIL: $*" >&2
  for f in "$scratch"/work/*.out; do [ -f "$f" ] && { echo "--- $f" >&2; tail -n 30 "$f" >&2; }; done
  exit 1
}
state() { scontrol show job "$1" | grep -o 'JobState=[A-Z_]*' | cut -d= -f2; }
field() { scontrol show job "$1" | grep -o "$2=[^ ]*" | cut -d= -f2; }
# Waits until job $1 is in one of the states $2 (a regex), at most $3 seconds.
wait_state() {
  local s
  for _ in $(seq $(($3 * 2))); do
    s=$(state "$1")
    [[ $s =~ ^($2)$ ]] && { echo "$s"; return 0; }
    sleep 0.5
  done
  fail "job $1 is $s after $3 s, expected $2"
}
sizes=(--nodes=2 --ntasks-per-node=1 --gpus-per-node=0)
# psgd-train's run for the tests: about 40 s of work on two 1-CPU nodes.
train=(--device cpu --model llama-tiny --global-batch 16 --steps 400 --warmup 20 --lr 3e-3
       --checkpoint-every 100 --eval-every 0 --log-every 50)

echo "== comm-bench over srun --mpi=pmix, one task per node"
j=$(sbatch --parsable "${sizes[@]}" --time=5 "$src/scripts/slurm/comm-bench.sbatch" \
      --device cpu --backend mpi --op all_reduce -b 8 -e 64K)
[ "$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 120)" = COMPLETED ] || fail "comm-bench job $j"
python3 - "comm-bench-$j.json" <<'EOF' || fail "comm-bench's JSON"
import json, sys
d = json.load(open(sys.argv[1]))
assert d["nranks"] == 2, d["nranks"]
assert len(d["results"]) > 0
EOF

echo "== psgd-train: uninterrupted reference run (mpiexec)"
mpiexec -n 2 --bind-to none "$build/tools/psgd-train/psgd-train" "${train[@]}" --save ref.h5 \
  --metrics /dev/null > ref.out 2>&1 || fail "the reference run"

echo "== psgd-train: warned before its time limit, requeued, resumed"
# A 2-minute limit, warned 30 s before it (SLURM sends it up to 30 s earlier still).
j=$(sbatch --parsable "${sizes[@]}" --time=2 --signal=B:USR1@30 --output=train-%j.out \
      "$src/scripts/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ck --save final.h5)
runs=0
while :; do
  s=$(wait_state "$j" 'PENDING|COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 400)
  case $s in
    COMPLETED) break ;;
    PENDING)  # requeued: SLURM holds a requeued job ~2 minutes; hurry it
      [ "$(field "$j" Restarts)" -gt "$runs" ] || { sleep 0.5; continue; }
      runs=$(field "$j" Restarts)
      scontrol update JobId="$j" StartTime=now
      [ "$runs" -le 4 ] || fail "job $j requeued $runs times" ;;
    *) fail "the training job $j ended $s" ;;
  esac
done
[ "$runs" -ge 1 ] || fail "job $j was never stopped by its time limit's warning"
grep -q "requeueing job $j" "train-$j.out" || fail "the script did not requeue job $j"
# Each stop wrote a checkpoint at the step it stopped at: nothing was lost.
stops=$(grep -o 'stopped at step [0-9]*' "train-$j.out" | awk '{print $4}')
[ "$(echo "$stops" | wc -w)" -eq "$runs" ] || fail "$runs requeues but stops at: $stops"
for s in $stops; do
  grep -q "step-$(printf %08d "$s").h5" "train-$j.out" || fail "no checkpoint at step $s"
done
grep -q "CPU threads per rank: $(( $(nproc) / 2 > 0 ? $(nproc) / 2 : 1 )) ($(nproc) cores shared by 2 rank" \
  "train-$j.out" || fail "ranks under srun do not share the host's cores"
"$build/tools/shard-inspect/shard-inspect" diff final.h5 ref.h5 model/ --rtol 0 --atol 0 \
  > diff.out 2>&1 || { cat diff.out >&2; fail "requeued run's weights differ from the uninterrupted run's"; }
echo "stopped at steps: $stops; weights bit-identical to the uninterrupted run"

echo "== psgd-train: a resubmission after the run finished exits 0 at once"
j=$(sbatch --parsable "${sizes[@]}" --time=2 --output=again-%j.out \
      "$src/scripts/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ck)
[ "$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 120)" = COMPLETED ] || fail "resubmitted job $j"
grep -q "the run is complete, nothing to do" "again-$j.out" || fail "job $j did not say the run was complete"

echo "== psgd-train: scancel during training"
j=$(sbatch --parsable "${sizes[@]}" --time=5 --output=cancel-%j.out \
      "$src/scripts/slurm/psgd-train.sbatch" "${train[@]}" --checkpoint-dir ck2 --checkpoint-every 0)
wait_state "$j" RUNNING 60 > /dev/null
for _ in $(seq 120); do grep -q 'step 50/' "cancel-$j.out" 2>/dev/null && break; sleep 0.5; done
scancel "$j"
s=$(wait_state "$j" 'COMPLETED|FAILED|CANCELLED|TIMEOUT|NODE_FAIL' 60)
[ "$s" = CANCELLED ] || fail "cancelled job $j ended $s"
stop=$(grep -o 'stopped at step [0-9]*' "cancel-$j.out" | awk '{print $4}')
[ -n "$stop" ] || fail "job $j did not stop gracefully on scancel"
[ -f "ck2/step-$(printf %08d "$stop").h5" ] || fail "no checkpoint at step $stop after scancel"
[ -z "$(ls -A ck2 | grep -v -e '^step-' -e '^latest$')" ] || fail "scancel left debris: $(ls -A ck2)"
! grep -q "requeueing" "cancel-$j.out" || fail "a cancelled job was requeued"
echo "scancel: stopped at step $stop with its checkpoint"
echo "PASS"
