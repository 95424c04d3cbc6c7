#!/usr/bin/env bash
# A real SLURM cluster on this machine, for the tests: munged, slurmctld and two slurmd (emulated
# nodes n1 and n2, both on this host, on their own ports), everything under one scratch
# directory, nothing in /etc touched; addresses are 127.0.0.1 (no name lookup needed).
#   tests/slurm/cluster.sh up DIR     starts it; prints `export SLURM_CONF=DIR/slurm.conf`
#   tests/slurm/cluster.sh down DIR   stops every daemon it started, by PID
# Needs root (slurmd runs jobs as their user) and Debian's slurm-wlm, munge and libpmix-dev.
set -euo pipefail
cmd=$1 dir=$(realpath -m "$2")

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Each daemon's PID file; `down` signals exactly these processes.
pidfiles() { echo "$dir/slurmd-n1.pid $dir/slurmd-n2.pid $dir/slurmctld.pid $dir/munged.pid"; }

down() {
  local f pid
  for f in $(pidfiles); do
    [ -s "$f" ] || continue
    pid=$(cat "$f")
    kill "$pid" 2>/dev/null || continue
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  done
  rm -f $(pidfiles)
}

up() {
  mkdir -p "$dir"/{state,spool,log,tmp/n1,tmp/n2,munge}
  chmod 700 "$dir/munge"
  dd if=/dev/urandom of="$dir/munge/key" bs=1024 count=1 status=none
  chmod 400 "$dir/munge/key"
  munged --force --key-file="$dir/munge/key" --socket="$dir/munge/sock" --pid-file="$dir/munged.pid" \
    --log-file="$dir/log/munged.log" --seed-file="$dir/munge/seed"
  local host ctld p1 p2
  host=$(hostname)
  ctld=$(free_port) p1=$(free_port) p2=$(free_port)
  # One CPU per emulated node: two nodes on one 2-core host, one task on each.
  cat > "$dir/slurm.conf" <<EOF
ClusterName=dtk-test
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$ctld
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/sock
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
TmpFS=$dir/tmp/%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=30
InactiveLimit=0
MinJobAge=300
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
NodeName=n1 NodeHostname=$host NodeAddr=127.0.0.1 Port=$p1 CPUs=1 State=UNKNOWN
NodeName=n2 NodeHostname=$host NodeAddr=127.0.0.1 Port=$p2 CPUs=1 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
EOF
  # The pmix plugin's fences: by ring. Unset (slurm's default) or by tree, a fence across the two
  # emulated nodes returns at once, without waiting for the other node's tasks (a task that enters it 2 s
  # late: 0.000 s waited by the other, where the ring waits 2.0 s); Open MPI's MPI_Init then lets
  # a rank start sending while its peer is still inside MPI_Init, before the peer can take
  # messages, and the peer dies of SIGSEGV (docs/slurm.md, "Requeue chains and launches that fail").
  echo "PMIxCollFence=ring" > "$dir/mpi.conf"
  export SLURM_CONF=$dir/slurm.conf
  slurmctld -i
  slurmd -N n1
  slurmd -N n2
  # Ready when both nodes are idle.
  for _ in $(seq 150); do
    if [ "$(sinfo -h -N -o '%t' 2>/dev/null | sort -u | tr -d '\n')" = idle ]; then
      echo "export SLURM_CONF=$SLURM_CONF"
      return 0
    fi
    sleep 0.2
  done
  echo "cluster.sh: the nodes did not come up; see $dir/log" >&2
  sinfo -N >&2 || true
  return 1
}

case $cmd in
  up) up ;;
  down) down ;;
  *) echo "usage: cluster.sh up|down DIR" >&2; exit 2 ;;
esac
