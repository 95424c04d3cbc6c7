#!/usr/bin/env bash
# psgd-train end to end: learning on the embedded synthetic data, exact resume (llama and mlp),
# world-size invariance of plain and PowerSGD training, compressor state across resume, bytes
# per step, and bad input that exits 2 on every rank without touching existing files.
#   psgd_train.sh MPIEXEC PSGD_TRAIN SHARD_INSPECT
set -u
. "$(dirname "$0")/../common/train_lib.sh"
mpiexec=$1 psgd=$2 si=$3
common="$small --global-batch 8 --lr 1e-2 --warmup 2 --eval-every 0 --log-level warn"

# ---- learning: the loss falls from ln(vocab) toward the chain's entropy rate ----
run $psgd $common --steps 150 --lr 1e-2 --metrics learn.jsonl
if [ $rc = 0 ]; then
  python3 - learn.jsonl <<'PY' && ok "llama-tiny learns the synthetic language" || bad "learning" "$(cat $tmp/e)" "$(tail -3 learn.jsonl)"
import json, math, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
first, last = rows[0]["loss"], rows[-1]
print(f"loss {first:.3f} -> {last['loss']:.3f}, val {last['val_loss']:.3f}, ln V = {math.log(64):.3f}")
# Uniform guessing gives ln 64 = 4.16 and unigram statistics about ln(64) too (the chain is nearly
# uniform overall); only a model that learned the transitions gets below 3.
assert abs(first - math.log(64)) < 0.3 and last["loss"] < 3.0 and last["val_loss"] < 3.0
for k in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "step_time_ms", "peak_mem_bytes", "comm_bytes"):
    assert k in last, k
PY
else bad "learning run (exit $rc)" "$(cat $tmp/e)"; fi

# ---- a packed classification file of another input size (--input-dim) ----
datapack=$(dirname "$psgd")/../data-pack/data-pack
if $datapack synthetic --kind classes --input-dim 48 --samples 512 -o cls.h5 >/dev/null 2>&1; then
  run $psgd --model mlp-small --input-dim 48 --data cls.h5 --steps 3 --global-batch 16 --log-level warn
  [ $rc = 0 ] && ok "mlp on a packed file with --input-dim" || bad "mlp --input-dim (exit $rc)" "$(cat $tmp/e)"
  run $psgd --model mlp-small --data cls.h5 --steps 3
  [ $rc = 2 ] && grep -q "cls.h5" $tmp/e && ok "input size mismatch names the file" || bad "input mismatch (exit $rc)" "$(cat $tmp/e)"
  # Accuracy: a classifier's metrics carry accuracy and val_accuracy (correct counts over the
  # global batch, the same on 1 and 2 ranks at the first step), samples_per_s for tokens_per_s.
  for n in 1 2; do
    run $mpiexec -n $n $psgd --model mlp-small --input-dim 48 --data cls.h5 --val-data cls.h5 --steps 4 --eval-every 2 \
      --global-batch 16 --lr 1e-2 --log-level warn --metrics acc$n.jsonl
  done
  # --epochs: 512 samples / 16 = 32 steps an epoch; --decay-epochs 1.5: step 48.
  run $psgd --model mlp-small --input-dim 48 --data cls.h5 --epochs 2 --global-batch 16 --lr 0.01 --schedule step \
    --decay-epochs 1.5 --decay-factor 0.5 --log-level warn --metrics ep.jsonl
  python3 - ep.jsonl <<'PY' && ok "--epochs 2 is 64 steps, --decay-epochs 1.5 decays at step 48" || bad "--epochs (exit $rc)" "$(cat $tmp/e)"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert len(rows) == 64 and rows[-1]["step"] == 64, len(rows)
assert rows[47]["lr"] == 0.01 and rows[48]["lr"] == 0.005, (rows[47]["lr"], rows[48]["lr"])
PY
  run $psgd --model mlp-small --input-dim 48 --data cls.h5 --epochs 2 --steps 5
  [ $rc = 2 ] && grep -q "excludes" $tmp/e && ok "--epochs and --steps exclude each other" || bad "--epochs with --steps (exit $rc)" "$(cat $tmp/e)"
  python3 - acc1.jsonl acc2.jsonl <<'PY' && ok "accuracy and val_accuracy reported, equal on 1 and 2 ranks" || bad "accuracy" "$(cat acc1.jsonl acc2.jsonl)"
import json, sys
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:])
for r in a + b:
    assert 0 <= r["accuracy"] <= 1 and abs(r["accuracy"] * 16 - round(r["accuracy"] * 16)) < 1e-9, r
    assert "samples_per_s" in r and "tokens_per_s" not in r
assert a[0]["accuracy"] == b[0]["accuracy"]
assert "val_accuracy" in a[1] and "val_accuracy" not in a[0] and abs(a[1]["val_accuracy"] - b[1]["val_accuracy"]) < 0.2
PY
else bad "data-pack synthetic"; fi

# ---- resume: 20 steps == 10 steps + resume + 10 steps, bit for bit ----
resume_check() {
  local name=$1; shift
  rm -f a.jsonl b.jsonl
  run $psgd "$@" --steps 20 --save full.h5 --metrics a.jsonl || true
  [ $rc = 0 ] || { bad "$name: uninterrupted run (exit $rc)" "$(cat $tmp/e)"; return; }
  rm -rf ck; run $psgd "$@" --steps 20 --stop-at 10 --checkpoint-dir ck --metrics b.jsonl
  [ $rc = 0 ] && [ -f ck/step-00000010.h5 ] || { bad "$name: first half (exit $rc)" "$(cat $tmp/e)"; return; }
  run $psgd "$@" --steps 20 --resume ck --save resumed.h5 --metrics b.jsonl
  [ $rc = 0 ] || { bad "$name: resumed half (exit $rc)" "$(cat $tmp/e)"; return; }
  run $si diff full.h5 resumed.h5
  if [ $rc = 0 ] && cmp -s <(cut -d, -f1-3 a.jsonl) <(cut -d, -f1-3 b.jsonl); then ok "$name: resume is exact"
  else bad "$name: resume differs (diff exit $rc)" "$(cat $tmp/o)" "$(diff <(cut -d, -f1-3 a.jsonl) <(cut -d, -f1-3 b.jsonl))"; fi
}
# ---- real images: Fashion-MNIST from Debian's dataset-fashion-mnist (scripts/install-deps) ----
fm=/usr/share/datasets/fashion-mnist
if [ -f $fm/train-images-idx3-ubyte.gz ]; then
  $datapack mnist $fm/train-images-idx3-ubyte.gz $fm/train-labels-idx1-ubyte.gz -o fm-train.h5 >/dev/null 2>&1 &&
    $datapack mnist $fm/t10k-images-idx3-ubyte.gz $fm/t10k-labels-idx1-ubyte.gz -o fm-test.h5 >/dev/null 2>&1 ||
    bad "data-pack mnist of Fashion-MNIST"
  run $mpiexec -n 2 $psgd --model mlp-mnist --data fm-train.h5 --val-data fm-test.h5 --global-batch 128 --steps 200 \
    --eval-every 0 --eval-batches 78 --optimizer sgd --lr 0.1 --momentum 0.9 --nesterov --warmup 20 \
    --schedule step --decay-steps 150 --log-level warn --metrics fm.jsonl
  python3 - fm.jsonl <<'PY' && ok "Fashion-MNIST: mlp-mnist passes 75% test accuracy" || bad "Fashion-MNIST (exit $rc)" "$(cat $tmp/e)" "$(tail -1 fm.jsonl)"
import json, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
print(f"test accuracy {r['val_accuracy']:.4f}")
assert r["step"] == 200 and r["val_accuracy"] > 0.75, r
PY
  # --augment crop-flip: the same draws on 1 and 2 ranks (the same losses up to summation
  # order) and across a resume (bit for bit).
  aug="--model mlp-mnist --data fm-train.h5 --global-batch 32 --steps 6 --lr 0.05 --augment crop-flip --log-level warn"
  run $psgd $aug --metrics aug1.jsonl --save aug-full.h5
  run $mpiexec -n 2 $psgd $aug --metrics aug2.jsonl
  run $psgd $aug --metrics plain.jsonl --augment none
  python3 - aug1.jsonl aug2.jsonl plain.jsonl <<'PY' && ok "--augment: the same losses on 1 and 2 ranks, not those without it" || bad "--augment world size" "$(cat aug1.jsonl aug2.jsonl | cut -c1-80)"
import json, sys
a, b, p = ([json.loads(l)["loss"] for l in open(f)] for f in sys.argv[1:])
assert len(a) == len(b) == 6 and all(abs(x - y) <= 1e-5 * abs(x) for x, y in zip(a, b)), (a, b)
assert a[0] != p[0], (a[0], p[0])
PY
  rm -rf augck
  run $psgd $aug --stop-at 3 --checkpoint-dir augck
  run $psgd $aug --resume augck --save aug-resumed.h5
  run $si diff aug-full.h5 aug-resumed.h5 model/ --rtol 0 --atol 0
  [ $rc = 0 ] && ok "--augment: resume is exact" || bad "--augment resume differs" "$(cat $tmp/o | tail -3)"
  run $psgd --model mlp-small --input-dim 48 --data cls.h5 --steps 2 --augment crop-flip
  [ $rc = 2 ] && grep -q "needs image data" $tmp/e && ok "--augment on feature data: exit 2" || bad "--augment on features (exit $rc)" "$(cat $tmp/e)"

  # ---- resnet: its input shape from the images, batch norm's running statistics in checkpoints ----
  rn="--model resnet-8 --data fm-train.h5 --global-batch 16 --optimizer sgd --nesterov --lr 0.05 --log-level warn"
  resume_check "resnet-8 (running statistics, crop-flip)" $rn --val-data fm-test.h5 --eval-every 5 --eval-batches 2 \
    --augment crop-flip
  run $si ls full.h5
  grep -q "model/layer2.0.downsample.1.running_var *f32 *\[32\]" $tmp/o && grep -q "model/conv1.weight *f32 *\[16, 1, 3, 3\]" $tmp/o \
    && ok "resnet-8: torchvision's names, running statistics saved, input 1x28x28 from the file" \
    || bad "resnet-8 checkpoint entries" "$(cat $tmp/o)"
  # --sync-batchnorm: statistics over the whole batch, so 2 ranks train as 1 (up to summation
  # order); without it each rank normalises its half, another run.
  for n in 1 2; do
    run $mpiexec -n $n $psgd $rn --steps 5 --sync-batchnorm --save sbn$n.h5 --metrics sbn$n.jsonl
    [ $rc = 0 ] || bad "--sync-batchnorm on $n ranks (exit $rc)" "$(cat $tmp/e)"
  done
  run $mpiexec -n 2 $psgd $rn --steps 5 --save bn2.h5
  run $si diff sbn1.h5 sbn2.h5 model/ optim/ $same_run
  if [ $rc = 0 ]; then run $si diff sbn1.h5 bn2.h5 model/ --rtol 1e-4 --atol 1e-6  # must differ: not $same_run's looser bound
    [ $rc = 1 ] && ok "--sync-batchnorm: 2 ranks == 1 rank (running statistics too); per-rank statistics differ" \
      || bad "per-rank batch norm equals the synchronised one (diff exit $rc)" "$(cat $tmp/o)"
  else bad "--sync-batchnorm: 2 ranks differ from 1" "$(cat $tmp/o)" "$(cat $tmp/e)"; fi
  expect2 "--input-shape against the images" "the images are \[1, 28, 28\] (C, H, W), but the model's input_shape is \[3, 32, 32\]" \
    $psgd $rn --steps 1 --input-shape 3,32,32
  expect2 "--sync-batchnorm without batch norm" "applies to models with batch norm" $psgd $small --steps 1 --sync-batchnorm
  expect2 "--input-shape of an mlp" "--input-shape applies to resnet models" $psgd --model mlp-mnist --steps 1 --input-shape 1,28,28
  expect2 "--dim of a resnet" "do not apply to resnet-8" $psgd --model resnet-8 --steps 1 --dim 32
else
  bad "Fashion-MNIST is not installed ($fm): scripts/install-deps installs dataset-fashion-mnist"
fi

# ---- real text: the licenses every Debian system has, a held-out split; no accuracy for llama ----
if $datapack text /usr/share/common-licenses/* -o lic.h5 --val-fraction 0.05 --val-output lic-val.h5 >/dev/null 2>&1; then
  run $psgd --model llama-tiny --data lic.h5 --val-data lic-val.h5 --global-batch 8 --steps 40 --lr 3e-3 --warmup 5 \
    --eval-every 40 --eval-batches 4 --log-every 40 --metrics lic.jsonl
  python3 - lic.jsonl <<'PY' && grep -q "step 40/40 loss .* val " $tmp/e && ! grep -q " acc " $tmp/e \
    && ok "real text: llama-tiny learns the licenses, no accuracy for a language model" \
    || bad "real text (exit $rc)" "$(cat $tmp/e)" "$(tail -1 lic.jsonl)"
import json, math, sys
r = [json.loads(l) for l in open(sys.argv[1])][-1]
print(f"val loss {r['val_loss']:.3f} (ln 256 = {math.log(256):.3f})")
assert r["val_loss"] < 3.6 and "accuracy" not in r and "val_accuracy" not in r and "tokens_per_s" in r, r
PY
else bad "data-pack text of /usr/share/common-licenses"; fi

# ---- resume ----
resume_check "llama adamw" $common
resume_check "llama sgd nesterov, micro-batches" $common --optimizer sgd --nesterov --weight-decay 1e-4 --micro-batch 3
resume_check "mlp" --model mlp-small --global-batch 16 --lr 1e-2 --log-level warn --eval-every 5
resume_check "powersgd state" $common --compressor powersgd --rank 2 --start-iter 3
resume_check "topk state" $common --compressor topk --compress-ratio 0.1

# ---- world-size invariance: 1, 2, 4 ranks give the same run ----
# To f32 summation order ($same_run, train_lib.sh): the ranks add the gradients in another
# order. Measured over these 6 steps at lr 1e-2 (updates ~1e-2): at most 1.3e-6 apart
# (RelWithDebInfo) and 2.3e-6 (Release, -O3); a wrong reduction (a sum for a mean, a lost rank)
# moves weights by ~lr.
for comp in none powersgd; do
  for n in 1 2 4; do
    run $mpiexec -n $n $psgd $common --steps 6 --compressor $comp --rank 2 --start-iter 2 --save ws$n.h5 --metrics ws$comp$n.jsonl
    [ $rc = 0 ] || bad "$comp on $n ranks (exit $rc)" "$(cat $tmp/e)"
  done
  for n in 2 4; do
    run $si diff ws1.h5 ws$n.h5 model/ optim/ $same_run
    [ $rc = 0 ] && ok "$comp: $n ranks == 1 rank" || bad "$comp: $n ranks differ from 1" "$(cat $tmp/o)" "$(cat $tmp/e)"
  done
  # small buckets: every block's gradients aggregated while backward goes on (PowerSGD's P and Q
  # of different buckets interleaved), the same run
  run $mpiexec -n 2 $psgd $common --steps 6 --compressor $comp --rank 2 --start-iter 2 --bucket-size 10K --save wsb.h5
  [ $rc = 0 ] || bad "$comp with small buckets (exit $rc)" "$(cat $tmp/e)"
  run $si diff ws1.h5 wsb.h5 model/ optim/ $same_run
  [ $rc = 0 ] && ok "$comp: small buckets on 2 ranks == 1 rank" || bad "$comp: small buckets differ" "$(cat $tmp/o)" "$(cat $tmp/e)"
done

# ---- bytes per step: PowerSGD sends r(n+m) per compressed matrix, far less than plain ----
run $mpiexec -n 2 $psgd $common --steps 3 --compressor powersgd --rank 2 --start-iter 1 --metrics bytes.jsonl
python3 - bytes.jsonl <<'PY' && ok "compressed bytes and ratio reported" || bad "bytes" "$(cat bytes.jsonl)"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
assert rows[0]["comm_bytes"] == rows[0]["comm_bytes_uncompressed"]   # start-iter: plain
r = rows[-1]
assert r["comm_bytes"] < r["comm_bytes_uncompressed"] and abs(r["compression_ratio"] - r["comm_bytes_uncompressed"] / r["comm_bytes"]) < 1e-9
PY

# ---- step decay: the metrics' learning rate follows --decay-steps after the warm-up ----
run $psgd $common --steps 8 --lr 0.01 --warmup 2 --schedule step --decay-steps 4,6 --decay-factor 0.5 --metrics sched.jsonl
python3 - sched.jsonl <<'PY' && ok "--schedule step: the rate halves at steps 4 and 6" || bad "step schedule (exit $rc)" "$(cat $tmp/e)" "$(cat sched.jsonl)"
import json, sys
lr = [json.loads(l)["lr"] for l in open(sys.argv[1])]
want = [0.005, 0.01, 0.01, 0.01, 0.005, 0.005, 0.0025, 0.0025]
assert len(lr) == 8 and all(abs(a - b) < 1e-12 for a, b in zip(lr, want)), lr
PY

# ---- --precision tf32: the weight products of TF32 operands (the CPU rounds as the GPU's tensor
# cores do, at no gain in speed): losses within TF32's reach of f32's and not equal to them; the
# first metrics line says which; a resume continues in the run's precision unrestated ----
run $psgd $common --steps 10 --metrics p32.jsonl
run $psgd $common --steps 10 --precision tf32 --metrics ptf.jsonl --save ptf.h5
python3 - p32.jsonl ptf.jsonl <<'PY' && ok "--precision tf32: losses within 1e-3 of f32's, not equal" \
  || bad "--precision tf32 against f32" "$(cat $tmp/e)" "$(head -c 600 ptf.jsonl)"
import json, sys
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:])
assert a[0]["precision"] == "f32" and b[0]["precision"] == "tf32", (a[0].get("precision"), b[0].get("precision"))
d = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)]
assert len(d) == 10 and 0 < max(d) < 1e-3, d
PY
rm -rf pck; run $psgd $common --steps 10 --precision tf32 --stop-at 5 --checkpoint-dir pck --metrics pres.jsonl
run $psgd $common --steps 10 --resume pck --save pres.h5 --metrics pres.jsonl
run $si diff ptf.h5 pres.h5 --rtol 0 --atol 0
if [ $rc = 0 ] && [ "$(grep -c '"precision":"tf32"' pres.jsonl)" = 2 ]; then ok "--precision tf32: the resume keeps it, exactly"
else bad "--precision tf32 resume (diff exit $rc)" "$(cat $tmp/o | tail -3)" "$(grep precision pres.jsonl)"; fi

# ---- --precision bf16: mixed precision (bf16 weights' copies and activations, f32 sums, the
# residual stream, statistics and loss in f32; the CPU rounds at the GPU's points): llama losses
# within 1e-2 of f32's and not equal, 150 steps learn as f32 does, an exact resume; the mlp and
# resnet train in it too ----
run $psgd $common --steps 10 --precision bf16 --metrics pbf.jsonl --save pbf.h5
python3 - p32.jsonl pbf.jsonl <<'PY' && ok "--precision bf16: losses within 1e-2 of f32's, not equal" \
  || bad "--precision bf16 against f32" "$(cat $tmp/e)" "$(head -c 600 pbf.jsonl)"
import json, sys
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:])
assert b[0]["precision"] == "bf16", b[0].get("precision")
d = [abs(x["loss"] - y["loss"]) / abs(x["loss"]) for x, y in zip(a, b)]
assert len(d) == 10 and 0 < max(d) < 1e-2, d
PY
rm -rf bck; run $psgd $common --steps 10 --precision bf16 --stop-at 5 --checkpoint-dir bck --metrics bres.jsonl
run $psgd $common --steps 10 --resume bck --save bres.h5 --metrics bres.jsonl
run $si diff pbf.h5 bres.h5 --rtol 0 --atol 0
[ $rc = 0 ] && ok "--precision bf16: the resume keeps it, exactly" || bad "--precision bf16 resume (exit $rc)" "$(tail -3 $tmp/o)"
run $psgd $common --steps 150 --precision bf16 --metrics blearn.jsonl
[ $rc = 0 ] && python3 - learn.jsonl blearn.jsonl <<'PY' && ok "--precision bf16: llama-tiny learns as in f32" \
  || bad "--precision bf16 learning" "$(cat $tmp/e)" "$(tail -2 blearn.jsonl)"
import json, sys
a, b = ([json.loads(l) for l in open(f)] for f in sys.argv[1:3])
print(f"final loss f32 {a[-1]['loss']:.4f}, bf16 {b[-1]['loss']:.4f}")
assert b[-1]["loss"] < 3.0 and abs(b[-1]["loss"] / a[-1]["loss"] - 1) < 0.05
PY
for model in mlp-small "resnet-8 --input-shape 3,8,8 --optimizer sgd"; do
  rm -f c32.jsonl cbf.jsonl
  run $psgd --model $model --global-batch 8 --steps 4 --warmup 0 --log-level warn --metrics c32.jsonl
  run $psgd --model $model --global-batch 8 --steps 4 --warmup 0 --log-level warn --precision bf16 --metrics cbf.jsonl
  [ $rc = 0 ] && python3 - c32.jsonl cbf.jsonl <<'PY' && ok "--precision bf16: ${model%% *} within 1e-2 of f32" \
    || bad "--precision bf16 ${model%% *}" "$(cat $tmp/e)"
import json, sys
a, b = ([json.loads(l)["loss"] for l in open(f)] for f in sys.argv[1:3])
d = [abs(x - y) / x for x, y in zip(a, b)]
assert len(d) == 4 and 0 < max(d) < 1e-2, d
PY
done

# ---- bad input: exit 2 on every rank, nothing written, existing files untouched ----
cp full.h5 keep.h5; sum=$(md5sum < keep.h5)
expect2 "missing data file" "no such file" $mpiexec -n 2 $psgd $common --data nothere.h5 --steps 2 --save keep.h5
expect2 "not a dataset" "nothere\|not an HDF5\|keep.h5" $psgd $common --data keep.h5 --steps 2
expect2 "missing checkpoint" "no such checkpoint" $mpiexec -n 2 $psgd $common --resume nothere.h5 --steps 2
expect2 "model contradicts the checkpoint" "contradicts" $psgd $common --resume keep.h5 --dim 64 --steps 30
expect2 "resume past --steps" "raise it" $psgd $common --resume keep.h5 --steps 10
expect2 "batch smaller than the world" "no sample" $mpiexec -n 4 $psgd $common --global-batch 2 --steps 2
expect2 "unknown model" "llama-tiny" $psgd --model gpt-9 --steps 2
expect2 "heads do not divide dim" "heads" $psgd $small --heads 5 --steps 2
expect2 "--stop-at beyond --steps" "stop-at" $psgd $common --steps 5 --stop-at 9 --save x.h5
head -c 3000 keep.h5 > trunc.h5
expect2 "truncated checkpoint" "trunc.h5" $mpiexec -n 2 $psgd $common --resume trunc.h5 --steps 30
[ "$(md5sum < keep.h5)" = "$sum" ] && ok "existing checkpoint untouched" || bad "keep.h5 changed"
[ -z "$(ls -A | grep -E '\.tmp|^x\.h5$')" ] && ok "no partial output" || bad "partial output" "$(ls -A)"
run $mpiexec -n 2 $psgd $small --global-batch 4 --steps 30 --lr 1e6 --clip 0 --optimizer sgd --momentum 0 \
  --compressor none --log-level warn --checkpoint-dir nan --checkpoint-every 1
[ $rc = 1 ] && grep -q "loss is NaN at step" $tmp/e && ok "a diverging run stops with exit 1, naming the step" \
  || bad "divergence (exit $rc)" "$(cat $tmp/e)"
# Failed before its first checkpoint: the --checkpoint-dir it made is not left behind, empty.
run $mpiexec -n 2 $psgd $small --global-batch 4 --steps 30 --lr 1e6 --clip 0 --optimizer sgd --momentum 0 \
  --compressor none --log-level warn --checkpoint-dir nan-empty
[ $rc = 1 ] && [ ! -e nan-empty ] && [ -n "$(ls -A nan)" ] && ok "a run that failed before a checkpoint leaves no empty --checkpoint-dir" \
  || bad "empty checkpoint dir left (exit $rc)" "$(ls -la nan-empty 2>&1; cat $tmp/e)"
run $psgd --help
[ $rc = 0 ] && grep -q -- "--compressor" "$tmp/o" && grep -q -- "--global-batch" "$tmp/o" && ok "--help" || bad "--help" "$(cat $tmp/o)"

finish
