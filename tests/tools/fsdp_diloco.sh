#!/usr/bin/env bash
# fsdp-train --sync diloco|streaming end to end: DiLoCo across the --replicate groups, each
# sharding the model within as FSDP does. With H = 1, outer lr 1, no outer momentum and SGD it is
# HSDP's every-step training; on the same ranks it is psgd-train's DiLoCo over sync groups of the
# same size (the placement within a replica does not change the algorithm); a resume continues bit
# for bit on the same world size (every rank writes its own per-rank state; the first replica the
# outer weights' rows) and starts a new round on another; misfits exit 2 on every rank.
#   fsdp_diloco.sh MPIEXEC FSDP_TRAIN PSGD_TRAIN SHARD_INSPECT
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 fsdp=$2 psgd=$3 si=$4
common="$small --data synthetic --global-batch 8 --warmup 0 --eval-every 0 --log-level warn"
f32="--param-dtype f32"  # the gathers exact, so that the runs compare with psgd-train's

# ---- H = 1, eta = 1, mu = 0, SGD: HSDP every-step training (4 ranks, 2 replicas of 2 shards).
# --clip 0: clipping acts on each replica's own gradient under --sync. Measured: bit for bit. ----
sgd="$common --optimizer sgd --lr 0.1 --clip 0 --steps 6"
run $mpiexec -n 4 $fsdp $sgd $f32 --replicate 2 --save every
[ $rc = 0 ] || bad "HSDP every-step run (exit $rc)" "$(cat $tmp/e)"
run $mpiexec -n 4 $fsdp $sgd $f32 --replicate 2 --sync diloco --sync-every 1 --outer-lr 1 --outer-momentum 0 --save h1
[ $rc = 0 ] || bad "H = 1 run (exit $rc)" "$(cat $tmp/e)"
run $si diff h1 every model/ --rtol 1e-6 --atol 1e-7
if [ $rc = 0 ]; then ok "H = 1, outer lr 1, momentum 0 equals HSDP every-step SGD within 1e-6 (2 replicas x 2 shards)"
else bad "H = 1 differs from HSDP every-step" "$(tail -5 $tmp/o)"; fi

# ---- the same DiLoCo as psgd-train's over sync groups of the same ranks. SGD with Nesterov outer
# steps: measured bit for bit; AdamW and clipping (whose norms sum the shards in another order)
# within 4e-7; PowerSGD on the pseudo-gradients (whole matrices over the shards) within 3e-7 ----
pair() {  # pair NAME RANKS REPLICAS TOLERANCES -- OPTIONS...
  local name=$1 n=$2 r=$3 tol=$4; shift 5
  rm -rf pa.h5 pb pa.jsonl pb.jsonl
  run $mpiexec -n $n $psgd $common "$@" --sync-groups $((n / r)) --save pa.h5 --metrics pa.jsonl
  [ $rc = 0 ] || { bad "$name: psgd-train (exit $rc)" "$(cat $tmp/e)"; return; }
  run $mpiexec -n $n $fsdp $common $f32 "$@" --replicate $r --save pb --metrics pb.jsonl
  [ $rc = 0 ] || { bad "$name: fsdp-train (exit $rc)" "$(cat $tmp/e)"; return; }
  run $si diff pa.h5 pb model/ $tol
  if [ $rc = 0 ]; then ok "$name: fsdp-train's DiLoCo equals psgd-train's ($n ranks, $r replicas; $tol)"
  else bad "$name: fsdp-train and psgd-train differ" "$(grep -v ' same\| close' $tmp/o | head -5)"; fi
}
pair "diloco, SGD" 4 2 "--rtol 0 --atol 0" -- --optimizer sgd --lr 0.1 --clip 0 --steps 6 --compressor none --sync diloco --sync-every 2
python3 - pa.jsonl pb.jsonl <<'PY' && ok "metrics: outer_bytes and outer_grad_norm (the whole model's) as psgd-train's" || bad "outer metrics differ from psgd-train's" "$(head -2 pa.jsonl pb.jsonl)"
import json, sys
a, b = ([json.loads(l) for l in open(p)] for p in sys.argv[1:])
for x, y in zip(a, b):
    assert x["outer_bytes"] == y["outer_bytes"], (x, y)
    assert ("outer_grad_norm" in x) == ("outer_grad_norm" in y) == (x["step"] % 2 == 0), (x, y)
    if "outer_grad_norm" in x: assert abs(x["outer_grad_norm"] - y["outer_grad_norm"]) <= 1e-6 * x["outer_grad_norm"], (x, y)
PY
pair "streaming, AdamW" 6 3 "--rtol 1e-3 --atol 1e-6" -- --lr 1e-2 --steps 9 --compressor none --sync streaming --fragments 2 --sync-every 4
pair "diloco + powersgd" 4 2 "--rtol 1e-3 --atol 1e-6" -- --lr 1e-2 --steps 9 --sync diloco --sync-every 3 --compressor powersgd --rank 2

# ---- resume: 10 steps == 7 + resume + 3, bit for bit (streaming int8: fragment 1 in flight at
# the checkpoint; diloco + powersgd) ----
strip() { python3 -c 'import json,sys; [print(json.dumps({k: r.get(k) for k in ("step","loss","grad_norm","comm_bytes","outer_bytes","outer_grad_norm")})) for r in map(json.loads, open(sys.argv[1]))]' "$1"; }
resume_check() {  # resume_check NAME OPTIONS...
  local name=$1; shift
  rm -rf ck full resumed a.jsonl b.jsonl
  run $mpiexec ${rx:-} -n 4 $fsdp $common --steps 10 "$@" --save full --metrics a.jsonl
  [ $rc = 0 ] || { bad "$name: uninterrupted run (exit $rc)" "$(cat $tmp/e)"; return; }
  run $mpiexec ${rx:-} -n 4 $fsdp $common --steps 10 "$@" --stop-at 7 --checkpoint-dir ck --metrics b.jsonl
  [ $rc = 0 ] || { bad "$name: first part (exit $rc)" "$(cat $tmp/e)"; return; }
  run $mpiexec ${rx:-} -n 4 $fsdp $common --steps 10 "$@" --resume ck --save resumed --metrics b.jsonl
  [ $rc = 0 ] || { bad "$name: resumed part (exit $rc)" "$(cat $tmp/e)"; return; }
  run $si diff full resumed --rtol 0 --atol 0
  if [ $rc = 0 ] && cmp -s <(strip a.jsonl) <(strip b.jsonl); then ok "$name: resume is exact (every tensor, the losses and bytes)"
  else bad "$name: resume differs (diff exit $rc)" "$(tail -5 $tmp/o)" "$(diff <(strip a.jsonl) <(strip b.jsonl))"; fi
}
resume_check "streaming int8, 2 replicas" --lr 1e-2 --replicate 2 --sync streaming --fragments 2 --sync-every 4 --outer-dtype int8
rx="-x DTK_AUTO_LINK=1,100" resume_check "streaming, H and F chosen (auto), 2 replicas" --lr 1e-2 --replicate 2 --sync streaming --sync-every auto
resume_check "diloco + powersgd, 2 replicas" --lr 1e-2 --replicate 2 --sync diloco --sync-every 3 --compressor powersgd --rank 2
run $si ls ck
if [ $rc = 0 ] && grep -q "^diloco/momentum/output.weight .*4 shards" $tmp/o && grep -q "^ranks/3/diloco/local/output.weight" $tmp/o \
   && grep -q "^ranks/2/diloco/compress/0/error/output.weight" $tmp/o && grep -q "^ranks/1/optim/exp_avg/output.weight" $tmp/o; then
  ok "shard-inspect ls: the outer momentum by rows, every rank's local weights, error feedback and inner optimizer state"
else bad "the sharded state lacks the outer state" "$(grep -E 'diloco|optim' $tmp/o | head)"; fi
run $si verify ck
if [ $rc = 0 ]; then ok "shard-inspect verify: the state written by every rank is whole"; else bad "verify (exit $rc)" "$(cat $tmp/o $tmp/e)"; fi
rm -f c.h5; run $si consolidate ck --output c.h5
run $mpiexec -n 4 $fsdp $common --steps 10 --lr 1e-2 --replicate 2 --sync diloco --sync-every 3 --compressor powersgd --rank 2 --resume c.h5 --save fromfull
run $si diff fromfull full --rtol 0 --atol 0
if [ $rc = 0 ]; then ok "consolidated into one file, it resumes the run bit for bit"; else bad "resume from the consolidated state (diff exit $rc)" "$(tail -3 $tmp/o)"; fi

# ---- a run that ends with a fragment in flight exits 0 (the exchange waited for at the exit) ----
run $mpiexec -n 4 $fsdp $common --lr 1e-2 --replicate 2 --sync streaming --fragments 2 --sync-every 4 --outer-dtype int8 --steps 5
if [ $rc = 0 ]; then ok "a run ending with a fragment in flight exits 0"; else bad "a run ending with a fragment in flight: exit $rc" "$(tail -5 $tmp/e)"; fi

# ---- another world size: the outer weights by rows, a new round from them ----
run $mpiexec -n 2 $fsdp $common --steps 10 --lr 1e-2 --replicate 2 --sync diloco --sync-every 3 --compressor powersgd --rank 2 --resume ck --save r2
if [ $rc = 0 ] && [ "$(grep -c 'every replica starts a new round from the outer weights' $tmp/e)" = 1 ]; then
  ok "4 -> 2 ranks: resumed, one warning naming the new round"
else bad "4 -> 2 ranks (exit $rc)" "$(cat $tmp/e)"; fi
run $si diff r2 full model/ -q
[ $rc = 1 ] || bad "the 2-rank continuation equals the 4-rank run (diff exit $rc)"

# ---- --print-plan: the fragments and FSDP's buckets ----
run $mpiexec -n 4 $fsdp $common --replicate 2 --sync streaming --print-plan
if [ $rc = 0 ] && python3 -c 'import json,sys; p = json.load(open(sys.argv[1])); assert p["diloco"]["replicas"] == 2 and len(p["diloco"]["fragments"]) == 4 and p["fsdp"]["buckets"]' $tmp/o; then
  ok "--print-plan: DiLoCo's fragments and the bucket plan within a replica"
else bad "--print-plan (exit $rc)" "$(cat $tmp/o $tmp/e | head)"; fi

# ---- options that do not fit: exit 2 on every rank ----
expect2 "--sync-groups (the replicas are --replicate's)" "unknown option --sync-groups" $mpiexec -n 4 $fsdp $common --steps 2 --sync diloco --sync-groups 2
expect2 "another --replicate on the same ranks" "--replicate 1 differs from the checkpoint's 2" $mpiexec -n 4 $fsdp $common --steps 10 --lr 1e-2 --sync diloco --sync-every 3 --compressor powersgd --rank 2 --resume ck
expect2 "auto outside" "with --compressor auto" $mpiexec -n 4 $fsdp $common --steps 2 --replicate 2 --sync diloco --compressor auto
expect2 "shampoo inside" "the inner optimizer is --optimizer sgd or adamw" $mpiexec -n 4 $fsdp $common --steps 2 --replicate 2 --sync diloco --optimizer shampoo
expect2 "outer dtype with a compressor" "--outer-dtype e3m0 is the plain exchange's" $mpiexec -n 4 $fsdp $common --steps 2 --replicate 2 --sync diloco --compressor topk --outer-dtype e3m0
expect2 "outer options without --sync" "--outer-lr needs --sync diloco or streaming" $mpiexec -n 4 $fsdp $common --steps 2 --replicate 2 --outer-lr 0.5
finish
