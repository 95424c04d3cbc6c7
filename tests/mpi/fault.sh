#!/usr/bin/env bash
# Fault handling end to end: every case must end the whole job, quickly, with the right exit code.
#   fault.sh MPIEXEC COMM_FAULT
set -u
mpiexec=$1 prog=$2
fails=0
check() {  # name, expected exit code ('nonzero' for any), max seconds, grep pattern for stderr, command...
  local name=$1 want=$2 max=$3 pat=$4; shift 4
  local t0=$SECONDS err rc
  err=$(timeout 100 "$@" 2>&1 >/dev/null); rc=$?
  local dt=$((SECONDS - t0))
  local ok=1
  if [ "$want" = nonzero ]; then [ $rc -ne 0 ] || ok=0; else [ $rc -eq "$want" ] || ok=0; fi
  [ $rc -eq 124 ] && ok=0
  [ $dt -le "$max" ] || ok=0
  [ -z "$pat" ] || grep -q -- "$pat" <<<"$err" || ok=0
  if [ $ok = 1 ]; then echo "ok   $name (exit $rc, ${dt}s)"; else
    echo "FAIL $name: exit $rc (want $want), ${dt}s (max $max), stderr:"; echo "$err" | tail -20; fails=$((fails+1)); fi
}
check "all ranks fine" 0 30 "" $mpiexec -n 2 $prog --mode ok
check "a rank is killed" nonzero 30 "" $mpiexec -n 2 $prog --mode die
check "a rank hangs: watchdog" 1 30 "did not complete within" $mpiexec -n 2 $prog --mode hang --comm-timeout 2
check "a wait for the GPU hangs: watchdog" 1 30 "a wait for the GPU did not complete within" \
  $mpiexec -n 2 $prog --mode device-hang --comm-timeout 2
check "the watchdog runs the expiry hook" 1 30 "the expiry hook ran" $mpiexec -n 2 $prog --mode device-hang --comm-timeout 2
check "waits on two threads: no false hang" 0 30 "" $mpiexec -n 2 $prog --mode overlapping-waits --comm-timeout 0.5
check "usage error on one rank" 2 30 "last rank only" $mpiexec -n 2 $prog --mode usage-on-one
check "failure on one rank" 1 30 "a failure on the last rank only" $mpiexec -n 2 $prog --mode fail-on-one
check "bad option" 2 30 "unknown option --no-such-option (see --help)" $mpiexec -n 2 $prog --mode ok --no-such-option
check "singleton" 0 30 "" $prog --mode ok
check "srun without PMI" 2 30 "mpi=pmix" env SLURM_STEP_ID=0 SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=4 SLURM_NTASKS=4 $prog --mode ok
[ $fails = 0 ] && echo "11 passed, 0 failed" || { echo "$((11-fails)) passed, $fails failed"; exit 1; }
