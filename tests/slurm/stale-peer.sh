#!/usr/bin/env bash
# Issue 31's launch-time SIGSEGV: what Open MPI 4.1's TCP BTL does with a connection from a
# process that is not one of its job's (a previous run's, say); not run by ctest. On the test
# cluster (cluster.sh), a 2-task `srun --mpi=pmix` step of a small MPI program that calls
# MPI_Init, then polls (MPI_Iprobe) for 8 s; while it polls, this script connects to task 1's
# TCP BTL port from the host's address and sends the BTL's handshake (a process name and the
# magic string "OPAL-TCP-BTL") and one fragment:
#   1. a name from another job: Open MPI warns ("cannot find a corresponding process entry")
#      and ignores the connection; the step ends normally;
#   2. the name of the step's own rank 0, as a previous run of the same job has it (Open MPI's
#      jobid is a hash of the PMIx namespace, slurm.pmix.JOBID.STEPID, the same in every run
#      of a requeued job), then a fragment of a tag nothing registered: task 1 dies of SIGSEGV
#      at address 0, a call through a null pointer from mca_btl_tcp.so; its core's backtrace
#      is printed.
# Exit 0 when both happen as described.
#   tests/slurm/stale-peer.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d "${TMPDIR:-/tmp}/dtk-stale-peer.XXXXXX")
cleanup() { cd /; "$here/cluster.sh" down "$dir/cluster" || true; }
trap cleanup EXIT
eval "$("$here/cluster.sh" up "$dir/cluster")"
[ "$(id -u)" -ne 0 ] || export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
# No handler of Open MPI's (the signal kills the task, which dumps core), unless OMPI_HANDLER=1: then
# Open MPI's report of the signal is shown too (its handler re-raises the signal: a core all the same).
[ "${OMPI_HANDLER:-0}" = 1 ] || export OMPI_MCA_opal_signal=""
cd "$dir"
cat > poll.c <<'EOF_C'
#include <mpi.h>
#include <stdio.h>
#include <unistd.h>
int main(int argc, char** argv) {
  int rank = 0, flag = 0;
  MPI_Init(&argc, &argv);
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  char name[32];
  snprintf(name, sizeof name, "ready.%d", rank);
  FILE* f = fopen(name, "w");
  fprintf(f, "%d\n", (int)getpid());
  fclose(f);
  for (int i = 0; i < 800; ++i) {
    MPI_Iprobe(MPI_ANY_SOURCE, 99, MPI_COMM_WORLD, &flag, MPI_STATUS_IGNORE);
    usleep(10000);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  if (rank == 0) printf("the step ended normally\n");
  MPI_Finalize();
  return 0;
}
EOF_C
mpicc -g -o poll poll.c
cat > peer.py <<'EOF_P'
# peer.py PID JOB VPID TAG: connects to the TCP BTL port of process PID (its lowest listening
# port below 32768) from the address Open MPI published for the peers (the host's first
# non-loopback IPv4 address) and sends the handshake with the name (JOB, VPID), JOB "own" for
# the jobid of PID's job (the hash Open MPI takes of PMIX_NAMESPACE), then one fragment of tag TAG.
import os, socket, struct, subprocess, sys, time
pid, job, vpid, tag = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4], 0)
env = dict(l.split("=", 1) for l in open(f"/proc/{pid}/environ").read().split("\0") if "=" in l)
def hash_jobid(s):  # OPAL_HASH_JOBID: Jenkins' one-at-a-time hash, bit 15 cleared
    x = 0
    for c in s.encode():
        x = (x + c) & 0xffffffff; x = (x + (x << 10)) & 0xffffffff; x ^= x >> 6
    x = (x + (x << 3)) & 0xffffffff; x ^= x >> 11; x = (x + (x << 15)) & 0xffffffff
    return x & ~0x8000
jobid = hash_jobid(env["PMIX_NAMESPACE"]) if job == "own" else int(job, 0)
links = [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
inodes = {l[8:-1] for l in links if l.startswith("socket:[")}
rows = [l.split() for l in open(f"/proc/{pid}/net/tcp").readlines()[1:]]
port = min(int(r[1].split(":")[1], 16) for r in rows if r[3] == "0A" and r[9] in inodes
           and int(r[1].split(":")[1], 16) < 32768)
addr = next(a for a in subprocess.run(["hostname", "-I"], capture_output=True, text=True).stdout.split()
            if "." in a and not a.startswith("127."))
print(f"{env['PMIX_NAMESPACE']} (jobid {hash_jobid(env['PMIX_NAMESPACE']):#x}): to task {env['SLURM_PROCID']}'s "
      f"TCP BTL port {addr}:{port} as [jobid {jobid:#x}, vpid {vpid}], then a fragment of tag {tag:#x}")
s = socket.create_connection((addr, port), source_address=(addr, 0))
s.sendall(struct.pack("<II", jobid, vpid) + b"OPAL-TCP-BTL".ljust(16, b"\0"))
time.sleep(0.3)
s.sendall(struct.pack("<BBHI", tag, 1, 0, 16) + b"\0" * 16)  # mca_btl_tcp_hdr_t: tag, type SEND, count, size
time.sleep(1)
s.close()
EOF_P
# Runs the step with peer.py's arguments $1 $2 $3 against task 1; its output in $4.
step() {
  rm -rf ready.* t0 t1
  srun --mpi=pmix --kill-on-bad-exit=1 --nodes=2 --ntasks-per-node=1 \
    bash -c 'ulimit -c unlimited; mkdir -p t$SLURM_PROCID; cd t$SLURM_PROCID; exec ../poll' > "$4" 2>&1 &
  local p=$! rc=0
  for _ in $(seq 600); do [ -s t1/ready.1 ] && break; sleep 0.1; done
  [ -s t1/ready.1 ] || { cat "$4"; echo "stale-peer: the step did not start" >&2; exit 1; }
  python3 peer.py "$(cat t1/ready.1)" "$1" "$2" "$3"
  wait $p || rc=$?
  echo "srun exit $rc"
}
ok=1
echo "== 1. a name from another job"
step 0x12345678 0 0x7f foreign.out
cat foreign.out
grep -q "cannot find a corresponding process" foreign.out && grep -q "ended normally" foreign.out || ok=0
echo "== 2. the name of this step's rank 0 (a previous run of the same job), then an unregistered tag"
step own 0 0x7f own.out
cat own.out
if [ -f t1/core ]; then
  gdb -batch -ex bt -ex 'info registers rip' ./poll t1/core 2>&1 | grep -E '^#|^rip'
  gdb -batch -ex bt ./poll t1/core 2>&1 | grep -q '^#0  0x0000000000000000 in ?? ()' \
    && gdb -batch -ex bt ./poll t1/core 2>&1 | grep -q '^#1 .* from .*mca_btl_tcp.so' || ok=0
else
  echo "no core from task 1"
  ok=0
fi
[ $ok = 1 ] && echo "AS DESCRIBED" || { echo "NOT AS DESCRIBED" >&2; exit 1; }
