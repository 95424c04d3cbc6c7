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
check "a rank hangs: watchdog names it" 1 30 \
  "collective timeout (2.0 s): rank 1 never reached all_reduce #1 (8 B, world), where 1 of 2 ranks wait; it is not waiting in a collective; its last, exit-code agreement #1 (4 B, runtime), completed" \
  $mpiexec -n 2 $prog --mode hang --comm-timeout 2
check "a wait for the GPU hangs: watchdog names it" 1 30 \
  "rank 1 never reached all_reduce #1 (8 B, world), where 1 of 2 ranks wait; it is waiting in a wait for the GPU for" \
  $mpiexec -n 2 $prog --mode device-hang --comm-timeout 2
check "a singleton's wait hangs: the rank's own line" 1 30 "rank 0: a wait for the GPU did not complete within 1.0 s" \
  $prog --mode device-hang --comm-timeout 1
check "after a stop request, a peer gone: no 5 s grace" 1 30 \
  "rank 0: all_reduce cannot complete after the stop request: rank 1 has exited" $mpiexec -n 2 $prog --mode gone-at-stop --comm-timeout 60
check "after a stop request, a peer gone during a checkpoint's wait (Patient): ended too" 1 30 \
  "rank 0: all_reduce cannot complete after the stop request: rank 1 has exited" $mpiexec -n 2 $prog --mode gone-at-stop-patient --comm-timeout 60
check "after a stop request, a peer stopped: the 5 s grace" 1 30 "has waited 5 s since the stop was requested" \
  $mpiexec -n 2 $prog --mode stopped-at-stop --comm-timeout 60
check "the watchdog runs the expiry hook" 1 30 "the expiry hook ran" $mpiexec -n 2 $prog --mode device-hang --comm-timeout 2
check "waits on two threads: no false hang" 0 30 "" $mpiexec -n 2 $prog --mode overlapping-waits --comm-timeout 0.5
check "usage error on one rank" 2 30 "last rank only" $mpiexec -n 2 $prog --mode usage-on-one
check "failure on one rank" 1 30 "a failure on the last rank only" $mpiexec -n 2 $prog --mode fail-on-one
check "bad option" 2 30 "unknown option --no-such-option (see --help)" $mpiexec -n 2 $prog --mode ok --no-such-option
check "singleton" 0 30 "" $prog --mode ok
check "srun without PMI" 2 30 "mpi=pmix" env SLURM_STEP_ID=0 SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=4 SLURM_NTASKS=4 $prog --mode ok
[ $fails = 0 ] && echo "15 passed, 0 failed" || { echo "$((15-fails)) passed, $fails failed"; exit 1; }
