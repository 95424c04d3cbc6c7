#!/usr/bin/env bash
# The watchdog names the culprit (comm/watchdog.h, comm/flight.h), end to end under mpiexec:
#   - psgd-train on 4 ranks, one rank stopped (SIGSTOP) during training: one line, from one rank,
#     names it within --comm-timeout + 2 s; every rank that still runs leaves its flight records
#     in --debug-dir; exit 1;
#   - --debug-dir on a run that ends well: every rank's records, valid JSON (psgd-train,
#     comm-bench); a --debug-dir that cannot be created: exit 2, one line.
#   flight.sh MPIEXEC PSGD_TRAIN COMM_BENCH
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 psgd=$2 bench=$3
common="$small --global-batch 16 --lr 1e-2 --warmup 2 --eval-every 0 --log-level info --log-every 1"
now() { date +%s.%N; }
# The PID of rank $2 among the children of mpiexec $1 (Open MPI puts the rank in each one's environment).
rank_pid() {
  local p
  for p in $(pgrep -P "$1"); do
    tr '\0' '\n' < "/proc/$p/environ" 2>/dev/null | grep -qx "OMPI_COMM_WORLD_RANK=$2" && { echo "$p"; return 0; }
  done
  return 1
}
# Checks that $1 is a flight record of rank $2 (JSON, dtk-flight) with at least one operation.
is_record() {
  python3 - "$1" "$2" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
assert d["format"] == "dtk-flight" and d["version"] == 1 and d["rank"] == int(sys.argv[2]), d
assert d["operations"] and {"label", "issued", "completed", "members"} <= set(d["communicators"][0]), d
EOF
}

# ---- one rank of 4 stopped during training ----
timeout_s=3
"$mpiexec" -n 4 "$psgd" $common --steps 100000 --comm-timeout $timeout_s --debug-dir dbg --metrics /dev/null \
  > stop.out 2> stop.err &
mpi=$!
for _ in $(seq 600); do grep -q "step 5/" stop.err 2>/dev/null && break; sleep 0.1; done
victim=$(rank_pid $mpi 2) || victim=""
if [ -z "$victim" ]; then
  bad "no rank 2 among the children of mpiexec" "$(cat stop.err)"
else
  kill -STOP "$victim"; t0=$(now)
  t1=""
  for _ in $(seq 400); do
    grep -q "collective timeout" stop.err && { t1=$(now); break; }
    kill -0 $mpi 2>/dev/null || break
    sleep 0.05
  done
  [ -n "$t1" ] || t1=$(now)
  for _ in $(seq 300); do kill -0 $mpi 2>/dev/null || break; sleep 0.1; done
  kill -0 $mpi 2>/dev/null && kill -9 $mpi
  wait $mpi; rc=$?
  kill -CONT "$victim" 2>/dev/null; kill -9 "$victim" 2>/dev/null
  dt=$(python3 -c "print(f'{$t1 - $t0:.2f}')")
  lines=$(grep -c "collective timeout" stop.err)
  if [ $rc = 1 ] && [ "$lines" = 1 ] && grep -Eq "collective timeout \($timeout_s.0 s\): (rank 2 never reached [a-z_]+ #[0-9]+ \([^)]*, world\), where 3 of 4 ranks wait; it|[a-z_]+ #[0-9]+ \([^)]*, world\) did not complete on [12] of 4 ranks \([12] completed it\); rank 2) does not answer" stop.err \
     && python3 -c "assert $t1 - $t0 <= $timeout_s + 2"; then
    ok "a stopped rank of 4: one line names rank 2, $dt s after SIGSTOP (--comm-timeout $timeout_s), exit 1"
  else bad "a stopped rank of 4 (exit $rc, $lines lines, $dt s after SIGSTOP)" "$(cat stop.err)"; fi
  grep "collective timeout" stop.err | sed 's/^/     /'
  # (The stopped rank may leave its records too, when mpiexec's SIGCONT and SIGTERM let it run
  # before the SIGKILL.)
  if is_record dbg/flight-rank-00000.json 0 && is_record dbg/flight-rank-00001.json 1 \
     && is_record dbg/flight-rank-00003.json 3 && [ -z "$(ls dbg | grep -v '^flight-rank-0000[0-3].json$')" ]; then
    ok "--debug-dir: the records of ranks 0, 1 and 3, and nothing else"
  else bad "--debug-dir after the timeout" "$(ls -la dbg)"; fi
fi

# ---- --debug-dir on runs that end well ----
run "$mpiexec" -n 2 "$psgd" $common --steps 3 --debug-dir dbg2/sub --metrics /dev/null
[ $rc = 0 ] && is_record dbg2/sub/flight-rank-00000.json 0 && is_record dbg2/sub/flight-rank-00001.json 1 \
  && python3 -c "
import json
d = json.load(open('dbg2/sub/flight-rank-00001.json'))
assert all(o['completed_s_ago'] is not None for o in d['operations']), d
assert any(c['label'] == 'world' and c['issued'] == c['completed'] > 0 for c in d['communicators']), d" \
  && ok "--debug-dir, psgd-train on 2 ranks: each rank's records at the end, every operation completed" \
  || bad "--debug-dir, psgd-train (exit $rc)" "$(cat $tmp/e)" "$(ls -la dbg2/sub)"
run "$mpiexec" -n 2 "$bench" --op allreduce -b 8 -e 64 -n 2 -w 1 --debug-dir dbg3
[ $rc = 0 ] && is_record dbg3/flight-rank-00000.json 0 && is_record dbg3/flight-rank-00001.json 1 \
  && ok "--debug-dir, comm-bench on 2 ranks" || bad "--debug-dir, comm-bench (exit $rc)" "$(cat $tmp/e)"
touch afile
expect2 "--debug-dir under a file" "error: --debug-dir afile/d: cannot be created: afile is not a directory" \
  "$mpiexec" -n 2 "$psgd" $common --steps 3 --debug-dir afile/d
[ "$(grep -c 'debug-dir' $tmp/e)" = 1 ] && ok "--debug-dir under a file: one line" || bad "--debug-dir lines" "$(cat $tmp/e)"
finish
