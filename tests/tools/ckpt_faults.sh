#!/usr/bin/env bash
# Checkpoints under faults and bad input (issue 14): a full file system during a checkpoint write,
# synchronous or in the background (--async-checkpoint), or already full when the temporary is
# created (exit 1 on every rank, one line naming
# the file and "No space left on device", the earlier checkpoint intact, no temporary left) and during shard-inspect export; a damaged dataset
# object header (exit 2, one line naming the file, from every reader); rank files of different sharded states mixed (exit 2
# naming the odd rank file); temporaries of dead writers removed by the next write while a live
# writer's and another host's stay, while a zombie writer (killed, not reaped) and a pid reused
# since count as dead; SIGKILL while a checkpoint is written in the background (the
# latest checkpoint intact, --auto-resume exact).
#   ckpt_faults.sh MPIEXEC PSGD_TRAIN FSDP_TRAIN SHARD_INSPECT CKPT_MAKE
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 psgd=$2 fsdp=$3 si=$4 mk=$5
common="$small --global-batch 8 --lr 1e-2 --warmup 2 --eval-every 0 --log-level warn"
# The program's own error lines (mpiexec adds lines of its own about the exit codes).
errors() { grep -E '(^|[] ])error' "$tmp/e" || true; }
# Exactly one error line, with every word given, and no HDF5 stack or buffer address.
one_line() {
  local lines; lines=$(errors)
  [ -n "$lines" ] && [ "$(wc -l <<<"$lines")" = 1 ] || return 1
  for w in "$@"; do grep -qF -- "$w" <<<"$lines" || return 1; done
  ! grep -qE 'HDF5-DIAG|0x[0-9a-f]{6,}|#[0-9]+:' "$tmp/e"
}
host=$(hostname)
dead_pid() { sh -c 'echo $$'; }  # a process that has ended

# ---- a full file system during a checkpoint write ----
# A private tmpfs (a mount namespace of its own, as root) that holds the step-2 checkpoint but
# not a second one beside it: the step-4 write fails.
if [ "$(id -u)" = 0 ] && unshare -m true 2>/dev/null; then
  full_disk() {  # NAME LAUNCH... : runs the program in a full tmpfs, then looks at what it left
    local name=$1 entry=$2 bytes=$3; shift 3
    local size=$(( (bytes * 3 / 2 + 65535) / 4096 * 4096 ))
    mkdir -p "$tmp/mnt"
    unshare -m sh -c '
      mount -t tmpfs -o size=$1 tmpfs "$2/mnt" || exit 99
      cd "$2/mnt"; shift 2
      "$@" --checkpoint-dir ck >"'"$tmp"'/o" 2>"'"$tmp"'/e"; echo $? >"'"$tmp"'/rc"
      ls -A ck >"'"$tmp"'/left"
      '"$si"' verify ck/'"$entry"' >"'"$tmp"'/verify" 2>&1; echo $? >>"'"$tmp"'/verify"
    ' sh $size "$tmp" "$@"
    rc=$(cat "$tmp/rc" 2>/dev/null || echo none)
    local left; left=$(grep -F .tmp "$tmp/left" || true)
    if [ "$rc" = 1 ] && one_line "No space left on device" "ck/step-00000004" && [ -z "$left" ] \
       && [ "$(tail -1 "$tmp/verify")" = 0 ]; then ok "full disk, $name: exit 1, one line, step 2 intact, no temporary"
    else bad "full disk, $name (exit $rc, left: $left)" "$(cat "$tmp/e")" "$(cat "$tmp/verify")"; fi
  }
  # The size of one checkpoint of each kind, on the ordinary file system.
  run $psgd $common --steps 2 --checkpoint-dir size1
  full_bytes=$(stat -c %s size1/step-00000002.h5)
  run $mpiexec -n 2 $fsdp $common --steps 2 --checkpoint-dir size2
  sharded_bytes=$(du -sb size2/step-00000002 | cut -f1)
  full_disk "psgd-train, 1 rank" step-00000002.h5 $full_bytes $psgd $common --steps 4 --checkpoint-every 2
  full_disk "psgd-train, 2 ranks" step-00000002.h5 $full_bytes $mpiexec -n 2 $psgd $common --steps 4 --checkpoint-every 2
  full_disk "fsdp-train (sharded), 2 ranks" step-00000002 $sharded_bytes \
    $mpiexec -n 2 $fsdp $common --steps 4 --checkpoint-every 2
  # The step-4 checkpoint written in the background (--async-checkpoint, the default; step 5 is
  # the last): its failure reaches every rank as the same line and exit 1.
  full_disk "psgd-train, 2 ranks, in the background" step-00000002.h5 $full_bytes \
    $mpiexec -n 2 $psgd $common --steps 5 --checkpoint-every 2
  full_disk "fsdp-train (sharded), 2 ranks, in the background" step-00000002 $sharded_bytes \
    $mpiexec -n 2 $fsdp $common --steps 5 --checkpoint-every 2
  # small_fs FILL CMD: runs CMD (one word-split string) in a private 64 KiB tmpfs, from inside it,
  # first filled up when FILL is "full"; $rc its exit status, $left what it left there.
  small_fs() {
    unshare -m sh -c '
      mount -t tmpfs -o size=64k tmpfs "$1/mnt" || exit 99
      [ "$2" = full ] && dd if=/dev/zero of="$1/mnt/fill" bs=4k 2>/dev/null
      cd "$1/mnt"; $3 >"$1/o" 2>"$1/e"; echo $? >"$1/rc"
      ls -A "$1/mnt" >"$1/left"
    ' sh "$tmp" "$1" "$2"
    rc=$(cat "$tmp/rc" 2>/dev/null || echo none) left=$(grep -vx fill "$tmp/left" || true)
  }
  # shard-inspect export into a file system too small for the file (npz through libzip's
  # callbacks, safetensors directly): exit 1, one line, no file and no temporary left.
  for format in npz safetensors; do
    small_fs empty "$si export $PWD/size1/step-00000002.h5 --format $format -o out"
    if [ "$rc" = 1 ] && one_line "No space left on device" "out" && [ -z "$left" ]; then
      ok "full disk, export --format $format: exit 1, one line, nothing left"
    else bad "full disk, export --format $format (exit $rc, left: $left)" "$(cat "$tmp/e")"; fi
  done
  # A file system already full: the temporary's creation fails (HDF5 makes the file, then cannot
  # write its superblock). Found by a sweep of tmpfs sizes under load: the empty temporary stayed.
  nofill="--warmup 0 --steps 1"
  for c in "psgd-train --save, 2 ranks|$mpiexec -n 2 $psgd $common $nofill --save out.h5" \
           "fsdp-train --save (sharded), 2 ranks|$mpiexec -n 2 $fsdp $common $nofill --save out" \
           "shard-inspect reshard|$si reshard $PWD/size1/step-00000002.h5 --world-size 2 -o out"; do
    name=${c%%|*}
    small_fs full "${c#*|}"
    if [ "$rc" = 1 ] && one_line "No space left on device" "create" && [ -z "$left" ]; then
      ok "full disk at the temporary's creation, $name: exit 1, one line, nothing left"
    else bad "full disk at creation, $name (exit $rc, left: $left)" "$(cat "$tmp/e")"; fi
  done
else
  echo "skip full-disk cases: they need root and unshare -m"
fi

# ---- killed (SIGKILL) while a checkpoint is written in the background ----
# A checkpoint every step, each written in the background (--async-checkpoint) while the next
# step runs: the kill lands when a checkpoint's temporary exists. `latest` names a complete
# checkpoint, every entry present verifies, and --auto-resume continues (the dead writer's
# temporaries removed) to the uninterrupted run's weights, bit for bit.
bigger="--model llama-tiny --global-batch 8 --lr 1e-3 --eval-every 0 --log-level warn"
run $psgd $bigger --steps 20 --save kref.h5 --metrics /dev/null
caught=0
for try in 1 2 3 4 5; do
  rm -rf kck
  $psgd $bigger --steps 20 --checkpoint-every 1 --checkpoint-dir kck --metrics /dev/null 2>kill.log &
  pid=$!
  while kill -0 $pid 2>/dev/null; do  # steps 1-19: written in the background (20, the last, is not)
    if compgen -G "kck/.step-000000[01][0-9].h5.tmp-*" >/dev/null && [ -f kck/latest ]; then
      kill -KILL $pid; caught=1; break
    fi
    sleep 0.01
  done
  wait $pid 2>/dev/null
  [ $caught = 1 ] && break
done
if [ $caught = 1 ]; then
  latest=$(cat kck/latest) all=1
  for e in kck/step-*; do $si verify "$e" >/dev/null 2>&1 || all=0; done
  run $si verify kck
  if [ $rc = 0 ] && [ $all = 1 ] && [ -e "kck/$latest" ]; then
    ok "SIGKILL during a write in the background: $latest intact and latest, every entry verifies"
  else bad "SIGKILL during an async write (verify exit $rc, all $all, latest $latest)" "$(ls -A kck)"; fi
  run $psgd $bigger --steps 20 --checkpoint-every 1 --checkpoint-dir kck --auto-resume --save kres.h5 --metrics /dev/null
  run2=$rc left=$(ls -A kck | grep -c tmp)
  run $si diff kres.h5 kref.h5 --rtol 0 --atol 0
  [ $run2 = 0 ] && [ $rc = 0 ] && [ "$left" = 0 ] \
    && ok "--auto-resume after it: temporaries removed, == uninterrupted, bit for bit" \
    || bad "resume after SIGKILL during an async write (exit $run2, diff $rc, temporaries $left)" "$(cat $tmp/e)"
else bad "no checkpoint write in flight seen in 5 tries" "$(cat kill.log)"; fi

# ---- a damaged dataset object header: bad input, exit 2, one line naming the file ----
$mk full full.h5 || { echo "ckpt-make failed"; exit 1; }
damage() {  # FILE DATASET: overwrites the first bytes of the dataset's object header
  local at; at=$($mk header "$1" "$2") || return 1
  printf '\377\377\377\377\377\377\377\377' | dd of="$1" bs=1 seek="$at" conv=notrunc status=none
}
cp full.h5 hdr.h5 && damage hdr.h5 model/w.f32
for cmd in "ls hdr.h5" "show hdr.h5" "stats hdr.h5" "verify hdr.h5" "diff full.h5 hdr.h5" "consolidate hdr.h5 -o out.h5" \
           "reshard hdr.h5 -n 2 -o outdir" "convert hdr.h5 --dtype f32 -o out.h5" "extract hdr.h5 model/x -o out.h5" \
           "export hdr.h5 --format npz -o out.npz"; do
  run $si $cmd
  if [ $rc = 2 ] && one_line "hdr.h5" && [ ! -e out.h5 ] && [ ! -e outdir ] && [ ! -e out.npz ]; then ok "damaged header: $cmd"
  else bad "damaged header: $cmd (exit $rc)" "$(cat "$tmp/e")"; fi
  rm -rf out.h5 outdir out.npz
done
run $psgd $common --steps 2 --save p.h5
cp p.h5 pd.h5 && damage pd.h5 model/tok_embeddings.weight
for opt in --resume --init-from; do
  run $mpiexec -n 2 $psgd $common --steps 4 $opt pd.h5
  [ $rc = 2 ] && one_line "pd.h5" && ok "damaged header: psgd-train $opt" || bad "damaged header: psgd-train $opt (exit $rc)" "$(cat "$tmp/e")"
done

# ---- rank files of different sharded states mixed: refused, naming the odd rank file ----
$mk sharded s1 && $mk sharded s2 && cp s2/rank-00001.h5 s1/rank-00001.h5
for cmd in "ls s1" "verify s1" "consolidate s1 -o out.h5" "reshard s1 -n 2 -o outdir" "convert s1 --dtype f32 -o outdir" \
           "extract s1 model/ramp -o out.h5" "export s1 --format npz -o out.npz"; do
  run $si $cmd
  if [ $rc = 2 ] && one_line "rank-00001.h5" "another sharded state" && [ ! -e out.h5 ] && [ ! -e outdir ]; then
    ok "mixed rank files: $cmd"
  else bad "mixed rank files: $cmd (exit $rc)" "$(cat "$tmp/e")"; fi
  rm -rf out.h5 outdir out.npz
done
run $mpiexec -n 2 $fsdp $common --steps 2 --checkpoint-dir m1 && run $mpiexec -n 2 $fsdp $common --steps 2 --checkpoint-dir m2
cp m2/step-00000002/rank-00001.h5 m1/step-00000002/
for prog in "$fsdp" "$psgd"; do
  run $mpiexec -n 2 $prog $common --steps 4 --resume m1
  [ $rc = 2 ] && one_line "rank-00001.h5" && ok "mixed rank files: $(basename $prog) --resume" \
    || bad "mixed rank files: $(basename $prog) --resume (exit $rc)" "$(cat "$tmp/e")"
done

# ---- temporaries of dead writers are removed by the next write; a live writer's stay ----
sleep 600 & live=$!
dead=$(dead_pid)
plant() {  # DIR NAMES...: temporaries that dead writers, a live one and another host left
  local d=$1; shift
  for n in "$@"; do printf x >"$d/$n"; done
}
mkdir ck
plant ck ".step-00000002.h5.tmp-$host-$dead-0" ".latest.tmp-$host-$dead-3" ".step-00000009.h5.tmp-$host-$live-0" \
  ".step-00000008.h5.tmp-elsewhere-$dead-0"
mkdir "ck/.step-00000006.tmp-$host-$dead-1" && plant "ck/.step-00000006.tmp-$host-$dead-1" rank-00000.h5
run $psgd $common --steps 2 --checkpoint-dir ck
left=$(ls -A ck | tr '\n' ' ')
if [ $rc = 0 ] && [ "$left" = ".step-00000008.h5.tmp-elsewhere-$dead-0 .step-00000009.h5.tmp-$host-$live-0 latest step-00000002.h5 " ]; then
  ok "checkpoint directory: dead writers' temporaries removed, a live one's and another host's kept"
else bad "checkpoint directory temporaries (exit $rc): $left" "$(cat "$tmp/e")"; fi
# A resubmission of the finished run writes nothing, but tidies the directory all the same.
plant ck ".step-00000002.h5.tmp-$host-$dead-4"
run $psgd $common --steps 2 --checkpoint-dir ck --auto-resume
left=$(ls -A ck | tr '\n' ' ')
if [ $rc = 0 ] && [ "$left" = ".step-00000008.h5.tmp-elsewhere-$dead-0 .step-00000009.h5.tmp-$host-$live-0 latest step-00000002.h5 " ]; then
  ok "checkpoint directory: a finished run's resubmission removes dead writers' temporaries"
else bad "finished run's temporaries (exit $rc): $left" "$(cat "$tmp/e")"; fi
# A writer killed but not yet reaped (a zombie: a harness that kills and starts the next command
# at once leaves one) is dead too, and so is a pid that a process started after the temporary
# was last written has taken over (the temporary is older than that process: not its writer).
bash -c 'sleep 600 & echo $! >zombie.pid; kill -9 $!; exec sleep 60' & reaper=$!
for _ in $(seq 50); do [ -s zombie.pid ] && grep -q ') Z' "/proc/$(cat zombie.pid)/stat" 2>/dev/null && break; sleep 0.1; done
zombie=$(cat zombie.pid)
mkdir si && plant si ".out.h5.tmp-$host-$dead-0" ".out.npz.tmp-$host-$dead-7" ".outdir.tmp-$host-$dead-2" ".out.h5.tmp-$host-$live-5" \
  ".out.h5.tmp-$host-$zombie-1" ".out.h5.tmp-$host-$live-6"
touch -d '2 hours ago' "si/.out.h5.tmp-$host-$live-6"
run $si consolidate s2 -o si/out.h5
left=$(ls -A si | tr '\n' ' ')
[ $rc = 0 ] && [ "$left" = ".out.h5.tmp-$host-$live-5 out.h5 " ] \
  && ok "shard-inspect output: dead, unreaped and pid-reused writers' temporaries removed, a live one's kept" \
  || bad "shard-inspect temporaries (exit $rc): $left" "$(cat "$tmp/e")"
kill $live $reaper

finish
