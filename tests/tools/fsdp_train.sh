#!/usr/bin/env bash
# fsdp-train end to end: learning; with f32 gathers and reductions the same run as psgd-train
# --compressor none on 1, 2 and 4 ranks for every bucket plan, reshard policy, prefetch depth,
# overlap off, HSDP, micro-batches and activation checkpointing; exact resume; resume on another
# world size or --replicate; checkpoints that psgd-train reads and the other way round; bf16
# gathers within 2% of f32; --print-plan and plan files; bytes and memory per rank; Shampoo's
# whole-parameter blocks over the shards (the run of shampoo-train, resumed on any shard count);
# bad input.
#   fsdp_train.sh MPIEXEC FSDP_TRAIN PSGD_TRAIN SHARD_INSPECT SHAMPOO_TRAIN
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 fsdp=$2 psgd=$3 si=$4 shampoo=$5
common="$small --global-batch 8 --lr 1e-2 --warmup 2 --eval-every 0 --log-level warn"
exact="--param-dtype f32 --reduce-dtype f32"

# ---- learning on 2 ranks, bf16 gathers (the defaults) ----
run $mpiexec -n 2 $fsdp $common --steps 120 --metrics learn.jsonl
if [ $rc = 0 ]; then
  python3 - learn.jsonl <<'PY' && ok "fsdp-train learns on 2 ranks" || bad "learning" "$(cat $tmp/e)" "$(tail -3 learn.jsonl)"
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
first, last = rows[0]["loss"], rows[-1]
print(f"loss {first:.3f} -> {last['loss']:.3f}")
assert abs(first - math.log(64)) < 0.3 and last["loss"] < 3.0
for k in ("all_gather_bytes", "reduce_scatter_bytes", "exposed_comm_ms", "peak_mem_bytes", "persistent_mem_bytes",
          "shard_bytes", "arena_bytes", "comm_bytes", "optim_state_bytes"):
    assert k in last, k
PY
else bad "learning run (exit $rc)" "$(cat $tmp/e)"; fi

# ---- the same run as psgd-train --compressor none (f32 on the wire) ----
for opt in "--optimizer adamw" "--optimizer sgd --momentum 0.9"; do
  tag=${opt##* }
  run $psgd $common $opt --steps 20 --compressor none --save ref.h5
  [ $rc = 0 ] || bad "psgd-train reference $opt (exit $rc)" "$(cat $tmp/e)"
  # the negative control of $same_run (train_lib.sh): lr 1% larger is another run
  run $psgd $common $opt --lr 1.01e-2 --steps 20 --compressor none --save ref-lr.h5
  [ $rc = 0 ] && run $si diff ref-lr.h5 ref.h5 model/ optim/ $same_run
  [ $rc = 1 ] && ok "$tag: lr 1% larger differs beyond \$same_run ($same_run)" || bad "$tag: lr 1% larger passes $same_run (exit $rc)" "$(cat $tmp/o)"
  cfgs=("1|"
        "2|"
        "4|"
        "4|--buckets param"
        "4|--buckets 2 --prefetch 2"
        "2|--buckets 100"
        "4|--reshard-after-forward always --prefetch 0"
        "2|--reshard-after-forward never"
        "4|--no-overlap"
        "4|--replicate 2"
        "4|--activation-checkpointing selective --buckets param"
        "2|--micro-batch 2 --activation-checkpointing"
        "4|--micro-batch 1 --keep-unsharded-grad --buckets 2")
  [ "$tag" = 0.9 ] && cfgs=("1|" "4|" "4|--buckets param --replicate 2")
  for c in "${cfgs[@]}"; do
    n=${c%%|*} extra=${c#*|}
    run $mpiexec -n $n $fsdp $common $opt $exact --steps 20 $extra --save f.ckpt
    if [ $rc != 0 ]; then bad "$tag on $n ranks $extra (exit $rc)" "$(cat $tmp/e)"; continue; fi
    run $si diff ref.h5 f.ckpt model/ optim/ $same_run
    [ $rc = 0 ] && ok "$tag: $n ranks $extra == psgd-train" || bad "$tag: $n ranks $extra differs" "$(cat $tmp/o)"
    rm -rf f.ckpt
  done
done

# ---- the mlp: its layers are the blocks ----
mlp="--model mlp-small --global-batch 16 --lr 1e-2 --optimizer sgd --log-level warn --eval-every 10 --steps 20"
run $psgd $mlp --compressor none --save mref.h5
run $mpiexec -n 2 $fsdp $mlp $exact --save m.ckpt
[ $rc = 0 ] && run $si diff mref.h5 m.ckpt model/ optim/ $same_run
[ $rc = 0 ] && ok "mlp on 2 ranks == psgd-train" || bad "mlp differs (exit $rc)" "$(cat $tmp/o)" "$(cat $tmp/e)"

# ---- a resnet: stem, residual blocks and head are the blocks; with --sync-batchnorm the batch
# statistics are the whole batch's, so 2 sharded ranks train as psgd-train on 1 (running
# statistics included) ----
rn="--model resnet-8 --input-shape 3,12,12 --global-batch 8 --lr 0.05 --optimizer sgd --nesterov --log-level warn --steps 4 --sync-batchnorm"
run $psgd $rn --compressor none --save rref.h5
run $mpiexec -n 2 $fsdp $rn $exact --activation-checkpointing selective --save r.ckpt
[ $rc = 0 ] && run $si diff rref.h5 r.ckpt model/ optim/ $same_run
[ $rc = 0 ] && ok "resnet with --sync-batchnorm on 2 sharded ranks == psgd-train on 1" || bad "resnet differs (exit $rc)" "$(cat $tmp/o)" "$(cat $tmp/e)"

# ---- resume: exact on the same world, continues on another ----
run $mpiexec -n 2 $fsdp $common $exact --steps 20 --save full.ckpt --metrics a.jsonl
rm -rf ck; run $mpiexec -n 2 $fsdp $common $exact --steps 20 --stop-at 10 --checkpoint-dir ck --metrics b.jsonl
if [ $rc = 0 ] && [ -f ck/step-00000010/index.h5 ]; then
  run $mpiexec -n 2 $fsdp $common $exact --steps 20 --resume ck --save resumed.ckpt --metrics b.jsonl
  run $si diff full.ckpt resumed.ckpt
  [ $rc = 0 ] && cmp -s <(cut -d, -f1-3 a.jsonl) <(cut -d, -f1-3 b.jsonl) && ok "resume is exact" ||
    bad "resume differs" "$(cat $tmp/o)"
  for c in "4|" "1|" "4|--replicate 2"; do
    n=${c%%|*} extra=${c#*|}
    rm -rf other.ckpt; run $mpiexec -n $n $fsdp $common $exact --steps 20 --resume ck $extra --save other.ckpt
    [ $rc = 0 ] || { bad "resume on $n ranks $extra (exit $rc)" "$(cat $tmp/e)"; continue; }
    run $si diff full.ckpt other.ckpt model/ optim/ $same_run
    [ $rc = 0 ] && ok "resume of a 2-rank state on $n ranks $extra continues the run" || bad "resume on $n $extra" "$(cat $tmp/o)"
  done
else bad "stop at 10 (exit $rc)" "$(cat $tmp/e)"; fi

# ---- checkpoints across programs ----
run $si consolidate full.ckpt -o consolidated.h5
[ $rc = 0 ] || bad "consolidate (exit $rc)" "$(cat $tmp/e)"
run $psgd $common --steps 2 --init-from consolidated.h5
[ $rc = 0 ] && ok "psgd-train --init-from a consolidated fsdp-train checkpoint" || bad "psgd init-from consolidated" "$(cat $tmp/e)"
run $psgd $common --steps 2 --init-from full.ckpt
[ $rc = 0 ] && ok "psgd-train --init-from a sharded state" || bad "psgd init-from sharded" "$(cat $tmp/e)"
run $psgd $common --steps 10 --save p10.h5
run $mpiexec -n 4 $fsdp $common $exact --steps 1 --lr 1e-30 --warmup 0 --optimizer sgd --momentum 0 --init-from p10.h5 --save i.ckpt
run $si diff p10.h5 i.ckpt model/ --rtol 1e-6
[ $rc = 0 ] && ok "fsdp-train --init-from a psgd-train checkpoint on 4 ranks" || bad "fsdp init-from psgd" "$(cat $tmp/o)" "$(cat $tmp/e)"

# ---- bf16 gathers: the loss curve within 2% of f32's ----
run $mpiexec -n 2 $fsdp $common --steps 300 --metrics bf.jsonl
run2=$rc; run $mpiexec -n 2 $fsdp $common $exact --steps 300 --metrics f32.jsonl
if [ $rc = 0 ] && [ $run2 = 0 ]; then
  python3 - bf.jsonl f32.jsonl <<'PY' && ok "bf16 all-gather: final loss within 2% of f32" || bad "bf16 vs f32"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(f)] for f in sys.argv[1:3])
tail = lambda x: sum(x[-10:]) / 10
print(f"bf16 {tail(a):.4f} f32 {tail(b):.4f} ({abs(tail(a) / tail(b) - 1) * 100:.2f}%)")
assert abs(tail(a) / tail(b) - 1) < 0.02
PY
else bad "bf16/f32 runs"; fi

# ---- --precision bf16: the layers compute with the gathered bf16 as it came (--param-dtype bf16)
# or rounded from the f32 gather: either way psgd-train's bf16 run, bit for bit on one rank
# (--clip 0: the clip's norm sums in another order on the shards), losses within 1e-3 on 2
# ranks; and the learning run above in bf16 ----
bfc="--precision bf16 --clip 0 --steps 20 --metrics"
run $psgd $common $bfc pb.jsonl --compressor none --save pb.h5
for pd in bf16 f32; do
  run $fsdp $common $bfc fb.jsonl --param-dtype $pd --reduce-dtype f32 --save fb.ckpt
  [ $rc = 0 ] && run $si diff pb.h5 fb.ckpt model/ optim/ --rtol 0 --atol 0
  [ $rc = 0 ] && ok "--precision bf16, --param-dtype $pd, 1 rank == psgd-train --precision bf16, exactly" \
    || bad "--precision bf16 --param-dtype $pd differs (exit $rc)" "$(tail -3 $tmp/o)" "$(cat $tmp/e)"
  rm -rf fb.ckpt fb.jsonl
done
run $mpiexec -n 2 $fsdp $common $bfc fb2.jsonl
[ $rc = 0 ] && python3 - pb.jsonl fb2.jsonl <<'PY' && ok "--precision bf16 on 2 ranks: losses within 1e-3 of psgd-train's" \
  || bad "--precision bf16 on 2 ranks" "$(cat $tmp/e)"
import json, sys
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
assert b[0]["precision"] == "bf16", b[0].get("precision")
d = [abs(x["loss"] - y["loss"]) / x["loss"] for x, y in zip(a, b)]
assert len(d) == 20 and max(d) < 1e-3, d
PY

# ---- bytes and memory per rank ----
for n in 1 4; do run $mpiexec -n $n $fsdp $common $exact --steps 2 --reshard-after-forward never --metrics bytes$n.jsonl; done
python3 - bytes1.jsonl bytes4.jsonl <<'PY' && ok "bytes per step and shard memory per rank" || bad "bytes and memory"
import json, sys
one, four = (json.loads(open(f).read().splitlines()[-1]) for f in sys.argv[1:3])
# Every row count of this model divides by 4 (no padding): each parameter gathered once (never
# resharded) and reduce-scattered once, in f32; one rank's shards are the values and gradients.
params_bytes = one["shard_bytes"] / 2
assert four["all_gather_bytes"] == four["reduce_scatter_bytes"] == params_bytes, (four, params_bytes)
assert 3.9 < one["shard_bytes"] / four["shard_bytes"] < 4.1, (one["shard_bytes"], four["shard_bytes"])
PY

# ---- --keep-unsharded-grad: one reduce-scatter a step instead of one a micro-batch ----
for k in "" --keep-unsharded-grad; do
  run $mpiexec -n 2 $fsdp $common $exact --steps 2 --micro-batch 1 $k --metrics keep$k.jsonl
done
python3 - keep.jsonl keep--keep-unsharded-grad.jsonl <<'PY' && ok "--keep-unsharded-grad: a quarter of the reduce-scatter bytes with 4 micro-batches, the whole gradient in the arenas" || bad "--keep-unsharded-grad bytes"
import json, sys
per, kept = (json.loads(open(f).read().splitlines()[-1]) for f in sys.argv[1:3])
assert per["reduce_scatter_bytes"] == 4 * kept["reduce_scatter_bytes"], (per, kept)
# The whole padded gradient (2 ranks x one rank's shard values: shard_bytes) joins the arenas and
# the gradient slot (one block, under half of this model) leaves them.
assert kept["arena_bytes"] - per["arena_bytes"] > 0.5 * per["shard_bytes"], (per, kept)
PY

# ---- plans: --print-plan, a plan file, auto ----
run $mpiexec -n 2 $fsdp $common --steps 5 --buckets 2 --print-plan
if [ $rc = 0 ] && python3 -c "
import json,sys; j=json.load(open('$tmp/o')); assert len(j['buckets'])==2 and 'exposed_comm_ms' in j['predicted'], j" 2>/dev/null
then ok "--print-plan: the plan and its prediction as JSON"; cp $tmp/o plan.json
else bad "--print-plan (exit $rc)" "$(cat $tmp/o)" "$(cat $tmp/e)"; fi
run $mpiexec -n 2 $fsdp $common $exact --steps 6 --buckets plan.json --save a.ckpt
run $mpiexec -n 2 $fsdp $common $exact --steps 6 --buckets 2 --save b.ckpt
run $si diff a.ckpt b.ckpt
[ $rc = 0 ] && ok "a saved plan gives the run of the plan it saved" || bad "plan file run" "$(cat $tmp/o)"
run $mpiexec -n 2 $fsdp $common $exact --steps 6 --buckets auto --save auto.ckpt
run $si diff b.ckpt auto.ckpt model/ $same_run
[ $rc = 0 ] && ok "--buckets auto trains the same model" || bad "auto plan" "$(cat $tmp/o)" "$(cat $tmp/e)"

# ---- Shampoo on shards: the whole parameters' blocks, gathered over the shard group ----
# Blocks of at most 24 rows and columns cross the shard boundaries of this model on 2 and 4
# ranks ([64, 32] in shards of 16 or 32 rows), and every rank owns some of every shard's: the
# same run as shampoo-train, for each preconditioner (epsilon 1e-6: roots of nearly singular
# factors amplify the last bits in which the reductions differ; atol 1e-5 for that).
# Eigenvalue-corrected's bases are arbitrary within a factor's degenerate eigenspaces (the
# embeddings' and norms' rank-deficient factors): those parameters go diagonal, and its
# direction amplifies rounding more (atol 1e-4; the optimizer alone is bit-identical on any
# number of ranks: tests/mpi/test_shampoo_mpi.cpp).
close="--rtol 1e-3 --atol 1e-5"
for pre in "root" "eigenvalue-corrected --grafting none --ec-epsilon 1e-8 --diagonal-params norm,embeddings" "spectral"; do
  sh="--optimizer shampoo --preconditioner $pre --max-preconditioner-dim 24 --shampoo-epsilon 1e-6"
  tol=$close
  case $pre in spectral) ;; eigen*) tol="--rtol 1e-3 --atol 1e-4"; sh="$sh --precondition-frequency 5" ;; *) sh="$sh --precondition-frequency 5" ;; esac
  run $shampoo $common $sh --steps 20 --save sref.h5
  [ $rc = 0 ] || bad "shampoo-train reference, ${pre%% *} (exit $rc)" "$(cat $tmp/e)"
  cases=("2|")
  [ "$pre" = root ] && cases=("1|" "2|" "4|" "4|--replicate 2 --buckets param" "4|--trainers-per-group 2 --direction-dtype f32")
  for c in "${cases[@]}"; do
    n=${c%%|*} extra=${c#*|}
    rm -rf s.ckpt; run $mpiexec -n $n $fsdp $common $sh $exact --steps 20 $extra --save s.ckpt
    [ $rc = 0 ] || { bad "shampoo ${pre%% *} on $n ranks $extra (exit $rc)" "$(cat $tmp/e)"; continue; }
    run $si diff sref.h5 s.ckpt model/ $tol
    [ $rc = 0 ] && ok "shampoo ${pre%% *}: $n ranks $extra == shampoo-train" || bad "shampoo ${pre%% *}: $n ranks $extra differs" "$(cat $tmp/o)"
  done
done
# Resume: exact on the same ranks; on 4 and 1 ranks the run the 2 ranks would have made (the
# blocks are named by parameter and block, the same on any shard count; dtk-checkpoint(5)).
sh="--optimizer shampoo --precondition-frequency 5 --max-preconditioner-dim 24 --shampoo-epsilon 1e-6"
run $mpiexec -n 2 $fsdp $common $sh --steps 20 --save sfull.ckpt --metrics sa.jsonl
rm -rf sck; run $mpiexec -n 2 $fsdp $common $sh --steps 20 --stop-at 10 --checkpoint-dir sck --metrics sb.jsonl
run $mpiexec -n 2 $fsdp $common $sh --steps 20 --resume sck --save sres.ckpt --metrics sb.jsonl
run $si diff sfull.ckpt sres.ckpt
[ $rc = 0 ] && cmp -s <(cut -d, -f1-3 sa.jsonl) <(cut -d, -f1-3 sb.jsonl) && ok "shampoo on shards: resume is exact" ||
  bad "shampoo resume differs" "$(cat $tmp/o)"
run $si ls sck/step-00000010
grep -q "^optim/shampoo/layers.0.feed_forward.w1.weight/block0/factor0 .*rank [01] " $tmp/o && ! grep -q "/rows[0-9]" $tmp/o &&
  ok "shampoo blocks named by parameter and block, each in its owner's file" || bad "shampoo state of shards" "$(cat $tmp/o)"
for n in 4 1; do
  run $mpiexec -n $n $fsdp $common $sh --steps 20 --resume sck --save s$n.ckpt
  [ $rc = 0 ] && [ ! -s $tmp/e ] && run $si diff sfull.ckpt s$n.ckpt model/ $close
  [ $rc = 0 ] && ok "shampoo state of 2 shard ranks resumed on $n: the 2 ranks' run, no warning" ||
    bad "shampoo resume on $n ranks (exit $rc)" "$(cat $tmp/e)" "$(cat $tmp/o)"
done
run $si consolidate sfull.ckpt -o sfull.h5
[ $rc = 0 ] && run $psgd $common --steps 2 --init-from sfull.h5
[ $rc = 0 ] && ok "a consolidated shampoo state initialises psgd-train" || bad "shampoo consolidate/init-from" "$(cat $tmp/e)"
run $shampoo $common $sh --steps 22 --resume sfull.h5 --save sfull22.h5
[ $rc = 0 ] && ok "shampoo-train resumes fsdp-train's consolidated Shampoo state" || bad "shampoo-train --resume consolidated (exit $rc)" "$(cat $tmp/e)"

# ---- Dion on shards: only the rank-r factors cross the shard group and the replica groups ----
# Its matrices stay on their shards (P's rows gathered, M^T Q and M^T P summed over the shard
# group; across HSDP's replica groups M Q and M^T P averaged instead of the gradients): the
# run of shampoo-train on one rank up to the order of the sums, on any R x S.
dion="--optimizer shampoo --preconditioner dion --diagonal-params embeddings,output"
# (--clip leaves Dion's matrices out with factors, not with gradients: a reference for each.)
run $shampoo $common $dion --steps 20 --save dref.h5
[ $rc = 0 ] && run $shampoo $common $dion --dion-sync gradients --steps 20 --save dref-gradients.h5
[ $rc = 0 ] || bad "shampoo-train dion reference (exit $rc)" "$(cat $tmp/e)"
for c in "1|" "2|" "4|" "2|--replicate 2" "4|--replicate 2" "4|--dion-sync gradients --replicate 2"; do
  n=${c%%|*} extra=${c#*|} ref=dref.h5
  [[ $extra == *gradients* ]] && ref=dref-gradients.h5
  rm -rf d.ckpt d.jsonl; run $mpiexec -n $n $fsdp $common $dion $exact --steps 20 $extra --save d.ckpt --metrics d.jsonl
  [ $rc = 0 ] || { bad "dion on $n ranks $extra (exit $rc)" "$(cat $tmp/e)"; continue; }
  run $si diff $ref d.ckpt model/ --rtol 0 --atol 2e-6
  [ $rc = 0 ] && ok "dion: $n ranks $extra == shampoo-train within 2e-6" || bad "dion: $n ranks $extra differs" "$(cat $tmp/o)"
done
# HSDP, factors: the replica hop carries the others' gradients only (fewer bytes than gradients').
python3 - d.jsonl <<'PY' || bad "dion's HSDP bytes"
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
assert r["all_reduce_bytes"] > 0 and r["optim_comm_bytes"] > 0, r
PY
# Resume on HSDP 2 x 2: every replica's buffer becomes the replicas' mean at a save, so the run
# that checkpoints at step 10 and its resume continue alike, bit for bit; on 1 rank within rounding.
rm -rf dck; run $mpiexec -n 4 $fsdp $common $dion $exact --replicate 2 --steps 20 --checkpoint-every 10 --checkpoint-dir dck --save dfull.ckpt
rm -rf dck2; run $mpiexec -n 4 $fsdp $common $dion $exact --replicate 2 --steps 20 --stop-at 10 --checkpoint-dir dck2
run $mpiexec -n 4 $fsdp $common $dion $exact --replicate 2 --steps 20 --resume dck2 --save dres.ckpt
run $si diff dfull.ckpt dres.ckpt
[ $rc = 0 ] && ok "dion on HSDP 2 x 2: resume is exact" || bad "dion HSDP resume differs" "$(cat $tmp/o)" "$(cat $tmp/e)"
run $fsdp $common $dion $exact --steps 20 --resume dck2 --save dres1.ckpt
[ $rc = 0 ] && [ ! -s $tmp/e ] && run $si diff dfull.ckpt dres1.ckpt model/ --rtol 0 --atol 2e-6
[ $rc = 0 ] && ok "dion: HSDP 2 x 2 checkpoint resumes on 1 rank, no warning" || bad "dion resume on 1 rank" "$(cat $tmp/o)" "$(cat $tmp/e)"
expect2 "a compressor with dion's factors" "does not fit \-\-preconditioner dion" \
  $mpiexec -n 2 $fsdp $common $dion --replicate 2 --compressor powersgd --steps 2

# ---- bad input: exit 2 on every rank, one line naming the problem ----
expect2 "--replicate that does not divide" "does not divide" $mpiexec -n 4 $fsdp $common --steps 2 --replicate 3
expect2 "--buckets nonsense" "--buckets" $mpiexec -n 2 $fsdp $common --steps 2 --buckets nonsense
expect2 "--buckets 0" "positive" $fsdp $common --steps 2 --buckets 0
echo '{"buckets": [{"blocks": [0, 1]}]}' > short.json
expect2 "a plan that leaves blocks out" "cover" $mpiexec -n 2 $fsdp $common --steps 2 --buckets short.json
echo '{"buckets": [' > broken.json
expect2 "a plan that is not JSON" "not JSON" $fsdp $common --steps 2 --buckets broken.json
expect2 "--bucket-memory without auto" "auto" $fsdp $common --steps 2 --bucket-memory 4M
# --print-plan trains nothing: a job's checkpoint options (its --config file's) are idle, not errors.
run $fsdp $common --steps 2 --print-plan --save x.ckpt --checkpoint-dir xck --checkpoint-every 1
[ $rc = 0 ] && jq -e .buckets "$tmp/o" >/dev/null && [ ! -e x.ckpt ] && [ ! -e xck ] \
  && ok "--print-plan with checkpoint options prints the plan and writes nothing" || bad "--print-plan --save (exit $rc)" "$(cat "$tmp/e")"
run $fsdp $common --steps 1 --print-plan
[ $rc = 0 ] && jq -e .buckets "$tmp/o" >/dev/null && ok "--print-plan of a one-step run still times two steps and prints the plan" \
  || bad "--print-plan --steps 1 (exit $rc)" "$(cat "$tmp/o" "$tmp/e")"
expect2 "--bucket-size is not an fsdp option" "bucket-size" $fsdp $common --steps 2 --bucket-size 4M
expect2 "--trainers-per-group that does not divide the shard group" "does not divide the 2 ranks that share" \
  $mpiexec -n 4 $fsdp $common --steps 2 --optimizer shampoo --replicate 2 --trainers-per-group 4
expect2 "a bad Shampoo setting" "grafting" $fsdp $common --steps 2 --optimizer shampoo --grafting nonsense
finish
