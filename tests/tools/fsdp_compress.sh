#!/usr/bin/env bash
# fsdp-train --replicate R --compressor ...: HSDP's all-reduce across the replica groups
# compressed (issue 33). PowerSGD at full rank is HSDP without compression; PowerSGD at rank 2 on
# R x S = 2x1, 2x2, 4x1 is psgd-train's PowerSGD on one rank (whole matrices, any shard count);
# resume is exact (bit for bit, on the same R x S) and continues the run on another R x S; topk
# warns that its resume is approximate; the replica hop's bytes; bad input.
#   fsdp_compress.sh MPIEXEC FSDP_TRAIN PSGD_TRAIN SHARD_INSPECT
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 fsdp=$2 psgd=$3 si=$4
common="$small --global-batch 8 --lr 1e-2 --warmup 2 --eval-every 0 --log-level warn"
exact="--param-dtype f32 --reduce-dtype f32"
psgd2="--compressor powersgd --rank 2 --start-iter 2"

# ---- full rank: every matrix compressed at rank min(n, m), which keeps all of it ----
# SGD with momentum: 10 steps within rtol 1e-6 at atol 1e-6 (measured; QR and Gram-Schmidt
# alike). Not AdamW: its first steps move each weight by about lr * sign(g), so a gradient
# element that plain all-reduce leaves exactly 0 (an embedding row no token of the batch used)
# and full-rank PowerSGD leaves at 1e-9 moves by lr (psgd-train's full rank does the same).
sgd="--optimizer sgd --momentum 0.9 --lr 0.1"
full="--compressor powersgd --rank 64 --min-compression-rate 1e-9 --start-iter 0"
run $mpiexec -n 4 $fsdp $common $sgd $exact --replicate 2 --steps 10 --save none.ckpt
run $mpiexec -n 4 $fsdp $common $sgd $exact --replicate 2 --steps 10 $full --save full.ckpt
[ $rc = 0 ] && run $si diff none.ckpt full.ckpt model/ optim/ $same_run
[ $rc = 0 ] && ok "PowerSGD at full rank on 2 x 2 == HSDP without compression" || bad "full rank differs (exit $rc)" "$(cat $tmp/o)" "$(cat $tmp/e)"

# ---- world-size invariance: PowerSGD r2 on R x S == psgd-train's on one rank ----
# SGD with momentum (AdamW's m / sqrt(v) magnifies rounding where v is tiny: 20 such steps on
# 2 x 2 differ from one rank by 1.5e-6 in one element of w2). Measured with SGD: every R x S
# within rtol 1e-6 at atol 1e-6 after 20 steps (8 steps of --buckets auto and of micro-batches
# likewise); $same_run leaves a factor 1000.
run $psgd $common $sgd $psgd2 --steps 20 --save ref.h5
[ $rc = 0 ] || bad "psgd-train reference (exit $rc)" "$(cat $tmp/e)"
# Also: a bucket per parameter; the automatic plan (the compressor rebuilt for it after two
# steps, its state carried over); micro-batches with one reduce-scatter a step, no overlap.
for c in "2|2" "4|2" "4|4" "4|2 --buckets param" "4|2 --buckets auto" "4|2 --micro-batch 1 --keep-unsharded-grad --no-overlap"; do
  n=${c%%|*} r=${c#*|}
  rm -rf w.ckpt; run $mpiexec -n $n $fsdp $common $sgd $exact $psgd2 --steps 20 --replicate $r --save w.ckpt
  [ $rc = 0 ] || { bad "PowerSGD on $n ranks --replicate $r (exit $rc)" "$(cat $tmp/e)"; continue; }
  run $si diff ref.h5 w.ckpt model/ $same_run
  [ $rc = 0 ] && ok "PowerSGD r2 on $n ranks --replicate $r == psgd-train on 1 rank" || bad "PowerSGD on $n ranks --replicate $r differs" "$(cat $tmp/o)"
done
# Uneven shards: the mlp's [10, 64] output layer over 6 shard ranks (12 ranks, 2 groups) is
# rows 2, 2, 2, 2, 2 and none (padded), compressed whole all the same (measured: rtol 3.5e-6).
mlp="--model mlp-small --global-batch 24 --lr 0.1 --optimizer sgd --momentum 0.9 --log-level warn --eval-every 0 --steps 6 $psgd2"
run $psgd $mlp --save mref.h5
rm -rf m.ckpt; run $mpiexec -n 12 $fsdp $mlp $exact --replicate 2 --save m.ckpt
[ $rc = 0 ] && run $si diff mref.h5 m.ckpt model/ $same_run
[ $rc = 0 ] && ok "mlp on 12 ranks --replicate 2 (a shard without rows) == psgd-train on 1 rank" || bad "mlp on 2 x 6 (exit $rc)" "$(cat $tmp/o)" "$(cat $tmp/e)"
# bf16 P and Q on the replica hop: the run trains as f32's does (within 2% of its loss).
run $mpiexec -n 4 $fsdp $common $psgd2 --steps 40 --replicate 2 --comm-dtype bf16 --metrics bf.jsonl
rc1=$rc; run $mpiexec -n 4 $fsdp $common $psgd2 --steps 40 --replicate 2 --metrics f.jsonl
[ $rc = 0 ] && [ $rc1 = 0 ] && python3 - bf.jsonl f.jsonl <<'PY' && ok "--comm-dtype bf16: loss within 2% of f32's" || bad "bf16 P and Q"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(f)] for f in sys.argv[1:3])
print(a[-1], b[-1]); assert abs(a[-1] / b[-1] - 1) < 0.02
PY

# ---- resume: bit for bit on the same R x S; the same run on another ----
# The save takes the error buffers' mean over the replicas (in place: PowerSGD's later steps
# depend on them only through it), so the uninterrupted run checkpoints at step 6 as well.
f="$fsdp $common $exact $psgd2 --steps 12"
rm -rf cka cks a.ckpt b.ckpt a.jsonl b.jsonl
run $mpiexec -n 4 $f --replicate 2 --checkpoint-dir cka --checkpoint-every 6 --save a.ckpt --metrics a.jsonl
run $mpiexec -n 4 $f --replicate 2 --stop-at 6 --checkpoint-dir cks --metrics b.jsonl
if [ $rc = 0 ] && [ -f cks/step-00000006/index.h5 ]; then
  run $mpiexec -n 4 $f --replicate 2 --resume cks --save b.ckpt --metrics b.jsonl
  [ $rc = 0 ] && run $si diff a.ckpt b.ckpt
  [ $rc = 0 ] && cmp -s <(cut -d, -f1-3 a.jsonl) <(cut -d, -f1-3 b.jsonl) && ok "PowerSGD on 2 x 2: resume is exact (compressor state included)" ||
    bad "resume differs" "$(cat $tmp/o)" "$(cat $tmp/e)"
  run $si ls cks/step-00000006
  grep -q "^compress/error/layers.0.feed_forward.w1.weight .*2 shards" $tmp/o && grep -q "^compress/q/" $tmp/o &&
    ok "the checkpoint keeps Q and the error buffers (sharded by rows)" || bad "compressor state in the checkpoint" "$(cat $tmp/o)"
  for c in "2|2" "4|4" "8|2"; do
    n=${c%%|*} r=${c#*|}
    rm -rf o.ckpt; run $mpiexec -n $n $f --replicate $r --resume cks --save o.ckpt
    [ $rc = 0 ] && [ ! -s $tmp/e ] && run $si diff a.ckpt o.ckpt model/ optim/ $same_run
    [ $rc = 0 ] && ok "2 x 2's PowerSGD state resumed on $n ranks --replicate $r continues the run, no warning" ||
      bad "resume on $n ranks --replicate $r (exit $rc)" "$(cat $tmp/o)" "$(cat $tmp/e)"
  done
else bad "stop at 6 (exit $rc)" "$(cat $tmp/e)"; fi
# randomk's later steps too depend on its error buffers only through their mean: bit for bit.
rk="$fsdp $common --compressor randomk --compress-ratio 0.1 --start-iter 1 --steps 6 --replicate 2"
rm -rf rka rkb ra.ckpt rb.ckpt
run $mpiexec -n 4 $rk --checkpoint-dir rka --checkpoint-every 3 --save ra.ckpt
run $mpiexec -n 4 $rk --stop-at 3 --checkpoint-dir rkb
[ $rc = 0 ] && run $mpiexec -n 4 $rk --resume rkb --save rb.ckpt
[ $rc = 0 ] && [ ! -s $tmp/e ] && run $si diff ra.ckpt rb.ckpt
[ $rc = 0 ] && ok "randomk on 2 x 2: resume is exact, no warning" || bad "randomk resume (exit $rc)" "$(cat $tmp/o)" "$(cat $tmp/e)"
# topk compresses each replica's own M: its resume from their mean is approximate, and says so.
rm -rf ckt; run $mpiexec -n 4 $fsdp $common --compressor topk --start-iter 1 --steps 6 --replicate 2 --stop-at 3 --checkpoint-dir ckt
[ $rc = 0 ] && run $mpiexec -n 4 $fsdp $common --compressor topk --start-iter 1 --steps 6 --replicate 2 --resume ckt
[ $rc = 0 ] && grep -q "mean over the replica groups, which does not continue it exactly" $tmp/e &&
  ok "topk: resume warns that the mean over replicas is approximate" || bad "topk resume (exit $rc)" "$(cat $tmp/e)"

# ---- bytes on the replica hop ----
for k in none powersgd topk randomk signum; do
  run $mpiexec -n 4 $fsdp $common --steps 3 --replicate 2 --compressor $k --start-iter 2 --metrics bytes-$k.jsonl
  [ $rc = 0 ] || bad "--compressor $k (exit $rc)" "$(cat $tmp/e)"
done
python3 - <<'PY' && ok "replica hop: all_reduce_bytes is what each compressor sends, comm_bytes_uncompressed today's HSDP's" || bad "bytes"
import json
rows = {k: [json.loads(l) for l in open(f"bytes-{k}.jsonl")] for k in ("none", "powersgd", "topk", "randomk", "signum")}
plain = rows["none"][-1]["all_reduce_bytes"]
assert "compression_ratio" not in rows["none"][-1] and "comm_bytes_uncompressed" not in rows["none"][-1]
for k in ("powersgd", "topk", "randomk", "signum"):
    before, last = rows[k][1], rows[k][-1]  # steps 1 (plain, before --start-iter 2) and 2
    assert before["all_reduce_bytes"] == last["comm_bytes_uncompressed"] == plain, (k, before, last, plain)
    assert before["compression_ratio"] == 1, (k, before)
    assert last["compression_ratio"] > 2 and abs(last["all_reduce_bytes"] * last["compression_ratio"] - plain) < 1e-6 * plain, (k, last)
    assert last["comm_bytes"] == last["all_gather_bytes"] + last["reduce_scatter_bytes"] + last["all_reduce_bytes"], (k, last)
    print(k, last["all_reduce_bytes"], f'{last["compression_ratio"]:.1f}x')
PY

# ---- bad input: exit 2 on every rank, one line naming the problem ----
expect2 "a compressor without --replicate" "--compressor powersgd .*--replicate > 1" $mpiexec -n 2 $fsdp $common --steps 2 --compressor powersgd
expect2 "a compressor with --replicate 1 on one rank" "--compressor topk .*--replicate > 1" $fsdp $common --steps 2 --compressor topk --replicate 1
expect2 "--rank 0" "--rank" $mpiexec -n 2 $fsdp $common --steps 2 --replicate 2 --compressor powersgd --rank 0
expect2 "--compress-ratio above 1" "--compress-ratio" $mpiexec -n 2 $fsdp $common --steps 2 --replicate 2 --compressor topk --compress-ratio 2
# A checkpoint without compressor state does not resume a compressed run.
rm -rf ckn; run $mpiexec -n 2 $fsdp $common --steps 4 --replicate 2 --stop-at 2 --checkpoint-dir ckn
expect2 "resuming an uncompressed run with a compressor" "--compressor powersgd differs from the checkpoint" $mpiexec -n 2 $fsdp $common --steps 4 --replicate 2 --compressor powersgd --resume ckn
finish
